"""Every rank must build a collective from the same settings, or the wire formats disagree.

A rank with another seed, Hadamard flag, bit width or bucket size than its peers does not fail
by itself: it sends bytes its peers decode differently (silently wrong sums) or of another size
(gloo aborts the process). `check_agreement` runs once when a collective or an integration
is set up (one small all-gather of the settings, none per step) and raises the same
`ConfigError` on every rank, naming each differing setting and which ranks hold which value.

Note: the check reads the gathered digests on the host (a device sync on GPU), so collectives are
built before training (`sdpq.fsdp.apply`), never inside a communication hook.

An integration that builds many collectives at set-up checks them in one collective
(`agreement_batch`: the checks inside the block are collected and run as one at its end). One
that builds collectives while training (ZeRO-3's run-time gradient buckets) agrees at set-up on
every setting that shapes them and builds them under `agreed_at_setup()`, which skips the check.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .._version import __version__
from ..config import ConfigError
from ._exchange import all_gather_objects, all_gather_rows, group_device, group_ranks, group_size

__all__ = ["check_agreement", "agreement_batch", "agreed_at_setup", "WIRE_FORMAT"]

# Bumped whenever the bytes on the wire change meaning (layout of codes and scales, transforms,
# rounding streams). Ranks must also run the same sdpq release; the format number says in the
# error whether the bytes themselves differ.
WIRE_FORMAT = 2


def _flatten(prefix: str, value: Any, out: dict[str, str]) -> None:
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    else:
        out[prefix] = repr(value)


# None: check now; a list: collect (agreement_batch); _AGREED: skip (agreed_at_setup)
_AGREED: list = []
_PENDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("sdpq_agreement", default=None)


@contextlib.contextmanager
def agreement_batch(what: str, group) -> Iterator[None]:
    """Collect every `check_agreement` made inside the block (its settings and its group's ranks)
    and check them all in one collective on `group` when it ends (the error names `what`, each
    check's own name and its position). A block left by an exception checks nothing.
    Collective: every rank of the group must run the block and make the same checks in it."""
    pending: list = []
    token = _PENDING.set(pending)
    try:
        yield
    finally:
        _PENDING.reset(token)
    check_agreement(what, {f"{name}[{i}]": s for i, (name, s) in enumerate(pending)}, group)


@contextlib.contextmanager
def agreed_at_setup() -> Iterator[None]:
    """`check_agreement` inside the block returns at once: the caller agreed at set-up on every
    setting that shapes what it builds (no collective, no host read: usable in a hook)."""
    token = _PENDING.set(_AGREED)
    try:
        yield
    finally:
        _PENDING.reset(token)


def check_agreement(what: str, settings: Mapping[str, Any], group) -> None:
    """Raise ConfigError on every rank of `group` unless all of them passed equal `settings`
    (nested mappings of plain values) and run the same sdpq release and wire format.
    Collective: every rank of the group must call it (inside `agreement_batch` it is collected
    instead; inside `agreed_at_setup` it does nothing)."""
    pending = _PENDING.get()
    if pending is _AGREED:
        return
    if pending is not None:
        pending.append((what, {"group": None if group is None else group_ranks(group), **settings}))
        return
    k = group_size(group)
    if k == 1:
        return
    mine: dict[str, str] = {}
    _flatten("", {"sdpq_version": __version__, "wire_format": WIRE_FORMAT, **settings}, mine)
    # Note: one all-gather of a 32-byte digest when the ranks agree (the usual case, ~1 ms);
    # only a mismatch pays for gathering the settings themselves to name what differs.
    digest = hashlib.sha256(repr(sorted(mine.items())).encode()).digest()
    mine_t = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(group_device(group))
    if bool((all_gather_rows(mine_t, group)[0] == mine_t).all()):
        return
    everyone: list[dict[str, str]] = all_gather_objects(mine, group)
    ranks = group_ranks(group)
    keys = sorted(set().union(*everyone))
    diffs = []
    for key in keys:
        held: dict[str, list[int]] = {}
        for r, d in zip(ranks, everyone):
            held.setdefault(d.get(key, "<missing>"), []).append(r)
        if len(held) > 1:
            diffs.append(f"{key}: " + "; ".join(f"{v} on ranks {rs}" for v, rs in held.items()))
    if diffs:
        raise ConfigError(
            f"{what}: the ranks disagree on settings that shape the wire, so their collectives "
            f"cannot work together ({len(diffs)} differing): " + " | ".join(diffs[:5])
        )
