"""Multi-rank test harness: run a function on N real gloo ranks from a pytest test.

A pool of persistent worker processes per world size is forked from the pytest process and
reused across tests (forking a pool and building its gloo group costs ~0.1-0.5 s; a run on a
warm pool costs a few milliseconds). See tests/README.md for usage.

Note: forking a process that has started an OpenMP thread pool can deadlock the child, so
OMP_NUM_THREADS=1 must be set before torch is imported (tests/conftest.py does it first thing).

Failure policy (gloo cannot recover a group after a failed collective; a peer may stay blocked
in a half-finished one): after any error on any rank, any timeout or any interruption of the
wait (Ctrl-C, pytest-timeout), the whole pool is killed - every worker, its process group with
it - and the next run forks a fresh one.  Every collective has a timeout: the run's timeout is
installed on the world group and as the default of groups created during the run, and the
parent waits at most timeout + a grace period before killing the workers.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import faulthandler
import importlib
import importlib.util
import io
import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any


def _grace_s(timeout: float) -> float:
    """Extra seconds the parent waits beyond the run's timeout: the ranks' own gloo timeouts fire
    at `timeout` and report a traceback; the parent only kills what is still silent after that."""
    return min(5.0, 1.0 + timeout / 2)


_POOL_START_TIMEOUT_S = 60.0


class DistTestError(AssertionError):
    """A rank raised. `rank` is the first rank that reported; `remote_traceback` its traceback;
    `errors` maps every rank that reported an error (before the pool was killed) to its traceback."""

    def __init__(self, message: str, rank: int, remote_traceback: str, errors: dict[int, str]):
        super().__init__(message)
        self.rank = rank
        self.remote_traceback = remote_traceback
        self.errors = errors


class DistTimeoutError(DistTestError):
    """Some ranks neither returned nor raised within timeout + grace; `stacks` holds their Python
    stacks (dumped with faulthandler just before they were killed)."""

    def __init__(self, message: str, hung: list[int], stacks: dict[int, str], errors: dict[int, str]):
        first = hung[0] if hung else -1
        super().__init__(message, first, stacks.get(first, ""), errors)
        self.hung = hung
        self.stacks = stacks


@dataclasses.dataclass(frozen=True)
class RankContext:
    """What `fn(ctx, *args)` gets: the rank's place in the simulated node layout
    (rank = node * ranks_per_node + local_rank)."""

    rank: int
    world_size: int
    ranks_per_node: int
    local_rank: int
    node: int
    nodes: int
    timeout: float


# ----------------------------------------------------------------------------- worker side


def _set_parent_death_signal() -> None:
    # Note: if pytest dies without cleaning up (SIGKILL, os._exit from pytest-timeout's thread
    # method), the kernel kills the workers too - no rank is left hanging.
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except Exception:  # non-Linux: the ppid poll in the main loop still catches it
        pass


def _resolve(ref: tuple) -> Callable:
    kind = ref[0]
    if kind == "pickle":
        return pickle.loads(ref[1])
    _, module_name, qualname, module_file, parent_path = ref
    module = sys.modules.get(module_name)
    if module is None:
        # The pool was forked before this module was imported in the parent: import it the same
        # way (same sys.path), or from its file under the same name.
        for p in reversed(parent_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            if not module_file:
                raise
            spec = importlib.util.spec_from_file_location(module_name, module_file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _drop_subgroups(dist) -> None:
    # Groups created by the previous run: every rank finished it (the parent got all results),
    # so no collective on them is in flight. Destroying them keeps sockets from piling up.
    from torch.distributed import distributed_c10d as c10d

    default = c10d._get_default_group()
    for pg in list(c10d._world.pg_map.keys()):
        if pg is not default:
            with contextlib.suppress(Exception):
                dist.destroy_process_group(pg)


def _worker_main(rank: int, world_size: int, conn, port_conn, stack_file: str) -> None:
    _set_parent_death_signal()
    # Ctrl-C goes to the whole foreground process group: the parent handles it and kills us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    parent = os.getppid()
    stack_fh = open(stack_file, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_fh, all_threads=True)

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    torch.set_num_threads(1)
    # Rendezvous: rank 0 hosts the store on a free port and tells the parent, which tells the
    # others (no port race).
    timeout = timedelta(seconds=_POOL_START_TIMEOUT_S)
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)
        port_conn.send(store.port)
    else:
        port = port_conn.recv()
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
    conn.send(("ready", rank))

    while True:
        # Poll so that an orphaned worker notices its parent is gone even without prctl.
        if not conn.poll(1.0):
            if os.getppid() != parent:
                os._exit(0)
            continue
        try:
            msg = conn.recv()
        except EOFError:
            os._exit(0)
        if msg[0] == "exit":
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
            os._exit(0)
        _, fn_ref, args_blob, ranks_per_node, run_timeout, seed = msg
        out = io.StringIO()
        try:
            _drop_subgroups(dist)
            td = timedelta(seconds=run_timeout)
            c10d._set_pg_timeout(td)
            # Note: groups created during the run (dist.new_group without a timeout) inherit
            # this instead of the 30-minute library default.
            c10d.default_pg_timeout = td
            local_rank = rank % ranks_per_node
            os.environ.update(
                RANK=str(rank),
                WORLD_SIZE=str(world_size),
                LOCAL_RANK=str(local_rank),
                LOCAL_WORLD_SIZE=str(ranks_per_node),
                GROUP_RANK=str(rank // ranks_per_node),
            )
            torch.manual_seed(seed + rank)
            ctx = RankContext(
                rank=rank,
                world_size=world_size,
                ranks_per_node=ranks_per_node,
                local_rank=local_rank,
                node=rank // ranks_per_node,
                nodes=world_size // ranks_per_node,
                timeout=run_timeout,
            )
            fn = _resolve(fn_ref)
            args = pickle.loads(args_blob)
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                result = fn(ctx, *args)
            payload = ("ok", rank, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL), out.getvalue())
        except BaseException:
            payload = ("err", rank, traceback.format_exc(), out.getvalue())
        try:
            conn.send(payload)
        except Exception:
            conn.send(("err", rank, traceback.format_exc(), out.getvalue()))


# ----------------------------------------------------------------------------- parent side


class _Pool:
    """`world_size` forked workers sharing one gloo world group."""

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.dir = tempfile.mkdtemp(prefix=f"sdpq-harness-{world_size}-")
        ctx = multiprocessing.get_context("fork")
        self.conns: list = []
        self.procs: list = []
        port_pipes = []
        try:
            for r in range(world_size):
                parent_end, child_end = ctx.Pipe()
                port_parent, port_child = ctx.Pipe()
                p = ctx.Process(
                    target=_worker_main,
                    args=(r, world_size, child_end, port_child, os.path.join(self.dir, f"stack{r}.txt")),
                    name=f"sdpq-rank{r}of{world_size}",
                    daemon=True,
                )
                p.start()
                child_end.close()
                port_child.close()
                self.conns.append(parent_end)
                self.procs.append(p)
                port_pipes.append(port_parent)
            if not port_pipes[0].poll(_POOL_START_TIMEOUT_S):
                raise RuntimeError("rank 0 did not start its store")
            port = port_pipes[0].recv()
            for pp in port_pipes[1:]:
                pp.send(port)
            deadline = time.monotonic() + _POOL_START_TIMEOUT_S
            pending = set(range(world_size))
            while pending:
                ready = mpc.wait([self.conns[r] for r in pending], timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise RuntimeError(f"ranks {sorted(pending)} did not join the gloo group")
                for c in ready:
                    r = self.conns.index(c)
                    msg = c.recv()
                    if msg[0] != "ready":
                        raise RuntimeError(f"rank {r} failed to start: {msg}")
                    pending.discard(r)
        except BaseException:
            self.kill()
            raise
        finally:
            for pp in port_pipes:
                pp.close()

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def dump_stacks(self, ranks: list[int]) -> dict[int, str]:
        for r in ranks:
            with contextlib.suppress(Exception):
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.3)
        stacks = {}
        for r in ranks:
            with contextlib.suppress(Exception):
                with open(os.path.join(self.dir, f"stack{r}.txt")) as f:
                    stacks[r] = f.read()
        return stacks

    def kill(self) -> None:
        for p in self.procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(Exception):
                    os.kill(p.pid, signal.SIGKILL)
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.join(5)
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.close()
        self.procs, self.conns = [], []
        with contextlib.suppress(Exception):
            for name in os.listdir(self.dir):
                os.unlink(os.path.join(self.dir, name))
            os.rmdir(self.dir)

    def close(self) -> None:
        for c in self.conns:
            with contextlib.suppress(Exception):
                c.send(("exit",))
        deadline = time.monotonic() + 2.0
        for p in self.procs:
            with contextlib.suppress(Exception):
                p.join(max(0.0, deadline - time.monotonic()))
        self.kill()


def _function_ref(fn: Callable) -> tuple:
    qualname = getattr(fn, "__qualname__", "")
    module_name = getattr(fn, "__module__", None)
    if module_name and qualname and "<" not in qualname:  # __main__ too: the fork inherits it
        module = sys.modules.get(module_name)
        return ("ref", module_name, qualname, getattr(module, "__file__", None), list(sys.path))
    try:
        import cloudpickle  # optional: lets lambdas and closures through
    except ImportError:
        raise TypeError(
            f"dist.run needs a module-level function of an importable module, got {fn!r} "
            "(install cloudpickle to send lambdas and closures)"
        ) from None
    return ("pickle", cloudpickle.dumps(fn))


class DistHarness:
    """Session-wide registry of worker pools, one per world size. Thread-unsafe by design
    (pytest runs tests sequentially in one process)."""

    def __init__(self, seed: int = 1234):
        self.seed = seed
        self._pools: dict[int, _Pool] = {}
        self.pools_started = 0  # for tests of the harness itself

    def run(self, fn: Callable, world_size: int, ranks_per_node: int | None = None, *args, timeout: float = 60) -> list:
        """Run `fn(ctx, *args)` on `world_size` gloo ranks; return the per-rank results in rank
        order. `ranks_per_node` (default: world_size, i.e. one node) sets the simulated layout
        and the LOCAL_WORLD_SIZE/LOCAL_RANK environment of the ranks. Raises DistTestError with
        the failing rank's traceback, DistTimeoutError if ranks hang past `timeout`."""
        if ranks_per_node is None:
            ranks_per_node = world_size
        if world_size < 1 or ranks_per_node < 1 or world_size % ranks_per_node:
            raise ValueError(f"world_size {world_size} is not a multiple of ranks_per_node {ranks_per_node}")
        if timeout <= 0:
            raise ValueError("timeout must be positive")
        fn_ref = _function_ref(fn)
        args_blob = pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL)
        pool = self._pool(world_size)
        try:
            return self._run_on(pool, fn_ref, args_blob, ranks_per_node, float(timeout))
        except BaseException:
            # Note: any error, timeout or interruption taints the gloo group: discard the pool.
            self.discard(world_size)
            raise

    def _pool(self, world_size: int) -> _Pool:
        pool = self._pools.get(world_size)
        if pool is not None and not pool.alive():
            self.discard(world_size)
            pool = None
        if pool is None:
            pool = _Pool(world_size)
            self.pools_started += 1
            self._pools[world_size] = pool
        return pool

    def _run_on(self, pool: _Pool, fn_ref, args_blob, ranks_per_node, timeout) -> list:
        n = pool.world_size
        for c in pool.conns:
            c.send(("run", fn_ref, args_blob, ranks_per_node, timeout, self.seed))
        results: list = [None] * n
        outputs: dict[int, str] = {}
        errors: dict[int, str] = {}
        pending = set(range(n))
        deadline = time.monotonic() + timeout + _grace_s(timeout)
        by_conn = {id(c): r for r, c in enumerate(pool.conns)}
        while pending and not errors:
            left = deadline - time.monotonic()
            ready = mpc.wait([pool.conns[r] for r in pending], timeout=max(0.0, left)) if left > 0 else []
            if not ready:
                break
            for c in ready:
                r = by_conn[id(c)]
                try:
                    status, _, body, out = c.recv()
                except EOFError:
                    status, body, out = "err", f"rank {r} died (exit code {pool.procs[r].exitcode})", ""
                pending.discard(r)
                outputs[r] = out
                if status == "ok":
                    results[r] = pickle.loads(body)
                else:
                    errors[r] = body
        for r in sorted(outputs):
            if outputs[r]:
                sys.stdout.write(f"---- output of rank {r} ----\n{outputs[r]}")
        if errors:
            first = next(iter(errors))  # first to report: the likeliest root cause
            others = "".join(
                f"\n(rank {r} also failed: {tb.strip().splitlines()[-1]})" for r, tb in errors.items() if r != first
            )
            raise DistTestError(
                f"rank {first} of {n} (ranks_per_node={ranks_per_node}) raised:\n{errors[first]}{others}",
                first,
                errors[first],
                errors,
            )
        if pending:
            hung = sorted(pending)
            stacks = pool.dump_stacks(hung)
            text = "".join(f"\n---- rank {r} stack ----\n{stacks.get(r, '(none)')}" for r in hung)
            raise DistTimeoutError(
                f"ranks {hung} of {n} did not finish within {timeout:g}s (+{_grace_s(timeout):g}s grace); "
                f"pool killed{text}",
                hung,
                stacks,
                errors,
            )
        return results

    def discard(self, world_size: int) -> None:
        pool = self._pools.pop(world_size, None)
        if pool is not None:
            pool.kill()

    def shutdown(self) -> None:
        for ws in list(self._pools):
            pool = self._pools.pop(ws)
            pool.close()


_HARNESS: DistHarness | None = None
_LOCK = threading.Lock()


def get_harness() -> DistHarness:
    """The one harness of this process (pools are shared by every test of the session)."""
    global _HARNESS
    with _LOCK:
        if _HARNESS is None:
            _HARNESS = DistHarness()
            import atexit

            atexit.register(shutdown_harness)
        return _HARNESS


def shutdown_harness() -> None:
    global _HARNESS
    if _HARNESS is not None:
        _HARNESS.shutdown()
        _HARNESS = None
