"""The model's shape, as every loader reports it and the model consumes it."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

# How a mixture-of-experts router turns its logits into the k experts' weights: softmax over
# all experts then the top k (renormalised over them where norm_topk_prob: qwen3_moe, mixtral),
# or the top k logits then a softmax over those (gpt-oss), or sigmoids chosen among by the
# sigmoids plus a correction bias within the best groups, then renormalised where norm_topk_prob
# and scaled (GLM-4.5, DeepSeek-V3's rule: moe_n_group, moe_topk_group, routed_scaling_factor), or
# the top k logits then a sigmoid of each (Llama 4, whose experts take their weight on their input),
# or softmax_topk on an RMS-normed, scaled input, renormalised, times a per-expert scale (Gemma 4:
# its router is the family's own, ridge/models/gemma4/model.py).
MOE_ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid_group_topk", "topk_sigmoid", "softmax_topk_scaled")


@dataclass(slots=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF-style dict: {"rope_type": "llama3"|"linear"|"yarn", "factor": ..., ...}
    rope_scaling: dict | None = None
    max_position: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q, k and v projections have biases (qwen2; llama's attention_bias)
    qk_norm: bool = False  # qwen3, gemma3_text
    # The gated MLP's activation, as transformers' ACT2FN names it: silu, gelu (erf) or
    # gelu_pytorch_tanh (the tanh approximation).
    hidden_act: str = "silu"
    o_bias: bool = False  # o_proj has a bias (llama's, qwen3's, olmo2's, granite's attention_bias)
    mlp_bias: bool = False  # gate, up and down projections have biases
    rotary_dim: int | None = None  # the leading dims of each head that rotate (partial rotary); None: all
    softmax_scale: float | None = None  # None: head_dim ** -0.5 (granite: attention_multiplier)
    embedding_multiplier: float = 1.0  # scales the embeddings (granite)
    residual_multiplier: float = 1.0  # scales each sublayer's output before the residual add (granite)
    logits_scaling: float = 1.0  # the logits are divided by it (granite)
    # Layer i attends within a sliding window (keys p - window < j <= p) where layer_types[i] is
    # "sliding_attention"; "full_attention" layers, or every layer when layer_types is None, see all.
    sliding_window: int | None = None
    layer_types: list[str] | None = None
    # Gemma 2/3 (ridge/models/gemma2/model.py): soft-caps s -> c * tanh(s / c) on the attention scores
    # and on the final logits; the sliding layers' own RoPE base and scaling (Gemma 3; None: the
    # full layers' table serves every layer).
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    rope_local_scaling: dict | None = None
    # Mixture of experts (ridge/models/layers/moe.py): with num_experts > 0 the layers in moe_layers
    # (None: every layer) replace the dense MLP by a router over num_experts experts, each a
    # gated MLP of moe_intermediate_size, of which each token takes num_experts_per_tok;
    # intermediate_size stays the dense layers' (qwen3_moe's mlp_only_layers).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_router: str = "softmax_topk"  # MOE_ROUTERS
    norm_topk_prob: bool = False  # softmax_topk: the k weights divided by their sum
    moe_layers: list[int] | None = None
    moe_bias: bool = False  # the router and the experts' projections have biases (gpt-oss)
    moe_n_group: int = 1  # sigmoid_group_topk: the experts' groups, of which moe_topk_group are chosen from
    moe_topk_group: int = 1
    routed_scaling_factor: float = 1.0  # sigmoid_group_topk: multiplies the k weights
    # A dense gated MLP beside the experts in each sparse layer, added to their output (GLM-4.5's
    # shared experts); 0: none.
    shared_expert_intermediate_size: int = 0
    # The experts' activation (kernels/moe.py ACTIVATIONS); None: hidden_act. gpt-oss's
    # "swigluoai" clamps at swiglu_limit and gates with sigmoid(swiglu_alpha * gate).
    moe_act: str | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_sinks: bool = False  # a learned logit per head in each softmax's denominator (gpt-oss)
    # The placeholder tokens of one image see each other both ways: full attention within an
    # image's run, causal elsewhere, still inside a sliding layer's window. True: on every layer
    # (Gemma 3); "sliding": on the sliding layers only, the full ones causal (Gemma 4). The runner
    # hands attention the runs (AttentionMetadata.spans); the scheduler never splits one across steps.
    image_attention_bidirectional: bool | str = False
    # Layers whose q and k enter attention unrotated (NoPE): SmolLM3's every fourth, EXAONE 4's
    # global layers. None: every layer applies RoPE.
    nope_layers: list[int] | None = None
    # q times 1 + beta * log(1 + floor((p + offset) / period)) at position p, after RoPE (Ministral 3's
    # llama_4_scaling_beta over original_max_position_embeddings; Llama 4's attn_scale over
    # floor_scale, offset 1, on its NoPE layers only): {"beta", "period"[, "offset"]}; None: 1.
    query_scale: dict | None = None
    # Hybrid models: the layers whose per-request state lives in a slot pool beside the paged KV
    # (cache/state_cache.py), so they hold no KV blocks, and their shape. Qwen3.5's Gated DeltaNet (a
    # [Dk, Dv] matrix per value head and the short convolution's last K - 1 inputs):
    # {"num_key_heads", "num_value_heads", "key_head_dim", "value_head_dim", "conv_kernel"}; LFM2's
    # gated short convolution (its last K - 1 inputs only): {"kind": "short_conv", "channels",
    # "conv_kernel"}. Mamba2 (Granite 4 hybrid, Nemotron-H: a [P, N] state per head plus the
    # convolution's last K - 1 inputs of x, B and C): {"kind": "mamba2", "num_heads", "head_dim",
    # "state_size", "n_groups", "conv_kernel", "conv_bias", "proj_bias", "dt_limit"}. None: none.
    linear_layers: list[int] | None = None
    linear_attention: dict | None = None
    # A stack of single sublayers (Nemotron-H): the layers listed are MLP (or experts) blocks
    # without a token mixer, which hold neither KV blocks nor a state, and the others are a token
    # mixer without an MLP. None: every layer runs a token mixer and an MLP.
    mixerless_layers: list[int] | None = None
    # The full-attention layers' own head size and KV heads where they differ from the others'
    # (Gemma 4's global layers: wider heads, fewer KV heads); None: head_dim, num_kv_heads.
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    name: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        assert self.num_heads % self.num_kv_heads == 0, "query heads must group evenly over KV heads"
        assert not self.global_kv_heads or self.num_heads % self.global_kv_heads == 0
        assert self.head_dim % 2 == 0, "rotary embedding needs an even head_dim"
        assert self.rotary_dim is None or (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0)
        assert not self.num_experts or (0 < self.num_experts_per_tok <= self.num_experts and self.moe_intermediate_size
                                        and self.moe_router in MOE_ROUTERS), "an MoE needs k <= E experts and a router"
        assert not self.linear_layers or (self.linear_attention and len(self.linear_layers) < self.num_layers), \
            "linear-attention layers need their shape and at least one attention layer beside them"

    def is_linear_layer(self, i: int) -> bool:
        """Whether layer i keeps a recurrent state (Gated DeltaNet, a short convolution) instead of KV."""
        return bool(self.linear_layers) and i in self.linear_layers

    def holds_kv(self, i: int) -> bool:
        """Whether layer i attends, over KV in the paged cache (not a recurrent layer, not an MLP block)."""
        return not self.is_linear_layer(i) and not (self.mixerless_layers and i in self.mixerless_layers)

    @property
    def num_kv_layers(self) -> int:
        """The layers that hold KV in the paged cache."""
        return sum(map(self.holds_kv, range(self.num_layers)))

    def state_shapes(self) -> dict[str, tuple[int, ...]]:
        """One request's states in each linear layer, by pool (cache/state_cache.py LayerState): the
        convolution's window (K - 1) x channels, and Gated DeltaNet's delta-rule state Hv x Dk x Dv
        (a short convolution keeps none)."""
        la = self.linear_attention
        if la.get("kind") == "short_conv":
            return {"conv": (la["conv_kernel"] - 1, la["channels"])}
        if la.get("kind") == "mamba2":
            return {"conv": (la["conv_kernel"] - 1, mamba2_conv_channels(la)),
                    "recurrent": (la["num_heads"], la["head_dim"], la["state_size"])}
        channels = 2 * la["num_key_heads"] * la["key_head_dim"] + la["num_value_heads"] * la["value_head_dim"]
        return {"conv": (la["conv_kernel"] - 1, channels),
                "recurrent": (la["num_value_heads"], la["key_head_dim"], la["value_head_dim"])}

    def state_bytes_per_request(self) -> int:
        """One request's recurrent states, fp32 (cache/state_cache.py), over every linear layer."""
        if not self.linear_layers:
            return 0
        return 4 * len(self.linear_layers) * sum(math.prod(s) for s in self.state_shapes().values())

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i's MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.moe_layers is None or i in self.moe_layers)

    def layer_kv_shape(self, i: int) -> tuple[int, int]:
        """Layer i's (KV heads, head_dim): its paged K and V blocks' last two dims."""
        if self.layer_window(i) is None:
            return self.global_kv_heads or self.num_kv_heads, self.global_head_dim or self.head_dim
        return self.num_kv_heads, self.head_dim

    def layer_window(self, i: int) -> int | None:
        """Layer i's sliding window, None where it attends to the whole context."""
        if self.layer_types is None or self.layer_types[i] == "full_attention":
            return None
        return self.sliding_window

    def kv_groups(self) -> list["KVGroupSpec"]:
        """The layers that share a block table (cache/manager.py): the full-attention layers
        first, then the sliding layers of each window."""
        by_window: dict = {}
        for i in range(self.num_layers):
            if not self.holds_kv(i):  # a state in the slot pool, or nothing, instead of blocks
                continue
            by_window.setdefault(self.layer_window(i), []).append(i)
        order = sorted(by_window, key=lambda w: -1 if w is None else w)
        return [KVGroupSpec(w, tuple(by_window[w])) for w in order]

    def kv_group_of(self, i: int) -> int:
        """The KV group of layer i (an index into kv_groups())."""
        return next(g for g, spec in enumerate(self.kv_groups()) if i in spec.layers)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**d)

    def shape(self, name: str | None = None) -> "ModelShape":
        """The numbers `ridge plan` needs. The parameter count leaves out norms and biases."""
        attn = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        if self.extra.get("attention_output_gate"):  # Qwen3.5's and Qwen3-Next's: a second q-sized output
            attn += self.hidden_size * self.q_size
        mats = 3 if self.extra.get("gated_mlp", True) else 2  # Nemotron-H's MLPs and experts: up and down
        latent = self.extra.get("moe_latent_size") or self.hidden_size  # experts between two latent projections
        mlp = mats * self.hidden_size * self.intermediate_size
        expert = mats * latent * self.moe_intermediate_size
        moe = sum(map(self.is_moe_layer, range(self.num_layers)))
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        sliding = sum(1 for i in range(self.num_layers) if self.layer_window(i) is not None
                      and not self.is_linear_layer(i))
        linear = len(self.linear_layers or ())
        if linear and self.linear_attention.get("kind") == "short_conv":  # LFM2: in_proj [B | C | x], out_proj
            gdn = 4 * self.hidden_size * self.hidden_size
            attn_total = (self.num_layers - linear) * attn + linear * gdn
        elif linear and self.linear_attention.get("kind") == "mamba2":  # in_proj [gate | x B C | dt], out_proj
            la = self.linear_attention
            inner = la["num_heads"] * la["head_dim"]
            mixer = self.hidden_size * (inner + mamba2_conv_channels(la) + la["num_heads"]) + inner * self.hidden_size
            attn_total = (self.num_layers - linear) * attn + linear * mixer
        elif linear:  # a Gated DeltaNet layer's projections in place of the attention's
            la = self.linear_attention
            kd, vd, hv = la["num_key_heads"] * la["key_head_dim"], la["num_value_heads"] * la["value_head_dim"], \
                la["num_value_heads"]
            gdn = self.hidden_size * (2 * kd + 2 * vd + 2 * hv) + vd * self.hidden_size
            attn_total = (self.num_layers - linear) * attn + linear * gdn
        else:
            attn_total = self.num_layers * attn
        mixerless = len(self.mixerless_layers or ())
        dense = self.num_layers - moe
        if self.mixerless_layers is not None:  # MLP and experts blocks apart from the mixers, which have none
            attn_total -= mixerless * attn
            dense = mixerless - moe
        if self.extra.get("moe_beside_mlp"):  # Gemma 4's experts run beside each layer's dense MLP
            dense += moe
        mlps = dense * mlp + moe * self.num_experts * (expert + self.hidden_size)  # + the router
        mlps += moe * mats * self.hidden_size * self.shared_expert_intermediate_size
        if self.extra.get("shared_expert_gate"):  # one logit a token gates the shared expert
            mlps += moe * self.hidden_size
        if latent != self.hidden_size:
            mlps += moe * 2 * self.hidden_size * latent
        return ModelShape(name or self.name, self.num_layers, self.num_kv_heads, self.head_dim,
                          attn_total + mlps + embeddings, self.sliding_window if sliding else None,
                          sliding, self.num_experts if moe else 0, self.num_experts_per_tok if moe else 0,
                          expert if moe else 0, moe, linear, self.state_bytes_per_request(), mixerless)


def mamba2_conv_channels(la: dict) -> int:
    """A Mamba2 layer's convolved channels: x (heads x head_dim), then B and C (groups x state)."""
    return la["num_heads"] * la["head_dim"] + 2 * la["n_groups"] * la["state_size"]


@dataclass(frozen=True, slots=True)
class KVGroupSpec:
    """Layers whose KV shares one block table per request: full attention (window None) or
    sliding layers of one window, which hold only the blocks their window reaches."""
    window: int | None
    layers: tuple[int, ...]


@dataclass
class ModelShape:
    """What sizes the KV cache and the weights: a ModelConfig's subset, or the flags of `ridge plan`.
    sliding_layers of the num_layers attend within sliding_window (None: every layer is full)."""
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_params: int | None = None
    sliding_window: int | None = None
    sliding_layers: int = 0
    # A mixture of experts: moe_layers of the layers route each token to experts_per_tok of
    # num_experts experts of expert_params parameters each (num_params counts them all).
    num_experts: int = 0
    experts_per_tok: int = 0
    expert_params: int = 0
    moe_layers: int = 0
    # A hybrid model: state_layers of the num_layers keep a recurrent state of state_bytes_per_request
    # in all (whatever the context) instead of KV.
    state_layers: int = 0
    state_bytes_per_request: int = 0
    mixerless_layers: int = 0  # MLP blocks of a stack of single sublayers: neither KV nor state

    @property
    def num_kv_layers(self) -> int:
        return self.num_layers - self.state_layers - self.mixerless_layers

    @property
    def num_active_params(self) -> int | None:
        """The parameters one token's forward pass reads: every expert it is not routed to left out."""
        if self.num_params is None:
            return None
        return self.num_params - self.moe_layers * (self.num_experts - self.experts_per_tok) * self.expert_params

    def experts_touched(self, batch: int) -> float:
        """The expected number of distinct experts a step of `batch` tokens reads per MoE layer,
        each token taking k of the E uniformly at random: E * (1 - (1 - k/E)^batch)."""
        E, k = self.num_experts, self.experts_per_tok
        return E * (1 - (1 - k / E) ** batch) if E else 0.0

    def params_read(self, batch: int) -> float | None:
        """The parameters a decode step of `batch` tokens reads: every dense one once, and per
        MoE layer each expert that some token routes to (the expected count)."""
        if self.num_params is None:
            return None
        unrouted = self.num_params - self.moe_layers * self.num_experts * self.expert_params
        return unrouted + self.moe_layers * self.experts_touched(batch) * self.expert_params


def draft_table_mismatch(target: ModelConfig, draft: ModelConfig) -> str | None:
    """Why a draft model cannot keep its KV in the target's blocks, or None. A draft layer of
    KV group g reads the target's table of group g (group 0's where the target has one):
    a full-attention table serves any layer, a sliding one only layers of its window."""
    windows = [g.window for g in target.kv_groups()]
    for g, spec in enumerate(draft.kv_groups()):
        have = windows[g] if g < len(windows) else windows[0]
        if have is not None and have != spec.window:
            return (f"its layers {list(spec.layers)} attend {'fully' if spec.window is None else f'within {spec.window}'}"
                    f" and the target's blocks of that group slide over {have}: the draft's KV would be freed under it")
    return None


# Pure Python on purpose: `ridge plan` sizes caches on machines without torch.
# cache/kv_cache.py maps the same names to torch dtypes.
KV_DTYPE_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
FP8_SCALE_BYTES = 2  # our FP8 KV cache keeps one float16 scale per token per KV head, for K and for V


def kv_bytes_per_token(shape: ModelConfig | ModelShape, kv_dtype: str, num_layers: int | None = None) -> int:
    """The seed's formula, 2 (K and V) x layers x KV heads x head_dim x bytes, plus FP8's scales;
    num_layers: of that many layers (one KV group's), every layer by default."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPE_BYTES)}")
    per_head = shape.head_dim * KV_DTYPE_BYTES[kv_dtype] + (FP8_SCALE_BYTES if kv_dtype == "fp8" else 0)
    return 2 * (shape.num_kv_layers if num_layers is None else num_layers) * shape.num_kv_heads * per_head


def layers_kv_bytes_per_token(cfg: ModelConfig, kv_dtype: str, layers) -> int:
    """kv_bytes_per_token over the given layers, each with its own KV shape (layer_kv_shape)."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; choose one of {', '.join(KV_DTYPE_BYTES)}")
    extra = FP8_SCALE_BYTES if kv_dtype == "fp8" else 0
    shapes = [cfg.layer_kv_shape(i) for i in layers]
    return sum(2 * heads * (dim * KV_DTYPE_BYTES[kv_dtype] + extra) for heads, dim in shapes)


def sliding_blocks_held(window: int, block_size: int) -> int:
    """The most blocks a sliding layer holds for a request between steps: the query at p reads
    keys p - window < j <= p, so the blocks of keys p - window + 1 .. p - 1 and p's own."""
    return -(-(window - 1) // block_size) + 1


def kv_bytes_per_request(shape: ModelShape, kv_dtype: str, context: int, block_size: int) -> int:
    """One request's KV at `context` tokens: a full layer holds every token, a sliding layer
    only the blocks its next query's window reaches (those wholly behind it are freed:
    cache/manager.py), cdiv(window - 1, block) + 1 blocks: min(window + block, context) tokens
    where the window is a whole number of blocks."""
    full = kv_bytes_per_token(shape, kv_dtype, shape.num_kv_layers - shape.sliding_layers) * context
    full += shape.state_bytes_per_request  # a hybrid's recurrent states: the same at any context
    if not shape.sliding_layers:
        return full
    held = min(sliding_blocks_held(shape.sliding_window, block_size) * block_size, context)
    return full + kv_bytes_per_token(shape, kv_dtype, shape.sliding_layers) * held
