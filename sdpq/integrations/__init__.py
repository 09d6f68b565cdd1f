"""Thin adapters that install sdpq's collectives and optimizer into training frameworks.

- `sdpq.integrations.fsdp` (exposed as `sdpq.fsdp`): PyTorch FSDP2 (`fully_shard`).
- `sdpq.integrations.deepspeed` (exposed as `sdpq.deepspeed`): DeepSpeed ZeRO-3.

Submodules are imported on demand, so using one framework never imports the other.
"""
