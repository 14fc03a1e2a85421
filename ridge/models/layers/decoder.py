"""The dense decoder over a flattened batch: llama's layer and model, which the dense families
run as they are and the others build on (ridge/models/<family>/model.py, layers/moe.py).

The forward pass takes every scheduled token of every request in one
[num_tokens] row, with positions and attention metadata; attention reads and
writes the paged KV cache. Linear layers are fused (qkv, gate_up) so each
layer runs four matrix products."""
from __future__ import annotations

import torch
from torch import nn

from ridge.config import ModelConfig
from ridge.kernels import ops
from ridge.kernels.decoder_native import LayerSpec
from ridge.kernels.metadata import AttentionMetadata
from ridge.kernels.timing import section
from ridge.quant.embedding import load_table_and_head
from ridge.quant.experts import FP8Experts
from ridge.quant.linear import FP8Linear, packed_image

from .rope import query_log_scale, rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("weight", torch.ones(dim))

    def forward(self, x, residual=None):
        return ops.rms_norm(x, self.weight, self.eps, residual)


# ModelConfig.hidden_act (transformers' ACT2FN name) -> the gated MLP's op.
ACT_AND_MUL = {"silu": ops.silu_and_mul, "gelu": ops.gelu_and_mul, "gelu_pytorch_tanh": ops.gelu_tanh_and_mul}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.qkv_proj = FP8Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = FP8Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.gate_up_proj = FP8Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = FP8Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.act_and_mul = ACT_AND_MUL[cfg.hidden_act]
        self.qk_norm = cfg.qk_norm  # a family may norm q and k on some layers only (Llama 4)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.softmax_scale or cfg.head_dim ** -0.5
        self.window = cfg.layer_window(index)  # None: the layer attends to the whole context
        # A sliding layer of a family with a RoPE of its own for them (Gemma 3, OLMo 3:
        # ModelConfig.rope_local_theta) takes the model's cos_sin_local instead of cos_sin.
        self.local_rope = self.window is not None and cfg.rope_local_theta is not None
        self.kv_group = cfg.kv_group_of(index)  # whose block table and slots it uses (meta.group)
        self.softcap = None  # the attention scores' soft-cap (Gemma 2)
        self.sinks = None  # [num_heads] fp32: a logit per head in the softmax's denominator (gpt-oss)
        self.rotary = not cfg.nope_layers or index not in cfg.nope_layers  # False: a NoPE layer
        self.query_scale = cfg.query_scale

    def attention(self, h, positions, cos_sin, meta, kv):
        cfg = self.cfg
        T = h.shape[0]
        q, k, v = self.qkv_proj.forward(h).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)  # [T, H, D]
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        if self.qk_norm:
            q, k = self.norm_qk(q, k)
        if self.rotary:
            q, k = ops.rope(q, k, positions, cos_sin, meta)
        if self.query_scale is not None:
            q = q * query_log_scale(positions, **self.query_scale).to(q.dtype)[:, None, None]
        gm = meta.group(self.kv_group) if self.kv_group else meta
        rot = ops.kv_rotation(kv.k, cfg.head_dim, k.dtype, k.device)
        if rot is not None:  # an FP8 cache holds K H and V H (kernels/kv_cache.py): exact, fewer FP8 errors
            q, k, v = q @ rot[1], k @ rot[0], v @ rot[0]
        ops.write_kv(k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, gm.slot_mapping, gm)
        o = ops.paged_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, gm, self.scale,
                                window=self.window, softcap=self.softcap, sinks=self.sinks)
        if rot is not None:
            o = o @ rot[1]
        return self.o_proj.forward(o.reshape(T, cfg.q_size))

    def norm_qk(self, q, k):
        """q: [T, H, D], k: [T, Hkv, D], each head normed on its own (qwen3)."""
        return self.q_norm.forward(q)[0], self.k_norm.forward(k)[0]

    def mlp(self, h):
        return self.down_proj.forward(self.act_and_mul(self.gate_up_proj.forward(h)))

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        # .forward, not __call__: no hooks are used, and a batch-1 step makes about 200 of these
        # calls, at a few microseconds of nn.Module dispatch each.
        h, residual = self.input_layernorm.forward(h, residual)
        h = self.attention(h, positions, cos_sin, meta, kv)
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_model_len: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.max_model_len = min(max_model_len or cfg.max_position, cfg.max_position)
        # No initialisation: load_weights replaces the table, and a random init on the meta device
        # imports torch's compiler stack (1.4 s of start-up).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = FP8Linear(cfg.hidden_size, cfg.vocab_size)
        # Built by load_weights on the model's device (on the meta device, building it here would
        # import torch's compiler stack: 1.3 s of start-up).
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.register_buffer("cos_sin_local", torch.empty(0), persistent=False)  # rope_local_theta's, where set

    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        """Layer `index` of the stack (a family's model overrides it: ridge/models/gemma2/model.py)."""
        return DecoderLayer(cfg, index)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list, num_layers: int | None = None, embeds=None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden].
        num_layers runs only the first L layers (the self-draft); embeds: (rows, values) that
        replace those rows' token embeddings (an image's encoder output: engine/encoder.py)."""
        with section("embed"):
            h = self.embed(input_ids)
            if embeds is not None:
                h = h.index_copy(0, embeds[0], embeds[1].to(h.dtype))
        layers = self.layers[:num_layers] if num_layers else self.layers  # a slice builds a ModuleList
        done = ops.decoder_layers(self.layer_stack(), h, positions, meta, kv_caches, len(layers))
        if done is not None:
            h, residual = done
        else:
            residual = None
            for layer, kv in zip(layers, kv_caches):
                h, residual = layer.forward(h, residual, positions, self.rope_for(layer), meta, kv)
        return self.norm.forward(h, residual)[0]

    def layer_stack(self):
        """The layers as ops.decoder_layers may run them in one C call (built once: kernels/decoder_native.py)."""
        stack = self.__dict__.get("_native_stack")
        if stack is None:
            linears = [m for layer in self.layers for m in layer.modules() if isinstance(m, FP8Linear)]
            stack = self.__dict__["_native_stack"] = ops.layer_stack(self.plain_layer_specs, linears)
        return stack

    def plain_layer_specs(self) -> list | None:
        """Each layer as kernels/decoder_native.py's LayerSpec, or None where one is not llama's
        layer: its attention (per-head norms taken) and either its SiLU MLP or a MLP of the layer's
        own (a mixture of experts, run between C calls); a family's own attention or forward, a
        query scale, soft-capped or sink logits, a KV group of its own, or another norm is not."""
        specs = []
        for layer in self.layers:
            kind = type(layer)
            if (not isinstance(layer, DecoderLayer) or layer.query_scale is not None or layer.softcap is not None
                    or layer.sinks is not None or layer.kv_group
                    or any(getattr(kind, f) is not getattr(DecoderLayer, f) for f in ("forward", "attention", "norm_qk"))):
                return None
            own_mlp = kind.mlp is not DecoderLayer.mlp  # a mixture of experts: run in Python between calls
            if not own_mlp and layer.act_and_mul is not ops.silu_and_mul:
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm]
            norms += [layer.q_norm, layer.k_norm] if layer.qk_norm else []
            mods = (layer.qkv_proj, layer.o_proj) + (() if own_mlp else (layer.gate_up_proj, layer.down_proj))
            if (any(type(n) is not RMSNorm or n.eps != norms[0].eps for n in norms)
                    or any(type(m) is not FP8Linear or m.cpu is None for m in mods)):
                return None
            cfg, heads = layer.cfg, norms[2:] or [None, None]
            specs.append(LayerSpec(
                tuple(m.cpu for m in mods) + (None, None) * own_mlp, tuple(m._buffers.get("bias") for m in mods),
                norms[0].weight, norms[1].weight, norms[0].eps, layer.scale, cfg.num_heads, cfg.num_kv_heads,
                cfg.head_dim, layer.window, self.rope_for(layer) if layer.rotary else None,
                *(n if n is None else n.weight for n in heads), layer.mlp if own_mlp else None,
                self._moe_spec(layer) if own_mlp else None))
        return specs

    @staticmethod
    def _moe_spec(layer):
        """A layer's own MLP as the C stack may run it: a mixture of experts' spec where the
        layer's MLP is that mixture's own (moe_spec), unchanged by its family."""
        spec = getattr(layer, "moe_spec", None)
        owner = next((k for k in type(layer).__mro__ if "mlp" in k.__dict__), None)
        return spec() if spec is not None and owner is not None and "moe_spec" in owner.__dict__ else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        with section("lm_head"):
            return self.lm_head(hidden).float()

    @property
    def dtype(self) -> torch.dtype:
        return getattr(self.embed_tokens, "dtype", self.embed_tokens.weight.dtype)  # PackedEmbedding's: its output's

    def rope_for(self, layer) -> torch.Tensor:
        """The RoPE table a layer rotates by: cos_sin_local for a sliding layer of a family with its
        own table for them (ModelConfig.rope_local_theta), else cos_sin."""
        return self.cos_sin_local if getattr(layer, "local_rope", False) else self.cos_sin  # recurrent layers: none

    def load_weights(self, sd: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
                     freq_factors: torch.Tensor | None = None) -> None:
        """sd: the fused, possibly FP8 state dict (quant/). Norms stay fp32."""
        self.load_globals(sd, device, dtype, freq_factors)
        for i in range(len(self.layers)):
            self.load_layer(i, sd, device, dtype)

    @staticmethod
    def _load_modules(modules, sd, device: torch.device, dtype: torch.dtype) -> None:
        for name, mod in modules:
            if isinstance(mod, FP8Linear):
                shape = (mod.out_features, mod.in_features)
                image = packed_image(sd, name, shape) if ops.resident_e4m3(device, shape) else None
                if image is not None:  # mapped from a CPU image (ridge/models/cpu_image.py): no copy
                    mod.hold(image, sd.get(name + ".bias"), dtype)
                    continue
                mod.load(sd[name + ".weight"], sd.get(name + ".weight_scale"), sd.get(name + ".bias"), device, dtype)
            elif isinstance(mod, RMSNorm):
                mod.weight = sd[name + ".weight"].float().to(device)

    def load_layer(self, i: int, sd, device: torch.device, dtype: torch.dtype) -> None:
        """Layer i's weights from sd (which needs hold no other layer's): a streamed conversion
        loads, runs and drops one layer at a time (fp8_stream.walk)."""
        self._load_modules(self.layers[i].named_modules(prefix=f"layers.{i}"), sd, device, dtype)

    def load_globals(self, sd, device: torch.device, dtype: torch.dtype,
                     freq_factors: torch.Tensor | None = None) -> None:
        """Everything but the decoder layers: the embedding, final norm, head and RoPE tables."""
        mods = [(n, m) for n, m in self.named_modules() if n and not n.startswith("layers")]
        self._load_modules([(n, m) for n, m in mods if n != "lm_head"], sd, device, dtype)
        load_table_and_head(self, sd, device, dtype)  # 8 bits on a CPU, a tied head the table's bytes
        cfg = self.cfg
        self.cos_sin = rope_cos_sin(cfg.head_dim, self.max_model_len, cfg.rope_theta, cfg.rope_scaling,
                                    freq_factors=freq_factors, rotary_dim=cfg.rotary_dim).to(device)
        if cfg.rope_local_theta is not None:  # the sliding layers' own table
            self.cos_sin_local = rope_cos_sin(cfg.head_dim, self.max_model_len, cfg.rope_local_theta,
                                              cfg.rope_local_scaling).to(device)

    def weight_bytes(self) -> int:
        tables = self._non_persistent_buffers_set  # the RoPE tables: derived, not weights
        tensors = list(self.parameters()) + [b for n, b in self.named_buffers() if n not in tables and b is not None]
        unique = {t.data_ptr(): t for t in tensors}  # a tied head shares the embedding's storage
        lowp = [t for m in self.modules() if isinstance(m, FP8Linear) and m.cpu is not None for t in m.cpu.copies.values()]
        lowp += [t for m in self.modules() if isinstance(m, FP8Experts) for t in m.cpu_copies()]  # stacked experts'
        # A stand-in expanded from one byte (quant/experts.py shape_only) holds its storage, not its numel.
        return sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in list(unique.values()) + lowp)
