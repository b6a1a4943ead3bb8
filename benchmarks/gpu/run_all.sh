#!/usr/bin/env bash
# The GPU tier in one command, on one NVIDIA GPU: the cuda tests, the snapshot benchmark, kill -> first step.
#
#   [OUT=dir] [PYTHON=python] [PARAMS=5e8] [PYTEST_ARGS=--lf] benchmarks/gpu/run_all.sh
#
# PYTHON: an interpreter whose torch sees the GPU, with this repository's test dependencies installed
# (pip install torch==2.13.0 -e '.[test]'; the PyPI wheel is a CUDA build). OUT: where the logs and JSON go
# (default benchmarks/results/gpu). Each part runs under its own time limit, about 8 minutes in all, and
# says its exit status; PYTEST_ARGS=--lf reruns only the tests that failed last time. Exit 0 when every
# part passed, 1 when one failed, 2 when no GPU is visible.
set -uo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PATH="$(dirname "$(command -v "$PYTHON")"):$PATH"  # the torchrun of the same environment
export PATH

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "run_all.sh: torch under $PYTHON sees no CUDA GPU; run this on a machine with one" >&2
  exit 2
fi
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))" \
  | tee "$OUT/versions.txt"

failed=0
part() {  # part NAME LIMIT_S COMMAND...: run it under its limit, log to $OUT/NAME.log, show the tail
  local name=$1 limit=$2 started=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit} s): $*"
  timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  tail -n 30 "$OUT/$name.log"
  echo "== $name: exit $rc after $((SECONDS - started)) s$([ $rc -eq 124 ] && echo ' (cut off at its limit)'); log $OUT/$name.log"
  [ $rc -eq 0 ] || failed=1
}

# The tests marked cuda (pyproject.toml): torchrun jobs with both ranks on cuda:0 and gloo, four at a time.
part cuda-tests 270 "$PYTHON" -m pytest -m cuda -n 4 -q -rs --junitxml="$OUT/cuda-tests.xml" ${PYTEST_ARGS:-} tests
# Blocked time and the steps around a snapshot: elastictrain's async tiers against DCP async_save, one model.
part gpu-snapshot 130 "$PYTHON" benchmarks/gpu_snapshot.py --device cuda --params "${PARAMS:-5e8}" --batch 4096 \
  --steps 60 --every 20 --out "$OUT/gpu_snapshot.json"
# Kill -> first step with warm restarts, the default job and the ~200 MB state with the fast tier, on cuda:0.
part recovery-cuda 75 "$PYTHON" benchmarks/recovery.py --trials 1 --import-repeats 1 \
  --jobs "default job + warm start,~200 MB state + fast tier + warm start" \
  --override dist.device=cuda:0 --override dist.backend=gloo --out "$OUT/recovery_cuda.json"

echo "results in $OUT"
exit $failed
