#!/usr/bin/env bash
# Run on EVERY node (same arguments): torchrun with a c10d rendezvous on MASTER_ADDR.
#   NNODES=2 NPROC_PER_NODE=8 MASTER_ADDR=node0 launchers/torchrun_multinode.sh --backend fsdp2 ...
# Optional: NODE_RANK (marks node 0 as the rendezvous host when hostnames are ambiguous),
# NODE_ADDR (this node's address, given to the workers as MASTER_ADDR), JOB_ID, RDZV_PORT.
set -euo pipefail
source "$(dirname "$0")/_common.sh"
: "${NNODES:?set NNODES}" "${MASTER_ADDR:?set MASTER_ADDR (node 0)}"
NPROC_PER_NODE="${NPROC_PER_NODE:-$(nproc)}"
set_threads "$NPROC_PER_NODE"
extra=()
if [ -n "${NODE_RANK:-}" ]; then extra+=(--rdzv-conf="is_host=$([ "$NODE_RANK" = 0 ] && echo true || echo false)"); fi
if [ -n "${NODE_ADDR:-}" ]; then extra+=(--local-addr="$NODE_ADDR"); fi
run "$SDPQ_PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$NPROC_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:${RDZV_PORT:-29400}" --rdzv-id="${JOB_ID:-sdpq}" \
    "${extra[@]}" -m sdpq.train "$@"
