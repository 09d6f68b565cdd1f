"""Smoke test: the example commands of launchers/README.md and ds_configs/README.md that can run on
this machine, run as written (2 steps), and a ready config with flags that override its keys (every
other ready config and backend is run elsewhere: see the note above the flags test).

Each run must state the layout its example promises, count cross-node bytes (non-zero where sdpq
is on; a baseline counts them with sdpq's exact collectives), print exactly the overrides its
record lists, and run the DeepSpeed config "file + printed overrides" (deepspeed backend) or take
the file's optimizer, precision and clipping (fsdp2). The default tier runs the READMEs' single-node
examples; the emulated cluster's is `slow`.
"""

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What a launcher would set: a stale value from the test's own environment must not leak in.
_JOB_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "SDPQ_DRY_RUN",
)
# 2 steps of a 1-layer model: the examples' settings, layouts and collectives, at a fraction of the time
# (the model's size is a flag of its own: no config key changes with it).
_SHORT = ["--steps", "2", "--eval-batches", "0", "--log-every", "0", "--n-layer", "1", "--d-model", "128"]
_COMMAND = re.compile(r"((?:[A-Z_]+=\S+ )*)launchers/(\S+)([^`\n]*)")


def readme_examples(readme: str) -> list[tuple[dict, str, list[str]]]:
    """(environment, script, arguments) of every launcher command in a README (code spans and blocks)."""
    out = []
    for m in _COMMAND.finditer((REPO / readme).read_text()):
        env = dict(kv.split("=", 1) for kv in m.group(1).split())
        args = [a for a in shlex.split(m.group(3)) if a != "..."]
        out.append((env, m.group(2), args))
    return out


def _runs_here(script: str) -> bool:
    if script == "single_node.sh":
        return True
    if script == "emulated_cluster.sh":  # network namespaces: root and iproute2
        return os.geteuid() == 0 and bool(shutil.which("ip")) and bool(shutil.which("tc"))
    return False  # other machines, ssh, a scheduler or an MPI hostfile


def _promised_layout(script: str, env: dict) -> str:
    if script == "single_node.sh":
        nproc, rpn = int(env.get("NPROC", 4)), int(env.get("RANKS_PER_NODE", 2))
        return f"{nproc // rpn}x{rpn}"
    return f"{env.get('NODES', 2)}x{env.get('RANKS_PER_NODE', 2)}"  # emulated_cluster.sh


def _set(d: dict, key: str, value) -> None:
    *parents, last = key.split(".")
    for part in parents:
        d = d.setdefault(part, {})
    d[last] = value


def run_example(tmp_path: Path, env: dict, script: str, args: list[str], timeout: float = 240) -> tuple[dict, str]:
    out = tmp_path / "record.json"
    base = {k: v for k, v in os.environ.items() if k not in _JOB_VARS}
    # The README's --steps (if any) is replaced by the short run's.
    if "--steps" in args:
        i = args.index("--steps")
        args = args[:i] + args[i + 2 :]
    proc = subprocess.run(
        ["bash", str(REPO / "launchers" / script), *args, *_SHORT, "--out", str(out)],
        cwd=REPO,
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} {args} failed:\n{log[-4000:]}"
    return json.loads(out.read_text()), proc.stdout


def check_record(record: dict, stdout: str, script: str, env: dict, args: list[str]) -> None:
    extra, spec = record["extra"], record["spec"]
    assert extra["layout"] == _promised_layout(script, env)
    assert f"layout={extra['layout']}" in stdout
    cross = record["cross_node_bytes_per_step"]
    if extra["layout"].startswith("1x"):
        assert cross == 0
    elif spec["sdpq"]:  # sdpq on: its own statistics, quantized bytes across the nodes
        assert extra["cross_node_counter"] == "sdpq.stats" and cross > 0
    else:  # a baseline counts with sdpq's exact collectives
        assert "exact collectives" in extra["cross_node_counter"] and cross > 0
    printed = [
        line.removeprefix("[sdpq.train] ")
        for line in stdout.splitlines()
        if line.startswith("[sdpq.train] ") and " overrides " in line
    ]
    assert printed == [o["line"] for o in record["overrides"]]
    if "--config" not in args:
        assert printed == []
        return
    path = REPO / args[args.index("--config") + 1]
    expected = json.loads(path.read_text())
    for o in record["overrides"]:
        assert o["line"].endswith(f"from {path.relative_to(REPO)}") and o["flag"] is not None
        _set(expected, o["key"], o["new"])
    backend = args[args.index("--backend") + 1]
    if backend == "deepspeed":  # the file as written, with the printed overrides and nothing else
        assert extra["ds_config"] == expected
        return
    params = expected["optimizer"]["params"]  # fsdp2: the file's optimizer, precision and clipping
    assert (spec["lr"], spec["eps"], spec["weight_decay"], list(spec["betas"])) == (
        params["lr"],
        params["eps"],
        params["weight_decay"],
        params["betas"],
    )
    assert spec["grad_clip"] == expected["gradient_clipping"]
    bf16 = expected.get("bf16", {}).get("enabled", False)
    assert (extra["mp_policy"] or {}).get("param_dtype") == ("torch.bfloat16" if bf16 else None)
    assert spec["sdpq"] == expected.get("sdpq")


def _cases():
    cases, seen = [], set()
    for readme in ("launchers/README.md", "ds_configs/README.md"):
        for env, script, args in readme_examples(readme):
            key = (script, tuple(sorted(env.items())), tuple(args))
            if key in seen:
                continue
            seen.add(key)
            marks = [] if script == "single_node.sh" else [pytest.mark.slow]
            name = f"{readme.split('/')[0]}:{script}:{' '.join(a for a in args if a != '--steps')}"
            cases.append(pytest.param(env, script, args, marks=marks, id=name))
    return cases


def test_readme_examples_are_found():
    found = {(s, tuple(a)) for r in ("launchers/README.md", "ds_configs/README.md") for _, s, a in readme_examples(r)}
    assert ("single_node.sh", ("--backend", "fsdp2")) in found
    assert (
        "single_node.sh",
        ("--backend", "deepspeed", "--config", "ds_configs/zero3_sdpq.json", "--steps", "10"),
    ) in found
    assert {s for s, _ in found} >= {
        "single_node.sh",
        "emulated_cluster.sh",
        "torchrun_multinode.sh",
        "deepspeed_hostfile.sh",
        "mpirun.sh",
    }


# Examples whose every part another test runs, left out to keep CI inside its time: the plain
# DeepSpeed baseline trains in tests/integrations/test_deepspeed_startup.py's test_ds_configs_train
# (zero3.json, 2 x 2), and its command line takes the same path as the zero3_sdpq.json example
# below, which runs (a file without "sdpq" counts with sdpq's exact collectives, as
# tests/train/test_train_settings.py checks).
_COVERED = {("single_node.sh", ("--backend", "deepspeed", "--config", "ds_configs/zero3.json", "--steps", "10"))}


@pytest.mark.parametrize("env,script,args", _cases())
def test_readme_example(tmp_path, env, script, args):
    if not _runs_here(script):
        pytest.skip(f"{script} needs other machines, ssh, a scheduler or root here")
    if (script, tuple(args)) in _COVERED:
        pytest.skip("run in parts by other tests (see _COVERED)")
    record, stdout = run_example(tmp_path, env, script, args)
    check_record(record, stdout, script, env, args)


# Note: the READMEs' examples run zero3.json and zero3_sdpq.json (DeepSpeed) and zero3_sdpq.json
# (FSDP2); every other (config, backend) pair is run elsewhere. DeepSpeed:
# tests/integrations/test_deepspeed_startup.py's test_ds_configs_train trains every ready config
# with DeepSpeed at 2 x 2, 2 steps, in one worker pool, and tests/train/test_train_settings.py
# builds the DeepSpeed config a flag changes. FSDP2 reads the blocks of the weights-only,
# gradients-only and optimizer-only configs, and the optimizer, precision and clipping of
# zero3.json, as it reads zero3_sdpq.json's; zero2_sdpq.json on FSDP2 is the flags test below.


def test_flags_override_the_file_and_say_so(tmp_path):
    """A flag changes its one key of the config, printed once; the rest runs as written: the
    ZeRO-2 ready config on FSDP2, 2 nodes x 1 rank (its collectives cross the simulated node
    boundary at half the start-up cost of 4 processes on 2 cores)."""
    env = {"NPROC": "2", "RANKS_PER_NODE": "1"}
    args = ["--backend", "fsdp2", "--config", "ds_configs/zero2_sdpq.json", "--lr", "0.001", "--grad-clip", "0.5"]
    record, stdout = run_example(tmp_path, env, "single_node.sh", args)
    assert [o["line"] for o in record["overrides"]] == [
        "--grad-clip 0.5 overrides gradient_clipping 1.0 from ds_configs/zero2_sdpq.json",
        "--lr 0.001 overrides optimizer.params.lr 0.0003 from ds_configs/zero2_sdpq.json",
        '--ranks-per-node 1 overrides sdpq.topology.ranks_per_node "auto" from ds_configs/zero2_sdpq.json',
    ]
    assert stdout.count("--lr 0.001 overrides") == 1
    check_record(record, stdout, "single_node.sh", env, args)
