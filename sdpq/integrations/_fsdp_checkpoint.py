"""sdpq.fsdp's checkpoint state for torch.distributed.checkpoint (DCP), see fsdp.py.

DCP wants a flat dict of tensors whose keys say whose they are, so the collectives' own
state_dicts are flattened into "rank{r}.{module fqn}.<field>" keys (every rank keeps its own
copy). These key names are a file format: checkpoints written by earlier versions must load.

Another layout (nodes x ranks per node, or world size) on resume: DCP reshards the model and
optimizer, but sdpq's state is per rank and per layout (a node's weight reference, a rank's
error-feedback residual), so it cannot be resharded. `state_dict(model, checkpoint_id=path)`
reads the checkpoint's metadata and, when the saved state has another shape, leaves it out of
the template; `load_state_dict` then rebuilds it: every weight reference is refreshed exactly
at the first gather (one unquantized all-gather) and the residuals restart from zero, with a
`ResumeLayoutWarning`. The run continues from the loaded weights and optimizer states.

A checkpoint whose ranks' sdpq states do not hold together (a rank's file from another save or
another rank, or damaged where DCP does not notice) raises one `CheckpointLoadError` on every rank
before any rank restores anything (_fsdp_checkpoint_checks.py says why an error, not a rebuild).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..comm import GradReduceScatter, WeightGather, group_device
from ._files import CheckpointLoadError, every_rank_problem
from ._fsdp_checkpoint_checks import disagreements, facts, unfit
from ._fsdp_hooks import ModuleComms, applied

__all__ = ["state_dict", "load_state_dict", "CheckpointLoadError", "ResumeLayoutWarning"]

# Keys a checkpoint of an earlier sdpq version lacks: left out of the template for such a checkpoint.
_ADDED_KEYS = (".gathers",)


class ResumeLayoutWarning(UserWarning):
    """A checkpoint's sdpq state was saved on another layout and is rebuilt instead of loaded."""


def _prefix(c: ModuleComms) -> str:
    return f"rank{dist.get_rank()}.{c.fqn or '<root>'}."


def _layout(c: ModuleComms) -> list[int]:
    return [c.topology.world_size, c.topology.ranks_per_node, c.weights.numel]


def _has_residual(rs: GradReduceScatter) -> bool:
    # Error feedback only exists on the inter-node stage of the two-level path.
    c = rs.config
    return c.mode == "two_level" and c.error_feedback and rs.topology.nodes > 1


def _save_weights(wg: WeightGather, p: str, out: dict[str, torch.Tensor]) -> None:
    s = wg.state_dict()
    if wg.holds_reference:
        ref = s["reference"]
        # Note: before the first gather there is no reference yet; a zero placeholder of the right
        # shape (version -1) keeps the saved keys and shapes independent of history.
        out[p + "weights.version"] = torch.tensor(s["version"] if ref is not None else -1, dtype=torch.int64)
        out[p + "weights.reference"] = ref if ref is not None else wg.new_reference("cpu").tensor
    if s["generator"] is not None:
        out[p + "weights.rng"] = s["generator"]


def _save_gradients(rs: GradReduceScatter, q: str, out: dict[str, torch.Tensor]) -> None:
    s = rs.state_dict()
    if _has_residual(rs):
        res = s["residual"]
        out[q + "residual"] = (
            res if res is not None else torch.zeros((rs.topology.nodes, rs.padded_chunk), dtype=torch.float32)
        )
    if s["generator"] is not None:
        out[q + "rng"] = s["generator"]


def _weights_state(wg: WeightGather, p: str, state: Mapping[str, torch.Tensor]) -> dict:
    """The WeightGather state_dict that the flat keys under `p` describe. "dirty" is left out on
    purpose: the weights were loaded too, so the next gather refreshes (a quantized difference
    against the restored reference), as the uninterrupted run's next gather would."""
    s = {"mode": wg.config.mode, "layout": wg.topology.layout, "numel": wg.numel, "version": 0, "reference": None}
    if wg.holds_reference:
        version = int(state[p + "weights.version"])
        if version >= 0:  # -1: saved before the first gather
            s.update(version=version, reference=state[p + "weights.reference"])
    if p + "weights.rng" in state:
        s["generator"] = state[p + "weights.rng"]
    if p + "gathers" in state:  # absent from checkpoints of earlier versions
        s["calls"] = int(state[p + "gathers"])
    return s


def _gradients_state(q: str, state: Mapping[str, torch.Tensor]) -> dict:
    """The GradReduceScatter state_dict that the flat keys under `q` describe ({} if none)."""
    s = {}
    if q + "residual" in state:
        s["residual"] = state[q + "residual"]
    if q + "rng" in state:
        s["generator"] = state[q + "rng"]
    return s


def state_dict(model: nn.Module, *, checkpoint_id: str | os.PathLike | Any | None = None) -> dict[str, torch.Tensor]:
    """This rank's sdpq state as a flat dict of tensors, for torch.distributed.checkpoint: weight
    references (+ version), gradient error-feedback residuals, stochastic-rounding RNG states.
    Keys start with "rank{r}." so that DCP keeps every rank's own copy. The same call on a freshly
    set-up model gives the template to load into (same shapes).

    To load, pass the checkpoint you will load (`checkpoint_id`: its path or a DCP StorageReader):
    if its sdpq state was saved on another layout, the template is empty (DCP would fail on the
    shapes) and `load_state_dict` rebuilds the state instead. Collective: call it on every rank."""
    st = applied(model)
    out: dict[str, torch.Tensor] = {}
    for c in st.comms:
        p = _prefix(c)
        out[p + "layout"] = torch.tensor(_layout(c), dtype=torch.int64)
        # Note: every rank gathers every module equally often: a rank whose count differs at a
        # load holds a file of another save (_fsdp_checkpoint_checks).
        out[p + "gathers"] = torch.tensor(c.weights.calls, dtype=torch.int64)
        _save_weights(c.weights, p, out)
        for numel, rs in sorted(c.gradients.items()):
            _save_gradients(rs, p + f"gradients.{numel}.", out)
        if c.replicate is not None:  # HSDP: the replicate all-reduce's phase 1, and its layout
            out[p + "replicate.layout"] = torch.tensor([c.replicate.world_size, c.replicate.ranks_per_node])
        for numel, ar in sorted(c.replicas.items()):
            _save_gradients(ar.reduce_scatter, p + f"replicate.{numel}.", out)
    st.relayout_from = None
    if checkpoint_id is not None:
        st.relayout_from = _other_layout(out, checkpoint_id, dist.group.WORLD)
        if st.relayout_from is not None:
            return {}
    return out


def _saved_sizes(checkpoint_id) -> tuple[dict | None, str | None]:
    """{key: shape or None} of the checkpoint's metadata, or why it cannot be read."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        reader = FileSystemReader(checkpoint_id) if isinstance(checkpoint_id, (str, os.PathLike)) else checkpoint_id
        return {k: getattr(m, "size", None) for k, m in reader.read_metadata().state_dict_metadata.items()}, None
    except Exception as e:
        return None, f"{type(e).__name__}: {e}"


def _other_layout(template: dict[str, torch.Tensor], checkpoint_id, group) -> str | None:
    """Why the checkpoint's sdpq state does not fit `template` (None if it does), decided alike
    on every rank (each compares its own keys). A key of _ADDED_KEYS the checkpoint lacks is taken
    out of the template (a checkpoint of an earlier version). Raises CheckpointLoadError on every
    rank if any rank cannot read the checkpoint's metadata."""
    saved, unreadable = _saved_sizes(checkpoint_id)
    # Note: no rank may raise before the others reach this agreement.
    problems = every_rank_problem(unreadable and f"cannot read its metadata: {unreadable}", group)
    if problems:
        raise CheckpointLoadError(
            f"sdpq.fsdp.state_dict: checkpoint {checkpoint_id}: {'; '.join(problems)}; it is not a complete DCP "
            "checkpoint (a save that failed or was killed leaves none): load another one"
        )
    assert saved is not None
    for key in [k for k in template if k.endswith(_ADDED_KEYS)]:
        if not any(k == key or k.endswith("." + key) for k in saved):
            del template[key]
    problem, nest = None, None
    for key, t in template.items():
        # The caller nests our dict under a key of its choice: DCP stores "<their key>.<ours>".
        hits = [(k, size) for k, size in saved.items() if size is not None and (k == key or k.endswith("." + key))]
        if not hits or tuple(hits[0][1]) != tuple(t.shape):
            problem = f"{key}: saved {tuple(hits[0][1]) if hits else 'nothing'}, this run {tuple(t.shape)}"
            break
        nest = hits[0][0][: len(hits[0][0]) - len(key)]
    if problem is None and nest is not None:
        # A weight reference saved across nodes, resumed on one node (which keeps none). Other
        # saved keys the template lacks (a residual, a rounding stream of a setting turned off)
        # are simply not loaded.
        mine = f"{nest}rank{dist.get_rank()}."
        extra = sorted(
            k
            for k in saved
            if k.startswith(mine) and k.endswith(".weights.reference") and k[len(nest) :] not in template
        )
        if extra:
            problem = f"{extra[0][len(nest) :]}: saved across nodes, but this layout keeps no weight reference"
    bad = torch.tensor([1 if problem else 0], dtype=torch.int64, device=group_device(group))
    dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    if not bad.item():
        return None
    return problem or "another rank's sdpq state has another layout"


def _rebuild(model: nn.Module, why: str) -> None:
    """Resume without sdpq's saved state: exact reference refresh, residuals from zero."""
    if dist.get_rank() == 0:
        warnings.warn(
            f"sdpq.fsdp.load_state_dict: the checkpoint's sdpq state is of another layout or configuration ({why}); "
            "the weight references are refreshed exactly at the first gather and the error-feedback "
            "residuals restart from zero",
            ResumeLayoutWarning,
            stacklevel=3,
        )
    for c in applied(model).comms:
        c.weights.mark_weights_changed(exact=True)
        for rs in [*c.gradients.values(), *(ar.reduce_scatter for ar in c.replicas.values())]:
            rs.reset_error_feedback()


def load_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Restore what state_dict saved (after dcp.load filled it). Marks the weights changed with a
    quantized difference against the restored reference, exactly as the uninterrupted run's next
    gather would: resuming reproduces the trajectory bitwise. Do not call mark_weights_changed
    on top of it (that would make the next refresh exact). After a `state_dict(model,
    checkpoint_id=...)` that found another layout, rebuilds the state instead (see the module)."""
    st = applied(model)
    if st.relayout_from is not None:
        why, st.relayout_from = st.relayout_from, None
        _rebuild(model, why)
        return
    # Note: every rank checks, then all agree, before any restores (_fsdp_checkpoint_checks).
    problems = every_rank_problem(unfit(st.comms, state, _prefix))
    problems = problems or disagreements(facts(st.comms, state, _prefix))
    if problems:
        raise CheckpointLoadError(
            f"sdpq.fsdp.load_state_dict: {'; '.join(problems)}; no rank loaded sdpq's state: load another "
            "checkpoint (its model and optimizer shards come from the same files)"
        )
    for c in st.comms:
        p = _prefix(c)
        c.weights.load_state_dict(_weights_state(c.weights, p, state))
        saved = [(f"gradients.{n}.", rs) for n, rs in c.gradients.items()]
        saved += [(f"replicate.{n}.", ar.reduce_scatter) for n, ar in c.replicas.items()]
        for key, rs in saved:
            s = _gradients_state(p + key, state)
            if s:  # Note: a GradReduceScatter state without "residual" clears the residual
                rs.load_state_dict(s)
