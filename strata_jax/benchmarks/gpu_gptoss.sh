#!/usr/bin/env bash
# gpt-oss (issue 48) on the GPU machine, through gpu_run.sh's stages, one build a call:
#   bash strata_jax/benchmarks/gpu_gptoss.sh [tests|qmm|link|e2e|e2e4k|resident][,...]
# tests:    the GPU tests of what gpt-oss adds (sinks on cuDNN, MXFP4 through the grouped matmul
#           and its fused kernel, the families' GPU tests) ($OUT/gpu_tests.log).
# qmm:      the MXFP4 grouped matmul, fused kernel against dequantize-first and bf16, at
#           gpt-oss-120b's expert shape (128 experts, 2880 x 2880, top-4), 1K/4K/8K tokens.
#           Run it first: QMM=fused makes the other stages read MXFP4 with the kernel.
# link:     gpt-oss-120b's first LAYERS (default 4) layers, bf16 against MXFP4 experts, 1K-8K
#           tokens, resident / stream-all / routed (targets: MXFP4 <= 0.30x the bf16 time
#           link-bound, stream-all >= 0.94 of the link, resident at 8K <= 1.05x bf16).
# e2e:      the whole gpt-oss-120b (36 layers, MXFP4 experts streamed, nothing resident),
#           32K tokens layer-major within a 16 GB card's footprint (XLA's pool capped at
#           POOL_GIB=12.93, 0.0925 of an H200, plus a 2.5 GiB ring), against RESIDENT_MS (the
#           resident stage's one-chunk time; give it from an earlier call).
# e2e4k:    the same at 4K tokens (one chunk).
# resident: the whole model all resident in one chunk on the whole card (61 GB of MXFP4
#           experts fit; XLA_CLIENT_MEM_FRACTION=WHOLE_FRACTION, default 0.92), 32K and 4K
#           (RESIDENT_LENGTHS): the times e2e divides by.
# Run from the repository root (the device tool's working directory).
set -uo pipefail
OUT=${OUT:-out}
RUN="bash strata_jax/benchmarks/gpu_run.sh"
# QMM: how the MXFP4 experts are read (auto dequantizes first; fused: the Hopper kernel).
MODEL="--preset gpt-oss-120b --layers 36 --quantize mxfp4 --parts prefill --quantized-matmul ${QMM:-auto}"
rc=0
build=""
for STAGE in ${1//,/ }; do
  case $STAGE in
    tests)
      TESTS="tests/test_sinks.py tests/test_mxfp4.py tests/test_mxfp4_mosaic.py tests/test_gpt_oss.py tests/test_quant_mosaic.py
        tests/test_quant_matmul.py tests/test_gpu_stream.py" $RUN tests || rc=1 ;;
    qmm)
      QMM_ARGS="--preset gpt-oss-120b --formats mxfp4 --tokens 1024,4096,8192" $RUN qmm \
        || rc=1 ;;
    link)
      PRESET=gpt-oss-120b LAYERS=${LAYERS:-4} FORMATS=bf16,mxfp4 LENGTHS=1024,2048,4096,8192 \
        QUANT_ARMS=resident,stream-all,routed BENCH_ARGS="--quantized-matmul ${QMM:-auto}" \
        $RUN quant || rc=1 ;;
    resident)
      for L in ${RESIDENT_LENGTHS:-32768 4096}; do
        XLA_CLIENT_MEM_FRACTION=${WHOLE_FRACTION:-0.92} NAME=gptoss_resident_$L CHUNKED_ARGS="$MODEL
          --arms resident --resident-orders one --long $L
          --reps-prefill 3" $RUN chunked || rc=1
        export SKIP_BUILD=1
      done ;;
    e2e)
      POOL_GIB=12.93 NAME=gptoss_l36_16g CHUNKED_ARGS="$MODEL --arms routed
        --no-resident ${RESIDENT_MS:+--resident-ms $RESIDENT_MS} --ring-gib 2.5
        --orders layer-major --reps-prefill 1" $RUN chunked || rc=1 ;;
    e2e4k)  # against the resident 4K run of this call where there is one (its bits checked)
      R4K="$OUT/chunked_gptoss_resident_4096.json"
      if [ -f "$R4K" ]; then R4K="--resident-json $R4K"
      else R4K=${RESIDENT_MS_4K:+--resident-ms $RESIDENT_MS_4K}; fi
      POOL_GIB=12.93 NAME=gptoss_l36_16g_4k CHUNKED_ARGS="$MODEL --arms routed
        --no-resident $R4K --ring-gib 2.5
        --orders one --long 4096 --chunk 4096 --reps-prefill 3" $RUN chunked || rc=1 ;;
    *) echo "unknown stage $STAGE"; rc=2 ;;
  esac
  export SKIP_BUILD=1  # one build a call
done
exit $rc
