#!/usr/bin/env bash
# Runs the GPU tests and the benchmarks recorded in docs/benchmarks.md on one GPU machine.
#   bash scripts/bench/gpu_suite.sh OUT_DIR [parts...]
#   parts: tests attention kpool moe proxy train (default all), smla (Triton sparse-MLA check,
#   timing, block-size sweep; on request); attention = both shapes, every
#   model.dsa_kernels backend; proxy = profile_step.py on glm5_proxy for bf16, fp8 and
#   serving_match, eager and with CUDA graphs;
#   proxy_ab (on request) = bf16 and serving_match with and without profile_step's --without choices;
#   fp8 (on request) = one FP8 linear against bf16 at glm5_proxy's and GLM-5's shapes, the FP8
#   grouped GEMM's tile sweep, and F.scaled_mm's blockwise combinations (an FP8 backward's GEMMs);
#   loss (on request) = the language-model loss: megatron's unfused and native fused, and ours;
#   fp8_cache (on request) = graphed glm5_proxy steps at global batch 2 and 8: bf16,
#   serving_match, and fp8 with each train.fp8_weight_cache choice;
#   train_graphed (on request) = 20 graphed serving_match train.py steps with a drift step every 5
#   glm53 (on request) = the mHC kernels (mixing matrix, stream mixing, block) and the torch ops (mhc.py), the KDA
#   delta rule and layer at 4K/16K/64K (kda.py; fla autotunes on first use), a glm5_3_proxy step
#   (profiled by module and by operator input shape)
#   glm53_graphs (on request) = the glm5_3_proxy step at global batch 2, eager and with
#   train.cuda_graph_impl=full_iteration
#   long_attention (on request) = the sparse MLA at long context, both Triton layouts beside
#   TileLang (GLM-5 16K/32K/64K, glm5_kpool 16K/32K, glm5_proxy 32K/64K), with each backend's top
#   12 kernels of one profiled forward + backward (attention.py --kernels)
# Each part has its own time limit and log under OUT_DIR; a failing part does not stop the others.
# Autotuning: Triton keeps each autotuned kernel's timings in its cache (`*.autotune.json`; fla's KDA
# kernels autotune on first use, minutes on a fresh machine). The suite copies those of an earlier
# run from KPOOL_AUTOTUNE_IN (default .triton-autotune/ in the checkout, git-ignored) into the cache
# first, and saves this run's as one archive, OUT_DIR/triton-autotune.tgz (unpack it with
# `mkdir -p .triton-autotune && tar xzf OUT_DIR/triton-autotune.tgz -C .triton-autotune`); the next
# run on the same software and GPU then compiles only the configurations chosen (the cache keys
# hash triton, the GPU target, the kernel source and the environment, so anything else autotunes
# again).
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT_DIR [parts...]}
shift
parts=${*:-tests attention kpool moe proxy train}
mkdir -p "$out"
out=$(cd "$out" && pwd)  # absolute: the archive is written from inside the cache
triton_cache=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
autotune_in=${KPOOL_AUTOTUNE_IN:-.triton-autotune}
if [ -d "$autotune_in" ]; then
  mkdir -p "$triton_cache" && cp -r "$autotune_in"/. "$triton_cache"/
  echo "autotuning results from $autotune_in: $(find "$autotune_in" -name '*.autotune.json' | wc -l) kernels"
fi
save_autotune() {
  [ -d "$triton_cache" ] || return 0
  (cd "$triton_cache" && find . -name '*.autotune.json' | tar czf "$out/triton-autotune.tgz" -T -)
}
trap save_autotune EXIT
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
    tests) run gpu_tests 300 "$py" -m pytest -q -m gpu tests/ -p no:cacheprovider ;;
    attention) run bench_attention 300 "$py" scripts/bench/attention.py --repeats 3 --out "$out/attention_h200.json"
               run bench_attention_kpool 240 "$py" scripts/bench/attention.py --shape glm5_kpool \
                 --backends torch tilelang triton --repeats 3 --out "$out/kpool_h200.json" ;;
    kpool) run bench_kpool 300 "$py" scripts/bench/kpool.py --kernels torch triton --seq 16384 --out "$out/kpool.json" ;;
    moe) run bench_moe 240 "$py" scripts/bench/moe_experts.py --out "$out/moe.json" ;;
    proxy) for p in bf16 fp8 serving_match; do  # eager, then replayed as one CUDA graph
             for g in none full_iteration; do
               run "proxy_${p}_$g" 150 "$py" scripts/bench/profile_step.py experiment=glm5_proxy_h200 \
                 precision=$p train.global_batch_size=2 train.cuda_graph_impl=$g --steps 5 \
                 --out "$out/proxy_${p}_$g.json"
             done
           done ;;
    proxy_ab) for p in bf16 serving_match; do  # the launch-saving choices on and off, side by side
                for w in "" "--without multi_tensor wgrad_fusion fused_router serving_quant_kernel local_dispatch"; do
                  run "proxy_ab_${p}${w:+_without}" 150 "$py" scripts/bench/profile_step.py \
                    experiment=glm5_proxy_h200 precision=$p train.global_batch_size=2 --steps 3 \
                    --ops-by-module $w --out "$out/proxy_ab_${p}${w:+_without}.json"
                done
              done ;;
    fp8) run bench_fp8_linear_proxy 120 "$py" scripts/bench/fp8_linear.py experiment=glm5_proxy_h200 \
           --out "$out/fp8_linear_proxy.json"
         run bench_fp8_linear_glm5 120 "$py" scripts/bench/fp8_linear.py model=glm5 data.seq_length=4096 \
           train.micro_batch_size=1 --out "$out/fp8_linear_glm5.json"
         run bench_fp8_grouped_sweep 240 "$py" scripts/bench/fp8_grouped_sweep.py experiment=glm5_proxy_h200 \
           --out "$out/fp8_grouped_sweep.json"
         run bench_fp8_scaled_mm_recipes 90 "$py" scripts/bench/fp8_scaled_mm_recipes.py ;;
    loss) run bench_loss 90 "$py" scripts/bench/cross_entropy.py --out "$out/cross_entropy.json" ;;
    fp8_cache) for b in 2 8; do  # side by side; batch 8 is the experiment's own (8 micro-batches)
                 for p in bf16 serving_match fp8:none fp8:fp8 fp8:dequantized; do
                   prof=${p%%:*} cache=${p#*:}; [ "$cache" = "$p" ] && cache=dequantized
                   run "cache_b${b}_${prof}_${cache}" 150 "$py" scripts/bench/profile_step.py \
                     experiment=glm5_proxy_h200 precision=$prof train.global_batch_size=$b \
                     train.cuda_graph_impl=full_iteration train.fp8_weight_cache=$cache --steps 5 \
                     --out "$out/cache_b${b}_${prof}_${cache}.json"
                 done
               done ;;
    train) KPOOL_RUN_ROOT=/tmp/kpool-runs KPOOL_RUN_ID=proxy run train_proxy 420 \
             "$py" train.py experiment=glm5_proxy_h200 logging.mode=offline train.save_final=false
           cp /tmp/kpool-runs/proxy/metrics.jsonl "$out/proxy_metrics.jsonl" ;;
    train_graphed) KPOOL_RUN_ROOT=/tmp/kpool-runs KPOOL_RUN_ID=graphed_drift run train_graphed 300 \
                     "$py" train.py experiment=glm5_proxy_h200 precision=serving_match \
                     train.cuda_graph_impl=full_iteration train.steps=20 precision.drift.interval=5 \
                     logging.mode=offline train.save_final=false
                   cp /tmp/kpool-runs/graphed_drift/metrics.jsonl "$out/graphed_drift_metrics.jsonl" ;;
    glm53) run bench_mhc 180 "$py" scripts/bench/mhc.py --out "$out/mhc.json"
           run bench_kda 420 "$py" scripts/bench/kda.py --seq 4096 16384 65536 --out "$out/kda.json"
           run glm53_proxy 420 "$py" scripts/bench/profile_step.py experiment=glm5_3_proxy_h200 --steps 3 --ops-by-module \
             --by-shape --out "$out/glm53_proxy.json" ;;
    glm53_graphs) for g in none full_iteration; do  # the glm5_3_proxy step eager, then replayed as one CUDA graph
                    run "glm53_proxy_$g" 280 "$py" scripts/bench/profile_step.py experiment=glm5_3_proxy_h200 train.global_batch_size=2 \
                      train.cuda_graph_impl=$g --steps 3 --out "$out/glm53_proxy_$g.json"
                  done ;;
    long_attention) for sh in "glm5 16384 32768 65536" "glm5_kpool 16384 32768" "glm5_proxy 32768 65536"; do
                      set -- $sh
                      run "long_attention_$1" 540 "$py" scripts/bench/attention.py --shape "$1" \
                        --seq "${@:2}" --backends tilelang triton_gather triton_dense --repeats 3 \
                        --kernels 12 --out "$out/long_attention_$1.json"
                    done ;;
    smla) run bench_sparse_mla 540 "$py" scripts/bench/sparse_mla_triton_check.py \
            --out "$out/sparse_mla_triton.json" ;;
    *) echo "unknown part $part" >&2 ;;
  esac
done
