"""The training loop's tensors live on the compute device: batches, the loss accumulators and every
tensor it all-reduces (NCCL takes only CUDA tensors), and no step reads a number back to the host
unless it prints it.

There is no GPU here, so the loops run on the "meta" device: a tensor created on the CPU by
mistake shows up as a CPU tensor in the records, and any read back to the host (float(), .item(),
.tolist()) raises on a meta tensor, which is how the tests see that a step does not sync."""

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from sdpq.launch import env as launch_env
from sdpq.train import deepspeed_backend, fsdp_backend
from sdpq.train.data import TokenData
from sdpq.train.model import GPTConfig
from sdpq.train.run import RunSpec, lr_at, optimizer_bytes_per_param, validation_loss

META = torch.device("meta")
SPEC = RunSpec(
    model=GPTConfig(seq_len=8, n_layer=1, n_head=1, d_model=8),
    micro_batch=2,
    grad_accum=2,
    steps=3,
    warmup=1,
    log_every=0,
    eval_batches=2,
)


class _Data:
    """Batches made where asked (TokenData's contract), recording the device asked for."""

    def __init__(self):
        self.devices = []

    def batch(self, step, rank, batch_size, seq_len, seed=0, split="train", device="cpu"):
        self.devices.append(torch.device(device))
        x = torch.zeros(batch_size, seq_len, dtype=torch.int64, device=device)
        return x, x


class _Model(torch.nn.Module):
    def __init__(self, device):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones((), device=device))
        self.inputs = []

    def set_requires_gradient_sync(self, sync):
        pass

    def forward(self, x, y):
        self.inputs += [x.device, y.device]
        return self.w * (x.float().mean() + 1)


@pytest.fixture
def collectives(monkeypatch):
    """dist.all_reduce records the device of what it is handed (no process group needed)."""
    seen = []
    monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: seen.append(t.device))
    return seen


def test_compute_device_follows_the_process_group(monkeypatch):
    assert launch_env.compute_device() == torch.device("cpu")  # no group: the CPU
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # init_distributed set it from LOCAL_RANK
    assert launch_env.compute_device() == torch.device("cuda", 1)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert launch_env.compute_device() == torch.device("cpu")


def test_token_batches_are_made_on_the_device():
    x, y = TokenData.stdlib().batch(3, 1, 2, 16, device=META)
    assert x.device == y.device == META and x.shape == (2, 16)
    cx, _ = TokenData.stdlib().batch(3, 1, 2, 16)
    assert cx.device == torch.device("cpu")


def test_fsdp_step_keeps_batches_and_loss_on_the_device(collectives):
    model, data = _Model(META), _Data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    total = fsdp_backend._step(model, opt, data, SPEC, step=0, lr=0.1, rank=0, device=META)
    assert data.devices == [META] * SPEC.grad_accum and set(model.inputs) == {META}
    assert collectives == [META] and total.device == META  # all-reduced on the device, not read back


class _Engine(_Model):
    """A DeepSpeed engine stand-in: engine(x, y) is the forward; backward and step as DeepSpeed's."""

    def __init__(self, device):
        super().__init__(device)
        self.optimizer = SimpleNamespace(param_groups=[{"lr": 0.0}])

    def backward(self, loss):
        loss.backward()

    def step(self):
        pass


def test_deepspeed_steps_keep_batches_and_losses_on_the_device(collectives):
    engine, data = _Engine(META), _Data()
    local, times, _ = deepspeed_backend._run_steps(SPEC, engine, data, start=0, rank=0, device=META, schedule=True)
    assert local.device == META and len(times) == SPEC.steps  # three steps, no host read of a loss
    assert set(data.devices) == set(engine.inputs) == {META}
    assert engine.optimizer.param_groups[0]["lr"] == lr_at(SPEC, SPEC.steps - 1)  # the schedule ran


def test_validation_sums_on_the_device(collectives):
    data, model = _Data(), _Model(META)
    with pytest.raises(RuntimeError, match="meta"):  # the one read: the mean it returns (meta has no value)
        validation_loss(model, data, SPEC, rank=0, world=1, device=META)
    assert set(data.devices) == set(model.inputs) == {META} and collectives == [META]


def test_optimizer_bytes_are_all_reduced_on_the_device(collectives):
    model = _Model("cpu")
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(RuntimeError, match="meta"):
        optimizer_bytes_per_param(opt, model, META)
    assert collectives == [META]


# ----------------------------------------------------------------------------- the whole loop, NCCL as seen from CPU


def _train_in_nccl_mode(ctx):
    """fsdp_backend.train in the collective-device test mode (tests/collective_devices.py): the
    group reports NCCL, its device is a stand-in accelerator. Returns (violations whose caller is
    the training loop, how many batches were not on the stand-in, collectives checked)."""
    from collective_devices import STANDIN, CollectiveDeviceError, device_of, nccl_devices

    from sdpq.train.settings import EXACT

    class Recording(TokenData):
        def batch(self, *args, **kw):
            x, y = super().batch(*args, **kw)
            off.extend(t for t in (x, y) if device_of(t) != STANDIN)
            return x, y

    off: list = []
    data = Recording(TokenData.stdlib().tokens)
    spec = RunSpec(
        model=GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=32),
        steps=2,
        micro_batch=2,
        warmup=1,
        sdpq=EXACT,
        ranks_per_node=1,
        eval_batches=1,
        log_every=1,
    )
    try:
        with nccl_devices() as report:
            fsdp_backend.train(spec, data=data)
    except CollectiveDeviceError:
        pass  # checked below: only the loop's own collectives are this test's business
    # Note: the model's parameters are host tensors in this mode (FSDP2 keeps them where they
    # were built; on a GPU fully_shard moves them to the mesh's device), so the collectives of
    # FSDP2's buffers report the host; the training loop's own tensors must not.
    mine = [v for v in report.violations if "sdpq/train/" in v]
    return mine, len(off), report.checked


def test_the_loop_hands_nccl_only_device_tensors(dist):
    for mine, off, checked in dist.run(_train_in_nccl_mode, 2, 1, timeout=120):
        assert mine == [] and off == 0 and checked > 0


def _train_deepspeed_in_nccl_mode(ctx):
    """deepspeed_backend.train in the same mode (DeepSpeed's own collectives are not checked)."""
    from collective_devices import CollectiveDeviceError, nccl_devices

    from benchmarks.zeropp.groups import reset_deepspeed_groups

    reset_deepspeed_groups()  # DeepSpeed caches the groups of an earlier run in this worker
    spec = RunSpec(
        backend="deepspeed",
        model=GPTConfig(seq_len=16, n_layer=1, n_head=2, d_model=32),
        steps=2,
        micro_batch=2,
        warmup=1,
        ranks_per_node=1,
        eval_batches=1,
        log_every=1,
        count_bytes="exact",
    )
    try:
        with nccl_devices() as report:
            deepspeed_backend.train(spec)
    except CollectiveDeviceError:
        pass
    return [v for v in report.violations if "sdpq/train/" in v], report.checked


def test_the_deepspeed_loop_hands_nccl_only_device_tensors(dist):
    for mine, checked in dist.run(_train_deepspeed_in_nccl_mode, 2, 1, timeout=120):
        assert mine == [] and checked > 0
