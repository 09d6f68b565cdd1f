"""sdpq.torchft: the quantized replica all-reduce as torchft's process group (docs/torchft.md).

Jobs: torchft's fault-injection pattern on gloo (its manager_integ_test.py): an in-process
lighthouse, replica groups as threads, a small model under torchft's DDP and OptimizerWrapper;
a healthy run against the same job on torchft's plain gloo group, a replica that fails and
restarts, and an all-reduce that fails mid-collective. Units: the wrapper on bare torchft gloo
groups, one thread per member.

Note: everything that starts torchft's servers or gloo groups runs in one spawned worker process
per module (`_Worker`): torchft's servers (a Rust runtime) and gloo groups run threads that live
until their objects are collected, and the multi-rank harness forks its ranks from this pytest
process. Every call into the worker
has a timeout, the worker is killed at the end of the module, and every torchft and gloo
timeout inside it is explicit.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import threading
import time
from datetime import timedelta
from unittest import mock

import pytest

pytest.importorskip("torchft")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp  # noqa: E402
from torchft.process_group import ProcessGroupGloo  # noqa: E402

import sdpq.torchft  # noqa: E402
from sdpq import ConfigError  # noqa: E402
from sdpq.comm import traffic  # noqa: E402

TIMEOUT = timedelta(seconds=20)  # torchft's and gloo's, unless a test needs a failure sooner
STEPS = 12
K = 3  # the step at which a fault strikes


# ----------------------------------------------------------------------------- the worker


class _Worker:
    """One spawned process that runs this module's functions (`call(fn, *args, timeout=...)`);
    a new one after a call that timed out."""

    def __init__(self) -> None:
        self.pool = None

    def call(self, fn, *args, timeout: float = 60.0):
        if self.pool is None:
            with mock.patch.dict(os.environ, {"RUST_LOG": "warn"}):  # torchft logs every RPC at info
                self.pool = multiprocessing.get_context("spawn").Pool(1)
        try:
            return self.pool.apply_async(fn, args).get(timeout)
        except multiprocessing.TimeoutError:
            self.close()  # its threads may be stuck in a collective: never reuse it
            raise

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


@pytest.fixture(scope="module")
def worker():
    w = _Worker()
    yield w
    w.close()


# ----------------------------------------------------------------------------- test-side groups


class _InstrumentedGloo(ProcessGroupGloo):
    """torchft's gloo group that counts its own all-reduces by sdpq's byte model (each replica
    group a node: the plain job's cross-replica bytes) and whose next all-gather raises once
    `armed` (the all-gather phase of sdpq's all-reduce, after its reduce-scatter)."""

    def __init__(self, timeout: timedelta) -> None:
        super().__init__(timeout=timeout)
        self.member = (0, 1)
        self.inter_bytes = 0
        self.armed = False
        self.failures = 0
        self.configured_at: list[float] = []  # when configure began, each time
        self.reduced_at: list[float] = []  # when each plain all-reduce had completed
        self.entered: threading.Event | None = None  # set when an all-reduce begins

    def configure(self, store_addr, replica_id, rank, world_size, *args, **kwargs) -> None:
        self.configured_at.append(time.monotonic())
        super().configure(store_addr, replica_id, rank, world_size, *args, **kwargs)
        self.member = (rank, world_size)

    def allreduce(self, tensors, opts):
        if self.entered is not None:
            self.entered.set()
        rank, size = self.member
        nbytes = tensors[0].numel() * tensors[0].element_size()
        self.inter_bytes += traffic.all_reduce(traffic.member_nodes(range(size), 1), rank, nbytes).inter
        work = super().allreduce(tensors, opts)
        work.wait()  # (completed here, so that its end can be timed; waiting again costs nothing)
        self.reduced_at.append(time.monotonic())
        return work

    def allgather(self, output_tensors, input_tensor, opts):
        if self.armed:
            self.armed = False
            self.failures += 1
            raise RuntimeError("injected failure in the all-gather phase")
        return super().allgather(output_tensors, input_tensor, opts)


# ----------------------------------------------------------------------------- the torchft job

TEACHER = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 8))


def _batch(replica: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(64, 32, generator=g)
    return x, torch.tanh(x @ TEACHER)


def _digest(*state_dicts) -> str:
    h = hashlib.sha256()
    for leaf in torch.utils._pytree.tree_leaves(list(state_dicts)):
        h.update(leaf.numpy().tobytes() if isinstance(leaf, torch.Tensor) else repr(leaf).encode())
    return h.hexdigest()


def _state_fns(model: nn.Module, adam: torch.optim.Optimizer) -> dict:
    """What torchft sends a recovering replica and how that replica loads it."""

    def load(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        adam.load_state_dict(sd["optim"])

    return {"state_dict": lambda: {"model": model.state_dict(), "optim": adam.state_dict()}, "load_state_dict": load}


def _attempt(job: dict, rid: int, attempt: int, lighthouse: str, initial: dict, events: dict, out: dict) -> bool:
    """One life of a replica group (one rank): True once it trained to the last step, False where
    an injected failure ended it."""
    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    inner = _InstrumentedGloo(timedelta(seconds=job["pg_timeout"]))
    pg = inner if job["config"] is None else sdpq.torchft.QuantizedProcessGroup(inner, job["config"])
    model = _model()
    model.load_state_dict(initial)  # every replica (and every restart) from the same weights
    adam = torch.optim.Adam(model.parameters(), lr=3e-3)
    manager = Manager(
        pg=pg, min_replica_size=2, replica_id=str(rid), rank=0, world_size=1, store_addr="localhost",
        store_port=store.port, lighthouse_addr=lighthouse, timeout=TIMEOUT, quorum_timeout=TIMEOUT,
        connect_timeout=TIMEOUT, **_state_fns(model, adam),
    )  # fmt: skip
    try:
        if attempt:
            events["rejoined"].set()
        ddp, optimizer = DistributedDataParallel(manager, model), OptimizerWrapper(manager, adam)
        if not attempt:  # every replica in the first quorum: none is still starting up
            events["started"].wait(TIMEOUT.total_seconds())
        while (step := manager.current_step()) < job["steps"]:
            if job["fail_replica"] is not None and rid != job["fail_replica"] and step == K + 2:
                assert events["rejoined"].wait(TIMEOUT.total_seconds()), "the failed replica did not restart"
            x, y = _batch(rid, step)
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), y)
            if job["fail_allreduce"] == rid and step == K and not inner.failures:
                inner.armed = True
            loss.backward()
            optimizer.step()
            done = manager.current_step()
            out["log"].append((step, done, loss.item(), manager.num_participants()))
            if pg is not inner:
                out["quorums"].append((pg.quorum.quorum_id, pg.quorum.size))
            if done > step:
                out["digests"][done] = _digest(model.state_dict(), adam.state_dict())
                if rid == 0 and manager.num_participants() == 2:
                    events["shrunk"].set()
            if job["fail_replica"] == rid and done == K and attempt == 0:
                return False
        out["final"] = _digest(model.state_dict(), adam.state_dict())
        return True
    finally:
        manager.shutdown(wait=False)
        out["inter_bytes"] += inner.inter_bytes
        out["injected"] += inner.failures
        if pg is not inner:
            inter = sdpq.stats.of(pg).as_dict().get("gradients", {}).get("inter", {})
            out["sdpq_inter"] += inter.get("bytes", 0)
            out["reconfigurations"] = pg.reconfigurations


def _replica(job: dict, rid: int, lighthouse: str, initial: dict, events: dict) -> dict:
    """A replica group that is restarted once after an injected failure, as torchft's tests do."""
    import gc

    out: dict = {"log": [], "digests": {}, "quorums": [], "failures": 0, "injected": 0}
    out["inter_bytes"] = out["sdpq_inter"] = 0
    for attempt in range(2):
        if _attempt(job, rid, attempt, lighthouse, initial, events, out):
            return out
        out["failures"] += 1
        # Note: a dead process stops heartbeating; here the failed life's manager server must be
        # collected for that (it sits in a reference cycle), else the lighthouse waits for it.
        gc.collect()
        assert events["shrunk"].wait(TIMEOUT.total_seconds()), "the others did not go on without it"
    raise AssertionError("unreachable: the second life returns or raises")


def _job(replicas: int, config, fail_replica=None, fail_allreduce=None, pg_timeout=20.0, steps=STEPS) -> list[dict]:
    from concurrent.futures import ThreadPoolExecutor

    from torchft._torchft import LighthouseServer

    job = dict(config=config, steps=steps, fail_replica=fail_replica, fail_allreduce=fail_allreduce)
    job["pg_timeout"] = pg_timeout
    torch.manual_seed(0)
    initial = _model().state_dict()
    events = {"shrunk": threading.Event(), "rejoined": threading.Event(), "started": threading.Barrier(replicas)}
    # Note: a dead replica's heartbeat lapses after 0.5 s (torchft's default is 5 s); a quorum
    # shrinks to two only where a replica fails.
    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=replicas if fail_replica is None else 2,
        join_timeout_ms=5000,
        heartbeat_timeout_ms=500,
    )
    pool = ThreadPoolExecutor(replicas, thread_name_prefix="replica")
    try:
        futures = [pool.submit(_replica, job, r, lighthouse.address(), initial, events) for r in range(replicas)]
        return [f.result(timeout=90) for f in futures]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        lighthouse.shutdown()


def _assert_replicas_bitwise_equal(results: list[dict]) -> None:
    """The final states and, at every step that several replicas committed, the states after it."""
    assert len({r["final"] for r in results}) == 1
    steps = {s for r in results for s in r["digests"]}
    for s in steps:
        assert len({r["digests"][s] for r in results if s in r["digests"]}) == 1, s


def _late_loss(results: list[dict]) -> float:
    """Mean loss of the last four committed steps over the replicas."""
    losses = [loss for r in results for step, done, loss, _ in r["log"] if done > step and step >= STEPS - 4]
    return sum(losses) / len(losses)


def test_healthy_job_bytes_and_loss_against_torchfts_plain_all_reduce(worker):
    plain = worker.call(_job, 3, None, timeout=120)
    quant = worker.call(_job, 3, {}, timeout=120)
    for results in (plain, quant):
        _assert_replicas_bitwise_equal(results)
        assert all(len(r["digests"]) == STEPS for r in results)
    # Cross-replica bytes by the one byte model: sdpq's counts against the plain fp32 all-reduce's.
    ratio = sum(r["sdpq_inter"] for r in quant) / sum(r["inter_bytes"] for r in plain)
    assert ratio <= 0.15, ratio
    assert sum(r["inter_bytes"] for r in quant) == 0  # nothing went through the plain all-reduce
    loss_ratio = _late_loss(quant) / _late_loss(plain)
    assert abs(loss_ratio - 1) <= 0.02, loss_ratio
    assert {q for r in quant for q in r["quorums"]} == {(1, 3)}


def test_a_replica_that_fails_heals_and_the_replicas_stay_bitwise_equal(worker):
    results = worker.call(_job, 3, {"gradients": {"error_feedback": True}}, 2, timeout=150)
    _assert_replicas_bitwise_equal(results)
    assert [r["failures"] for r in results] == [0, 0, 1]
    sizes = [size for _, size in results[0]["quorums"]]
    # The quorum shrank to two while the replica was down and grew back: the wrapper rebuilt its
    # layout each time, and the job ended at its last step on every replica.
    assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3
    assert results[0]["reconfigurations"] >= 3
    assert all(r["log"][-1][1] == STEPS for r in results)


def test_an_all_reduce_failing_mid_collective_is_skipped_and_the_replicas_stay_bitwise_equal(worker):
    # The failing member never enters the all-gather; its peer waits there until the group's
    # timeout (3 s here), so both report the error and neither commits that step.
    results = worker.call(_job, 2, {"gradients": {"error_feedback": True}}, None, 0, 3.0, timeout=150)
    _assert_replicas_bitwise_equal(results)
    assert [r["injected"] for r in results] == [1, 0]
    for r in results:
        assert (K, K) in [(step, done) for step, done, _, _ in r["log"]]  # step K ran and did not commit
        assert r["log"][-1][1] == STEPS
    # torchft bumps the quorum after a step that did not commit: every member reconfigured and
    # rebuilt its all-reduce for the new quorum.
    ids = [qid for qid, _ in results[0]["quorums"]]
    assert len(set(ids)) == 2 and ids == sorted(ids)
    assert results[0]["reconfigurations"] == results[1]["reconfigurations"] == 2


# ----------------------------------------------------------------------------- the wrapper alone


def _on_members(size: int, fn, configs=None, inner=ProcessGroupGloo) -> list:
    """fn(rank, pg, call) on `size` wrappers, one thread each, after configuring them for quorum 1
    (`call.port`: the store's, for later quorums; `call.events`: threading.Events the members
    share); the results (or what each raised) in rank order."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
    pgs = [sdpq.torchft.QuantizedProcessGroup(inner(timeout=TIMEOUT), (configs or [{}] * size)[r]) for r in range(size)]
    call = SimpleNamespace(port=store.port, events={"asked": threading.Event(), "entered": threading.Event()})

    def member(r: int):
        try:
            pgs[r].configure(f"localhost:{store.port}/q1", str(r), r, size, quorum_id=1)
            return fn(r, pgs[r], call)
        except Exception as e:  # returned, so that the test sees every member's error
            return e

    with ThreadPoolExecutor(size, thread_name_prefix="member") as pool:
        return [f.result(timeout=60) for f in [pool.submit(member, r) for r in range(size)]]


def _sum_op(op=ReduceOp.SUM) -> AllreduceOptions:
    opts = AllreduceOptions()
    opts.reduceOp = op
    return opts


def _inputs(size: int, numel: int) -> list[torch.Tensor]:
    return [torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(size)]


def _sums(r: int, pg, call) -> dict:
    x = _inputs(3, 5000)[r]
    quant, bf16 = x.clone(), x.to(torch.bfloat16)
    pg.allreduce([quant], _sum_op()).wait()
    pg.allreduce([bf16], _sum_op()).wait()
    strided = torch.zeros(5000, 2)
    strided[:, 0] = x
    pg.allreduce([strided[:, 0]], _sum_op()).wait()  # a non-contiguous view, written in place
    ints, top = torch.full((7,), r + 1, dtype=torch.int64), torch.full((7,), float(r))
    pg.allreduce([ints], _sum_op()).wait()
    pg.allreduce([top], _sum_op(ReduceOp.MAX)).wait()
    told = torch.full((3,), float(r))
    pg.broadcast_one(told, 0).wait()
    empty_done = pg.allreduce([torch.empty(0)], _sum_op()).wait()  # nothing to send: done at once
    out = {"quant": quant, "bf16": bf16, "strided": strided, "ints": ints, "max": top, "broadcast": told}
    out["empty_done"] = empty_done
    out["chunk"] = pg.quorum.reducers[5000].reduce_scatter.chunk_numel
    return {**out, "stats": sdpq.stats.of(pg).as_dict(), "default_group": dist.is_initialized()}


def test_sum_is_quantized_and_bitwise_the_same_on_every_member(worker):
    got = worker.call(_on_members, 3, _sums)
    exact = sum(_inputs(3, 5000))
    for g in got:
        for key in ("quant", "bf16", "strided"):
            assert torch.equal(g[key], got[0][key]), key
        assert not g["strided"][:, 1].any()  # the view's neighbours are left alone
        assert torch.equal(g["ints"], torch.full((7,), 6, dtype=torch.int64))  # exact: the wrapped group's
        assert torch.equal(g["max"], torch.full((7,), 2.0)) and torch.equal(g["broadcast"], torch.zeros(3))
        assert g["chunk"] == 1667 and g["empty_done"] and not g["default_group"]
    for sum_ in (got[0]["quant"], got[0]["bf16"].float(), got[0]["strided"][:, 0]):
        err = (sum_ - exact).norm() / exact.norm()
        assert 0 < err < 0.3, err  # 4-bit groups of 128, twice (reduce-scatter, then the gathered sum)
    inter = got[0]["stats"]["gradients"]["inter"]
    assert inter["calls"] == 6 and inter["bits_per_element"] < 4.6, inter  # 3 all-reduces, 2 phases each


def test_exact_mode_is_the_plain_sum(worker):
    got = worker.call(_on_members, 3, _sums, [{"gradients": {"mode": "exact"}}] * 3)
    torch.testing.assert_close(got[0]["quant"], sum(_inputs(3, 5000)), rtol=1e-6, atol=1e-6)
    assert all(torch.equal(g["quant"], got[0]["quant"]) for g in got)


def _quorum_change(r: int, pg, call) -> dict:
    x = _inputs(3, 3000)[r]
    for _ in range(2):
        pg.allreduce([x.clone()], _sum_op()).wait()
    before = {"residuals": len(list(pg.held_tensors())), "chunk": pg.quorum.reducers[3000].reduce_scatter.chunk_numel}
    if r == 2:
        return before  # leaves: the next quorum is members 0 and 1
    pg.configure(f"localhost:{call.port}/q2", str(r), r, 2, quorum_id=2)
    after_configure = len(list(pg.held_tensors()))
    y = x.clone()
    pg.allreduce([y], _sum_op()).wait()
    return {**before, "after_configure": after_configure, "sum": y, "size": pg.quorum.size,
            "chunk_after": pg.quorum.reducers[3000].reduce_scatter.chunk_numel}  # fmt: skip


def test_a_quorum_change_rebuilds_the_layout_and_resets_error_feedback(worker):
    got = worker.call(_on_members, 3, _quorum_change, [{"gradients": {"error_feedback": True}}] * 3)
    assert [g["residuals"] for g in got] == [1, 1, 1] and [g["chunk"] for g in got] == [1000] * 3
    two = got[:2]
    assert [g["after_configure"] for g in two] == [0, 0]  # dropped with the old quorum's collectives
    assert [(g["size"], g["chunk_after"]) for g in two] == [(2, 1500), (2, 1500)]
    assert torch.equal(two[0]["sum"], two[1]["sum"])
    exact = sum(_inputs(3, 3000)[:2])
    assert (two[0]["sum"] - exact).norm() / exact.norm() < 0.3


def _bits_disagree(r: int, pg, call) -> None:
    pg.allreduce([torch.ones(512)], _sum_op()).wait()


def test_members_that_disagree_on_the_config_all_raise(worker):
    configs = [{"gradients": {"inter_bits": 4}}, {"gradients": {"inter_bits": 2}}]
    got = worker.call(_on_members, 2, _bits_disagree, configs)
    assert all(isinstance(e, ConfigError) and "inter_bits" in str(e) for e in got), got


def _fail_then_reconfigure(r: int, pg, call) -> dict:
    pg.parent.armed = True  # both members fail in the same all-gather: nobody waits for a timeout
    out = {}
    for name in ("first", "refused"):
        work = pg.allreduce([torch.ones(512)], _sum_op())
        out[name + "_wait"] = work.wait()
        try:
            work.get_future().wait()
        except RuntimeError as e:
            out[name] = str(e)
    out["errored"] = str(pg.errored())
    pg.configure(f"localhost:{call.port}/q2", str(r), r, 2, quorum_id=2)
    y = torch.ones(512)
    out["wait_after"] = pg.allreduce([y], _sum_op()).wait()
    return {**out, "sum": y, "errored_after": pg.errored()}


def test_a_failed_all_reduce_is_reported_and_refused_until_the_next_quorum(worker):
    got = worker.call(_on_members, 2, _fail_then_reconfigure, None, _InstrumentedGloo)
    for g in got:
        assert "injected failure" in g["first"] and "injected failure" in g["errored"]
        assert "needs configure() for a new quorum" in g["refused"]
        assert (g["first_wait"], g["refused_wait"], g["wait_after"]) == (False, False, True)
        assert g["errored_after"] is None and torch.equal(g["sum"], got[0]["sum"])
        assert (g["sum"] - 2).norm() / torch.full((512,), 2.0).norm() < 0.3  # the new quorum sums again


def _configure_during_all_reduce(r: int, pg, call) -> dict:
    pg.allreduce([torch.ones(4096)], _sum_op()).wait()  # builds (and agrees on) the collective first
    x = torch.ones(4096)
    if r == 1:  # joins the all-reduce only once member 0's configure() is waiting for it
        assert call.events["asked"].wait(30)
        time.sleep(0.2)
        pg.allreduce([x], _sum_op()).wait()
        pg.configure(f"localhost:{call.port}/q2", str(r), r, 2, quorum_id=2)
        return {}
    asked: list[float] = []

    def reconfigure() -> None:
        assert call.events["entered"].wait(30)  # member 0 is inside its all-reduce
        asked.append(time.monotonic())
        call.events["asked"].set()
        pg.configure(f"localhost:{call.port}/q2", "0", 0, 2, quorum_id=2)

    thread = threading.Thread(target=reconfigure)
    thread.start()
    pg.parent.entered = call.events["entered"]
    pg.allreduce([x], _sum_op()).wait()
    thread.join(timeout=30)
    inner = pg.parent
    return {"asked": asked[0], "reduced": inner.reduced_at[-1], "configured": inner.configured_at[-1], "sum": x,
            "quorum": pg.quorum.quorum_id}  # fmt: skip


def test_a_reconfiguration_waits_for_the_running_all_reduce(worker):
    exact = [{"gradients": {"mode": "exact"}}] * 2  # the plain all-reduce inside: its end is timed
    got = worker.call(_on_members, 2, _configure_during_all_reduce, exact, _InstrumentedGloo)[0]
    # configure() was called while the all-reduce ran and reached the wrapped group after it ended.
    assert got["asked"] < got["reduced"] <= got["configured"], got
    assert got["quorum"] == 2 and torch.equal(got["sum"], torch.full((4096,), 2.0))


# ----------------------------------------------------------------------------- bad input (no group)


def test_bad_input_gets_a_clear_error():
    with pytest.raises(TypeError, match="must be a torchft.process_group.ProcessGroup"):
        sdpq.torchft.QuantizedProcessGroup(object())
    with pytest.raises(ConfigError, match="gradients"):
        sdpq.torchft.QuantizedProcessGroup(ProcessGroupGloo(timeout=TIMEOUT), {"gradients": {"inter_bits": 5}})
    pg = sdpq.torchft.QuantizedProcessGroup(ProcessGroupGloo(timeout=TIMEOUT))
    for op, name in ((ReduceOp.AVG, "AVG"), (dist._make_nccl_premul_sum(2.0), "PREMUL_SUM")):
        with pytest.raises(ValueError, match=f"reduce op {name} is not supported"):
            pg.allreduce([torch.ones(4)], _sum_op(op))
    with pytest.raises(ValueError, match="exactly one tensor, got 2"):
        pg.allreduce([torch.ones(4), torch.ones(4)], _sum_op())
    with pytest.raises(RuntimeError, match="allreduce before configure"):
        pg.allreduce([torch.ones(4)], ReduceOp.SUM)
