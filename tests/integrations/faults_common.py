"""Shared pieces of the fault tests of sdpq.fsdp (FSDP2, HSDP) and sdpq.ddp (test_fsdp_faults.py,
test_ddp_faults.py): one rank's checkpoint file damaged, a full disk, and a job run to its end
while one of its ranks is killed.

Note: `dist.run` ends a run at the first rank that fails and kills the others: right for every
other test, but it hides how the survivors of a killed rank end. `run_to_the_end` runs `fn` on
a pool of the harness's workers of its own, where every rank ends as a training script does: a
rank that raises writes down what it raised and exits (so its peers' gloo connections close, as
in a real job), a killed rank just dies. It waits for every rank to exit and reports how each
ended and when; a rank still running at the deadline is reported with its stack, then killed.
"""

from __future__ import annotations

import errno
import os
import pickle
import shutil
import signal
import time
import warnings

import harness
import torch
import torch.distributed as tdist

__all__ = [
    "DAMAGES",
    "damage",
    "full_disk",
    "kill_this_rank",
    "kill_within_next_save",
    "killed_at",
    "outcome",
    "run_to_the_end",
    "save_on_a_full_disk",
    "tree",
    "warm_up_before_fork",
]

# How one rank's file is damaged: cut to half its size, overwritten with as many random bytes,
# deleted, replaced by another rank's file of the same checkpoint, or by this rank's file of the
# run's earlier checkpoint.
DAMAGES = ("truncated", "random", "deleted", "other-rank", "stale")


def warm_up_before_fork() -> None:
    """Do here, once, what every rank forked from this process would do at its first step: import
    torch._dynamo and its lazily loaded parts (torch._inductor, sympy, networkx: FSDP2's DTensors
    and every optimizer's first add_param_group reach them) and load sdpq's C++ kernels. Note (CI
    time): about a CPU second a rank (four with DeepSpeed) less for every fresh pool."""
    import torch._dynamo  # noqa: F401

    from sdpq.kernels import native

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # dynamo's disable wrapper, once
    for name in ("codec", "adamw", "finite"):
        native.load(name)


def damage(path: str, how: str, *, other_rank: str | None = None, earlier: str | None = None) -> None:
    """Damage the file `path` as DAMAGES says (`other_rank`, `earlier`: the files copied over it)."""
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    elif how == "random":
        size = os.path.getsize(path)
        with open(path, "wb") as f:
            f.write(os.urandom(size))
    elif how == "deleted":
        os.remove(path)
    elif how == "other-rank":
        assert other_rank is not None
        shutil.copy(other_rank, path)
    elif how == "stale":
        assert earlier is not None
        shutil.copy(earlier, path)
    else:
        raise ValueError(how)


def full_disk(n: int = 100):
    """A stand-in for a write that fills the disk: writes n bytes to `f`, then fails with ENOSPC."""

    def write(obj, f, *args, **kwargs):
        f.write(b"\0" * n)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    return write


def outcome(fn, *args, errors: tuple = ()) -> dict:
    """How fn(*args) ended on this rank: {"raised": "Type: message"} (an Exception or one of
    `errors`) or {}, the sdpq warnings it gave ("warned") and its seconds."""
    t0 = time.perf_counter()
    out: dict = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn(*args)
        except (Exception, *errors) as e:
            out["raised"] = f"{type(e).__name__}: {e}"
    out["warned"] = [f"{w.category.__name__}: {w.message}" for w in caught if "sdpq" in str(w.message)]
    out["seconds"] = time.perf_counter() - t0
    return out


def save_on_a_full_disk(save, full: bool, previous: str, errors: tuple = ()) -> dict:
    """save() (collective) while this rank's disk is full if `full` (torch.save fails midway with
    ENOSPC): {"full-save": its outcome, "unchanged": whether the files under `previous` are as
    they were}."""
    before = tree(previous)
    tdist.barrier()  # every rank has looked before any rank writes
    real_save = torch.save
    torch.save = full_disk() if full else real_save
    try:
        out = {"full-save": outcome(save, errors=errors)}
    finally:
        torch.save = real_save
    tdist.barrier()
    out["unchanged"] = tree(previous) == before
    return out


def tree(path: str) -> dict[str, bytes]:
    """Every file under `path` (relative name -> bytes)."""
    out = {}
    for root, _, names in os.walk(path):
        for n in names:
            with open(os.path.join(root, n), "rb") as f:
                out[os.path.relpath(os.path.join(root, n), path)] = f.read()
    return out


def kill_this_rank(out_dir: str) -> None:
    """SIGKILL this process, after writing down when (for the survivors' exit times)."""
    with open(os.path.join(out_dir, "killed_at"), "w") as f:
        f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def kill_within_next_save(out_dir: str) -> None:
    """Arm this rank: its next sdpq save (_files.write_pending, which every agreed save calls)
    writes the new file completely beside the old one, then the process is killed (kill_this_rank)
    before the ranks agree and rename."""
    import sdpq.integrations._files as sdpq_files

    write_pending = sdpq_files.write_pending

    def dying(*args, **kwargs):
        write_pending(*args, **kwargs)
        kill_this_rank(out_dir)

    sdpq_files.write_pending = dying


def _to_the_end(ctx, fn, out_dir: str, args: tuple) -> None:
    """Runs on a worker: fn(ctx, out_dir, *args), then this rank's end written to out_dir and the
    process gone, whatever fn did (see the module docstring)."""
    try:
        end = {"end": "returned", "value": fn(ctx, out_dir, *args)}
    except BaseException as e:  # noqa: BLE001 - every end is reported
        end = {"end": "raised", "error": f"{type(e).__name__}: {e}"}
    end["at"] = time.time()
    tmp = os.path.join(out_dir, f".rank{ctx.rank}.tmp")
    with open(tmp, "wb") as f:
        pickle.dump(end, f)
    os.replace(tmp, os.path.join(out_dir, f"rank{ctx.rank}.end"))
    os._exit(0)


def run_to_the_end(fn, world_size: int, ranks_per_node: int, out_dir: str, *args, timeout: float = 20) -> list[dict]:
    """Run fn(ctx, out_dir, *args) on `world_size` fresh gloo ranks until every one has exited
    (gloo's timeout: `timeout`; the wait: timeout + 5 s). Per rank: {"end": "returned" (+ value),
    "raised" (+ error) or "killed" | "hung" (+ stack), "at": time.time() of the end or None}."""
    os.makedirs(out_dir, exist_ok=True)
    pool = harness._Pool(world_size)
    try:
        ref = harness._function_ref(_to_the_end)
        blob = pickle.dumps((fn, out_dir, args), protocol=pickle.HIGHEST_PROTOCOL)
        for conn in pool.conns:
            conn.send(("run", ref, blob, ranks_per_node, float(timeout), 1234))
        deadline = time.monotonic() + timeout + 5
        for p in pool.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(pool.procs) if p.is_alive()]
        stacks = pool.dump_stacks(hung) if hung else {}
    finally:
        pool.kill()
    ends = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.end")
        if os.path.exists(path):
            with open(path, "rb") as f:
                ends.append(pickle.load(f))
        elif r in hung:
            ends.append({"end": "hung", "stack": stacks.get(r, ""), "at": None})
        else:
            ends.append({"end": "killed", "at": None})
    return ends


def killed_at(out_dir: str) -> float:
    with open(os.path.join(out_dir, "killed_at")) as f:
        return float(f.read())
