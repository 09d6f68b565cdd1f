"""Start the ranks of a job on this machine through a real launcher: the one way the benchmarks
start ranks, so that they run exactly as a user's job does (fresh processes, env:// rendezvous).

    run_local(["bench.py", "--worker", "job.json"], nproc=4, log=Path("run.log"), timeout=600)

Launchers: ``torchrun`` (``python -m torch.distributed.run``), ``deepspeed`` (its launcher
script, next to the interpreter) and ``mpirun`` (Open MPI; the ranks find each other through
MPI's variables, ``sdpq.launch.env``). Every rank gets ``OMP_NUM_THREADS=1`` unless the caller's
environment or `env` sets it: ranks share the cores. The launch runs in its own session, so a timeout ends the
launcher and every rank it started.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .env import free_port

__all__ = ["LAUNCHERS", "local_command", "run_local"]

LAUNCHERS = ("torchrun", "deepspeed", "mpirun")


def local_command(
    argv: Sequence[str], nproc: int, launcher: str = "torchrun", env: Mapping[str, str] | None = None
) -> list[str]:
    """The command line that starts `nproc` ranks of ``python argv...`` on this machine (mpirun
    forwards OMP_NUM_THREADS and PYTHONPATH from `env`, default os.environ, where they are set)."""
    py = sys.executable
    bindir = Path(py).parent
    if launcher == "torchrun":
        # Note: --standalone lets the rendezvous store bind port 0 itself. A port picked here and
        # bound later by torchrun can be taken in between (parallel test workers, gloo's own
        # connections): the likely cause of a CI launch that ended with exit code 1.
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *argv]  # fmt: skip
    port = str(free_port())
    if launcher == "deepspeed":
        return [str(bindir / "deepspeed"), "--num_nodes", "1", "--num_gpus", str(nproc),
                "--master_addr", "127.0.0.1", "--master_port", port, *argv]  # fmt: skip
    if launcher == "mpirun":
        # --map-by slot: contiguous ranks per host (Open MPI 5 otherwise interleaves local ranks,
        # which DeepSpeed's MPI discovery rejects).
        cmd = [str(bindir / "mpirun"), "-np", str(nproc), "--oversubscribe", "--map-by", "slot", "--bind-to", "none"]
        env = os.environ if env is None else env
        forward = [name for name in ("OMP_NUM_THREADS", "PYTHONPATH") if name in env]
        for name in (*forward, "MASTER_ADDR=127.0.0.1", f"MASTER_PORT={port}"):
            cmd += ["-x", name]
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
        return [*cmd, py, *argv]
    raise ValueError(f"launcher {launcher!r}; allowed: {', '.join(LAUNCHERS)}")


def run_local(
    argv: Sequence[str],
    nproc: int,
    *,
    log: Path,
    timeout: float,
    launcher: str = "torchrun",
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None] | None = None,
) -> int:
    """Run the job, its output (all ranks) written to `log` and each line given to `on_line`;
    returns the launcher's exit code. Past `timeout` seconds every process of the launch is
    killed and a TimeoutError raised."""
    full_env = {"OMP_NUM_THREADS": "1", **os.environ, **(env or {})}
    cmd = local_command(argv, nproc, launcher, full_env)
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # fmt: skip

        def pump() -> None:  # a thread: a silent, hung launch must not block the timeout
            assert proc.stdout is not None
            try:
                for line in proc.stdout:
                    f.write(line)
                    if on_line is not None:
                        on_line(line)
            except (OSError, ValueError):  # the pipe or the log closed under us: the launch is over
                pass

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _end_launch(proc)
            raise TimeoutError(f"{launcher} launch ran past {timeout:.0f} s; log: {log}") from None
        except BaseException:  # Ctrl-C (the launch has a session of its own: the signal stops here)
            _end_launch(proc)
            raise
        finally:
            reader.join(10)
            if proc.stdout is not None:
                proc.stdout.close()
    return code


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ... start time is
    field 20 here), None if the process is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _descendants(pid: int) -> list[tuple[int, str]]:
    """(pid, start time) of every process below `pid` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        fields = _stat(int(entry.parent.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append((int(entry.parent.name), fields[19]))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child[0])
    return out


def _end_launch(proc: subprocess.Popen) -> None:
    """End the launcher and every rank. Note: torchrun starts its ranks in sessions of their own,
    so a signal to the launcher's process group does not reach them; it stops them itself on
    SIGTERM, and what is still alive after that is killed by pid."""
    ranks = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)  # our child: its pid stays ours until we wait for it
    for pid, started in ranks:
        fields = _stat(pid)
        if fields is not None and fields[19] == started:  # the same process, not a reused pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    proc.wait()
