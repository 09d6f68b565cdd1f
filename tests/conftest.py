"""Shared pytest setup: the multi-rank `dist` fixture (see tests/README.md and tests/harness.py)."""

import os

# Note: must happen before torch is imported anywhere in this process: the harness forks worker
# ranks from it, and a child forked after an OpenMP thread pool started can deadlock.
os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Note: Triton reads TRITON_INTERPRET when it is imported (DeepSpeed imports it on import), so the
# kernel tests' interpreter mode must be chosen here, before anything imports triton. With a GPU
# (nvidia-smi present) the kernels are compiled and run on it instead.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import sys  # noqa: E402

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

import harness as _harness  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def _dist_session():
    h = _harness.get_harness()
    yield h
    _harness.shutdown_harness()


@pytest.fixture
def dist(_dist_session):
    """`dist.run(fn, world_size, ranks_per_node, *args, timeout=60) -> [result of rank 0, ...]`
    runs module-level `fn(ctx, *args)` on real gloo ranks from a reused worker pool."""
    return _dist_session


def pytest_sessionfinish(session, exitstatus):
    # Also reached on Ctrl-C: never leave a rank behind.
    _harness.shutdown_harness()


# CI replays a fixed sequence of hypothesis examples (a red CI must mean a regression, not a
# newly drawn example); local runs keep exploring new ones and store failures in .hypothesis/.
from hypothesis import settings as _hyp_settings  # noqa: E402

_hyp_settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    _hyp_settings.load_profile("ci")


# Note: `./run test` hands whole files to 2 pytest-xdist workers in collection order (--dist
# loadfile), and tests/train/ sorts last: a long file scheduled at the end ran while the other
# worker sat idle. The files that take longest (measured on 2 cores, 30-250 s each) go first,
# so the short ones fill the end; the order inside a file is unchanged.
_LONG_FIRST = (
    "train/test_train_examples.py",
    "check/test_gpu_check.py",
    "kernels/test_sm90_compile.py",
    "integrations/test_deepspeed_zero12.py",
    "integrations/test_deepspeed.py",
    "integrations/test_lightning.py",
    "integrations/test_hf_trainer.py",
    "test_demo.py",
    "bench/test_step_bench.py",
    "integrations/test_fsdp.py",
    "integrations/test_accelerate.py",
    "test_memory.py",
)


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        path = item.nodeid.split("::", 1)[0].removeprefix("tests/")
        return _LONG_FIRST.index(path) if path in _LONG_FIRST else len(_LONG_FIRST)

    items.sort(key=rank)  # stable: the rest keep their order
