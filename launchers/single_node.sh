#!/usr/bin/env bash
# One machine, NPROC ranks, nodes simulated by grouping RANKS_PER_NODE ranks (rank r on node r / L).
#   NPROC=4 RANKS_PER_NODE=2 launchers/single_node.sh --backend fsdp2 --config ds_configs/zero3_sdpq.json
set -euo pipefail
source "$(dirname "$0")/_common.sh"
NPROC="${NPROC:-4}"
RANKS_PER_NODE="${RANKS_PER_NODE:-2}"
set_threads "$NPROC"
run "$SDPQ_PYTHON" -m torch.distributed.run --standalone --nproc-per-node="$NPROC" \
    -m sdpq.train --ranks-per-node "$RANKS_PER_NODE" "$@"
