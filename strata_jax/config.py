"""`ModelConfig`: the shape of a decoder-only MoE transformer, as every layer of the package reads
it (the engine, the stream, the memory plan, the model).

Guards against an inconsistent shape reaching the device: every field is checked when a config
is made, with an error naming the field. The presets of published models live with their
families (`strata_jax.models`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import ml_dtypes
import numpy as np

from strata_jax.formats import EXPERT_FORMATS, ExpertFormat

DTYPES = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float64": np.dtype(np.float64),
}

ROUTER_SCORES = ("softmax", "sigmoid")
# The routed experts' activation between their gate/up and down products (`layers.moe`):
# silu(gate) * up, or gpt-oss's clamped SwiGLU.
EXPERT_ACTS = ("silu", "clamped_swiglu")
QK_NORMS = ("none", "per_head", "full")
# Attention kinds a layer may have (Hugging Face `layer_types` spelling).
LAYER_TYPES = ("full_attention", "sliding_attention")


ROPE_TYPES = ("linear", "dynamic", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling of a checkpoint (Hugging Face `rope_scaling` / `rope_parameters`).

    Attributes:
        rope_type: "linear", "dynamic" or "yarn" (`strata_jax.layers.rope`); no scaling is
            `ModelConfig.rope_scaling=None`.
        factor: context extension factor (> 0).
        original_max_position_embeddings: dynamic: the length up to which the default
            frequencies hold (and the longest context accepted); yarn: the pre-training context
            whose rotation counts place the ramp.
        attention_factor: yarn: multiplier of cos and sin; None: from factor (and mscale).
        beta_fast: yarn: rotations that bound the extrapolated (high-frequency) end; None: 32.
        beta_slow: yarn: rotations that bound the interpolated (low-frequency) end; None: 1.
        mscale: yarn: numerator weight of the default attention_factor (with mscale_all_dim).
        mscale_all_dim: yarn: denominator weight of the default attention_factor.
        truncate: yarn: round the ramp bounds outwards to whole indices.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type={self.rope_type!r}: implemented are {ROPE_TYPES} "
                             f"(and no scaling, rope_scaling=None)")
        if not isinstance(self.factor, (int, float)) or not self.factor > 0:
            raise ValueError(f"RoPE scaling factor must be a positive number, got {self.factor!r}")
        if self.rope_type in ("dynamic", "yarn"):
            orig = self.original_max_position_embeddings
            if not isinstance(orig, int) or isinstance(orig, bool) or orig <= 0:
                raise ValueError(f"{self.rope_type} RoPE scaling needs a positive int "
                                 f"original_max_position_embeddings, got {orig!r}")
        if self.attention_factor is not None and not self.attention_factor > 0:
            raise ValueError(f"attention_factor must be positive, got {self.attention_factor!r}")

    @property
    def yarn_attention_factor(self) -> float:
        """YaRN's cos/sin multiplier: attention_factor, or its default from factor and mscale."""
        if self.attention_factor is not None:
            return float(self.attention_factor)

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim)
        return mscale(self.factor)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape and routing description of a decoder-only MoE transformer.

    Attributes:
        name: Preset name (informational).
        vocab_size: Number of token ids.
        hidden_size: Residual stream width H.
        n_layers: Number of decoder layers.
        n_heads: Query heads.
        n_kv_heads: Key/value heads (grouped-query attention); divides `n_heads`.
        head_dim: Per-head width D.
        n_experts: Routed experts per MoE layer E.
        top_k: Experts chosen per token.
        expert_intermediate: Per-expert SwiGLU width I.
        n_dense_layers: The first `n_dense_layers` layers use a dense MLP instead of MoE (DeepSeek).
        dense_intermediate: Width of those dense MLPs.
        shared_expert_intermediate: Width of the always-on shared expert; 0 means none.
        shared_expert_gate: Whether the shared expert output is scaled by sigmoid(x @ w) (Qwen2/3-MoE
            style gate).
        router_scores: "softmax" (Qwen, Mixtral, OLMoE) or "sigmoid" (DeepSeek-V3).
        norm_topk_prob: Renormalise the chosen k weights to sum to one.
        routed_scaling: Multiplier applied to the routed weights (DeepSeek-V3: 2.5).
        selection_bias: A learned per-expert bias added to the scores for choosing only
            (DeepSeek-V3 `e_score_correction_bias`); weights come from the unbiased scores.
        n_groups: Expert groups for group-limited routing (DeepSeek-V3: 8); 1 disables it.
        topk_groups: Groups kept per token when `n_groups > 1` (DeepSeek-V3: 4).
        router_bias: The router adds a learned per-expert bias to its logits (gpt-oss).
        expert_bias: Each routed expert's gate, up and down products add a bias of their own
            (gpt-oss), held in the expert's blob beside its weights (`strata_jax.formats`) and
            streamed with them.
        expert_act: The experts' activation: "silu" (silu(gate) * up) or "clamped_swiglu"
            (gpt-oss: gate clamped above at `swiglu_limit`, up clamped to +-swiglu_limit,
            (up + 1) * gate * sigmoid(swiglu_alpha * gate)).
        swiglu_alpha: clamped_swiglu's sigmoid gain (gpt-oss: 1.702).
        swiglu_limit: clamped_swiglu's clamp (gpt-oss: 7.0).
        attention_sinks: Each attention head has a learned sink logit that joins every
            softmax row as one more term with no value (gpt-oss): out = sum_j p_j v_j with
            p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink)).
        qk_norm: "none", "per_head" (Qwen3: RMSNorm over each head's D) or "full" (OLMoE: RMSNorm over
            the whole q / k projection).
        attention_bias: The q, k and v projections add a bias (Hugging Face
            `attention_bias`: Qwen3-MoE, OLMoE, GLM-4.5), and o too unless
            `attention_out_bias` is False; q/k biases come before the q/k norm.
        attention_out_bias: With `attention_bias`, whether the o projection adds a bias too
            (Qwen3-MoE, OLMoE: yes; GLM-4.5: no). False needs `attention_bias`.
        rotary_dim: RoPE rotates the first `rotary_dim` dims of each attention head (partial
            rotary: Hugging Face `partial_rotary_factor` x head_dim); 0: every dim.
        rope_theta: RoPE base.
        rope_scaling: Context-extension scaling of the RoPE frequencies (`strata_jax.layers.rope`:
            linear, dynamic, yarn); None: plain RoPE.
        sliding_window: Sliding-window attention: a query at position q sees the keys at
            positions q - sliding_window < k <= q (itself and the sliding_window - 1 before it;
            Hugging Face's masking_utils), in the layers `layer_types` names; None: every layer
            attends to all earlier positions.
        layer_types: Each layer's attention, "full_attention" or "sliding_attention", one per
            layer (Qwen2/3's `layer_types`, which Hugging Face derives as sliding for layers
            i >= max_window_layers when use_sliding_window). None: every layer is windowed when
            `sliding_window` is set (Mixtral, and Qwen3-MoE, whose Hugging Face model applies
            the window to every layer). `window_of(layer)` reads both.
        rms_norm_eps: RMSNorm epsilon.
        tie_embeddings: LM head shares the embedding matrix.
        max_seq_len: Longest context the model accepts.
        param_dtype: Parameter and activation dtype name ("bfloat16", "float32", ...).
        expert_format: How the routed experts are stored, on the host, over the link and in
            device memory (`strata_jax.formats`): "plain" (the parameter dtype), "fp8" (e4m3
            with block scales), "int4" (GPTQ's 4-bit values and group scales) or "mxfp4" (OCP
            Microscaling FP4, gpt-oss's: e2m1 values, an e8m0 scale per 32 inputs; the input
            widths multiples of 64). The expert math reads them (`Kernels.quantized_matmul`).
        expert_block: fp8's scale block side or int4's group along the input dim; 0 means the
            checkpoints' 128 (mxfp4: 0 or 32, its one scale group).
        expert_zero_points: int4 only: each group and column has its own 4-bit zero-point z
            (asymmetric GPTQ, `sym: false`), w = (q - z) * scale, held as a plane of its own;
            False: the implicit zero 8 of symmetric GPTQ.
        expert_act_order: int4 only: each matrix's input rows are in the scale groups the
            checkpoint's `g_idx` names (GPTQ act-order, `desc_act: true`), stored sorted by
            group beside an int32 plane naming each stored row's input row (`formats`);
            False: row k is in group k // group.
    """

    name: str
    vocab_size: int
    hidden_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    expert_intermediate: int
    n_dense_layers: int = 0
    dense_intermediate: int = 0
    shared_expert_intermediate: int = 0
    shared_expert_gate: bool = False
    router_scores: str = "softmax"
    norm_topk_prob: bool = True
    routed_scaling: float = 1.0
    selection_bias: bool = False
    n_groups: int = 1
    topk_groups: int = 1
    router_bias: bool = False
    expert_bias: bool = False
    expert_act: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_sinks: bool = False
    qk_norm: str = "none"
    attention_bias: bool = False
    attention_out_bias: bool = True
    rotary_dim: int = 0
    rope_theta: float = 1_000_000.0
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    max_seq_len: int = 32_768
    param_dtype: str = "bfloat16"
    expert_format: str = "plain"
    expert_block: int = 0
    expert_zero_points: bool = False
    expert_act_order: bool = False

    def __post_init__(self):
        self._check_positive(
            "vocab_size", "hidden_size", "n_layers", "n_heads", "n_kv_heads", "head_dim",
            "n_experts", "top_k", "expert_intermediate", "max_seq_len", "n_groups", "topk_groups")
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if not 0 <= self.n_dense_layers <= self.n_layers:
            raise ValueError(
                f"n_dense_layers={self.n_dense_layers} must be within 0..n_layers={self.n_layers}")
        if self.n_dense_layers and self.dense_intermediate <= 0:
            raise ValueError(
                f"n_dense_layers={self.n_dense_layers} needs dense_intermediate > 0, "
                f"got {self.dense_intermediate}")
        if self.shared_expert_intermediate < 0:
            raise ValueError(
                f"shared_expert_intermediate must be >= 0, got {self.shared_expert_intermediate}")
        if self.shared_expert_gate and not self.shared_expert_intermediate:
            raise ValueError("shared_expert_gate=True needs shared_expert_intermediate > 0")
        if self.router_scores not in ROUTER_SCORES:
            raise ValueError(f"router_scores={self.router_scores!r}, expected one of {ROUTER_SCORES}")
        self._check_experts()
        if self.qk_norm not in QK_NORMS:
            raise ValueError(f"qk_norm={self.qk_norm!r}, expected one of {QK_NORMS}")
        self._check_attention()
        if self.param_dtype not in DTYPES:
            raise ValueError(f"param_dtype={self.param_dtype!r}, expected one of {sorted(DTYPES)}")
        if self.expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format={self.expert_format!r}, expected one of "
                             f"{EXPERT_FORMATS}")
        if (isinstance(self.expert_block, bool) or not isinstance(self.expert_block, (int, np.integer))
                or self.expert_block < 0):
            raise ValueError(f"expert_block must be an int >= 0 (0: the format's own), got "
                             f"{self.expert_block!r}")
        for name, what in (("expert_zero_points", "zero-points (asymmetric GPTQ)"),
                           ("expert_act_order", "act-order group indices (GPTQ desc_act)")):
            value = getattr(self, name)
            if not isinstance(value, (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {value!r}")
            if value and self.expert_format != "int4":
                raise ValueError(f"{name}=True with expert_format={self.expert_format!r}: "
                                 f"{what} are an int4 format's; set expert_format='int4' or "
                                 f"leave {name} off")
        if self.expert_format != "plain":
            ExpertFormat.of(self)  # the widths must suit the format (int4's groups, mxfp4's packs)
        if self.n_experts % self.n_groups:
            raise ValueError(
                f"n_experts={self.n_experts} is not a multiple of n_groups={self.n_groups}")
        if self.n_groups > 1 and self.n_experts // self.n_groups < 2:
            raise ValueError(
                f"n_groups={self.n_groups} leaves {self.n_experts // self.n_groups} expert per "
                f"group of n_experts={self.n_experts}: a group's score is the sum of its two best "
                "experts' (DeepSeek-V3's group-limited routing), so each group needs at least "
                "two; use fewer groups (n_groups=1 turns group-limited routing off)")
        if self.topk_groups > self.n_groups:
            raise ValueError(f"topk_groups={self.topk_groups} exceeds n_groups={self.n_groups}")
        if self.n_groups > 1 and self.top_k > self.topk_groups * (self.n_experts // self.n_groups):
            raise ValueError(
                f"top_k={self.top_k} exceeds the {self.topk_groups * (self.n_experts // self.n_groups)}"
                f" experts left by topk_groups={self.topk_groups} of n_groups={self.n_groups}")
        if self.selection_bias and self.router_scores != "sigmoid":
            raise ValueError("selection_bias=True is only defined for router_scores='sigmoid'")
        scaling = self.rope_scaling
        if scaling is not None and not isinstance(scaling, RopeScaling):
            raise ValueError(f"rope_scaling must be None or a RopeScaling, got {scaling!r}")
        if (scaling is not None and scaling.rope_type == "dynamic"
                and self.max_seq_len > scaling.original_max_position_embeddings):
            raise ValueError(
                f"max_seq_len={self.max_seq_len} exceeds the "
                f"{scaling.original_max_position_embeddings} positions of dynamic RoPE scaling's"
                " original context: past them its frequencies depend on the prompt's length,"
                " which is not implemented")
        self._check_windows()

    def _check_experts(self):
        for name in ("router_bias", "expert_bias", "attention_sinks"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.expert_act not in EXPERT_ACTS:
            raise ValueError(f"expert_act={self.expert_act!r}, expected one of {EXPERT_ACTS}")
        for name in ("swiglu_alpha", "swiglu_limit"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float, np.floating))
                    or not math.isfinite(value) or value <= 0):
                raise ValueError(f"{name} must be a positive finite number, got {value!r}")

    def _check_attention(self):
        for name in ("attention_bias", "attention_out_bias"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not self.attention_out_bias and not self.attention_bias:
            raise ValueError("attention_out_bias=False drops the o projection's bias of "
                             "attention_bias=True (q, k, v biases without o's); without "
                             "attention_bias no projection has one: leave it True")
        r = self.rotary_dim
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)) or not (
                0 <= r <= self.head_dim) or r % 2:
            raise ValueError(f"rotary_dim={r!r} must be an even int within 0..head_dim="
                             f"{self.head_dim} (0: every dim)")

    def _check_windows(self):
        w = self.sliding_window
        if w is not None and (isinstance(w, bool) or not isinstance(w, (int, np.integer))
                              or w < 1):
            raise ValueError(f"sliding_window must be None or a positive int, got {w!r}")
        if self.layer_types is None:
            return
        types = self._check_per_layer("layer_types", LAYER_TYPES)
        if "sliding_attention" in types and w is None:
            raise ValueError("layer_types names sliding_attention layers but sliding_window is "
                             "None; give the window size")

    def _check_positive(self, *fields: str) -> None:
        """Refuses each of `fields` that is not a positive int (a bool is not), by name."""
        for field in fields:
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"{field} must be a positive int, got {value!r}")

    def _check_per_layer(self, field: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
        """Field `field`, one of `allowed` per layer, as a tuple (a list from config.json made
        hashable); refused by name and entry otherwise."""
        value = getattr(self, field)
        if isinstance(value, str):
            raise ValueError(f"{field} must be a sequence of {allowed}, one per layer, got the "
                             f"string {value!r}")
        kinds = tuple(value)
        object.__setattr__(self, field, kinds)
        if len(kinds) != self.n_layers:
            raise ValueError(f"{field} has {len(kinds)} entries for n_layers={self.n_layers}")
        for i, kind in enumerate(kinds):
            if kind not in allowed:
                raise ValueError(f"{field}[{i}]={kind!r}: only {allowed} are implemented")
        return kinds

    # ---- derived values -------------------------------------------------------------------------

    @functools.cached_property
    def dtype(self) -> np.dtype:
        """The parameter dtype as a NumPy dtype (bfloat16 through ml_dtypes)."""
        return DTYPES[self.param_dtype]

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s attention window (keys q - w < k <= q for a query at q), or None
        for full causal attention."""
        if not 0 <= layer < self.n_layers:
            raise ValueError(f"layer {layer} outside 0..{self.n_layers - 1}")
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return int(self.sliding_window)
        return None

    @functools.cached_property
    def moe_layers(self) -> tuple[int, ...]:
        """Model layer indices that hold an MoE block, in order."""
        return tuple(range(self.n_dense_layers, self.n_layers))

    @functools.cached_property
    def dense_layers(self) -> tuple[int, ...]:
        """Model layer indices that hold a dense MLP."""
        return tuple(range(self.n_dense_layers))

    @functools.cached_property
    def expert_params(self) -> int:
        """Parameters of one routed expert: gate [H, I] + up [H, I] + down [I, H]."""
        return 3 * self.hidden_size * self.expert_intermediate

    @functools.cached_property
    def expert_bytes(self) -> int:
        """Bytes of one routed expert (gate + up + down, with their scales in a quantized
        format): the blob of its `strata_jax.formats.ExpertFormat` (`expert_format`)."""
        return ExpertFormat.of(self).blob_bytes

    @functools.cached_property
    def expert_bytes_per_layer(self) -> int:
        """Bytes of one MoE layer's routed experts."""
        return self.n_experts * self.expert_bytes

    @functools.cached_property
    def expert_bytes_total(self) -> int:
        """Bytes of all routed experts of the model."""
        return len(self.moe_layers) * self.expert_bytes_per_layer

    @functools.cached_property
    def attention_biases(self) -> tuple[str, ...]:
        """The attention projections that add a bias: ("q", "k", "v", "o"), ("q", "k", "v")
        (`attention_out_bias` False) or none."""
        if not self.attention_bias:
            return ()
        return ("q", "k", "v", "o") if self.attention_out_bias else ("q", "k", "v")

    @functools.cached_property
    def rotated_dims(self) -> int:
        """The dims of each attention head RoPE rotates: `rotary_dim`, or all of them."""
        return self.rotary_dim or self.head_dim

    @functools.cached_property
    def q_dim(self) -> int:
        """Width of the query projection, n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @functools.cached_property
    def kv_dim(self) -> int:
        """Width of each of the key and value projections, n_kv_heads * head_dim."""
        return self.n_kv_heads * self.head_dim

    # ---- variants -------------------------------------------------------------------------------

    def replace(self, **changes) -> "ModelConfig":
        """Returns a copy with `changes` applied (validated again); a new `n_layers` without
        `layer_types` repeats the layer kinds from the first layer (the first n of the
        published pattern)."""
        if ("n_layers" in changes and "layer_types" not in changes
                and self.layer_types is not None):
            changes["layer_types"] = tuple(self.layer_types[i % self.n_layers]
                                           for i in range(changes["n_layers"]))
        return dataclasses.replace(self, **changes)

    def scaled(
        self,
        *,
        n_layers: int | None = None,
        hidden_size: int | None = None,
        n_heads: int | None = None,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        n_experts: int | None = None,
        top_k: int | None = None,
        expert_intermediate: int | None = None,
        vocab_size: int | None = None,
        max_seq_len: int | None = None,
        param_dtype: str | None = None,
    ) -> "ModelConfig":
        """Shrinks a preset for tests and CPU demos while keeping its structure.

        Defaults: 2 layers beyond the dense ones (so DeepSeek keeps one dense and one MoE layer at
        least), hidden 64, head_dim 16, heads divided keeping the q/kv ratio, vocab 512, widths
        divided proportionally. Routing kind, shared experts, qk-norm, tying, group-limited
        routing and the rotated fraction of a head (`rotary_dim`) are kept; experts and top-k are kept unless given. A sliding window is kept,
        and `layer_types` is resampled to the new depth: new layer i takes the kind of the last
        old layer of its share, (i + 1) * n_layers_old // n_layers_new - 1.

        Returns:
            A new validated `ModelConfig` named "<name>-scaled".
        """
        hidden = hidden_size or 64
        ratio = self.hidden_size / hidden

        def shrink(width: int) -> int:
            return max(8, int(round(width / ratio / 8)) * 8) if width else 0

        kv = n_kv_heads or max(1, min(self.n_kv_heads, 2))
        heads = n_heads or kv * min(self.n_heads // self.n_kv_heads, 4)
        dense = min(self.n_dense_layers, 1)
        experts = n_experts or self.n_experts
        # Group-limited routing survives where the experts still split into groups of two or more.
        groups = (self.n_groups if experts % self.n_groups == 0 and experts >= 2 * self.n_groups
                  else 1)
        depth = n_layers or dense + 2
        types = (None if self.layer_types is None else
                 tuple(self.layer_types[(i + 1) * self.n_layers // depth - 1]
                       for i in range(depth)))
        return dataclasses.replace(self, **self._scaled_fields(
            name=f"{self.name}-scaled",
            n_layers=depth,
            n_dense_layers=min(dense, depth),
            layer_types=types,
            hidden_size=hidden,
            n_heads=heads,
            n_kv_heads=kv,
            head_dim=head_dim or 16,
            n_experts=experts,
            top_k=top_k or min(self.top_k, experts),
            expert_intermediate=expert_intermediate or shrink(self.expert_intermediate),
            dense_intermediate=shrink(self.dense_intermediate),
            shared_expert_intermediate=shrink(self.shared_expert_intermediate),
            n_groups=groups,
            topk_groups=min(self.topk_groups, groups),
            vocab_size=vocab_size or 512,
            max_seq_len=max_seq_len or min(self.max_seq_len, 4096),
            param_dtype=param_dtype or self.param_dtype,
        ))

    def _scaled_fields(self, **fields) -> dict:
        """`scaled`'s new field values (the rotary part keeps its fraction of a head); a
        subclass adds its own fields' (made to match)."""
        head = fields["head_dim"]
        rotary = 0 if not self.rotary_dim else max(2, round(
            self.rotary_dim / self.head_dim * head / 2) * 2)
        return {**fields, "rotary_dim": 0 if rotary >= head else rotary}
