#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests and/or benchmarks; results under $OUT.
#   bash strata_jax/benchmarks/gpu_run.sh [tests|bench|quant|qmm|timeline|chunked|hybrid|profile|mla|score|hashes|all][,...]
# Stages run in the order given after one build (a comma list: "tests,chunked"); TESTS: the test
# files (default tests/), TEST_K: a pytest -k expression over them, TEST_DONE: ids to leave
# out, TEST_WORKERS: pytest-xdist workers sharing the GPU (below); SKIP_BUILD=1
# reuses the build of an earlier invocation in the same call (another NAME, CHUNKED_ARGS,
# SCORE_ARGS). PACK_LOGS=0: the logs stay files (below).
# Run from the repository root (the device tool's working directory).
set -uo pipefail
STAGE=${1:-all}
OUT=${OUT:-out}
mkdir -p "$OUT"
# The device tool brings back at most 8 files from $OUT: on exit the text logs (machine.txt,
# build.log, each stage's .log) go into one $OUT/logs.tar, which a later invocation with the
# same OUT appends to (`tar -xf logs.tar` leaves the latest of each name); PACK_LOGS=0 keeps
# them as files.
pack_logs() {
  [ "${PACK_LOGS:-1}" = 1 ] || return 0
  local files
  files=$(cd "$OUT" && ls -- *.log machine.txt 2>/dev/null)
  [ -z "$files" ] || (cd "$OUT" && tar -rf logs.tar $files && rm -f $files)
}
trap pack_logs EXIT
export PYTHONUNBUFFERED=1
PY=${PY:-python3}
nvidia-smi --query-gpu=name,driver_version,pcie.link.gen.current,pcie.link.width.current,memory.total \
  --format=csv > "$OUT/machine.txt" 2>&1
$PY -c "import jax; print('jax', jax.__version__, jax.devices())" >> "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
# POOL_GIB: cap XLA's pool at that many GiB whatever the card (a smaller card's footprint on a
# larger one): XLA_CLIENT_MEM_FRACTION from the GPU's total memory.
if [ -n "${POOL_GIB:-}" ]; then
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  XLA_CLIENT_MEM_FRACTION=$(awk -v g="$POOL_GIB" -v t="$total" 'BEGIN {printf "%.4f", g * 1024 / t}')
  export XLA_CLIENT_MEM_FRACTION
  echo "XLA's pool: $POOL_GIB GiB of $total MiB (XLA_CLIENT_MEM_FRACTION=$XLA_CLIENT_MEM_FRACTION)" \
    | tee -a "$OUT/machine.txt"
fi
t0=$(date +%s)
if [ -z "${SKIP_BUILD:-}" ]; then  # SKIP_BUILD=1: a second invocation in the same call
$PY -m pip install --no-build-isolation --no-deps -e . -Ccmake.define.STRATA_CUDA=ON > "$OUT/build.log" 2>&1 \
  || { tail -60 "$OUT/build.log"; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
fi
rc=0
for STAGE in ${STAGE//,/ }; do
if [ "$STAGE" = tests ] || [ "$STAGE" = all ]; then
  # TEST_DONE: a file of test ids an earlier call finished (its $OUT/gpu_tests_done.txt, copied
  # into the repository), left out here: a suite longer than one call's limit goes on in the
  # next. $OUT/gpu_tests_done.txt: those ids and the ones this run passed or skipped.
  # TEST_WORKERS=N (default 4; 1: one process): N pytest-xdist workers share the GPU (most of
  # the suite's time is compiling, on the CPU; the whole suite takes 8 to 10 minutes, so a
  # second call with TEST_DONE may finish what TEST_TIMEOUT, default 560 s, cut), each JAX client
  # preallocating TEST_MEM_FRACTION of the GPU's memory (default 0.72 / N: the rest stays free
  # for the engines' rings and cuDNN).
  desel=() par=() envs=(STRATA_REQUIRE_GPU=1)
  if [ -n "${TEST_DONE:-}" ]; then
    while read -r t; do [ -z "$t" ] || desel+=(--deselect "$t"); done < "$TEST_DONE"
  fi
  if [ "${TEST_WORKERS:-4}" -gt 1 ]; then
    par=(-n "${TEST_WORKERS:-4}" --dist worksteal)
    envs+=(XLA_PYTHON_CLIENT_MEM_FRACTION=${TEST_MEM_FRACTION:-$(awk "BEGIN {print 0.72 / ${TEST_WORKERS:-4}}")})
  fi
  env "${envs[@]}" timeout ${TEST_TIMEOUT:-560} $PY -m pytest -m gpu -v -rs --durations=0 --timeout=150 \
    ${par[@]+"${par[@]}"} ${TEST_K:+-k "$TEST_K"} ${desel[@]+"${desel[@]}"} ${TESTS:-tests} 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
  # A finished test's line: "ID PASSED" (one process) or "[gwN] [ P%] PASSED ID" (xdist).
  { [ -z "${TEST_DONE:-}" ] || cat "$TEST_DONE"
    grep -oE '^[^ ]+::[^ ]+ (PASSED|XPASS|SKIPPED|XFAIL)' "$OUT/gpu_tests.log" | cut -d' ' -f1
    grep -oE '(PASSED|XPASS|SKIPPED|XFAIL) [^ ]+::[^ ]+' "$OUT/gpu_tests.log" | cut -d' ' -f2
  } | sort -u > "$OUT/gpu_tests_done.txt"
  echo "tests done (this run and TEST_DONE): $(wc -l < "$OUT/gpu_tests_done.txt")"
fi
if [ "$STAGE" = bench ] || [ "$STAGE" = all ]; then
  [ -n "${SKIP_GMM:-}" ] || timeout 240 $PY -m strata_jax.benchmarks.grouped_matmul_bench --json "$OUT/grouped_matmul.json" 2>&1 \
    | tee "$OUT/grouped_matmul.log" | tail -20
  timeout ${BENCH_TIMEOUT:-420} $PY -m strata_jax.benchmarks.stream_bench --preset ${PRESET:-qwen3-30b-a3b} \
    --layers ${LAYERS:-8} --lengths ${LENGTHS:-950,1024,2048,4096,6144} --parts ${PARTS:-sweep} \
    --skew ${SKEW:-0} ${BENCH_ARGS:-} --json "$OUT/stream_${NAME:-sweep}.json" 2>&1 \
    | tee "$OUT/stream_${NAME:-sweep}.log" | tail -40
fi
if [ "$STAGE" = quant ]; then  # issue 21: one stream_bench sweep per expert format, compared
  files=""
  FMTS=${FORMATS:-bf16,fp8,int4}
  for F in ${FMTS//,/ }; do
    # ACCURACY=1: a quantized format also reports its accuracy against the plain model (two
    # more resident engines and their compiles: give BENCH_TIMEOUT room for them)
    Q=""; P=sweep; [ "$F" = bf16 ] || { Q="--quantize $F"; [ "${ACCURACY:-0}" = 1 ] && P=sweep,accuracy; }
    rm -f "$OUT/stream_quant_$F.json"  # what is there afterwards is this run's
    timeout ${BENCH_TIMEOUT:-300} $PY -m strata_jax.benchmarks.stream_bench --preset ${PRESET:-qwen3-30b-a3b} \
      --layers ${LAYERS:-8} --lengths ${LENGTHS:-1024,2048,4096,8192} --parts $P --skew ${SKEW:-0} \
      --arms ${QUANT_ARMS:-resident,stream-all,routed} --blocks ${BLOCKS:-1} $Q ${BENCH_ARGS:-} \
      --json "$OUT/stream_quant_$F.json" 2>&1 | tee "$OUT/stream_quant_$F.log" \
      | grep -v -e '^{"part"' -e '^    @ ' | tail -30  # rows' JSON: in the log and the JSON
    st=${PIPESTATUS[0]}
    [ "$st" = 0 ] || { rc=1; echo "stream_bench $F: exit $st (124: stopped by BENCH_TIMEOUT)"; }
    # a run stopped by BENCH_TIMEOUT has saved every length it finished
    if [ -f "$OUT/stream_quant_$F.json" ]; then files="$files $OUT/stream_quant_$F.json"
    else echo "stream_bench $F: no JSON (stopped before its first length)"; fi
  done
  [ -z "$files" ] || $PY -m strata_jax.benchmarks.quant_summary $files --json "$OUT/quant_summary.json" || rc=1
fi
if [ "$STAGE" = qmm ]; then  # the quantized grouped matmuls (Mosaic kernels) against bf16
  timeout ${BENCH_TIMEOUT:-300} $PY -m strata_jax.benchmarks.quant_matmul_bench ${QMM_ARGS:-} \
    --json "$OUT/quant_matmul.json" 2>&1 | tee "$OUT/quant_matmul.log" | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$STAGE" = timeline ]; then
  timeout ${BENCH_TIMEOUT:-420} $PY -m strata_jax.benchmarks.timeline \
    --tokens ${TOKENS:-1024} ${TL_ARGS:-} --out "$OUT/timeline_${NAME:-run}" 2>&1 \
    | tee "$OUT/timeline_${NAME:-run}.log" | tail -20
fi
if [ "$STAGE" = chunked ]; then
  timeout ${BENCH_TIMEOUT:-420} $PY -m strata_jax.benchmarks.chunked_bench ${CHUNKED_ARGS:-} \
    --json "$OUT/chunked_${NAME:-run}.json" 2>&1 | tee "$OUT/chunked_${NAME:-run}.log" | tail -40
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$STAGE" = hybrid ]; then  # a hybrid model's DeltaNet layer against its attention layer
  timeout ${BENCH_TIMEOUT:-420} $PY -m strata_jax.benchmarks.hybrid_bench ${HYBRID_ARGS:-} \
    --json "$OUT/hybrid_${NAME:-run}.json" 2>&1 | tee "$OUT/hybrid_${NAME:-run}.log" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$STAGE" = profile ]; then  # a hybrid's layers kernel by kernel (kernel_profile)
  timeout ${BENCH_TIMEOUT:-300} $PY -m strata_jax.benchmarks.kernel_profile ${PROFILE_ARGS:-} \
    --json "$OUT/profile_${NAME:-run}.json" 2>&1 | tee "$OUT/profile_${NAME:-run}.log" | tail -80
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$STAGE" = mla ]; then  # a later chunk's latent attention over its prefix against a first chunk
  timeout ${BENCH_TIMEOUT:-420} $PY -m strata_jax.benchmarks.mla_bench ${MLA_ARGS:-} \
    --json "$OUT/mla_${NAME:-run}.json" 2>&1 | tee "$OUT/mla_${NAME:-run}.log" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$STAGE" = score ]; then  # Engine.score against prefill of the same prompt, per arm
  timeout ${BENCH_TIMEOUT:-420} $PY -m strata_jax.benchmarks.score_bench ${SCORE_ARGS:-} \
    --json "$OUT/score_${NAME:-run}.json" 2>&1 | tee "$OUT/score_${NAME:-run}.log" | tail -20
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$STAGE" = hashes ]; then  # every arm's output hashes (output_hashes), to compare with a
  # run of another commit: HASH_ARGS picks cases and dtype
  timeout ${BENCH_TIMEOUT:-420} $PY -m strata_jax.benchmarks.output_hashes --backend cuda \
    ${HASH_ARGS:---dtype bfloat16} --json "$OUT/hashes_${NAME:-run}.json" 2>&1 \
    | tee "$OUT/hashes_${NAME:-run}.log" | tail -5
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
done
exit $rc
