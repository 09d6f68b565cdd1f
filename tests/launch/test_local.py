"""sdpq.launch.local: the benchmarks' one way to start ranks on this machine."""

import sys
import time

import pytest

from sdpq.launch.local import local_command, run_local

RANK_SCRIPT = """
import os
import torch.distributed as dist
dist.init_process_group("gloo")
# one write per line (a short write to a pipe is atomic; print() writes the line and its end apart)
os.write(1, f"rank {dist.get_rank()} of {dist.get_world_size()} threads {os.environ['OMP_NUM_THREADS']}\\n".encode())
dist.destroy_process_group()
"""


def test_command_lines():
    torchrun = local_command(["job.py", "--x"], 4)
    assert torchrun[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert torchrun[torchrun.index("--nproc_per_node") + 1] == "4" and torchrun[-2:] == ["job.py", "--x"]
    assert "--standalone" in torchrun and "--master_port" not in torchrun  # the store binds its own port
    mpi = local_command(["job.py"], 2, "mpirun", env={"OMP_NUM_THREADS": "1"})
    assert mpi[mpi.index("-np") + 1] == "2" and mpi[-2:] == [sys.executable, "job.py"]
    assert "PYTHONPATH" not in mpi and "OMP_NUM_THREADS" in mpi  # only what is set is forwarded
    with pytest.raises(ValueError, match="launcher 'srun'; allowed: torchrun, deepspeed, mpirun"):
        local_command(["job.py"], 2, "srun")


def test_run_local_starts_every_rank(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # then every rank gets 1
    script = tmp_path / "job.py"
    script.write_text(RANK_SCRIPT)
    lines: list[str] = []
    code = run_local([str(script)], 2, log=tmp_path / "log", timeout=120, on_line=lines.append)
    assert code == 0, (tmp_path / "log").read_text()[-4000:]
    assert sorted(x.strip() for x in lines if x.startswith("rank")) == [
        "rank 0 of 2 threads 1",
        "rank 1 of 2 threads 1",
    ]
    assert (tmp_path / "log").read_text().count("rank ") >= 2


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


def test_run_local_kills_a_hung_launch(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text(
        f"import os, time\nopen(os.path.join({str(tmp_path)!r}, str(os.getpid())), 'w').close()\ntime.sleep(600)\n"
    )
    with pytest.raises(TimeoutError, match="ran past 10 s"):
        run_local([str(script)], 2, log=tmp_path / "log", timeout=10)
    pids = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    assert len(pids) == 2  # both ranks had started
    for _ in range(50):  # SIGKILL is asynchronous: give the kernel a moment
        if not any(_running(pid) for pid in pids):
            break
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)  # the ranks were killed with the launcher
