"""Each launcher script's command line (dry run), and the launcher-environment discovery."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sdpq.launch import env as launch_env
from sdpq.launch.emulated import torchrun_command

REPO = Path(__file__).resolve().parents[2]
LAUNCHERS = REPO / "launchers"
_JOB_VARS = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE",
    "SLURM_NODEID",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "PMIX_RANK",
    "OMP_NUM_THREADS",
    "NODE_RANK",
    "NODE_ADDR",
]


def _dry_run(script: str, *args: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in _JOB_VARS}
    out = subprocess.run(
        ["bash", str(LAUNCHERS / script), *args],
        env={**base, "SDPQ_DRY_RUN": "1", **env},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("[sdpq launcher]")]
    return line


def test_single_node():
    line = _dry_run("single_node.sh", "--steps", "5", NPROC="4", RANKS_PER_NODE="2")
    assert "-m torch.distributed.run --standalone --nproc-per-node=4 -m sdpq.train --ranks-per-node 2 --steps 5" in line
    assert "OMP_NUM_THREADS=1" in line or f"OMP_NUM_THREADS={max(1, os.cpu_count() // 4)}" in line


def test_torchrun_multinode_marks_the_rendezvous_host():
    env = dict(NNODES="2", NPROC_PER_NODE="2", MASTER_ADDR="10.213.7.1", NODE_ADDR="10.213.7.2", NODE_RANK="1")
    line = _dry_run("torchrun_multinode.sh", "--backend", "fsdp2", **env)
    for part in (
        "--nnodes=2",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.213.7.1:29400",
        "--rdzv-conf=is_host=false",
        "--local-addr=10.213.7.2",
        "-m sdpq.train --backend fsdp2",
    ):
        assert part in line
    assert "is_host=true" in _dry_run("torchrun_multinode.sh", **{**env, "NODE_RANK": "0"})


def test_torchrun_multinode_requires_master():
    out = subprocess.run(
        ["bash", str(LAUNCHERS / "torchrun_multinode.sh")],
        capture_output=True,
        text=True,
        env={"PATH": os.environ["PATH"], "NNODES": "2", "SDPQ_DRY_RUN": "1"},
        timeout=30,
    )
    assert out.returncode != 0 and "MASTER_ADDR" in out.stderr


def test_deepspeed_hostfile_ssh_and_no_ssh(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("# comment\nnodeA slots=4\nnodeB slots=4\n")
    line = _dry_run("deepspeed_hostfile.sh", "--config", "x.json", HOSTFILE=str(hosts), MASTER_ADDR="nodeA")
    assert (
        f"/deepspeed --hostfile={hosts} --master_addr=nodeA --master_port=29500 "
        "--module sdpq.train --backend deepspeed --config x.json"
    ) in line
    assert "--no_ssh" not in line
    line = _dry_run("deepspeed_hostfile.sh", HOSTFILE=str(hosts), MASTER_ADDR="nodeA", NODE_RANK="1")
    assert "--no_ssh --node_rank=1" in line
    assert f"OMP_NUM_THREADS={max(1, os.cpu_count() // 4)}" in line  # cores / slots per node


def test_slurm_uses_srun_and_task_cpus():
    line = _dry_run("slurm.sbatch", "--steps", "9", SDPQ_REPO=str(REPO), MASTER_ADDR="n0", SLURM_CPUS_PER_TASK="6")
    assert "OMP_NUM_THREADS=6" in line and "srun --kill-on-bad-exit=1" in line and "-m sdpq.train --steps 9" in line


def test_mpirun():
    line = _dry_run("mpirun.sh", NP="8", MPI_HOSTFILE="hosts")
    assert (
        "/mpirun -np 8 --map-by slot --oversubscribe" in line
        and "--hostfile hosts" in line
        and "-x OMP_NUM_THREADS" in line
    )
    assert "-m sdpq.train" in line


def test_emulated_cluster():
    line = _dry_run("emulated_cluster.sh", "--steps", "3", NODES="2", RANKS_PER_NODE="2", BANDWIDTH="200mbit")
    assert "-m sdpq.launch.emulated --nodes 2 --ranks-per-node 2 --bandwidth 200mbit -- -m sdpq.train --steps 3" in line


def test_torchrun_command_for_module_and_script():
    cmd = torchrun_command(2, 0, 4, "10.0.0.1:29400", "j", ["-m", "sdpq.train", "--steps", "1"], "10.0.0.1")
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert "--module" in cmd and cmd[-3:] == ["sdpq.train", "--steps", "1"] and "--local-addr=10.0.0.1" in cmd
    assert torchrun_command(2, 1, 4, "h:1", "j", ["train.py"])[-1] == "train.py"


@pytest.fixture
def clean_env(monkeypatch):
    for k in _JOB_VARS:
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_discover_deepspeed_maps_local_size(clean_env):
    for k, v in dict(
        RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_SIZE="4", MASTER_ADDR="h", MASTER_PORT="1"
    ).items():
        clean_env.setenv(k, v)
    job = launch_env.discover()
    assert job == launch_env.JobEnv("deepspeed", 5, 8, 1, 4) and os.environ["LOCAL_WORLD_SIZE"] == "4"


def test_discover_slurm(clean_env):
    for k, v in dict(
        SLURM_PROCID="6", SLURM_NTASKS="8", SLURM_LOCALID="2", SLURM_NTASKS_PER_NODE="4(x2)", MASTER_ADDR="n0"
    ).items():
        clean_env.setenv(k, v)
    assert launch_env.discover() == launch_env.JobEnv("slurm", 6, 8, 2, 4)
    assert os.environ["RANK"] == "6" and os.environ["MASTER_PORT"] == "29500"


def test_discover_slurm_without_ntasks_per_node(clean_env):
    # sbatch -n 7 over 2 nodes: SLURM_TASKS_PER_NODE="4,3"; node 1 runs 3 tasks.
    for k, v in dict(
        SLURM_PROCID="5",
        SLURM_NTASKS="7",
        SLURM_LOCALID="1",
        SLURM_TASKS_PER_NODE="4,3",
        SLURM_NODEID="1",
        MASTER_ADDR="n0",
    ).items():
        clean_env.setenv(k, v)
    assert launch_env.discover() == launch_env.JobEnv("slurm", 5, 7, 1, 3)


def test_slurm_tasks_per_node_run_length():
    f = launch_env._slurm_tasks_on_this_node
    assert f({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "1"}) == "4"
    assert f({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"}) == "3"
    assert f({"SLURM_NTASKS_PER_NODE": "8", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NODEID": "0"}) == "8"
    assert f({}) is None


def test_discover_torchrun_and_single(clean_env):
    for k, v in dict(RANK="1", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="x").items():
        clean_env.setenv(k, v)
    assert launch_env.discover() == launch_env.JobEnv("torchrun", 1, 4, 1, 2)
    for k in _JOB_VARS + ["TORCHELASTIC_RUN_ID"]:
        clean_env.delenv(k, raising=False)
    assert launch_env.discover() == launch_env.JobEnv("single", 0, 1, 0, 1)
