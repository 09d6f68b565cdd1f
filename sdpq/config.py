"""sdpq configuration: one frozen dataclass per section, validated strictly.

Every option is documented here and only here (``docs/config.md`` is generated from these
docstrings by ``sdpq config --doc``). A DeepSpeed user writes the same keys in the top-level
``"sdpq"`` block of the DeepSpeed JSON config; an FSDP2 user passes a ``Config`` or a dict.

Validation rule: one ``ConfigError`` names the full key path (``sdpq.weights.bits``), the bad
value and what is allowed. Unknown keys are errors, never ignored: a typo must not silently
fall back to a default.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

__all__ = [
    "Config",
    "ConfigError",
    "WeightsConfig",
    "GradientsConfig",
    "OptimizerConfig",
    "ADAMW_HYPERPARAMETERS",
    "check_adamw_hyperparameters",
    "TopologyConfig",
    "StatsConfig",
    "WorkaroundsConfig",
]

ROOT = "sdpq"


class ConfigError(ValueError):
    """A bad sdpq option; the message names the key path, the value and what is allowed."""


def _fail(path: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"{path}: invalid value {value!r}; allowed: {allowed}")


def _check_int(path: str, value: Any, lo: int, hi: int | None = None) -> None:
    # bool is an int subclass; `bits: true` is a typo, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        _fail(path, value, f"an integer in [{lo}, {hi if hi is not None else 'inf'}]")


# Values that earlier releases accepted, with why they are refused now.
_RETIRED = {
    ("scale_dtype", "fp16"): "fp16 scales lose whole groups: a 4-bit group with absmax below about "
    "4e-7 decodes as zeros and one above 4.6e5 as NaN (gradients span both); use 'bf16' (the same "
    "16 bits per group, the range of fp32)",
}


def _check_choice(path: str, value: Any, choices: tuple) -> None:
    # Note: the type must match too: 4.0 == 4 and True == 1 in Python, but `bits: 4.0` would reach
    # the codec as a float (shifts fail mid-training) and `bits: true` is a typo.
    if value not in choices or type(value) is not type(choices[0]):
        why = _RETIRED.get((path.rsplit(".", 1)[-1], value))
        _fail(path, value, ", ".join(repr(c) for c in choices) + (f" ({why})" if why else ""))


def _check_power_of_two(path: str, value: Any, lo: int, hi: int, why: str = "") -> None:
    if not isinstance(value, int) or isinstance(value, bool):
        _check_int(path, value, lo, hi)  # the type error
    if value < lo or value > hi or value & (value - 1):
        _fail(path, value, f"a power of two in [{lo}, {hi}]" + (f" ({why})" if why else ""))


# The largest quantization group / Hadamard block: a GPU kernel holds a whole group and a whole
# block in one Triton tile. Compiled for an H100, tiles of 4096 fit in registers; 8192 and more
# spill to local memory and past 32768 a tile exceeds the shared memory of a block
# (docs/kernels.md).
TILE_MAX = 1 << 12
_TILE_WHY = f"the GPU kernels hold a whole group or Hadamard block in one tile of at most {TILE_MAX}"


@dataclass(frozen=True)
class _Section:
    """Base of every section: strict from_dict/to_dict and path-aware validation.

    Subclasses are frozen dataclasses whose ``_validate(path)`` checks ranges; type checks
    against the annotations happen here, once, for every section.
    """

    def __post_init__(self) -> None:
        self._check_types(ROOT + "." + self._key())
        self._validate(ROOT + "." + self._key())

    @classmethod
    def _key(cls) -> str:
        return cls.__name__.removesuffix("Config").lower()

    def _check_types(self, path: str) -> None:
        hints = get_type_hints(type(self))
        for f in fields(self):
            value = getattr(self, f.name)
            hint = hints[f.name]
            if get_origin(hint) is Literal:
                _check_choice(f"{path}.{f.name}", value, get_args(hint))
            elif hint is bool and not isinstance(value, bool):
                raise ConfigError(f"{path}.{f.name}: expected true or false, got {type(value).__name__} {value!r}")

    def _validate(self, path: str) -> None:  # range checks of a section; default: none
        pass

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], path: str | None = None):
        path = path or f"{ROOT}.{cls._key()}"
        if not isinstance(d, Mapping):
            raise ConfigError(f"{path}: expected an object (dict), got {type(d).__name__} {d!r}")
        names = [f.name for f in fields(cls)]
        for key in d:
            if key not in names:
                raise ConfigError(f"{path}.{key}: unknown key; allowed: {', '.join(names)}")
        try:
            return cls(**d)
        except ConfigError as e:
            # Re-root errors raised with the default path (sections nested elsewhere).
            default = f"{ROOT}.{cls._key()}"
            raise ConfigError(str(e).replace(default, path, 1)) from None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# Wire formats of the group scales (both sections; sdpq.quant.groupwise.SCALE_DTYPES maps them).
ScaleFormat = Literal["fp32", "bf16"]


@dataclass(frozen=True)
class WeightsConfig(_Section):
    """Weight all-gather (forward/backward parameter gathers).

    mode: "diff" sends 2-8-bit differences against a node-resident reference once per weight
        version and gathers the reference inside the node (SDP4Bit qWD + ZeRO++ hpZ);
        "direct" quantizes the weights themselves on every gather (ZeRO++ qwZ, stateless);
        "exact" is the plain all-gather (baseline).
    bits: code width of the quantized payload. diff: 2 (default), 3, 4 or 8 (symmetric codes in
        [-(2^(bits-1) - 1), 2^(bits-1) - 1]: 2 bits is -1, 0, 1; the reference carries each
        difference's error into the next, so 2 bits kept the baseline's loss; see "Choosing code
        widths"); direct: 8 only (4-bit direct weights cost SDP4Bit 2.573 vs 2.294 validation
        loss on GPT-125M).
    group_size: elements per absmax scale; 2048 gives 2 + 32/2048 = 2.016 bits per element at
        2 bits (a power of two, 32 to 4096: the GPU kernels hold a group in one tile).
    rounding: "nearest" (weights: errors are fed back by the reference) or "stochastic".
    scale_dtype: wire scale format: "fp32" (32 bits per group) or "bf16" (16 bits, rounded up;
        same range as fp32, so no finite group is lost). "fp16" is refused: it loses groups of
        small or large values.
    resync_every: every N weight versions exchange the exact shard instead of the
        difference (0 = only the first refresh).
    verify_every: every N refreshes compare a checksum of the reference across its holders;
        a mismatch resyncs and warns (0 = never).
    reference: storage of the node-resident reference (diff mode; on one node none is kept):
        "auto" (default: the compute dtype, so the gathered weights are the reference itself;
        bf16 under bf16 mixed precision: 2 bytes per element of it, 2/L per parameter on a
        rank with L ranks per node, the size of ZeRO++'s secondary copy), "bf16", "fp16",
        "fp32" (4/L), or "int8" (8-bit codes with one fp32 scale per 128: ~1.03/L; the compute
        weights are then int8 group-quantized, and the node's gathers send 8.25 instead of 16
        bits per element). Each storage's rounding is fed into the next difference, so none
        drifts. Memory per choice: `sdpq plan`.
    """

    mode: Literal["diff", "direct", "exact"] = "diff"
    bits: int = 2
    group_size: int = 2048
    rounding: Literal["nearest", "stochastic"] = "nearest"
    scale_dtype: ScaleFormat = "fp32"
    resync_every: int = 0
    verify_every: int = 100
    reference: Literal["auto", "bf16", "fp16", "fp32", "int8"] = "auto"

    def _validate(self, path: str) -> None:
        _check_choice(f"{path}.bits", self.bits, (2, 3, 4, 8))
        if self.mode == "direct" and self.bits != 8:
            _fail(f"{path}.bits", self.bits, "8 when mode is 'direct' (4-bit direct weights hurt the loss)")
        _check_power_of_two(f"{path}.group_size", self.group_size, 32, TILE_MAX, _TILE_WHY)
        _check_int(f"{path}.resync_every", self.resync_every, 0)
        _check_int(f"{path}.verify_every", self.verify_every, 0)


@dataclass(frozen=True)
class GradientsConfig(_Section):
    """Gradient reduce-scatter (SUM; the integration keeps the framework's averaging exact).

    mode: "two_level" = 8-bit intra-node all-to-all, then 4-bit inter-node all-to-all
        (SDP4Bit TLq); "exact" = the plain reduce-scatter (baseline).
    intra_bits / inter_bits: code widths of the two stages: intra 4 or 8; inter 2, 3, 4 or 8
        (below 4 bits the loss suffers; see "Choosing code widths" in docs/config.md).
    intra_group_size / inter_group_size: elements per scale of each stage (SDP4Bit: 128;
        their inter-node flag is silently ignored; ours is honoured); a power of two, 32 to 4096.
    hadamard: randomized blockwise Walsh-Hadamard smoothing before quantization, inverted
        once after the final sum (spreads outliers so 4-bit groups lose less; computed so that
        no finite gradient overflows, up to the fp32 maximum).
    hadamard_block: transform block (power of two, 2 to 4096, <= both group sizes is typical; a
        block larger than a rank's chunk of the bucket is clamped to the chunk rounded up to a
        power of two).
    rounding: "stochastic" (unbiased; SDP4Bit default) or "nearest".
    scale_dtype: wire scale format: "bf16" (default: 16 bits per group, rounded up, so a code
        step is at most 2^-8 coarser; the range of fp32, but sums within 2^-8 of the fp32
        maximum may round past it; 4-bit groups of 128 travel at 4.125 bits an element) or
        "fp32" (32 bits, 4.25 bits an element). "fp16" is refused: it loses groups of small or
        large values.
    error_feedback: keep the inter-node stage's residual and add it before the next quantization.
    pipeline_chunks: slices whose inter-node stage overlaps the next slice's intra-node stage.
    seed: shared seed of the Hadamard signs and stochastic rounding streams.
    """

    mode: Literal["two_level", "exact"] = "two_level"
    intra_bits: int = 8
    inter_bits: int = 4
    intra_group_size: int = 128
    inter_group_size: int = 128
    hadamard: bool = True
    hadamard_block: int = 128
    rounding: Literal["stochastic", "nearest"] = "stochastic"
    scale_dtype: ScaleFormat = "bf16"
    error_feedback: bool = False
    pipeline_chunks: int = 1
    seed: int = 0

    def _validate(self, path: str) -> None:
        _check_choice(f"{path}.intra_bits", self.intra_bits, (4, 8))
        _check_choice(f"{path}.inter_bits", self.inter_bits, (2, 3, 4, 8))
        for key in ("intra_group_size", "inter_group_size"):
            _check_power_of_two(f"{path}.{key}", getattr(self, key), 32, TILE_MAX, _TILE_WHY)
        _check_power_of_two(f"{path}.hadamard_block", self.hadamard_block, 2, TILE_MAX, _TILE_WHY)
        _check_int(f"{path}.pipeline_chunks", self.pipeline_chunks, 1, 64)
        _check_int(f"{path}.seed", self.seed, 0, 2**63 - 1)


# The AdamW choices and defaults, defined here once: sdpq.optim.AdamW takes its defaults from
# OptimizerConfig and ADAMW_HYPERPARAMETERS and validates its arguments through the same code
# (OptimizerConfig and check_adamw_hyperparameters), so the class refuses what the config refuses.
ADAMW_HYPERPARAMETERS: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}


def _finite(value: Any) -> float | None:
    """value as a finite float, or None (bools, non-numbers, inf and NaN)."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) and not isinstance(value, bool) else None


def check_adamw_hyperparameters(path: str, *, lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    """lr, eps and weight_decay finite and >= 0, betas two finite values in [0, 1); a ConfigError
    naming ``path.<name>`` and the value otherwise."""
    for name, value in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
        x = _finite(value)
        if x is None or x < 0.0:
            _fail(f"{path}.{name}", value, "a finite number >= 0")
    pair = [_finite(b) for b in betas] if isinstance(betas, (tuple, list)) else []
    if len(pair) != 2 or any(b is None or not 0.0 <= b < 1.0 for b in pair):
        _fail(f"{path}.betas", betas, "two numbers in [0, 1)")


OptimizerStates = Literal["fp8", "bf16", "fp32"]
MasterWeights = Literal["mcf", "native"]
SecondMomentFormat = Literal["e4m3", "e5m2"]


@dataclass(frozen=True)
class OptimizerConfig(_Section):
    """Compressed AdamW states and master weights (used when an integration builds the optimizer).

    enabled: build sdpq.optim.AdamW (DeepSpeed: from the "optimizer" block's hyperparameters).
    states: "fp8" (COAT dynamic range expansion), "bf16" or "fp32" (reference).
    master: "mcf" = bf16 parameter + bf16 compensation (Collage), "native" = the parameter's dtype
        (the one meaning of "native" in sdpq; the compiled CPU kernels are "cpp": SDPQ_CPP).
    mcf_second_moment: keep v as a bf16 pair with an exact beta2 product (Collage "plus").
    group_size: FP8 expansion group (COAT: 128); a power of two, 16 to 4096.
    v_format: FP8 format of the second moment, "e4m3" or "e5m2".
    sdpq.optim.AdamW takes the same defaults and refuses the same values (its checks are these).
    """

    enabled: bool = True
    states: OptimizerStates = "fp8"
    master: MasterWeights = "mcf"
    mcf_second_moment: bool = False
    group_size: int = 128
    v_format: SecondMomentFormat = "e4m3"

    def adamw_options(self) -> dict[str, Any]:
        """The sdpq.optim.AdamW keyword arguments this section sets (no hyperparameters)."""
        return {
            "states": self.states,
            "master": self.master,
            "mcf_second_moment": self.mcf_second_moment,
            "group_size": self.group_size,
            "v_format": self.v_format,
        }

    def _validate(self, path: str) -> None:
        _check_power_of_two(f"{path}.group_size", self.group_size, 16, TILE_MAX, _TILE_WHY)


@dataclass(frozen=True)
class TopologyConfig(_Section):
    """How ranks map to nodes.

    ranks_per_node: "auto" reads what the launcher sets (LOCAL_WORLD_SIZE of torchrun, LOCAL_SIZE
        of the deepspeed launcher, Open MPI's, MPICH's or srun's); an integer simulates nodes on
        one machine (rank r is on node r // ranks_per_node). The world size must divide by it.
    """

    ranks_per_node: int | Literal["auto"] = "auto"

    def _check_types(self, path: str) -> None:
        if self.ranks_per_node != "auto":
            _check_int(f"{path}.ranks_per_node", self.ranks_per_node, 1)


@dataclass(frozen=True)
class StatsConfig(_Section):
    """Communication statistics.

    enabled: count bytes per link class (intra/inter) and path (weights/gradients).
    error_sample_every: measure the relative quantization error on every Nth call
        (0 = never; it costs one extra dequantize).
    """

    enabled: bool = True
    error_sample_every: int = 50

    def _validate(self, path: str) -> None:
        _check_int(f"{path}.error_sample_every", self.error_sample_every, 0)


@dataclass(frozen=True)
class WorkaroundsConfig(_Section):
    """Opt-in workarounds for bugs of the frameworks sdpq plugs into; each key names its bug.

    deepspeed_alias_bf16_master: ZeRO-3 (deepspeed 0.19) means to use the bf16 compute partition
      as the master partition when both are bf16, but its check compares a torch.device with a
      device-name string and always fails, so with sdpq's MCF master (bf16 high part) it keeps a
      second bf16 copy, refreshed after every step: 2 bytes per parameter for nothing. True
      points the master partitions at the compute partitions before the first step (the same
      values at every step: bitwise the same training). Ignored by FSDP2.
    """

    deepspeed_alias_bf16_master: bool = False


_SECTIONS: dict[str, type[_Section]] = {
    "weights": WeightsConfig,
    "gradients": GradientsConfig,
    "optimizer": OptimizerConfig,
    "topology": TopologyConfig,
    "stats": StatsConfig,
    "workarounds": WorkaroundsConfig,
}


@dataclass(frozen=True)
class Config:
    """The whole sdpq configuration. Defaults follow the published methods (see each section)."""

    weights: WeightsConfig = field(default_factory=WeightsConfig)
    gradients: GradientsConfig = field(default_factory=GradientsConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    stats: StatsConfig = field(default_factory=StatsConfig)
    workarounds: WorkaroundsConfig = field(default_factory=WorkaroundsConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"{ROOT}.{name}: expected {cls.__name__}, got {getattr(self, name)!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Config:
        if d is None:
            return cls()
        if not isinstance(d, Mapping):
            raise ConfigError(f"{ROOT}: expected an object (dict), got {type(d).__name__} {d!r}")
        for key in d:
            if key not in _SECTIONS:
                raise ConfigError(f"{ROOT}.{key}: unknown key; allowed: {', '.join(_SECTIONS)}")
        return cls(**{k: _SECTIONS[k].from_dict(v) for k, v in d.items()})

    @classmethod
    def from_deepspeed(cls, ds_config: str | os.PathLike | Mapping[str, Any]) -> Config | None:
        """The top-level ``"sdpq"`` block of a DeepSpeed config (path or dict); None = plain DeepSpeed.

        No other key of the DeepSpeed config is read: DeepSpeed validates its own keys.
        A missing or empty block means plain DeepSpeed (None); any key turns sdpq on, with the
        defaults for every section the block leaves out.
        """
        if isinstance(ds_config, (str, os.PathLike)):
            with open(ds_config) as f:
                ds_config = json.load(f)
        if not isinstance(ds_config, Mapping):
            raise ConfigError(f"DeepSpeed config: expected an object, got {type(ds_config).__name__}")
        block = ds_config.get(ROOT)
        if block is None or (isinstance(block, Mapping) and not block):
            return None
        return cls.from_dict(block)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name).to_dict() for name in _SECTIONS}

    def replace(self, **sections: Mapping[str, Any]) -> Config:
        """A copy with some options changed: ``cfg.replace(weights={"mode": "exact"})``."""
        d = self.to_dict()
        for name, changes in sections.items():
            if name not in _SECTIONS:
                raise ConfigError(f"{ROOT}.{name}: unknown key; allowed: {', '.join(_SECTIONS)}")
            d[name].update(changes)
        return Config.from_dict(d)


# Note: the one place the reference says which settings to pick; the figures behind it are in
# benchmarks/RESULTS.md ("Below four bits", "The default"), from the studies named here.
_CHOOSING_WIDTHS = """## Choosing code widths

The defaults send 2-bit weight differences (fp32 scales per 2048) and gradients 8-bit inside a
node, then 4-bit across nodes (bf16 scales per 128). `weights.bits` takes 2, 3, 4 or 8 and
`gradients.inter_bits` 2, 3, 4 or 8. A screen of every combination of {4, 3, 2} weight bits,
{4, 3, 2} gradient bits and gradient error feedback on or off (`benchmarks/frontier.py`, one seed,
200 steps, FSDP2) found:

- Weight differences tolerate fewer bits. The node-resident reference carries each
  difference's rounding into the next. `weights.bits: 3` cost no loss. `weights.bits: 2` cost
  +0.4% at 200 steps and nothing measurable over 1000 steps and 3 seeds
  (`benchmarks/frontier_long.py`: -0.21% FSDP2, -0.01% ZeRO-3), nor on a 14.4M-parameter Llama
  over 300 steps (`benchmarks/hf_llama_seeds.py`, the scale study in benchmarks/RESULTS.md).
- Gradients do not. `inter_bits: 3` cost +0.5% to +0.9% and `inter_bits: 2` about +3%, at
  every weight width.
- `error_feedback` helped at no width. With 2-bit gradients it diverged (+22%): a three-level
  code's residual is as large as the gradient itself, and Adam's per-element scaling amplifies
  it on small coordinates.
- bf16 gradient scales (the default) make a code step at most 2^-8 coarser and save 0.125 bits
  an element (4.125 instead of 4.25 across nodes); set `gradients.scale_dtype: "fp32"` for
  sums within 2^-8 of the fp32 maximum.

By the least cross-node traffic, the defaults send about 0.10 of bf16 FSDP2's bytes (fp32
reduce) and 0.13 of bf16 ZeRO-3's when ZeRO-3 gathers the weights again in the backward, as at
scale (`benchmarks/plan_bytes_check.py`, `sdpq plan`). `{"weights": {"bits": 4}}` (the default
until 2026-11-28) sends about 0.13 and 0.17 for a finer weight code at no measured loss benefit.
"""


def describe() -> str:
    """Markdown reference of every option: the section docstrings plus defaults, then how to
    choose the code widths."""
    out = ["# sdpq configuration reference", "", "Generated by `sdpq config --doc` from `sdpq/config.py`.", ""]
    for name, cls in _SECTIONS.items():
        out += [f"## `{name}`", "", "```", (cls.__doc__ or "").strip(), "```", "", "| key | default |", "|---|---|"]
        out += [f"| `{f.name}` | `{json.dumps(getattr(cls(), f.name))}` |" for f in fields(cls)]
        out.append("")
    return "\n".join(out) + "\n" + _CHOOSING_WIDTHS
