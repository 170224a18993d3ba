#!/usr/bin/env bash
# Every check that needs a CUDA device, most important first, each under its own time limit,
# so that a short loan of a GPU still gives the first ones: the CUDA tests, the planner on this
# host, the benchmark against the oracle (--quick), SELECTIVE and CHECKPOINT beside NONE at
# batch 1 and 4, and what the controller adds. Logs and JSONs go to OUT.
#
#     stress/gpu_checks.sh [OUT]          # OUT defaults to runs/gpu-<date>
#     PYTHON=python3 BUDGET=540 stress/gpu_checks.sh /tmp/out
#
# BUDGET (seconds, default 900) bounds the whole; a check that would start with less than a
# minute left is skipped and says so. Render the JSONs with `--render` of the script that
# wrote them (docs/results.md keeps the runs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu-$(date +%Y-%m-%d)}
PYTHON=${PYTHON:-python}
BUDGET=${BUDGET:-900}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
start=$(date +%s)

check() {  # check NAME LIMIT COMMAND...: run it with at most LIMIT seconds, fewer if less is left
    local name=$1 limit=$2 left
    shift 2
    left=$((BUDGET - ($(date +%s) - start)))
    if ((left < 60)); then
        echo "== $name: skipped ($left s left of $BUDGET)" | tee -a "$OUT/summary.txt"
        return
    fi
    ((limit > left)) && limit=$left
    echo "== $name (at most $limit s)"
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    tail -n 30 "$OUT/$name.log"
    echo "== $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$OUT/summary.txt"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
"$PYTHON" -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/summary.txt"
check tests 240 "$PYTHON" -m pytest -q -m cuda -p no:cacheprovider tests
check planner 60 "$PYTHON" stress/bench_planner.py
check bench 240 "$PYTHON" -m stress.bench --device cuda --quick --reps 14 --json "$OUT/bench_quick.json"
check modes_b1 150 "$PYTHON" -m stress.bench_modes --device cuda --batch 1 --modes NONE,SELECTIVE,CHECKPOINT \
    --no-peer --repeat 8 --json "$OUT/modes_b1.json"
check modes_b4 150 "$PYTHON" -m stress.bench_modes --device cuda --batch 4 --modes NONE,SELECTIVE,CHECKPOINT \
    --no-peer --repeat 6 --json "$OUT/modes_b4.json"
check controller 120 "$PYTHON" -m stress.controller_gpu
cat "$OUT/summary.txt"
