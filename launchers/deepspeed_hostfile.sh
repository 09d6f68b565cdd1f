#!/usr/bin/env bash
# The deepspeed launcher with a hostfile (see hostfile.example: "<host> slots=<ranks>").
#   HOSTFILE=launchers/hostfile MASTER_ADDR=node0 launchers/deepspeed_hostfile.sh --config ds_configs/zero3_sdpq.json
# Default: run once on node 0; the launcher reaches the other hosts over ssh (pdsh).
# Without ssh: run on every node with NODE_RANK set (deepspeed --no_ssh --node_rank).
set -euo pipefail
source "$(dirname "$0")/_common.sh"
HOSTFILE="${HOSTFILE:-$here/hostfile.example}"
: "${MASTER_ADDR:?set MASTER_ADDR (node 0)}"
slots="$(awk '!/^#/ && NF { for (i = 2; i <= NF; i++) if ($i ~ /^slots=/) { sub("slots=", "", $i); print $i; exit } }' "$HOSTFILE")"
set_threads "${slots:-1}"
extra=()
if [ -n "${NODE_RANK:-}" ]; then extra+=(--no_ssh --node_rank="$NODE_RANK"); fi
run "$PYBIN/deepspeed" --hostfile="$HOSTFILE" --master_addr="$MASTER_ADDR" --master_port="${MASTER_PORT:-29500}" \
    "${extra[@]}" --module sdpq.train --backend deepspeed "$@"
