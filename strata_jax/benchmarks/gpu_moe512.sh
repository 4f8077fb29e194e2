#!/usr/bin/env bash
# Issue 46 (fast expert math at 512 experts) in one call on the GPU machine: build, then
#   bash strata_jax/benchmarks/gpu_moe512.sh [sweep|confirm|tests|bench][,...]
# sweep:   grouped_matmul_bench's tiling sweep (every format at 512 experts of width 512,
#          top-10, and at Qwen3-30B-A3B's 128 of width 768, top-8; 1K/4K/16K tokens;
#          SWEEP_ARGS) as JSON lines in $OUT/sweep.jsonl;
# bench:   grouped_matmul_bench at the 512-expert shape with the kernel the library picks
#          ($OUT/grouped_matmul_512.json; the figure: grouped over dense);
# confirm: the sweep of what the library picks at 512 experts, and at 128 experts it against
#          this package's bf16 kernel and the small-row tilings ($OUT/confirm.jsonl);
# tests:   the kernels' GPU tests (grouped, quantized, Mosaic), $OUT/gpu_tests.log.
# ncu:     Nsight Compute's counters of this package's kernels (what the library picks, bf16, at
#          NCU_TOKENS, default 8192 and 32768): speed of light, memory, compute (the tensor
#          pipe's share) and warp states in $OUT/ncu_gmm.txt, DRAM / L2 bytes and throughputs
#          in $OUT/ncu_metrics.txt (a Firecracker machine only: KINDS.md).
# Every sweep stops starting rows DEADLINE seconds (default 390) after the start.
# Run from the repository root (the device tool's working directory).
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
t0=$(date +%s)
left() { echo $(( t0 + ${DEADLINE:-390} - $(date +%s) - ${1:-0} )); }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | tee "$OUT/machine.txt"
# the build gpu_run.sh makes (the native library with CUDA), unless SKIP_BUILD=1
[ -n "${SKIP_BUILD:-}" ] || PACK_LOGS=0 bash strata_jax/benchmarks/gpu_run.sh none > /dev/null \
  || { tail -40 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
SW="$PY -m strata_jax.benchmarks.grouped_matmul_bench sweep --warmup 1 --repeats 3 --batch 5"
rc=0
for STAGE in ${1//,/ }; do
  if [ "$STAGE" = sweep ]; then
    $SW --budget-s $(left 60) ${SWEEP_ARGS:-} --out "$OUT/sweep.jsonl" 2>&1 | grep -v '^{' | tail -5
  fi
  if [ "$STAGE" = bench ]; then
    timeout 120 $PY -m strata_jax.benchmarks.grouped_matmul_bench --hidden 2048 \
      --intermediate 512 --experts 512 --top-k 10 --tokens 1024 4096 16384 --repeats 10 \
      --json "$OUT/grouped_matmul_512.json" 2>&1 | tail -6
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  fi
  if [ "$STAGE" = confirm ]; then
    $SW --set 512 --budget-s $(left 200) --out "$OUT/confirm.jsonl" --cand bf16=auto \
      --cand bf16=128,256,64,3,8,1,2/64,128,64,3,8,2 --cand fp8=auto --cand fp8=64,128,64,3,8,2 \
      --cand int4=auto 2>&1 | grep -v '^{' | tail -5
  fi
  if [ "$STAGE" = confirm128 ]; then
    $SW --set 128 --budget-s $(left 15) --out "$OUT/confirm.jsonl" --cand bf16=auto \
      --cand bf16=128,256,64,3,8,1,2 --cand bf16=64,128,64,3,8,2 --cand fp8=auto \
      --cand fp8=64,128,64,3,8,2 --cand int4=auto --cand int4=64,128,64,3,8,2 2>&1 \
      | grep -v '^{' | tail -5
  fi
  if [ "$STAGE" = tests ]; then
    STRATA_REQUIRE_GPU=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 timeout ${TEST_TIMEOUT:-170} \
      $PY -m pytest -q -m gpu -rs -p no:cacheprovider -n 4 --dist worksteal \
      tests/test_grouped_matmul.py tests/test_quant_mosaic.py tests/test_quant_matmul.py \
      2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  fi
  if [ "$STAGE" = ncu ]; then
    NCU_RUN="$PY -m strata_jax.benchmarks.grouped_matmul_bench sweep --set 512 --formats bf16
      --cand bf16=auto --tokens ${NCU_TOKENS:-8192 32768} --warmup 0 --repeats 1 --batch 1"
    # each size: the reference's three products (jax's kernel, also named "body", 128 threads
    # a block), then the correctness call's and the timed call's (384 threads a block)
    export XLA_PYTHON_CLIENT_PREALLOCATE=false
    NCU="ncu --clock-control none -k regex:^body_mosaic --launch-count 18"
    timeout 200 $NCU --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section ComputeWorkloadAnalysis --section WarpStateStats --section LaunchStats \
      $NCU_RUN > "$OUT/ncu_gmm.txt" 2>&1; echo "ncu sections rc $?"
    timeout 120 $NCU --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,\
lts__t_bytes.sum,lts__t_sector_hit_rate.pct,\
dram__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed \
      $NCU_RUN > "$OUT/ncu_metrics.txt" 2>&1; echo "ncu metrics rc $?"
    unset XLA_PYTHON_CLIENT_PREALLOCATE
    grep -E "body_mosaic|Block Size|Duration|DRAM Throughput|L2 Cache Throughput|Compute \(SM\)|L2 Hit" \
      "$OUT/ncu_gmm.txt" | head -130
    grep -vE "^==PROF==|^\{|^jax" "$OUT/ncu_metrics.txt" | tail -120
  fi
  echo "$STAGE done at $(( $(date +%s) - t0 )) s"
done
exit $rc
