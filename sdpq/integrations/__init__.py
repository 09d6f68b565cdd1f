"""Thin adapters that install sdpq's collectives and optimizer into training frameworks.

- `sdpq.integrations.fsdp` (exposed as `sdpq.fsdp`): PyTorch FSDP2 (`fully_shard`).

Submodules are imported on demand, so using one framework never imports the other.
"""
