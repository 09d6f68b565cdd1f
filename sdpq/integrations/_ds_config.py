"""The DeepSpeed config against its "sdpq" block: every check `sdpq.deepspeed.initialize` makes
before it builds an engine, the config DeepSpeed then gets, and the config sdpq runs with
(`config_at_stage`; with ZeRO-3's per-parameter weight group, `zero3_weight_group`: the two
policies the adapters and `sdpq plan` share). No torch import here, so `sdpq config --check` runs
exactly these checks cheaply."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping

from ..config import ADAMW_HYPERPARAMETERS, Config, ConfigError, check_adamw_hyperparameters

__all__ = ["IncompatibleConfigError", "check_config", "config_at_stage", "prepare_config", "zero3_weight_group"]


class IncompatibleConfigError(ValueError):
    """The "sdpq" block cannot work with the rest of the DeepSpeed config (stage, ZeRO++ flags...)."""


_OPT_KEYS = {"lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "fused", "foreach", "amsgrad"}


def _check_mcf_bf16(ds: dict) -> None:
    """The MCF master keeps bf16 weights plus a bf16 compensation: bf16 training, with DeepSpeed's
    bf16 master-weights mode (which prepare_config switches on) not switched off."""
    bf16 = ds.get("bf16") or ds.get("bfloat16") or {}
    if not bf16.get("enabled", False):
        raise IncompatibleConfigError(
            "sdpq.optimizer.master: 'mcf' keeps bf16 weights plus a bf16 compensation and needs "
            '"bf16": {"enabled": true}; set "master": "native" for fp32/fp16 training'
        )
    for flag in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if bf16.get(flag) is False:
            raise IncompatibleConfigError(
                f"sdpq.optimizer.master: 'mcf' replaces the fp32 master copy, which needs bf16.{flag} "
                "true (it is set automatically when absent); remove the false or use master 'native'"
            )


def _sdpq_optimizer(ds: dict, cfg: Config, a: dict):
    """Check the DeepSpeed "optimizer" block and return a callable that builds sdpq.optim.AdamW."""
    oc = cfg.optimizer
    if a.get("optimizer") is not None:
        raise IncompatibleConfigError(
            'sdpq.optimizer.enabled is true (the default when an "sdpq" block is present), but an optimizer '
            'was passed to initialize(): drop it (sdpq builds AdamW from the "optimizer" block) or set '
            '"sdpq": {"optimizer": {"enabled": false}} to keep yours'
        )
    block = ds.get("optimizer")
    if not isinstance(block, Mapping) or not isinstance(block.get("type"), str):
        raise IncompatibleConfigError(
            'sdpq.optimizer.enabled needs the DeepSpeed "optimizer" block ({"type": "AdamW", "params": '
            '{...}}) for its hyperparameters, or set "sdpq": {"optimizer": {"enabled": false}}'
        )
    kind = block["type"].lower()
    params = dict(block.get("params", {}))
    unknown = sorted(set(params) - _OPT_KEYS)
    if kind not in ("adamw", "adam") or unknown or params.get("amsgrad"):
        got = (
            f"unsupported params {', '.join(unknown)}"
            if unknown
            else "amsgrad"
            if params.get("amsgrad")
            else f"type {block['type']!r}"
        )
        raise IncompatibleConfigError(
            f"sdpq.optimizer.enabled replaces the DeepSpeed optimizer with sdpq AdamW, which takes type Adam/AdamW "
            f'with params lr, betas, eps, weight_decay; got {got}. Set "sdpq": {{"optimizer": '
            f'{{"enabled": false}}}} to keep DeepSpeed\'s optimizer'
        )
    if kind == "adam" and not params.get("adam_w_mode", True):
        raise IncompatibleConfigError(
            'sdpq AdamW decays weights decoupled (adam_w_mode true); "adam_w_mode": false (L2 Adam) is not supported'
        )
    defaults = dict(ADAMW_HYPERPARAMETERS)
    if kind != "adamw":
        defaults["weight_decay"] = 0.0  # DeepSpeed's Adam: no decay unless asked
    hp = {k: params.get(k, v) for k, v in defaults.items()}
    try:  # what sdpq's AdamW will check, found before any rank starts
        check_adamw_hyperparameters('"optimizer"."params"', **hp)
    except ConfigError as e:
        raise IncompatibleConfigError(str(e)) from None
    hp = {k: tuple(map(float, v)) if k == "betas" else float(v) for k, v in hp.items()}
    if oc.master == "mcf":
        _check_mcf_bf16(ds)

    def build(model_parameters):
        import torch.distributed as dist

        from ..optim import AdamW

        # sync_group: a non-finite gradient skips the step on every rank (ZeRO-3 partitions are
        # plain tensors; DeepSpeed's own norm check normally catches it first).
        return AdamW.from_config(model_parameters, oc, **hp, sync_group=dist.group.WORLD)

    return build


def prepare_config(ds: dict, cfg: Config, a: dict) -> tuple[dict, Config]:
    """Check the DeepSpeed config against the block; return the config DeepSpeed gets and the
    config sdpq runs with (`config_at_stage`). With sdpq's optimizer, a["optimizer"] becomes the
    callable that builds it."""
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0)) if isinstance(zero, Mapping) else 0
    if stage not in (1, 2, 3):
        raise IncompatibleConfigError(
            f'the "sdpq" block works with ZeRO stages 1, 2 and 3 (it replaces their gradient reductions and '
            f"weight gathers); this config has zero_optimization.stage {stage}. Set a stage, use sdpq.ddp for "
            f'plain data parallelism, or remove the "sdpq" block (or leave it empty) to train with plain DeepSpeed'
        )
    if stage < 3:
        _check_zero12(ds, zero, cfg, stage)
    cfg = config_at_stage(cfg, stage)
    clash = [
        k
        for k in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients")
        if zero.get(k)
    ]
    clash += [
        k
        for k, off in (("zero_hpz_partition_size", 1), ("mics_shard_size", 0))
        if isinstance(zero.get(k), int) and zero[k] > off
    ]
    if clash:
        raise IncompatibleConfigError(
            f'zero_optimization.{clash[0]} (DeepSpeed ZeRO++/MiCS) replaces the same collectives as the "sdpq" '
            "block; use one or the other (see ds_configs/zero3_zeropp.json for ZeRO++ alone)"
        )
    if stage == 3 and zero.get("reduce_scatter") is False:
        raise IncompatibleConfigError(
            "sdpq's gradient path is ZeRO-3's reduce-scatter: remove zero_optimization.reduce_scatter false"
        )
    offload = zero.get("offload_param") or {}
    if isinstance(offload, Mapping) and offload.get("device") == "nvme":
        raise IncompatibleConfigError(
            'zero_optimization.offload_param to nvme is not supported with the "sdpq" block (cpu offload is)'
        )
    out = copy.deepcopy(ds)
    out.pop("sdpq", None)
    if cfg.optimizer.enabled:
        a["optimizer"] = _sdpq_optimizer(ds, cfg, a)
        _hand_the_optimizer_to_sdpq(out, zero, cfg)
    return out, cfg


def config_at_stage(cfg: Config, stage: int) -> Config:
    """The config sdpq runs with at ZeRO `stage` (what `engine.sdpq.config` and a run's record
    show, and what `sdpq plan` plans): at stages 1-2 sdpq's AdamW keeps a native fp32 master
    where the block leaves the MCF default, because DeepSpeed runs its bf16 master-weights mode
    (which the MCF master uses) at those stages only with CPU offload. An explicit "mcf" there is
    refused by `prepare_config`.

    Note: the one place this rule is written (sdpq.deepspeed.initialize and sdpq.plan use it)."""
    if stage < 3 and cfg.optimizer.enabled and cfg.optimizer.master == "mcf":
        return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, master="native"))
    return cfg


def zero3_weight_group(shard_numel: int, group_size: int) -> int:
    """The weights' quantization group of a ZeRO-3 parameter whose partition holds `shard_numel`
    elements: the config's `group_size`, capped at the partition rounded up to a power of two
    (at least 32). The wire pads codes to whole groups, so a small parameter's partition (a bias,
    a norm) would otherwise send a full 2048-code group.

    Note: the one place this cap is written (the ZeRO-3 adapter and sdpq.plan use it)."""
    return min(group_size, max(32, 1 << max(0, shard_numel - 1).bit_length()))


def _hand_the_optimizer_to_sdpq(out: dict, zero: Mapping, cfg: Config) -> None:
    """Edit the config DeepSpeed gets so that it takes sdpq's AdamW (built by initialize)."""
    out.pop("optimizer", None)
    out["zero_allow_untested_optimizer"] = True
    opt_offload = zero.get("offload_optimizer") or {}
    if isinstance(opt_offload, Mapping) and opt_offload.get("device") not in (None, "none"):
        if cfg.optimizer.master == "mcf":
            raise IncompatibleConfigError(
                "zero_optimization.offload_optimizer with sdpq.optimizer.master 'mcf': DeepSpeed runs its bf16 "
                "master-weights mode (which the MCF master uses) with an offloaded optimizer only through its own "
                'CPU Adam. Set "sdpq": {"optimizer": {"master": "native"}} to offload sdpq\'s AdamW, '
                "or remove offload_optimizer"
            )
        if opt_offload.get("device") != "cpu":
            raise IncompatibleConfigError(
                f"zero_optimization.offload_optimizer.device "
                f"{opt_offload.get('device')!r} with sdpq's AdamW; allowed: 'cpu'"
            )
        # Note: sdpq's AdamW (C++ kernels on CPU) then steps the offloaded partitions in place
        # of DeepSpeed's CPU Adam, which DeepSpeed only allows with this flag.
        out["zero_force_ds_cpu_optimizer"] = False
    if cfg.optimizer.master == "mcf":
        key = "bf16" if "bf16" in out else "bfloat16"
        out[key] = dict(out.get(key) or {}, bf16_master_weights_and_grads=True, bf16_optimizer_states=True)


def _check_zero12(ds: dict, zero: Mapping, cfg: Config, stage: int) -> None:
    """ZeRO-1/2 with the block: what is refused (an explicit MCF master among them: see
    `config_at_stage`)."""
    where = f"ZeRO-{stage}"
    refuse = []
    offload = zero.get("offload_optimizer") or {}
    if isinstance(offload, Mapping) and offload.get("device") not in (None, "none"):
        refuse.append("zero_optimization.offload_optimizer (offloaded ZeRO-1/2 is not supported with the block yet)")
    if zero.get("contiguous_gradients") is False:
        refuse.append("zero_optimization.contiguous_gradients false (sdpq reduces the contiguous gradient buckets)")
    if cfg.weights.mode == "direct":
        refuse.append(
            'sdpq.weights.mode "direct" (with ZeRO-1/2 every rank holds the weights, so "diff" needs no '
            'reference and sends fewer bits: use "diff" or "exact")'
        )
    if refuse:
        raise IncompatibleConfigError(f'the "sdpq" block with {where}: {refuse[0]}')
    raw = (ds.get("sdpq") or {}).get("optimizer") or {}
    if cfg.optimizer.enabled and isinstance(raw, Mapping) and raw.get("master") == "mcf":
        raise IncompatibleConfigError(
            f"sdpq.optimizer.master 'mcf' with {where}: DeepSpeed's bf16 master-weights mode, which the MCF "
            'master uses, runs at stages 1-2 only with CPU offload; use "master": "native" (the default there)'
        )


def check_config(ds: Mapping, cfg: Config) -> None:
    """Raise IncompatibleConfigError where `initialize` would (ZeRO stage, ZeRO++ / MiCS flags,
    offload, the optimizer block, bf16 for the MCF master)."""
    prepare_config(dict(ds), cfg, {})
