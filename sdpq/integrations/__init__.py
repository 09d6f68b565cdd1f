"""Thin adapters that install sdpq's collectives and optimizer into training frameworks.

- `sdpq.integrations.fsdp` (exposed as `sdpq.fsdp`): PyTorch FSDP2 (`fully_shard`).
- `sdpq.integrations.deepspeed` (exposed as `sdpq.deepspeed`): DeepSpeed ZeRO-1, -2 and -3.
- `sdpq.integrations.ddp` (exposed as `sdpq.ddp`): PyTorch DDP.

Submodules are imported on demand, so using one framework never imports the other. Exported
here, without importing torch.distributed or DeepSpeed: the DeepSpeed config check that
`sdpq config --check` runs, the config sdpq runs with at a ZeRO stage and ZeRO-3's weight group
(what `sdpq plan` plans with), the post-import hook `import sdpq` installs (and its removal), and
the all-or-none save of one file per rank that sdpq's own checkpoints use.
"""

import os
import sys

from ._ds_config import IncompatibleConfigError, zero3_weight_group
from ._ds_config import check_config as check_deepspeed_config
from ._ds_config import config_at_stage as deepspeed_config_at_stage
from ._ds_hook import install as install_deepspeed_hook
from ._ds_hook import uninstall as uninstall_deepspeed_hook

__all__ = [
    "IncompatibleConfigError",
    "check_deepspeed_config",
    "deepspeed_config_at_stage",
    "install_deepspeed_hook",
    "mark_weights_changed",
    "save_on_every_rank",
    "uninstall_deepspeed_hook",
    "zero3_weight_group",
]


def mark_weights_changed(target, *, exact: bool = True) -> None:
    """The weights of `target` changed outside a hooked optimizer step (edited by hand, loaded
    without sdpq's state): the next gather refreshes the weight reference, exactly by default.
    `target`: an FSDP2 model after sdpq.fsdp.apply or a DeepSpeed engine from
    sdpq.deepspeed.initialize. Call it on every rank alike."""
    # Only an integration that is imported can have built `target`: look in those alone, so
    # this call imports no framework.
    fsdp = sys.modules.get(__name__ + ".fsdp")
    if fsdp is not None and fsdp.is_applied(target):
        fsdp.mark_weights_changed(target, exact=exact)
        return
    ds = sys.modules.get(__name__ + "._ds_base")
    if ds is not None and isinstance(getattr(target, "sdpq", None), ds.DeepSpeedAdapterBase):
        target.sdpq.mark_weights_changed(exact=exact)  # ZeRO-1/2: the next gathers are exact whatever `exact` says
        return
    raise TypeError(
        f"sdpq.mark_weights_changed: {type(target).__name__} has no sdpq weight gathers; expected an "
        "FSDP2 model after sdpq.fsdp.apply or a DeepSpeed engine from sdpq.deepspeed.initialize"
    )


def save_on_every_rank(obj, path: str | os.PathLike, what: str = "save_on_every_rank") -> None:
    """torch.save(obj, path) on every rank of the default group, all or none (collective): each
    rank writes its file beside its previous one, the ranks agree that all were written, and only
    then does each replace its previous file. A rank that cannot write (a full disk) raises the
    same CheckpointSaveError on every rank, naming it; no previous file is replaced. `what` names
    the caller in that error."""
    from ._files import every_rank_problem, save_agreed  # Note: torch.distributed only when used

    save_agreed(obj, os.fspath(path), every_rank_problem, what)
