"""Strict config: every error names the key path, the value and what is allowed."""

import dataclasses
import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpq.config import Config, ConfigError, describe


def _error(d) -> str:
    with pytest.raises(ConfigError) as e:
        Config.from_dict(d)
    return str(e.value)


def test_defaults_follow_the_published_methods():
    c = Config()
    # 2-bit weight differences: the long-run and scale studies in benchmarks/RESULTS.md
    assert (c.weights.mode, c.weights.bits, c.weights.group_size) == ("diff", 2, 2048)
    assert (c.gradients.intra_bits, c.gradients.inter_bits, c.gradients.intra_group_size) == (8, 4, 128)
    assert (c.weights.scale_dtype, c.gradients.scale_dtype) == ("fp32", "bf16")
    assert c.gradients.hadamard and c.gradients.rounding == "stochastic"
    assert (c.optimizer.states, c.optimizer.master) == ("fp8", "mcf")


def test_unknown_nested_key_names_path_and_allowed_keys():
    msg = _error({"weights": {"bitz": 4}})
    assert msg.startswith("sdpq.weights.bitz: unknown key; allowed: mode, bits, group_size")
    assert _error({"optimiser": {}}).startswith("sdpq.optimiser: unknown key; allowed: weights, gradients")


@pytest.mark.parametrize(
    "d,path,shown",
    [
        ({"gradients": {"hadamard": "yes"}}, "sdpq.gradients.hadamard", "'yes'"),
        ({"stats": {"error_sample_every": 1.5}}, "sdpq.stats.error_sample_every", "1.5"),
        ({"weights": {"bits": True}}, "sdpq.weights.bits", "True"),
        ({"weights": {"bits": 4.0}}, "sdpq.weights.bits", "4.0"),  # equal to 4, but a float reaches the codec
        ({"gradients": {"inter_bits": 8.0}}, "sdpq.gradients.inter_bits", "8.0"),
        ({"topology": {"ranks_per_node": "four"}}, "sdpq.topology.ranks_per_node", "'four'"),
        ({"gradients": []}, "sdpq.gradients", "[]"),
    ],
)
def test_wrong_type_names_path_and_value(d, path, shown):
    msg = _error(d)
    assert msg.startswith(path + ":") and shown in msg


@pytest.mark.parametrize(
    "d,path,allowed",
    [
        ({"weights": {"bits": 5}}, "sdpq.weights.bits", "allowed: 2, 3, 4, 8"),
        ({"gradients": {"inter_bits": 1}}, "sdpq.gradients.inter_bits", "allowed: 2, 3, 4, 8"),
        ({"gradients": {"intra_bits": 2}}, "sdpq.gradients.intra_bits", "allowed: 4, 8"),
        ({"weights": {"group_size": 1000}}, "sdpq.weights.group_size", "power of two"),
        # The GPU kernels hold a group / Hadamard block in one tile of at most 4096 (TILE_MAX).
        ({"weights": {"group_size": 8192}}, "sdpq.weights.group_size", "a power of two in [32, 4096] (the GPU"),
        ({"gradients": {"intra_group_size": 1 << 16}}, "sdpq.gradients.intra_group_size", "[32, 4096] (the GPU"),
        ({"gradients": {"inter_group_size": 1 << 13}}, "sdpq.gradients.inter_group_size", "[32, 4096] (the GPU"),
        ({"gradients": {"hadamard_block": 1 << 16}}, "sdpq.gradients.hadamard_block", "[2, 4096] (the GPU"),
        ({"optimizer": {"group_size": 8192}}, "sdpq.optimizer.group_size", "[16, 4096] (the GPU"),
        ({"gradients": {"pipeline_chunks": 0}}, "sdpq.gradients.pipeline_chunks", "[1, 64]"),
        ({"optimizer": {"states": "fp4"}}, "sdpq.optimizer.states", "'fp8', 'bf16', 'fp32'"),
        ({"weights": {"mode": "direct"}}, "sdpq.weights.bits", "8 when mode is 'direct'"),
        ({"topology": {"ranks_per_node": 0}}, "sdpq.topology.ranks_per_node", "[1, inf]"),
        ({"gradients": {"scale_dtype": "fp16"}}, "sdpq.gradients.scale_dtype", "'bf16' (the same 16 bits"),
        ({"weights": {"scale_dtype": "fp16"}}, "sdpq.weights.scale_dtype", "decodes as zeros"),
    ],
)
def test_out_of_range_names_path_value_and_allowed(d, path, allowed):
    msg = _error(d)
    assert msg.startswith(path + ":") and allowed in msg


@settings(deadline=None, max_examples=50)
@given(
    mode=st.sampled_from(["diff", "exact"]),
    wbits=st.sampled_from([2, 3, 4, 8]),
    group=st.sampled_from([128, 2048]),
    had=st.booleans(),
    chunks=st.integers(1, 8),
    states=st.sampled_from(["fp8", "bf16", "fp32"]),
    rpn=st.one_of(st.just("auto"), st.integers(1, 8)),
)
def test_to_dict_round_trips(mode, wbits, group, had, chunks, states, rpn):
    d = {
        "weights": {"mode": mode, "bits": wbits, "group_size": group},
        "gradients": {"hadamard": had, "pipeline_chunks": chunks},
        "optimizer": {"states": states},
        "topology": {"ranks_per_node": rpn},
    }
    c = Config.from_dict(d)
    assert Config.from_dict(c.to_dict()) == c
    assert Config.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_from_deepspeed_reads_only_the_sdpq_block(tmp_path):
    ds = {
        "train_batch_size": 8,
        "zero_optimization": {"stage": 3, "whatever": 1},
        "sdpq": {"weights": {"mode": "exact"}},
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    assert Config.from_deepspeed(path).weights.mode == "exact"
    assert Config.from_deepspeed(str(path)) == Config.from_deepspeed(ds)
    assert Config.from_deepspeed({"train_batch_size": 8}) is None  # plain DeepSpeed
    assert Config.from_deepspeed({"sdpq": {}}) is None  # an empty block is plain DeepSpeed too
    assert Config.from_deepspeed({"sdpq": {"stats": {}}}) == Config()  # any key: defaults elsewhere
    with pytest.raises(ConfigError, match=r"^sdpq\.gradients\.inter_bitz: unknown key"):
        Config.from_deepspeed({"sdpq": {"gradients": {"inter_bitz": 4}}})


def test_frozen_and_replace():
    c = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.weights.bits = 8  # type: ignore[misc]
    c2 = c.replace(weights={"mode": "exact"}, gradients={"hadamard": False})
    assert c2.weights.mode == "exact" and not c2.gradients.hadamard and c.weights.mode == "diff"
    with pytest.raises(ConfigError, match="sdpq.weights.bits"):
        c.replace(weights={"bits": 5})


def test_every_option_is_documented():
    doc = describe()
    for section, values in Config().to_dict().items():
        explained = type(getattr(Config(), section)).__doc__
        for key in values:
            assert f"`{key}`" in doc, f"{section}.{key} missing from the reference table"
            assert key in explained, f"{section}.{key} has no explanation in its section docstring"


def test_committed_reference_is_current():
    from pathlib import Path

    committed = (Path(__file__).parents[1] / "docs" / "config.md").read_text()
    assert committed.strip() == describe().strip(), "regenerate: sdpq config --doc > docs/config.md"


@pytest.mark.parametrize(
    "zero,message",
    [
        ({"stage": 0}, "ZeRO stages 1, 2 and 3"),
        ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
        ({"stage": 3, "zero_quantized_weights": True}, "zero_quantized_weights"),
        ({"stage": 3, "offload_param": {"device": "nvme"}}, "nvme"),
    ],
)
def test_config_check_runs_the_checks_of_initialize(tmp_path, capsys, zero, message):
    """`sdpq config --check` rejects what sdpq.deepspeed.initialize rejects, and passes what it starts."""
    from sdpq.cli import main

    path = tmp_path / "ds.json"
    base = {"train_batch_size": 8, "bf16": {"enabled": True}, "sdpq": {"optimizer": {"enabled": False}}}
    path.write_text(json.dumps({**base, "zero_optimization": zero}))
    assert main(["config", "--check", str(path)]) == 2
    assert message in capsys.readouterr().err
    path.write_text(json.dumps({**base, "zero_optimization": {"stage": 3}}))
    assert main(["config", "--check", str(path)]) == 0


def test_scale_formats_are_the_codec_formats():
    from typing import get_args

    from sdpq.config import ScaleFormat
    from sdpq.quant.groupwise import SCALE_DTYPES

    assert set(get_args(ScaleFormat)) == set(SCALE_DTYPES)


def test_the_largest_tiles_are_allowed():
    """TILE_MAX itself is accepted for every group size and the Hadamard block."""
    from sdpq.config import TILE_MAX

    c = Config.from_dict(
        {
            "weights": {"group_size": TILE_MAX},
            "gradients": {"intra_group_size": TILE_MAX, "inter_group_size": TILE_MAX, "hadamard_block": TILE_MAX},
            "optimizer": {"group_size": TILE_MAX},
        }
    )
    assert c.weights.group_size == c.gradients.hadamard_block == c.optimizer.group_size == TILE_MAX == 4096


def test_deepspeed_optimizer_hyperparameters_are_checked_as_adamw_checks_them():
    """`sdpq config --check` refuses the DeepSpeed optimizer values sdpq's AdamW would refuse."""
    from sdpq.integrations import IncompatibleConfigError, check_deepspeed_config

    for params, message in (
        ({"lr": float("inf")}, '"optimizer"."params".lr: invalid value inf'),
        ({"betas": [0.9, 1.5]}, '"optimizer"."params".betas: invalid value [0.9, 1.5]'),
    ):
        ds = {
            "zero_optimization": {"stage": 3},
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": params},
            "sdpq": {"weights": {}},
        }
        with pytest.raises(IncompatibleConfigError, match=re.escape(message)):
            check_deepspeed_config(ds, Config.from_deepspeed(ds))
