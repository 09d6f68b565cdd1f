"""Join a job started by any launcher: torchrun, the deepspeed launcher, Slurm's srun, mpirun.

Each launcher describes the job with its own variables; ``discover()`` maps them onto the ones
torch's ``env://`` rendezvous and sdpq's ``ranks_per_node="auto"`` read (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), without overwriting what is already set.

| launcher | rank / size | local rank / ranks per node | master |
|---|---|---|---|
| torchrun | RANK WORLD_SIZE | LOCAL_RANK LOCAL_WORLD_SIZE | MASTER_ADDR/PORT |
| deepspeed | RANK WORLD_SIZE | LOCAL_RANK LOCAL_SIZE | MASTER_ADDR/PORT |
| srun | SLURM_PROCID SLURM_NTASKS | SLURM_LOCALID SLURM_(N)TASKS_PER_NODE | SLURM_JOB_NODELIST's first host |
| mpirun | mpi4py COMM_WORLD | COMM_TYPE_SHARED split | rank 0's address, broadcast over MPI |
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["JobEnv", "discover", "init_distributed", "compute_device", "free_port"]


@dataclass(frozen=True)
class JobEnv:
    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int


def _setdefault(**values: object) -> None:
    for k, v in values.items():
        if v is not None:
            os.environ.setdefault(k, str(v))


def _from_mpi() -> None:
    from mpi4py import MPI  # only under mpirun

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    addr = comm.bcast(os.environ.get("MASTER_ADDR") or socket.gethostbyname(socket.gethostname()), root=0)
    _setdefault(
        RANK=comm.Get_rank(),
        WORLD_SIZE=comm.Get_size(),
        LOCAL_RANK=local.Get_rank(),
        LOCAL_WORLD_SIZE=local.Get_size(),
        MASTER_ADDR=addr,
        MASTER_PORT=29500,
    )


def _slurm_tasks_on_this_node(env: os._Environ | dict) -> str | None:
    """Tasks on this node: SLURM_NTASKS_PER_NODE (set only with --ntasks-per-node) or this
    node's entry of SLURM_TASKS_PER_NODE, a run-length list such as "4(x2),3" (always set)."""
    if env.get("SLURM_NTASKS_PER_NODE"):
        return env["SLURM_NTASKS_PER_NODE"].split("(")[0]
    spec, node = env.get("SLURM_TASKS_PER_NODE"), env.get("SLURM_NODEID")
    if not spec or node is None:
        return None
    counts: list[str] = []
    for item in spec.split(","):
        n, _, rep = item.partition("(x")
        counts += [n] * (int(rep.rstrip(")")) if rep else 1)
    return counts[int(node)] if int(node) < len(counts) else None


def discover() -> JobEnv:
    """Normalise the launcher's variables into torch's; returns what was found."""
    env = os.environ
    if "LOCAL_SIZE" in env and "LOCAL_WORLD_SIZE" not in env:  # deepspeed launcher
        launcher = "deepspeed"
        _setdefault(LOCAL_WORLD_SIZE=env["LOCAL_SIZE"])
    elif "TORCHELASTIC_RUN_ID" in env or "LOCAL_WORLD_SIZE" in env:
        launcher = "torchrun"
    elif "SLURM_PROCID" in env and "RANK" not in env:
        launcher = "slurm"
        per_node = _slurm_tasks_on_this_node(env)
        _setdefault(
            RANK=env["SLURM_PROCID"],
            WORLD_SIZE=env["SLURM_NTASKS"],
            LOCAL_RANK=env.get("SLURM_LOCALID"),
            LOCAL_WORLD_SIZE=per_node,
            MASTER_PORT=29500,
        )
    elif "OMPI_COMM_WORLD_SIZE" in env or "PMI_SIZE" in env or "PMIX_RANK" in env:
        launcher = "mpirun"
        _from_mpi()
    elif "RANK" in env:
        launcher = "env"
    else:
        launcher = "single"
        _setdefault(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, LOCAL_WORLD_SIZE=1, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    _setdefault(LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=29500)
    return JobEnv(
        launcher,
        int(env["RANK"]),
        int(env["WORLD_SIZE"]),
        int(env["LOCAL_RANK"]),
        int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
    )


def init_distributed(backend: str | None = None, timeout_s: float = 600) -> JobEnv:
    """``discover()`` then ``init_process_group`` (gloo on CPU, nccl with CUDA) if not done."""
    job = discover()
    if not dist.is_initialized():
        from datetime import timedelta

        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(job.local_rank)
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout_s))
    return job


def compute_device(group=None) -> torch.device:
    """The device this process computes on, and so where every tensor it hands to a collective
    must live: sdpq.comm.device.comm_device of the process group (NCCL: the current CUDA device,
    which init_distributed set from LOCAL_RANK; gloo: the CPU); the CPU before any group exists."""
    from ..comm.device import comm_device

    return comm_device(group) if dist.is_initialized() else torch.device("cpu")


def free_port() -> int:
    """A TCP port that is free on this machine now, for a rendezvous on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
