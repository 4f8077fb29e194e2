"""Which kernels a prefill's programs run: `Kernels`, static configuration.

A `Kernels` is held by the model (`build_model(..., kernels=)`, `Engine(..., kernels=)`): it is
part of the model's static structure, so a program traced with one choice is never reused for
another (jit keys on it). Nothing is read from the environment.

    grouped_matmul  "auto" | "mosaic" | "lax" | "tiled"  (`kernels.grouped`; auto: the Mosaic
                    GPU kernel on Hopper, row tiles on other GPUs, lax.ragged_dot on the CPU)
    quantized_matmul  "auto" | "fused" | "dequantize"  (`kernels.quantized.resolve_quantized`:
                    how a grouped matmul reads fp8/int4/mxfp4 expert planes). fused: the Mosaic GPU
                    kernel that dequantizes each tile as it multiplies (`kernels.mosaic`,
                    `kernels.mosaic_mxfp4`) where it reads the matrix (a Hopper GPU; fp8 in
                    128 x 128 blocks, int4 in groups of 128, zero-points and act-order
                    included, mxfp4 with columns a multiple of 64), else dequantize; dequantize:
                    the whole matrix to its dtype first, then grouped_matmul; auto: as fused
                    (the kernels give dequantize's bits), but int4 with zero-points is
                    dequantized first (faster there than the kernel).
    attention       "auto" | "cudnn" | "split" | "xla" | "einsum" | "blocked"
                    (`layers.attention`; auto: fused cuDNN for bf16/fp16 on the GPU, exact XLA
                    paths elsewhere)
    delta_rule      "auto" | "xla" | "pallas"  (`kernels.delta_rule`: a Gated DeltaNet layer's
                    chunkwise rule. xla: XLA's matmuls, the state walked by a scan; pallas:
                    two Pallas (Triton) kernels in the tokens-first layout, the UT transform
                    and the state's walk with the outputs; auto: pallas for a bf16/fp16 layer
                    on a GPU (bf16 products: `kernels.delta_rule.AUTO_ON_GPU`), xla for a
                    float32 layer and off a GPU)

The defaults are the measured best on each platform; the others exist for tests and
comparisons.
"""

from __future__ import annotations

import dataclasses

__all__ = ["Kernels", "GROUPED_MATMULS", "QUANTIZED_MATMULS", "ATTENTION_PATHS", "DELTA_RULES"]

GROUPED_MATMULS = ("auto", "mosaic", "lax", "tiled")
QUANTIZED_MATMULS = ("auto", "fused", "dequantize")
ATTENTION_PATHS = ("auto", "cudnn", "split", "xla", "einsum", "blocked")
DELTA_RULES = ("auto", "xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Kernels:
    """The grouped matmuls and attention a model's programs use (see the module docstring)."""

    grouped_matmul: str = "auto"
    attention: str = "auto"
    quantized_matmul: str = "auto"
    delta_rule: str = "auto"

    def __post_init__(self):
        for field, allowed in (("grouped_matmul", GROUPED_MATMULS),
                               ("attention", ATTENTION_PATHS),
                               ("quantized_matmul", QUANTIZED_MATMULS),
                               ("delta_rule", DELTA_RULES)):
            value = getattr(self, field)
            if not isinstance(value, str) or value.lower() not in allowed:
                raise ValueError(f"Kernels({field}={value!r}): expected one of "
                                 f"{'|'.join(allowed)}")
            object.__setattr__(self, field, value.lower())
