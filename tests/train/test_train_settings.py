"""sdpq.train.settings: one resolution order (flag > file > launcher > default) for both backends,
the overrides it prints, what the FSDP2 backend takes from a DeepSpeed config, and how a baseline
counts its cross-node bytes."""

import argparse
import json

import pytest

from sdpq.config import ConfigError
from sdpq.train.__main__ import add_arguments
from sdpq.train.run import RunSpec
from sdpq.train.settings import EXACT, resolve

ENV = {"WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}


def _resolve(*argv: str, env=None):
    p = argparse.ArgumentParser()
    add_arguments(p)
    return resolve(p.parse_args(list(argv)), ENV if env is None else env)


def _file(tmp_path, base: str = "zero3_sdpq.json", **changes) -> str:
    cfg = json.loads(open(f"ds_configs/{base}").read())
    for key, value in changes.items():
        d = cfg
        *parents, last = key.split("__")
        for part in parents:
            d = d.setdefault(part, {})
        if value is None:
            d.pop(last, None)
        else:
            d[last] = value
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def test_without_a_file_flags_and_defaults(tmp_path):
    r = _resolve()
    assert (r.spec.lr, r.spec.grad_clip, r.spec.micro_batch, r.spec.bf16, r.spec.mixed_precision) == (
        1e-3,
        1.0,
        4,
        False,
        None,
    )
    assert r.spec.ranks_per_node == 4 and r.overrides == () and r.spec.deepspeed is None  # launcher's
    assert r.spec.count_bytes == "exact" and RunSpec().count_bytes == "off"  # the CLI counts; the library is plain
    r = _resolve("--lr", "0.01", "--bf16", "--grad-clip", "0")
    assert (r.spec.lr, r.spec.bf16, r.spec.grad_clip) == (0.01, True, 0.0) and r.overrides == ()


def test_deepspeed_runs_the_file_as_written(tmp_path):
    path = _file(tmp_path)
    r = _resolve("--backend", "deepspeed", "--config", path)
    assert r.spec.deepspeed == json.loads(open(path).read()) and r.lines() == []
    assert (r.spec.lr, r.spec.micro_batch, r.spec.grad_clip) == (3e-4, 4, 1.0)


def test_a_flag_overrides_one_key_and_says_so(tmp_path):
    path = _file(tmp_path)
    r = _resolve("--backend", "deepspeed", "--config", path, "--lr", "0.001", "--micro-batch", "4")  # 4: as the file
    assert r.lines() == [f"--lr 0.001 overrides optimizer.params.lr 0.0003 from {path}"]
    expected = json.loads(open(path).read())
    expected["optimizer"]["params"]["lr"] = 0.001
    assert r.spec.deepspeed == expected and r.spec.lr == 0.001
    r = _resolve("--backend", "deepspeed", "--config", path, "--no-bf16")
    assert r.lines() == [f"--no-bf16 overrides bf16.enabled true from {path}"]
    assert r.spec.deepspeed["bf16"] == {"enabled": False}


def test_keys_the_file_leaves_out_mean_what_they_mean_to_deepspeed(tmp_path):
    path = _file(tmp_path, gradient_clipping=None, bf16=None)
    for backend in ("deepspeed", "fsdp2"):
        r = _resolve("--backend", backend, "--config", path)
        assert r.spec.grad_clip == 0.0 and r.spec.mixed_precision is None and not r.spec.bf16
    r = _resolve("--backend", "deepspeed", "--config", path, "--grad-clip", "2")
    assert r.lines() == [f"--grad-clip 2.0 overrides gradient_clipping (not set) from {path}"]
    assert r.spec.deepspeed["gradient_clipping"] == 2.0


@pytest.mark.parametrize(
    "flag,file,env,expected",
    [
        (None, "auto", {"LOCAL_WORLD_SIZE": "4"}, 4),  # the launcher, for "auto"
        (None, 2, {"LOCAL_WORLD_SIZE": "4"}, 2),  # the file's integer over the launcher
        ("1", "auto", {"LOCAL_WORLD_SIZE": "4"}, 1),  # the flag over the file
        ("auto", 2, {"LOCAL_WORLD_SIZE": "4"}, 2),  # the flag "auto" defers to the file
        (None, "auto", {}, 8),  # no launcher variable: one node
    ],
)
def test_ranks_per_node_order(tmp_path, flag, file, env, expected):
    path = _file(tmp_path, sdpq__topology__ranks_per_node=file)
    for backend in ("deepspeed", "fsdp2"):  # the same answer for both backends
        argv = ["--backend", backend, "--config", path] + (["--ranks-per-node", flag] if flag else [])
        assert _resolve(*argv, env={"WORLD_SIZE": "8", **env}).spec.ranks_per_node == expected


def test_a_contradicting_integer_is_an_error_naming_both(tmp_path):
    path = _file(tmp_path, sdpq__topology__ranks_per_node=4)
    with pytest.raises(ConfigError, match=f"--ranks-per-node 2 contradicts sdpq.topology.ranks_per_node 4 in {path}"):
        _resolve("--config", path, "--ranks-per-node", "2")
    assert _resolve("--config", path, "--ranks-per-node", "4").overrides == ()


def test_fsdp2_takes_optimizer_precision_and_clipping_from_the_file(tmp_path):
    r = _resolve("--backend", "fsdp2", "--config", "ds_configs/zero3_sdpq.json")
    s = r.spec
    assert (s.lr, s.betas, s.eps, s.weight_decay, s.grad_clip) == (3e-4, (0.9, 0.95), 1e-8, 0.1, 1.0)
    assert s.mixed_precision == "bf16" and s.bf16  # MCF master: bf16 parameters, as on DeepSpeed
    assert s.deepspeed is None and s.sdpq["weights"]["mode"] == "diff"
    s = _resolve("--backend", "fsdp2", "--config", "ds_configs/zero3.json").spec
    assert s.mixed_precision == "bf16" and not s.bf16 and s.sdpq is None  # bf16 compute, fp32 parameters
    s = _resolve("--backend", "fsdp2", "--config", "ds_configs/zero3_sdpq_weights.json").spec
    assert s.mixed_precision == "bf16" and not s.bf16  # DeepSpeed's own AdamW: fp32 master
    s = _resolve("--backend", "fsdp2", "--config", "ds_configs/zero3.json", "--mixed-precision", "none").spec
    assert s.mixed_precision is None


def test_fsdp2_refuses_what_it_cannot_run(tmp_path):
    with pytest.raises(ConfigError, match="optimizer.type: 'Lamb'"):
        _resolve("--config", _file(tmp_path, optimizer__type="Lamb"))
    with pytest.raises(ConfigError, match="fp16.enabled"):
        _resolve("--config", _file(tmp_path, bf16=None, fp16={"enabled": True}))


def test_baseline_counts_with_exact_collectives_or_says_not_counted():
    from sdpq.train.deepspeed_backend import run_config

    base = json.loads(open("ds_configs/zero3.json").read())
    spec = RunSpec(backend="deepspeed", ranks_per_node=2, count_bytes="exact", deepspeed=base)
    cfg, counter = run_config(spec, base)
    assert "exact collectives" in counter and cfg["sdpq"] == {**EXACT, "topology": {"ranks_per_node": 2}}
    assert {k: v for k, v in cfg.items() if k != "sdpq"} == base  # every key DeepSpeed reads: the file's
    assert run_config(RunSpec(backend="deepspeed", count_bytes="off", deepspeed=base), base) == (base, None)
    zeropp = json.loads(open("ds_configs/zero3_zeropp.json").read())  # sdpq cannot be installed with ZeRO++
    assert run_config(RunSpec(backend="deepspeed", count_bytes="exact", deepspeed=zeropp), zeropp) == (zeropp, None)
    quiet = dict(base, sdpq={"stats": {"enabled": False}})
    assert run_config(RunSpec(backend="deepspeed", ranks_per_node=2, deepspeed=quiet), quiet)[1] is None


def test_a_bare_sdpq_block_is_one_even_with_an_optimizer_section(tmp_path):
    path = tmp_path / "block.json"
    path.write_text(json.dumps(EXACT))  # "optimizer" is an sdpq section here, not DeepSpeed's block
    r = _resolve("--config", str(path), "--ranks-per-node", "2")
    assert r.spec.sdpq == {**EXACT, "topology": {"ranks_per_node": 2}} and r.spec.lr == 1e-3
    path.write_text(json.dumps({"weightz": {}}))
    with pytest.raises(ConfigError, match="weightz"):
        _resolve("--config", str(path))


def test_bad_ranks_per_node_and_missing_optimizer_params(tmp_path):
    with pytest.raises(ConfigError, match="--ranks-per-node: 'two'; allowed: a positive integer or 'auto'"):
        _resolve("--ranks-per-node", "two")
    path = _file(tmp_path, optimizer__params={"lr": 0.01})
    s = _resolve("--backend", "fsdp2", "--config", path).spec  # torch.optim.AdamW's defaults, as torch_adam
    assert (s.lr, s.betas, s.eps, s.weight_decay) == (0.01, (0.9, 0.999), 1e-8, 0.01)
    assert _resolve("--config", path, "--ranks-per-node", "2").ranks_per_node_from == "--ranks-per-node"
