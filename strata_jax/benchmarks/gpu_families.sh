#!/usr/bin/env bash
# The hybrid Qwen (issue 46) and latent-attention (issue 47) families on the GPU machine, through
# gpu_run.sh's stages, one build a call:
#   bash strata_jax/benchmarks/gpu_families.sh [tests|kernels|mixers|profile|mla|gmm512|chunks|routed512|next-resident|next-e2e|next-short|ds-link|ds-32k|glm-resident|glm-e2e][,...]
# tests:         the families' GPU tests (MLA on cuDNN, the hybrid and MLA arms byte-identical).
# kernels:       the grouped / quantized matmul GPU tests (gpu_moe512.sh tests).
# mixers:        Qwen3-Next's Gated DeltaNet layer (each Kernels.delta_rule) against its gated
#                attention layer at 32K tokens, and an 8K chunk over the rest (target: DeltaNet
#                <= 0.5x attention); the delta rule's variants, pieces and kernel launches.
# profile:       Qwen3-Next's DeltaNet and attention mixers at 32K and an 8K chunk over 24K, its
#                MoE block at 8K and 32K, kernel by kernel (kernel_profile): what chunks add.
# mla:           DeepSeek-V3's latent attention, an 8K chunk over a 24K prefix against a first
#                chunk of the same work (target >= 0.60).
# gmm512:        the expert math at 512 experts of width 512, top-10, the library's choice
#                in every format, against dense at 1K / 4K / 16K tokens (gpu_moe512.sh confirm).
# chunks:        Qwen3-Next's first 8 layers all resident, 32K tokens: one chunk against 8K
#                chunks (target <= 1.10); CHUNKS_FORMATS (default bf16; fp8, int4: the experts
#                quantized) and CHUNKS_SIZES (default 8192) give other formats and chunks;
#                CHUNKS_ORDERS (default one,chunked; layer-major: the chunk as sub-chunks).
# routed512:     Qwen3-Next's first 8 layers, bf16 experts, 1K / 4K: routed against its link
#                floor and stream-all (target routed <= 1.05 of its floor).
# next-resident: the whole Qwen3-Next-80B-A3B (48 layers, int4 experts) all resident, one chunk
#                and layer-major, at 32K and 4K (NEXT_LENGTHS) on the whole card: the time
#                next-e2e divides by (one chunk) and the bits it must equal (layer-major).
# next-e2e:      the same streamed within a 16 GB card's footprint (XLA's pool capped at
#                POOL_GIB=12.93, 0.0925 of an H200, plus a 2.5 GiB ring), 32K layer-major,
#                against this call's next-resident JSON (its bits checked) or RESIDENT_MS.
# next-short:    the same in the same footprint at 1K and 4K (NEXT_SHORT), one chunk: routed
#                against stream-all, over next-resident's 4K JSON where this call made it.
# ds-link:       a DeepSeek-V3 slice (its 3 dense layers + DS_MOE_LAYERS MoE layers, fp8
#                experts, 10.5 GiB a layer), 1K-8K: stream-all against the link, routed against
#                its floor. The resident arm holds every expert in XLA's pool (DS_LINK_FRACTION
#                of the card, 0.45: 35.8 GiB of an H100) and each streamed arm's ring two layer
#                frames (21.0 GiB) beside it, both arms' engines at once: DS_MOE_LAYERS=2 on an
#                H100 (default), up to 6 on an H200 with DS_LINK_FRACTION=0.6.
# ds-32k:        DeepSeek-V3 slices (3 dense + M MoE layers for each M of DS_32K_MOE_LAYERS="1 2",
#                fp8 experts), 32K tokens layer-major within next-e2e's 16 GB footprint (XLA's
#                pool 12.93 GiB, a ring of DS_RING_GIB=2.5): a layer frame of 256 fp8 experts is
#                10.5 GiB, so each layer streams in parts (16 parts of 16 experts, three part
#                frames); sub-chunks of DS_SUB_CHUNK=2048. The difference of the two slices is a
#                MoE layer's time: $OUT/dsv3_projection.json projects the 61 layers (3+2 plus 56
#                such layers; a time, as 61 layers' 31.9 GiB of dense weights outgrow 16 GB);
#                3 + 4 layers outgrow the pool.
# glm-resident:  the whole GLM-4.5-Air (46 layers, int4 experts) all resident, one chunk and
#                layer-major (GLM_RESIDENT_ORDERS), 32K (51.4 GB of experts; on an H100 one
#                chunk's 32K activations do not fit: GLM_RESIDENT_ORDERS=layer-major, which
#                glm-e2e then divides by).
# glm-e2e:       the same streamed within a 16 GB footprint (pool POOL 12.93 GiB + 2.5 GiB ring),
#                32K layer-major, against this call's glm-resident JSON (its bits checked) or
#                RESIDENT_MS. GLM-4.5-Air's dense weights (13.4 GiB) and 32K KV cache (5.8 GiB)
#                alone outgrow 16 GB: the streamed engine keeps its dense weights in pinned host
#                memory (GLM_DENSE=host, Engine(dense="host"); "device" needs GLM_POOL_GIB=26).
#                GLM_E2E_NAME names the output. The engine picks its chunk (--engine-chunk):
#                with the whole prompt as its chunk, its cache's padding slack doubles the KV.
# next-e2e and glm-e2e take RESIDENT_JSON (a resident JSON an earlier call brought back, put in
# the repository) in place of this call's.
# Run from the repository root (the device tool's working directory).
set -uo pipefail
OUT=${OUT:-out}
RUN="bash strata_jax/benchmarks/gpu_run.sh"
PY=${PY:-python3}
NEXT="--preset qwen3-next-80b-a3b --layers 48 --quantize int4 --parts prefill"
GLM="--preset glm-4.5-air --layers 46 --quantize int4 --parts prefill"
# All-resident runs take the whole card (XLA's default 75% leaves an H100 short of a whole
# int4 model); the 16 GB runs cap XLA's pool with POOL_GIB (gpu_run.sh).
WHOLE=${WHOLE_FRACTION:-0.92}
rc=0
for STAGE in ${1//,/ }; do
  case $STAGE in
    tests)
      TESTS="tests/test_gpu_mla.py tests/test_gpu_hybrid.py" TEST_TIMEOUT=${TEST_TIMEOUT:-200} \
        $RUN tests || rc=1 ;;
    kernels)  # gpu_moe512.sh's test stage
      bash strata_jax/benchmarks/gpu_moe512.sh tests || rc=1 ;;
    mixers)
      BENCH_TIMEOUT=${MIXERS_TIMEOUT:-420} NAME=next_32k \
        HYBRID_ARGS="--tokens 32768 --chunk 8192 --reps 5" $RUN hybrid || rc=1 ;;
    profile)
      BENCH_TIMEOUT=${PROFILE_TIMEOUT:-150} NAME=next_32k \
        PROFILE_ARGS=${PROFILE_ARGS:-"--tokens 32768 --chunk 8192 --moe-tokens 8192 32768"} \
        $RUN profile || rc=1 ;;
    mla)
      BENCH_TIMEOUT=200 NAME=dsv3_32k MLA_ARGS="--tokens 32768 --chunk 8192 --reps 5" \
        $RUN mla || rc=1 ;;
    gmm512)  # the library's choice at 512 experts, every format (gpu_moe512.sh confirm)
      DEADLINE=${GMM_DEADLINE:-380} bash strata_jax/benchmarks/gpu_moe512.sh confirm || rc=1 ;;
    chunks)  # each format of CHUNKS_FORMATS (bf16|fp8|int4) at each of CHUNKS_SIZES
      for Q in ${CHUNKS_FORMATS:-bf16}; do
        for C in ${CHUNKS_SIZES:-8192}; do
          S="" QA=""
          [ "$Q" = bf16 ] || { S="_$Q"; QA="--quantize $Q"; }
          [ "$C" = 8192 ] || S="${S}_c$C"
          BENCH_TIMEOUT=240 NAME=next_l8$S CHUNKED_ARGS="--preset qwen3-next-80b-a3b --layers 8
            --parts prefill --arms resident --resident-orders ${CHUNKS_ORDERS:-one,chunked}
            --long 32768 --chunk $C --reps-prefill 3 $QA" \
            $RUN chunked || rc=1
          export SKIP_BUILD=1
        done
      done ;;
    routed512)
      BENCH_TIMEOUT=300 PRESET=qwen3-next-80b-a3b LAYERS=8 FORMATS=bf16 LENGTHS=1024,4096 \
        QUANT_ARMS=resident,stream-all,routed $RUN quant || rc=1 ;;
    next-resident)
      for L in ${NEXT_LENGTHS:-32768 4096}; do
        XLA_CLIENT_MEM_FRACTION=$WHOLE BENCH_TIMEOUT=280 NAME=next_resident_$L CHUNKED_ARGS="$NEXT
          --arms resident --resident-orders one,layer-major --long $L --reps-prefill 2" \
          $RUN chunked || rc=1
        export SKIP_BUILD=1
      done ;;
    next-e2e)
      R=${RESIDENT_JSON:-$OUT/chunked_next_resident_32768.json}
      if [ -f "$R" ]; then R="--resident-json $R"; else R=${RESIDENT_MS:+--resident-ms $RESIDENT_MS}; fi
      POOL_GIB=12.93 BENCH_TIMEOUT=500 NAME=next_l48_16g CHUNKED_ARGS="$NEXT
        --arms routed --no-resident $R --ring-gib 2.5
        --orders layer-major --reps-prefill 2" $RUN chunked || rc=1 ;;
    next-short)
      for L in ${NEXT_SHORT:-1024 4096}; do
        R="$OUT/chunked_next_resident_$L.json"
        if [ -f "$R" ]; then R="--resident-json $R"; else R=""; fi
        POOL_GIB=12.93 BENCH_TIMEOUT=300 NAME=next_l48_16g_$L CHUNKED_ARGS="$NEXT
          --arms routed,stream-all --no-resident $R --ring-gib 2.5 --orders one --long $L
          --reps-prefill 2" $RUN chunked || rc=1
        export SKIP_BUILD=1
      done ;;
    ds-link)
      XLA_CLIENT_MEM_FRACTION=${DS_LINK_FRACTION:-0.45} BENCH_ARGS="--ring-gib 21.5" BENCH_TIMEOUT=${DS_LINK_TIMEOUT:-400} \
        PRESET=deepseek-v3 LAYERS=$((3 + ${DS_MOE_LAYERS:-2})) FORMATS=fp8 \
        LENGTHS=1024,2048,4096,8192 QUANT_ARMS=stream-all,routed $RUN quant || rc=1 ;;
    ds-32k)
      for M in ${DS_32K_MOE_LAYERS:-1 2}; do
        POOL_GIB=12.93 BENCH_TIMEOUT=${DS32K_TIMEOUT:-280} NAME=dsv3_16g_l$((3 + M)) \
          CHUNKED_ARGS="--preset deepseek-v3 --layers $((3 + M)) --quantize fp8 --parts prefill
          --arms routed --no-resident --ring-gib ${DS_RING_GIB:-2.5} --chunk ${DS_SUB_CHUNK:-2048}
          --orders layer-major --reps-prefill 1" $RUN chunked || rc=1
        export SKIP_BUILD=1
      done
      $PY - "$OUT" <<'PYEOF' || rc=1
import json, sys
# A MoE layer's time is the two slices' difference; the 61-layer DeepSeek-V3 (3 dense + 58 MoE)
# is the 3+2 slice plus 56 more of it.
out = sys.argv[1]
ms = {}
for m in (1, 2):
    try:
        rows = json.load(open(f"{out}/chunked_dsv3_16g_l{3 + m}.json"))["rows"]
        ms[m] = next(r["ms"] for r in rows if r.get("ms"))
    except (OSError, ValueError, KeyError, StopIteration):
        sys.exit(f"ds-32k projection: no timed read of the 3+{m} slice")
layer = ms[2] - ms[1]
total = ms[2] + 56 * layer
res = {"slice_ms": ms, "moe_layer_ms": layer, "projected_61_layer_ms": total,
       "projected_tok_per_s": 32768 / total * 1e3}
print(f"ds-32k: a MoE layer {layer:.1f} ms; 61 layers projected {total / 1e3:.2f} s "
      f"({res['projected_tok_per_s']:,.0f} tok/s)")
json.dump(res, open(f"{out}/dsv3_projection.json", "w"), indent=1)
PYEOF
      ;;
    glm-resident)
      XLA_CLIENT_MEM_FRACTION=$WHOLE BENCH_TIMEOUT=${GLM_RESIDENT_TIMEOUT:-400} NAME=glm_air_resident_32768 \
        CHUNKED_ARGS="$GLM --arms resident --resident-orders ${GLM_RESIDENT_ORDERS:-one,layer-major}
        --long 32768 --reps-prefill 2" \
        $RUN chunked || rc=1 ;;
    glm-e2e)
      R=${RESIDENT_JSON:-$OUT/chunked_glm_air_resident_32768.json}
      if [ -f "$R" ]; then R="--resident-json $R"; else R=${RESIDENT_MS:+--resident-ms $RESIDENT_MS}; fi
      POOL_GIB=${GLM_POOL_GIB:-12.93} BENCH_TIMEOUT=${GLM_E2E_TIMEOUT:-500} NAME=${GLM_E2E_NAME:-glm_air_l46_16g} CHUNKED_ARGS="$GLM
        --arms routed --no-resident $R --ring-gib 2.5 --orders layer-major --engine-chunk
        --dense ${GLM_DENSE:-host} --reps-prefill 2" $RUN chunked || rc=1 ;;
    *) echo "unknown stage $STAGE"; rc=2 ;;
  esac
  export SKIP_BUILD=1  # one build a call
done
exit $rc
