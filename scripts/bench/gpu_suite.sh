#!/usr/bin/env bash
# Runs the GPU tests and the benchmarks recorded in docs/benchmarks.md on one GPU machine.
#   bash scripts/bench/gpu_suite.sh OUT_DIR [parts...]   parts: tests attention kpool train (default)
#   and smla (Triton sparse-MLA check/timing/sweep, on request)
# Each part has its own time limit and log under OUT_DIR; a failing part does not stop the others.
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [parts...]}
shift
parts=${*:-tests attention kpool train}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 WANDB_SILENT=true
py=${KPOOL_PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
"$py" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' | tee -a "$out/gpu.txt"
run() {  # name, limit_s, command...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0))s"
  tail -n 25 "$out/$name.log"
}
for part in $parts; do
  case $part in
    tests) run gpu_tests 240 "$py" -m pytest -q -m gpu tests/ -p no:cacheprovider ;;
    attention) run bench_attention 300 "$py" scripts/bench/attention.py --out "$out/attention.json" ;;
    kpool) run bench_kpool 300 "$py" scripts/bench/kpool.py --out "$out/kpool.json" ;;
    smla) run bench_sparse_mla 540 "$py" scripts/bench/sparse_mla_triton_check.py \
            --out "$out/sparse_mla_triton.json" ;;
    train) KPOOL_RUN_ROOT=/tmp/kpool-runs KPOOL_RUN_ID=proxy run train_proxy 420 \
             "$py" train.py experiment=glm5_proxy_h200 logging.mode=offline train.save_final=false
           cp /tmp/kpool-runs/proxy/metrics.jsonl "$out/proxy_metrics.jsonl" ;;
    *) echo "unknown part $part" >&2 ;;
  esac
done
