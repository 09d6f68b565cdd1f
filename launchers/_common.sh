# Shared by the launcher scripts (sourced): python, thread count, print-then-exec.
# SDPQ_PYTHON: interpreter (default: the repo's .venv if present, else python3).
# OMP_NUM_THREADS: default = cores / ranks on this node (at least 1); oversubscribed OpenMP
#   makes CPU ranks ~8x slower, and the deepspeed launcher does not set it at all.
# SDPQ_DRY_RUN=1: print the command and exit (the tests check each script's command line).
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
if [ -z "${SDPQ_PYTHON:-}" ]; then
    if [ -x "$repo/.venv/bin/python" ]; then SDPQ_PYTHON="$repo/.venv/bin/python"; else SDPQ_PYTHON=python3; fi
fi
PYBIN="$(dirname "$SDPQ_PYTHON")"

set_threads() {  # $1 = ranks on this node
    local cores
    cores="$(nproc 2>/dev/null || echo 1)"
    export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( cores / $1 > 0 ? cores / $1 : 1 ))}"
}

run() {
    echo "[sdpq launcher] OMP_NUM_THREADS=$OMP_NUM_THREADS $*" >&2
    if [ "${SDPQ_DRY_RUN:-0}" = 1 ]; then exit 0; fi
    exec "$@"
}
