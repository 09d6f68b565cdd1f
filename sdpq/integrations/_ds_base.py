"""`DeepSpeedAdapterBase`: what sdpq's DeepSpeed adapters (ZeRO-3: _ds_adapter.py; ZeRO-1/2:
_ds_zero12.py) do alike. The stage's subclass builds its collectives (`_setup`) and installs its
hooks (`_install`) and keeps only what differs: its state and what decides its collectives.

- install and undo: every hook goes through `patch` (one attribute of one object, put back on
  `remove`) or `on_remove` (a release, e.g. of a `ProcessPatch`: a process-wide replacement shared
  by reference count). A failure while installing undoes what was installed and raises.
- statistics: `engine.sdpq.stats` (sdpq.stats.of(engine)), registered once for every stage.
- the config as it runs: `config` is what sdpq runs with (`sdpq.deepspeed.initialize` passes the
  effective config: at ZeRO-1/2 an MCF master becomes native, _ds_config.config_at_stage).
- checkpoints: `engine.save_checkpoint` writes `state_dict()` on every rank, agreed
  (_ds_checkpoint.wrap_engine); `engine.load_checkpoint` runs `_after_load`: read and validate
  (never raising) -> agree across ranks, on the problems and on what decides the next collectives
  (`_schedule`) -> load -> agree again. On any rank's problem every rank warns the same problems
  and rebuilds alike (`_rebuild`: the state of a fresh engine, every next gather exact).

Note (invariant): every decision that chooses a collective is taken from state every rank holds
alike. A rank that kept its own state while the others took the file's would run other
collectives at the next step (gloo aborts on the size mismatch; NCCL hangs or corrupts).
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from ..comm import CommStats, Topology
from ..comm.device import comm_device
from ..comm.stats import process_stats, register_holder
from ..config import Config
from ._ds_checkpoint import STATE_FILE, agree_on_problems, read_state, state_path, wrap_engine
from ._ds_monitor import install_monitor

__all__ = ["DeepSpeedAdapterBase", "engine_stats"]

_SHOWN = 3  # files named per value when the ranks' files disagree


class DeepSpeedAdapterBase:
    """sdpq's state for one DeepSpeed engine (``engine.sdpq``). Built by
    ``sdpq.deepspeed.initialize`` on every rank (collective: it creates the node groups and agrees
    on the settings)."""

    FORMAT: ClassVar[int]  # the state format written
    READS: ClassVar[tuple[int, ...]] = ()  # older formats read as well
    FREE_WEIGHTS: ClassVar[tuple[str, ...]] = ("resync_every", "verify_every")  # may change on resume
    REBUILT: ClassVar[str]  # what a rebuild does (in its warning)

    def __init__(self, engine, config: Config):
        self.engine, self.config = engine, config
        self.optimizer = engine.optimizer
        # This engine's counters (sdpq.stats.of(engine)); the process-wide ones get every record too.
        self.stats = CommStats(config=config.stats, parent=process_stats())
        self.topology = Topology.build(config.topology)
        self._undo: list[Callable[[], object]] = []
        self._setup()
        try:
            self._install()
            wrap_engine(self)
            install_monitor(self)
            engine.sdpq = self
        except BaseException:
            self.remove()
            raise

    # ------------------------------------------------------------------ what a stage provides

    def _setup(self) -> None:
        """Check the engine and build the collectives (collective; nothing is installed yet)."""

    def _install(self) -> None:
        """Install the stage's hooks through `patch` and `on_remove`."""

    def mark_weights_changed(self, params: Any = None, *, exact: bool = True) -> None:
        raise NotImplementedError

    def _state(self) -> dict:
        """The stage's part of `state_dict()`."""
        return {}

    def _state_problem(self, state: dict, name: str) -> str | None:
        """Why the stage's part of `state` cannot be loaded here (None: it can)."""
        return None

    def _load(self, state: dict) -> None:
        """Restore a state `_incompatible` found no problem with."""

    def _schedule(self, state: dict | None) -> tuple[int, ...]:
        """What in `state` decides the next steps' collectives, the first number its step count;
        as many numbers on every rank (zeros for None: that rank reports a problem instead)."""
        return (0,) if state is None else (int(state.get("steps", -1)),)

    def _describe_schedule(self, value: tuple[int, ...]) -> str:
        return f"step {value[0]}"

    def _rebuild(self) -> None:
        """The state of a fresh engine, alike on every rank, with every next gather exact."""

    def _loaded(self) -> None:
        """After a checkpoint load, restored or rebuilt (every rank)."""

    # ------------------------------------------------------------------ install and undo

    def patch(self, obj, name: str, fn):
        """obj.name = fn on the instance until `remove()`, which puts back what the instance held
        (or removes the attribute, bringing back the class's); -> what obj.name was."""
        own = vars(obj)
        had, held = name in own, own.get(name)
        orig = getattr(obj, name)
        setattr(obj, name, fn)

        def undo() -> None:
            if had:
                setattr(obj, name, held)
            else:
                vars(obj).pop(name, None)

        self._undo.append(undo)
        return orig

    def on_remove(self, fn: Callable[[], object]) -> None:
        self._undo.append(fn)

    def remove(self) -> None:
        """Undo every hook, last installed first (DeepSpeed behaves as if sdpq was never
        installed). Idempotent."""
        while self._undo:
            self._undo.pop()()
        if vars(self.engine).get("sdpq") is self:
            del self.engine.sdpq

    def held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(kind, tensor) of everything sdpq keeps for this engine between steps (sdpq.memory)."""
        return iter(())

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict:
        """This rank's sdpq state, saved next to DeepSpeed's files by engine.save_checkpoint."""
        head = {"format": self.FORMAT, "layout": self.topology.layout, "rank": self.topology.rank}
        return {**head, "config": self.config.to_dict(), **self._state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; ValueError if it does not fit this run. Not collective:
        engine.load_checkpoint agrees across ranks around it."""
        problem = self._incompatible(state)
        if problem:
            raise ValueError(f"sdpq: {problem}")
        self._load(state)

    def _state_path(self, ckpt_dir: str) -> str:
        return state_path(ckpt_dir, self.topology.rank)

    def _after_load(self, ckpt_dir: str) -> None:
        """DeepSpeed has loaded its files from ckpt_dir: restore this rank's sdpq state, or, if
        any rank cannot, rebuild it on every rank alike (see the module docstring)."""
        path = self._state_path(ckpt_dir)
        state, problem = read_state(path, ckpt_dir, self._incompatible)
        # Note: no rank may raise before the agreement (the others would wait in it).
        problems = self._agree(problem, self._schedule(state))
        if not problems and state is not None:  # (state is None only where there is a problem)
            try:
                self._load(state)
            except Exception as e:  # passed the checks, yet does not load: partly loaded, rebuilt below
                problem = f"{path} does not load: {type(e).__name__}: {e}"
            problems = self._agree(problem)
        if problems:
            warnings.warn(
                f"sdpq: checkpoint {ckpt_dir}: {'; '.join(problems)}; every rank rebuilds sdpq's state: {self.REBUILT}",
                RuntimeWarning,
                stacklevel=4,
            )
            self._rebuild()
        self._loaded()

    def _agree(self, problem: str | None, same: tuple[int, ...] = ()) -> list[str]:
        """Every rank's problem, the same list on every rank (see agree_on_problems)."""
        device = comm_device(self.topology.world_group)
        return agree_on_problems(problem, self.topology, device, same, differ=self._schedules_differ)

    def _schedules_differ(self, values: list[tuple[int, ...]]) -> str:
        """The ranks' files were not saved together (one from another checkpoint of the run?):
        which files hold what, the rarest first."""
        by_value: dict[tuple[int, ...], list[int]] = {}
        for r, v in enumerate(values):
            by_value.setdefault(v, []).append(r)
        parts = []
        for v, _ in sorted(Counter(values).items(), key=lambda kv: kv[1]):
            ranks = by_value[v]
            files = ", ".join(f"rank {r} ({STATE_FILE.format(rank=r)})" for r in ranks[:_SHOWN])
            more = f" and {len(ranks) - _SHOWN} more" if len(ranks) > _SHOWN else ""
            parts.append(f"{self._describe_schedule(v)} in {files}{more}")
        return "the ranks' sdpq state files were not saved together (at different steps?): " + "; ".join(parts)

    def _incompatible(self, state: dict) -> str | None:
        """Why `state` cannot be this rank's (None: it can). Checks everything `_load` reads, so
        that a file of another run is a problem here and not a failure later, on one rank,
        inside a step."""
        name = STATE_FILE.format(rank=self.topology.rank)
        if state.get("format") not in (self.FORMAT, *self.READS):
            return f"{name} has state format {state.get('format')!r}, expected {self.FORMAT}"
        if (state.get("layout"), state.get("rank")) != (self.topology.layout, self.topology.rank):
            return (
                f"{name} was saved on rank {state.get('rank')} of layout {state.get('layout')}; this is rank "
                f"{self.topology.rank} of {self.topology.layout}"
            )
        saved_cfg, mine_cfg = state.get("config") or {}, self.config.to_dict()
        for section, free in (("weights", self.FREE_WEIGHTS), ("gradients", ())):
            saved = saved_cfg.get(section) or {}
            for k, v in mine_cfg[section].items():
                if k not in free and saved.get(k) != v:
                    return f"{name} was saved with sdpq.{section}.{k} = {saved.get(k)!r}; this run has {v!r}"
        return self._state_problem(state, name)


def engine_stats(engine: object) -> CommStats | None:
    """sdpq.stats.of(engine) for an engine from sdpq.deepspeed.initialize (``engine.sdpq``)."""
    adapter = getattr(engine, "sdpq", None)
    return adapter.stats if isinstance(adapter, DeepSpeedAdapterBase) else None


register_holder(engine_stats)
