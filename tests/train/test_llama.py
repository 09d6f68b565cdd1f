"""The Llama-shaped model (sdpq/train/llama.py) and how a run chooses it.

Single process: shapes and parameter count from the config, RMSNorm without bias and no bias
anywhere, tied vs untied head, the rotary relative-position property, rotary and learned
positions both train, causality, config validation. Choice: --model / --n-kv-head in
python -m sdpq.train and through the launchers, RunSpec's JSON round trip (the demo's --model:
tests/test_demo.py). Distributed: the
llama model through both backends (FSDP2, ZeRO-3) on 4 gloo ranks as 2 x 2 with sdpq's
quantized collectives.
"""

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

from sdpq.config import ConfigError
from sdpq.train.__main__ import add_arguments
from sdpq.train.llama import Llama, LlamaConfig, apply_rotary, default_ffn_hidden, rotary_tables
from sdpq.train.model import GPT, GPTConfig, model_from_config
from sdpq.train.run import RunSpec
from sdpq.train.settings import resolve

REPO = Path(__file__).resolve().parents[2]
TINY = dict(seq_len=16, n_layer=2, n_head=4, d_model=64)
# sdpq on, quantized: the default weight differences (2-bit), two-level gradients (the framework's optimizer).
QUANT = {"weights": {"mode": "diff"}, "gradients": {"mode": "two_level"}, "optimizer": {"enabled": False}}


def _expected_params(cfg: LlamaConfig) -> int:
    d, f, hd = cfg.d_model, cfg.ffn_hidden, cfg.d_model // cfg.n_head
    per_block = 2 * d + d * d + 2 * d * cfg.n_kv_head * hd + d * d + 3 * d * f  # norms, q, k+v, o, gate+up+down
    embeddings = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)  # token table (+ an untied head)
    positions = cfg.seq_len * d if cfg.positions == "learned" else 0
    return embeddings + positions + cfg.n_layer * per_block + d  # + the final norm


@pytest.mark.parametrize(
    "kw", [{}, {"n_kv_head": 2}, {"n_kv_head": 1, "positions": "learned"}, {"tie_embeddings": True}]
)
def test_shapes_and_parameter_count_follow_the_config(kw):
    cfg = LlamaConfig(**TINY, **kw)
    assert cfg.ffn_hidden == 192 and cfg.n_kv_head == kw.get("n_kv_head", 4)  # ceil(8/3 * 64 / 64) * 64
    torch.manual_seed(0)
    model = model_from_config(cfg)
    assert isinstance(model, Llama) and len(model.blocks) == 2
    assert model.num_params() == _expected_params(cfg)
    assert model.blocks[0].k.weight.shape == (cfg.n_kv_head * 16, 64)
    x, y = torch.randint(0, 256, (3, 16)), torch.randint(0, 256, (3, 16))
    assert model(x).shape == (3, 16, 256)
    loss = model(x, y).detach()
    assert loss.dim() == 0 and loss.dtype == torch.float32
    assert abs(float(loss) - math.log(256)) < 0.1  # near-uniform at initialisation (std 0.02 weights)


def test_default_ffn_width_is_8_thirds_rounded_up_to_64():
    assert [default_ffn_hidden(d) for d in (64, 96, 192, 256, 4096)] == [192, 256, 512, 704, 10944]
    assert LlamaConfig(d_model=256).ffn_hidden == 704 and LlamaConfig(ffn_hidden=100).ffn_hidden == 100


def test_rmsnorm_has_no_bias_and_no_layer_has_one():
    model = Llama(LlamaConfig(**TINY))
    norms = [m for m in model.modules() if isinstance(m, nn.RMSNorm)]
    assert len(norms) == 2 * 2 + 1  # two per block, one final
    assert not any(isinstance(m, nn.LayerNorm) for m in model.modules())
    for n in norms:
        assert [name for name, _ in n.named_parameters()] == ["weight"] and torch.equal(n.weight, torch.ones(64))
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))
    assert not [name for name, _ in model.named_parameters() if "bias" in name]


def test_tied_head_is_the_embedding_untied_is_its_own():
    tied, untied = Llama(LlamaConfig(**TINY, tie_embeddings=True)), Llama(LlamaConfig(**TINY))
    assert tied.head.weight is tied.embed.weight
    assert untied.head.weight is not untied.embed.weight
    assert not torch.equal(untied.head.weight, untied.embed.weight)  # initialised separately
    assert untied.num_params() - tied.num_params() == 256 * 64
    assert LlamaConfig().tie_embeddings is False and GPTConfig().tie_embeddings is True  # Llama 3 vs GPT-2


def test_rotary_scores_depend_on_the_position_difference_only():
    torch.manual_seed(0)
    q, k = torch.randn(16), torch.randn(16)
    cos, sin = rotary_tables(40, 16, 10000.0, torch.device("cpu"))

    def score(m, n):
        return apply_rotary(q, cos[m], sin[m]) @ apply_rotary(k, cos[n], sin[n])

    for m, n in [(5, 2), (9, 9), (3, 7)]:
        for shift in (1, 17, 30):
            assert torch.allclose(score(m, n), score(m + shift, n + shift), atol=1e-5)
    assert not torch.allclose(score(5, 2), score(5, 3), atol=1e-3)  # a different offset scores differently
    assert torch.allclose(apply_rotary(q, cos[0], sin[0]), q)  # position 0 is unrotated
    assert torch.allclose(apply_rotary(q, cos[11], sin[11]).norm(), q.norm())  # a rotation


@pytest.mark.parametrize("positions", ["rotary", "learned"])
def test_both_position_kinds_train(positions):
    """20 AdamW steps on one batch of random bytes: the model memorises it."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY, n_kv_head=2, positions=positions))
    x, y = torch.randint(0, 256, (4, 16)), torch.randint(0, 256, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(20):
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[0] > 5.0 and losses[-1] < 1.0, losses  # from ln(256) = 5.5 to memorised


@pytest.mark.parametrize("kw", [{}, {"n_kv_head": 1}, {"positions": "learned", "tie_embeddings": True}])
def test_a_future_token_does_not_change_earlier_logits(kw):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**TINY, **kw)).eval()
    x = torch.randint(0, 256, (2, 16))
    changed = x.clone()
    changed[:, 9] = (changed[:, 9] + 1) % 256
    with torch.no_grad():
        a, b = model(x), model(changed)
    assert torch.equal(a[:, :9], b[:, :9])
    assert not torch.allclose(a[:, 9:], b[:, 9:])  # from the changed position on, the logits move


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"d_model": 62}, "LlamaConfig.d_model: 62 must be divisible by n_head=4"),
        ({"n_kv_head": 3}, "LlamaConfig.n_kv_head: 3; allowed: a divisor of n_head=4"),
        ({"positions": "alibi"}, "LlamaConfig.positions: 'alibi'; allowed: 'rotary', 'learned'"),
        ({"d_model": 12, "n_head": 4}, "LlamaConfig.d_model: rotary .* d_model / n_head = 3 must be even"),
        ({"n_layer": 0}, r"LlamaConfig.n_layer: 0; allowed: an integer >= 1"),
        ({"ffn_hidden": -64}, r"LlamaConfig.ffn_hidden: -64; allowed: an integer >= 1"),
        ({"seq_len": 8.0}, r"LlamaConfig.seq_len: 8.0; allowed: an integer >= 1"),
        ({"tie_embeddings": "yes"}, "LlamaConfig.tie_embeddings: 'yes'; allowed: True, False"),
        ({"norm_eps": 0.0}, r"LlamaConfig.norm_eps: 0.0; allowed: a number > 0"),
        ({"rope_theta": -1.0}, r"LlamaConfig.rope_theta: -1.0; allowed: a number > 0"),
    ],
)
def test_bad_config_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**{**TINY, **kw})


def test_odd_head_dims_are_fine_without_rotary():
    assert LlamaConfig(d_model=12, n_head=4, positions="learned").ffn_hidden == 64


# ----------------------------------------------------------------------------- choosing the model


def _parser():
    p = argparse.ArgumentParser(prog="python -m sdpq.train")
    add_arguments(p)
    return p


def test_train_flag_selects_the_model():
    env = {"WORLD_SIZE": "4"}
    spec = resolve(_parser().parse_args([]), env).spec
    assert type(spec.model) is GPTConfig and isinstance(model_from_config(spec.model), GPT)
    args = _parser().parse_args(["--model", "llama", "--n-kv-head", "2", "--d-model", "64", "--seq-len", "32"])
    spec = resolve(args, env).spec
    assert spec.model == LlamaConfig(seq_len=32, n_layer=4, n_head=4, n_kv_head=2, d_model=64)
    assert RunSpec.from_dict(json.loads(json.dumps(dataclasses.asdict(spec)))) == spec  # --out records round-trip
    with pytest.raises(ConfigError, match="--n-kv-head: grouped-query attention is an option of --model llama"):
        resolve(_parser().parse_args(["--n-kv-head", "2"]), env)
    with pytest.raises(ConfigError, match="--model: 'foo'; allowed: 'gpt', 'llama'"):
        resolve(argparse.Namespace(**{**vars(args), "model": "foo"}), env)


def test_unknown_model_flag_names_the_flag_and_the_choices(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["--model", "foo"])
    # argparse quotes the choices on Python < 3.12.8 / 3.13.1 and not after.
    assert re.search(
        r"argument --model: invalid choice: 'foo' \(choose from '?gpt'?, '?llama'?\)", capsys.readouterr().err
    )


def test_launchers_pass_the_model_on():
    env = {**os.environ, "SDPQ_DRY_RUN": "1", "NPROC": "4", "RANKS_PER_NODE": "2"}
    proc = subprocess.run(
        ["bash", "launchers/single_node.sh", "--model", "llama"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert proc.returncode == 0 and "-m sdpq.train --ranks-per-node 2 --model llama" in proc.stderr


# ----------------------------------------------------------------------------- through both backends


# FSDP2 with grouped-query attention, ZeRO-3 with the head tied to the embedding (one parameter
# used twice in a step under its hooks).
FSDP2_MODEL = LlamaConfig(**{**TINY, "seq_len": 32, "n_kv_head": 2})
ZERO3_MODEL = LlamaConfig(**{**TINY, "seq_len": 32, "tie_embeddings": True})


def _llama_spec(ctx, backend, model):
    return RunSpec(
        backend=backend,
        model=model,
        sdpq=QUANT,
        steps=8,
        micro_batch=2,
        warmup=2,
        lr=3e-3,
        eval_batches=1,
        log_every=0,
        ranks_per_node=ctx.ranks_per_node,
    )


def _summary(r) -> dict:
    return {
        "losses": r.losses,
        "val": r.val_loss,
        "comm": r.comm["total"],
        "cross": r.cross_node_bytes_per_step,
        "params": r.extra["params"],
    }


def _train_fsdp(ctx):
    from sdpq.train import fsdp_backend

    return _summary(fsdp_backend.train(_llama_spec(ctx, "fsdp2", FSDP2_MODEL)))


def _train_zero3(ctx):
    from benchmarks.zeropp.groups import reset_deepspeed_groups
    from sdpq.train import deepspeed_backend

    reset_deepspeed_groups()  # DeepSpeed caches the groups of an earlier run in this worker
    return _summary(deepspeed_backend.train(_llama_spec(ctx, "deepspeed", ZERO3_MODEL)))


def _check_run(results, cfg: LlamaConfig):
    r = results[0]
    assert all(x == r for x in results[1:])  # every rank reports the same mean losses and totals
    losses = r["losses"]
    assert all(math.isfinite(v) for v in losses) and math.isfinite(r["val"])
    assert losses[-1] < losses[0] - 0.5, losses  # from ~ln(256) on the stdlib text
    assert r["params"] == _expected_params(cfg)
    for path in ("weights", "gradients"):  # sdpq's collectives carried the run across the 2 nodes
        inter = r["comm"][path]["inter"]
        assert inter["bytes"] > 0 and inter["bits_per_element"] < 16, (path, inter)
    assert r["cross"] > 0


def test_fsdp2_trains_llama_with_sdpq(dist):
    _check_run(dist.run(_train_fsdp, 4, 2, timeout=120), FSDP2_MODEL)


def test_zero3_trains_llama_with_sdpq(dist):
    pytest.importorskip("deepspeed")
    _check_run(dist.run(_train_zero3, 4, 2, timeout=180), ZERO3_MODEL)
