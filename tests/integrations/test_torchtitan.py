"""sdpq.torchtitan on 4 gloo ranks as 2 nodes x 2: torchtitan's ParallelDims (its meshes), its
llama3 (the debug model's width, one layer) sharded by its own parallelize_llama, its
OptimizersContainer and its clip_grad_norm_, with the hook against the same steps without it.
Every multi-rank case runs in one run of fresh workers (the `runs` fixture).

Shims for a CPU without CUDA (none changes what sdpq sees):
- torchtitan picks the device type "cuda" when no accelerator is present: its meshes are built on
  "cpu" instead (`parallel_dims.device_type`);
- the attention is torchtitan's SDPA module (its default FlexAttention is torch.compile'd, tens of
  seconds a process on a CPU);
- the plain runs force FSDP2's sum reduction: torchtitan sets the gradient divide factor to 1,
  which FSDP2 sends as PREMUL_SUM, a reduction gloo lacks (sdpq forces the sum itself).
torchtitan 0.3.0's default `spmd_backend` ("spmd_types") fails in fully_shard on torch 2.13 for any
data-parallel degree above 1, and "full_dtensor" wants DTensor inputs from torchtitan's trainer:
these runs use "partial_dtensor", whose FSDP2 meshes are the ones sdpq sees under every backend.
"""

import re
import types

import pytest

pytest.importorskip("torchtitan")

# Note: imported here, in the pytest process the workers fork from, so the ranks do not each import
# torchtitan again (seconds per rank on 2 cores).
import torch  # noqa: E402
import torchtitan.distributed.parallel_dims as tt_parallel_dims  # noqa: E402
from torchtitan.components.optimizer import default_adamw  # noqa: E402
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as tt_dist_utils  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import llama3_configs, parallelize_llama  # noqa: E402

import sdpq  # noqa: E402
import sdpq.torchtitan  # noqa: E402

WORLD, RPN = 4, 2
LAYERS, SEQ, BATCH, LR = 1, 32, 2, 8e-4
FSDP_STEPS, HSDP_STEPS = 4, 3
BACKEND = "partial_dtensor"


# ----------------------------------------------------------------------------- one rank's run


def _parallel_dims(dp_replicate: int) -> ParallelDims:
    tt_parallel_dims.device_type = "cpu"  # torchtitan's choice without an accelerator is "cuda"
    tt_dist_utils.set_spmd_backend(BACKEND)
    return ParallelDims(
        dp_replicate=dp_replicate, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, world_size=WORLD, spmd_backend=BACKEND
    )


def _model(parallel_dims: ParallelDims):
    """torchtitan's llama3 debug model cut to LAYERS layers, sharded and initialised as its trainer does."""
    cfg = llama3_configs["debugmodel"](attn_backend="flex")
    cfg.layers = cfg.layers[:LAYERS]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    # Note: no cfg.update_from_config: it sets tensor-parallel sharding (tp is 1 here) and checks the
    # trainer's seq_len, and imports torchtitan's trainer with it (datasets, tensorboard: seconds a rank).
    parallelism, training = ParallelismConfig(spmd_backend=BACKEND), TrainingConfig(seq_len=SEQ)
    with torch.device("meta"):
        model = cfg.build()
    model = parallelize_llama(
        model,
        parallel_dims=parallel_dims,
        training=training,
        parallelism=parallelism,
        compile_config=CompileConfig(),
        ac_config=None,
        dump_folder="",
    )
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model.train()


def _force_sum(model) -> None:
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_force_sum_reduction_for_comms(True)


def _train(ctx, model, optimizers, steps: int, meter, between=None) -> list[float]:
    """torchtitan's step: loss summed over the tokens / the global token count, backward,
    clip_grad_norm_, optimizers.step(). Returns the global mean loss per step; the meter gets a
    snapshot after every step. between(step) runs before each step (outside the meter)."""
    import torch.distributed as torch_dist

    from sdpq.train.data import TokenData

    data = TokenData.stdlib()
    losses = []
    for step in range(steps):
        if between is not None:
            meter.enabled = False
            between(step)
            meter.enabled = True
        inputs, labels = data.batch(step, ctx.rank, BATCH, SEQ)
        optimizers.zero_grad()
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
        loss = loss / (labels.numel() * ctx.world_size)
        loss.backward()
        tt_dist_utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizers.step()
        meter.snapshot()
        meter.enabled = False  # the logged loss's all-reduce is no training traffic
        logged = loss.detach().clone()
        torch_dist.all_reduce(logged)
        losses.append(logged.item())
        meter.enabled = True
    return losses


def _arm(ctx, parallel_dims, steps, hook=None, between=None) -> dict:
    """One run: the model, torchtitan's optimizer container, `hook` as the spec's
    post_optimizer_build_fn (None: the plain run). The meter's first slice is the hook's."""
    from sdpq.comm.link_bytes import LinkBytes

    model = _model(parallel_dims)
    optimizers = default_adamw(lr=LR).build(model_parts=[model])
    with LinkBytes(ctx.ranks_per_node) as meter:
        if hook is None:
            _force_sum(model)
        else:
            hook(optimizers, [model], parallel_dims)
        meter.snapshot()
        losses = _train(ctx, model, optimizers, steps, meter, between)
    return {"model": model, "losses": losses, "bytes": meter.as_dict()}


def _moe_style_hook(calls: list):
    """What torchtitan's MoE models put in post_optimizer_build_fn (register_moe_load_balancing_hook):
    an optimizer step pre-hook on the container."""

    def hook(optimizers, model_parts, parallel_dims):
        calls.append(("built", len(model_parts), parallel_dims.dp_shard))
        optimizers.register_step_pre_hook(lambda *_: calls.append("step"))

    return hook


def _fsdp_vs_sdpq(ctx, steps: int) -> dict:
    parallel_dims = _parallel_dims(dp_replicate=1)  # FSDP over all 4 ranks (torchtitan's default)
    plain = _arm(ctx, parallel_dims, steps)
    calls: list = []
    ours = _arm(ctx, parallel_dims, steps, sdpq.torchtitan.post_optimizer_build_fn(chain=_moe_style_hook(calls)))
    return {
        "plain": plain["bytes"],
        "sdpq": ours["bytes"],
        "losses": (plain["losses"], ours["losses"]),
        "calls": calls,
        "applied": sdpq.fsdp.is_applied(ours["model"]),
    }


def _hsdp_vs_sdpq(ctx, steps: int) -> dict:
    import hashlib

    from sdpq.integrations import _fsdp_internals as fsdp_internals

    parallel_dims = _parallel_dims(dp_replicate=2)  # torchtitan's HSDP: 2 replicas of 2 shards
    plain = _arm(ctx, parallel_dims, steps)
    ours = _arm(ctx, parallel_dims, steps, sdpq.torchtitan.post_optimizer_build_fn())
    model = ours["model"]
    comms = sdpq.fsdp.module_comms(model)
    shards = b"".join(p.to_local().detach().numpy().tobytes() for p in model.parameters())
    sdpq.fsdp.remove(model)  # gives FSDP2 its mesh HSDP back
    return {
        "plain": plain["bytes"],
        "sdpq": ours["bytes"],
        "losses": (plain["losses"], ours["losses"]),
        "all_reduces": [len(c.replicas) for c in comms.values()],
        "digest": hashlib.sha256(shards).hexdigest(),
        "hsdp_after_remove": [fsdp_internals.is_mesh_hsdp(c.param_group) for c in comms.values()],
    }


class _Manager:
    """torchft's Manager as far as torchtitan's torchft optimizer container and sdpq's hook use it."""

    def __init__(self) -> None:
        self.commit = True
        self.state_dict_fns: dict = {}

    def start_quorum(self) -> None:
        pass

    def should_commit(self) -> bool:
        return self.commit

    def register_state_dict_fn(self, key, load_state_dict, state_dict) -> None:
        self.state_dict_fns[key] = (load_state_dict, state_dict)


def _torchft(ctx, steps: int) -> dict:
    """torchtitan's torchft trainer, as sdpq's hook meets it: an all-reduce hook on every FSDP
    module (across replica groups; here a counter) and torchtitan's torchft optimizer container
    stepping through the Manager. Step 2 is not committed; before step 4 the Manager loads a
    healthy replica's state (healing)."""
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.experiments.torchft.optimizer import TorchFTOptimizersContainer

    from sdpq.comm.link_bytes import LinkBytes

    parallel_dims = _parallel_dims(dp_replicate=1)  # torchft: one replica group of 4 FSDP ranks
    model = _model(parallel_dims)
    replica_all_reduces: list = []

    def replica_all_reduce(output):  # torchft's: dist.all_reduce(output, group=<its replicas>, op=AVG)
        replica_all_reduces.append(output.numel())

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_all_reduce_hook(replica_all_reduce)
    manager = _Manager()
    container = TorchFTOptimizersContainer.Config(param_groups=default_adamw(lr=LR).param_groups)
    hook = sdpq.torchtitan.post_optimizer_build_fn()
    ft = types.SimpleNamespace(manager=manager, use_async_quorum=False)  # TorchFTManager with semi_sync_method
    semi_sync = container.build(model_parts=[model], ft_manager=ft)
    try:
        hook(semi_sync, [model], parallel_dims)
        refused = None
    except ValueError as e:
        refused = str(e)
    ft = types.SimpleNamespace(manager=manager, use_async_quorum=True)  # per-step torchft
    optimizers = container.build(model_parts=[model], ft_manager=ft)

    def between(step: int) -> None:
        manager.commit = step != 1
        if step == 3:
            load_state_dict, state_dict = manager.state_dict_fns[sdpq.torchtitan.RECOVERY_KEY]
            load_state_dict(state_dict())  # what torchft does on a healing replica

    with LinkBytes(ctx.ranks_per_node) as meter:
        hook(optimizers, [model], parallel_dims)
        meter.snapshot()
        _train(ctx, model, optimizers, steps, meter, between)
    comms = sdpq.fsdp.module_comms(model)
    return {
        "refused": refused,
        "bytes": meter.as_dict(),
        "groups": len(comms),
        "replica_all_reduces": len(replica_all_reduces),
        "hook_kept": all(c.param_group._all_reduce_hook is replica_all_reduce for c in comms.values()),
        "sdpq_all_reduces": sum(len(c.replicas) for c in comms.values()),
    }


def _runs(ctx) -> dict:
    """Every multi-rank scenario in one run of fresh workers (torchtitan's and sdpq's first-use
    costs paid once)."""
    import importlib.util

    out = {"fsdp": _fsdp_vs_sdpq(ctx, FSDP_STEPS), "hsdp": _hsdp_vs_sdpq(ctx, HSDP_STEPS)}
    if importlib.util.find_spec("torchft") is not None:
        out["torchft"] = _torchft(ctx, 4)
    return out


@pytest.fixture(scope="module")
def runs(_dist_session) -> list:
    """[per rank: {scenario: results}]. Note: fresh workers (see `dist` in test_fsdp_hsdp.py: torch's
    cached sub-meshes of an equal mesh would reach groups an earlier run destroyed)."""
    _dist_session.discard(WORLD)
    return _dist_session.run(_runs, WORLD, RPN, timeout=400)


# ----------------------------------------------------------------------------- byte accounting


def _inter(slice_: dict) -> int:
    """Cross-node bytes of one meter slice ({path: {link: bytes}})."""
    return sum(links.get("inter", 0) for links in slice_.values())


def _cross(results: list, arm: str, first: int, last: int | None = None) -> int:
    """Every rank's cross-node bytes over meter slices [first, last) (0: the hook; k: step k)."""
    return sum(_inter(s) for r in results for s in r[arm]["steps"][first:last])


def _check_losses(results: list) -> tuple[list, list]:
    plain, ours = results[0]["losses"]
    assert all(r["losses"] == (plain, ours) for r in results)  # the global mean, equal on every rank
    assert plain[-1] < plain[0] and ours[-1] < ours[0]  # both learn
    assert all(abs(q / p - 1) <= 0.02 for p, q in zip(plain, ours)), (plain, ours)
    return plain, ours


def test_fsdp_with_the_hook_sends_under_a_seventh_of_the_cross_node_bytes(runs):
    res = [r["fsdp"] for r in runs]
    plain, ours = _check_losses(res)
    assert all(r["applied"] for r in res)
    # The spec's own hook ran first, once, and its step pre-hook on the container every step.
    assert all(r["calls"] == [("built", 1, WORLD)] + ["step"] * FSDP_STEPS for r in res)
    # Steps 2..n: sdpq's 2-bit weight differences once a step and 4-bit gradients against FSDP2's
    # bf16 gathers (twice a step for the blocks) and fp32 reduce-scatters.
    steady = _cross(res, "sdpq", 2) / _cross(res, "plain", 2)
    # Once per job: the hook's agreement checks and step 1's exact weight exchange (the references
    # start from the exact weights: one bf16 gather against the plain step's gathers).
    first = _cross(res, "sdpq", 0, 2) / _cross(res, "plain", 0, 2)
    whole = _cross(res, "sdpq", 0) / _cross(res, "plain", 0)
    print(
        f"torchtitan FSDP 2x2, {FSDP_STEPS} steps: cross-node bytes (least-traffic count) {steady:.3f} of the "
        f"plain run's per step after the first, {first:.3f} in the hook and step 1, {whole:.3f} over the run; "
        f"losses {ours} vs {plain}"
    )
    assert steady <= 0.15, steady
    assert first <= 0.4, first


def test_hsdp_replicate_all_reduce_is_taken_over(runs):
    res = [r["hsdp"] for r in runs]
    plain, ours = _check_losses(res)
    assert all(r["all_reduces"] == [1, 1, 1] for r in res)  # sdpq's, per FSDP group: embeddings, block, norm+head
    assert res[0]["digest"] == res[2]["digest"] and res[1]["digest"] == res[3]["digest"]  # replicas equal
    assert all(r["hsdp_after_remove"] == [True] * 3 for r in res)
    # Only the replicate all-reduce crosses nodes: 4.25 bits an element against fp32's 32.
    steady = _cross(res, "sdpq", 1) / _cross(res, "plain", 1)
    # The hook's start: the replicas start from the first one's shards (one fp32 broadcast).
    start = _cross(res, "sdpq", 0, 1) / (_cross(res, "plain", 1) / HSDP_STEPS)
    print(
        f"torchtitan HSDP 2x2, {HSDP_STEPS} steps: cross-node bytes {steady:.3f} of the plain run's per step; the "
        f"hook itself {start:.2f} plain steps' worth; losses {ours} vs {plain}"
    )
    assert steady <= 0.15, steady


def test_torchft_all_reduce_is_left_to_torchft(runs):
    if "torchft" not in runs[0]:
        pytest.skip("torchft is not installed")
    res = [r["torchft"] for r in runs]
    assert all("semi_sync_method" in r["refused"] for r in res)  # DiLoCo / LocalSGD refused on every rank
    for r in res:
        assert r["hook_kept"] and r["sdpq_all_reduces"] == 0
        assert r["replica_all_reduces"] == r["groups"] * 4  # torchft's all-reduce, every group, every step
    weights = [sum(r["bytes"]["steps"][k].get("weights", {}).get("inter", 0) for r in res) for k in range(5)]
    # Step 2's gathers refresh with step 1's update (2-bit); step 2 was not committed, so step 3's
    # gathers send no weights; after healing, step 4's are exact (bf16 against 2-bit differences).
    assert weights[2] > 0 and weights[3] == 0 and weights[4] > 3 * weights[2], weights


# ----------------------------------------------------------------------------- single process


def _printed(trainer_config) -> str:
    return re.sub(" at 0x[0-9a-f]+", "", str(trainer_config.to_dict()))


def test_configs_through_torchtitans_module_lookup():
    """`--module sdpq.torchtitan_configs --config <fn>` as torchtitan's ConfigManager resolves it:
    torchtitan's own config with sdpq's hook (defaults) on the model spec."""
    from torchtitan.config import ConfigManager
    from torchtitan.models.llama3 import config_registry

    import sdpq.torchtitan_configs as configs

    for name in ("llama3_debugmodel", "llama3_8b"):
        ours = ConfigManager().parse_args(["--module", "sdpq.torchtitan_configs", "--config", name])
        theirs = getattr(config_registry, name)()
        hook = ours.model_spec.post_optimizer_build_fn
        assert isinstance(hook, sdpq.torchtitan.SdpqHook) and hook.config == sdpq.Config() and hook.chain is None
        # The same config (the inits are new function objects per call: compared by what they print).
        assert _printed(ours) == _printed(theirs)
    overridden = configs.llama3_8b({"gradients": {"inter_bits": 3}})
    assert overridden.model_spec.post_optimizer_build_fn.config.gradients.inter_bits == 3
    with pytest.raises(ValueError, match="Available config functions: \\['llama3_8b', 'llama3_debugmodel'\\]"):
        ConfigManager().parse_args(["--module", "sdpq.torchtitan_configs", "--config", "llama3"])


def test_an_moe_spec_keeps_its_load_balancing_hook():
    from torchtitan.components.optimizer import register_moe_load_balancing_hook
    from torchtitan.models.qwen3 import model_registry

    spec = sdpq.torchtitan.model_spec_with_sdpq(model_registry("debugmodel_moe"), {"weights": {"bits": 3}})
    assert spec.post_optimizer_build_fn.chain is register_moe_load_balancing_hook
    assert spec.post_optimizer_build_fn.config.weights.bits == 3


def test_refusals_name_the_option():
    def dims(**kw):
        layout = {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1, "ep": 1, "world_size": 2}
        return ParallelDims(**{**layout, **kw})

    hook = sdpq.torchtitan.post_optimizer_build_fn()
    with pytest.raises(ValueError, match="expert_parallel_degree=2"):
        hook(None, [], dims(ep=2))
    with pytest.raises(ValueError, match="data_parallel_shard_degree=1"):
        hook(None, [], dims(dp_replicate=2, dp_shard=1))
    hook(None, [], dims(dp_shard=1, world_size=1))  # no data parallelism: nothing to do
    with pytest.raises(sdpq.ConfigError, match="weights.bits"):
        sdpq.torchtitan.post_optimizer_build_fn({"weights": {"bits": 5}})
    with pytest.raises(TypeError, match="chain must be callable"):
        sdpq.torchtitan.post_optimizer_build_fn(chain="register_moe_load_balancing_hook")
