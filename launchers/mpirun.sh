#!/usr/bin/env bash
# mpirun with mpi4py rank discovery (pip install 'sdpq[mpi]' gives mpi4py and an mpirun).
#   NP=4 launchers/mpirun.sh --backend fsdp2 ...            (one machine)
#   NP=8 MPI_HOSTFILE=hosts launchers/mpirun.sh ...         (hosts: "<host> slots=<n>")
# Ranks per node come from MPI's shared-memory split; MASTER_ADDR is broadcast from rank 0.
set -euo pipefail
source "$(dirname "$0")/_common.sh"
NP="${NP:-4}"
set_threads "${RANKS_PER_NODE:-$NP}"
extra=()
if [ -n "${MPI_HOSTFILE:-}" ]; then extra+=(--hostfile "$MPI_HOSTFILE"); fi
if [ "$(id -u)" = 0 ]; then extra+=(--allow-run-as-root); fi
# --map-by slot: consecutive ranks share a node (Open MPI 5 otherwise interleaves them, and
# local ranks no longer follow rank // ranks_per_node).
run "$PYBIN/mpirun" -np "$NP" --map-by slot --oversubscribe "${extra[@]}" -x OMP_NUM_THREADS -x PATH \
    "$SDPQ_PYTHON" -m sdpq.train "$@"
