#!/usr/bin/env bash
# K emulated nodes on this machine (network namespaces, tc-shaped inter-node link; needs root).
#   NODES=2 RANKS_PER_NODE=2 BANDWIDTH=200mbit [LATENCY=1ms] launchers/emulated_cluster.sh --backend fsdp2 ...
# (LATENCY needs the kernel's sch_netem; our CI machines lack it and the launcher then says so.)
# Runs one torchrun per node with a c10d rendezvous, like a real cluster; always tears down.
set -euo pipefail
source "$(dirname "$0")/_common.sh"
NODES="${NODES:-2}"
RANKS_PER_NODE="${RANKS_PER_NODE:-2}"
set_threads "$(( NODES * RANKS_PER_NODE ))"
run "$SDPQ_PYTHON" -m sdpq.launch.emulated --nodes "$NODES" --ranks-per-node "$RANKS_PER_NODE" \
    --bandwidth "${BANDWIDTH:-1gbit}" ${LATENCY:+--latency "$LATENCY"} ${MEASURE:+--measure} -- -m sdpq.train "$@"
