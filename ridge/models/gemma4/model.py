"""Gemma 4 (text) decoder: Gemma 3's layer (ridge/models/gemma2/model.py) with, as transformers'
Gemma4TextModel computes them (the oracle of tests/test_gemma4.py):
- norms that multiply by w itself (not 1 + w); q and k normed per head, v too with no weight;
  softmax scale 1 (the norms set the scores' size);
- a per-layer scalar on the whole residual stream after each layer (layer_scalar);
- per-layer input embeddings (hidden_size_per_layer_input = P): a second table gives each token
  P values a layer, sqrt(P)-scaled; the scaled embedding projected to L x P, times hidden ** -0.5
  and RMS-normed per layer, is added, and the sum is times 2 ** -0.5. Layer i gates its output
  with them: out + norm(proj(gelu_tanh(gate(out)) * input_i));
- KV-shared layers (cfg.extra["kv_source"]): they attend over their source layer's paged K and V
  (the same block table: the same layer type, so the same KV group) and write none;
- full layers with their own head size and KV heads (global_head_dim, global_kv_heads): each
  layer is built from its own shape, and the full layers' RoPE table spans their heads;
- the MoE variant (cfg.num_experts): beside the dense MLP, a router reading the stream before the
  MLP (RMS-normed without a weight, times its own scale and hidden ** -0.5; softmax over every
  expert, the top k renormalised, each times its expert's scale) and the experts on the stream
  normed apart; each branch normed on its own, their sum normed again (post_feedforward_layernorm)."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from ridge.config import ModelConfig
from ridge.kernels import ops
from ridge.kernels.timing import section
from ridge.quant.linear import FP8Linear

from ridge.quant.experts import FP8Experts

from ..gemma2.model import GemmaCausalLM, GemmaDecoderLayer
from ..layers.decoder import RMSNorm
from ..layers.moe import Router
from ..layers.rope import rope_cos_sin


class Gemma4Router(Router):
    """ModelConfig.moe_router "softmax_topk_scaled": Gemma4TextRouter's rule."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.eps, self.root = cfg.rms_norm_eps, cfg.hidden_size ** -0.5
        self.register_buffer("input_scale", torch.empty(0))  # [H] fp32: the normed input's own scale
        self.register_buffer("per_expert_scale", torch.empty(0))  # [E] fp32

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with section("router"):
            x = h.float()
            x = x * torch.pow(x.pow(2).mean(-1, keepdim=True) + self.eps, -0.5) * self.input_scale * self.root
            weights, ids = torch.topk(torch.softmax(F.linear(x, self.weight), dim=-1), self.k, dim=-1)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids, weights * self.per_expert_scale[ids]


class Gemma4DecoderLayer(GemmaDecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int):
        self.kv_source = cfg.extra["kv_source"][index]  # None: the layer computes its own K and V
        if cfg.extra["double_wide_mlp"] and self.kv_source is not None:
            cfg = dataclasses.replace(cfg, intermediate_size=2 * cfg.intermediate_size)
        heads, dim = cfg.layer_kv_shape(index)
        if (heads, dim) != (cfg.num_kv_heads, cfg.head_dim):  # a full layer's own heads
            cfg = dataclasses.replace(cfg, num_kv_heads=heads, head_dim=dim)
        super().__init__(cfg, index)
        if self.kv_source is not None:
            # q alone (named qkv_proj as the FP8 recipes name the attention's input product): the
            # source layer's K and V serve this one
            self.qkv_proj = FP8Linear(cfg.hidden_size, cfg.q_size, bias=cfg.attention_bias)
            del self.k_norm
        self.per_layer = cfg.extra["per_layer_input"]
        if self.per_layer:
            self.register_buffer("per_layer_input_gate", torch.empty(self.per_layer, cfg.hidden_size))
            self.register_buffer("per_layer_projection", torch.empty(cfg.hidden_size, self.per_layer))
            self.post_per_layer_input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.register_buffer("layer_scalar", torch.ones(1))
        self.v_scale: torch.Tensor | None = None  # ones: v's RMS norm has no weight (set at load)
        self.router = self.experts = None
        if cfg.num_experts:
            self.router = Gemma4Router(cfg)
            self.experts = FP8Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)
            for name in ("post_feedforward_layernorm_1", "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2"):
                setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def block(self, h, residual, positions, cos_sin, meta, kv):
        """Gemma's attention and MLP (GemmaDecoderLayer.forward), with the MoE variant's experts
        beside the MLP."""
        if self.experts is None:
            return super().forward(h, residual, positions, cos_sin, meta, kv)
        h, residual = self.input_layernorm.forward(h, residual)
        h = self.post_attention_layernorm.forward(self.attention(h, positions, cos_sin, meta, kv))[0]
        h, residual = self.pre_feedforward_layernorm.forward(h, residual)
        dense = self.post_feedforward_layernorm_1.forward(self.mlp(h))[0]
        ids, weights = self.router.forward(residual)
        sparse = self.experts.forward(self.pre_feedforward_layernorm_2.forward(residual)[0], ids, weights)
        h = dense + self.post_feedforward_layernorm_2.forward(sparse)[0]
        return self.post_feedforward_layernorm.forward(h)[0], residual

    def attention(self, h, positions, cos_sin, meta, kv):
        cfg = self.cfg
        T = h.shape[0]
        qkv = self.qkv_proj.forward(h)
        q = self.q_norm.forward(qkv[:, :cfg.q_size].reshape(T, cfg.num_heads, cfg.head_dim))[0]
        gm = meta.group(self.kv_group) if self.kv_group else meta
        rot = ops.kv_rotation(kv.k, cfg.head_dim, q.dtype, q.device)
        if self.kv_source is None:
            k, v = qkv[:, cfg.q_size:].split([cfg.kv_size, cfg.kv_size], dim=-1)
            k = self.k_norm.forward(k.reshape(T, cfg.num_kv_heads, cfg.head_dim))[0]
            v = ops.rms_norm(v.reshape(T, cfg.num_kv_heads, cfg.head_dim).contiguous(), self.v_scale,
                             cfg.rms_norm_eps)[0]
            q, k = ops.rope(q, k, positions, cos_sin, meta)
            if rot is not None:  # an FP8 cache holds K H and V H (kernels/kv_cache.py)
                k, v = k @ rot[0], v @ rot[0]
            ops.write_kv(k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, gm.slot_mapping, gm)
        else:  # the source layer wrote this step's K and V already; the op rotates q beside a k
            q, _ = ops.rope(q, q[:, :1].clone(), positions, cos_sin, meta)
        if rot is not None:
            q = q @ rot[1]
        o = ops.paged_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, gm, self.scale, window=self.window)
        if rot is not None:
            o = o @ rot[1]
        return self.o_proj.forward(o.reshape(T, cfg.q_size))

    def forward(self, h, residual, positions, cos_sin, meta, kv, per_layer_input=None, from_model=False):
        if not from_model and (self.per_layer or self.kv_source is not None):
            # fp8_stream.walk (the calibrated FP8 recipes) runs each layer on its own cache and
            # without the model's per-layer inputs
            raise RuntimeError("Gemma 4's per-layer inputs and KV-shared layers need its model's forward: the "
                               "calibrated FP8 recipes do not run it yet (use --fp8-recipe channel)")
        h, residual = self.block(h, residual, positions, cos_sin, meta, kv)
        h = h + residual  # the layer scalar scales the whole stream
        if self.per_layer:
            gate = F.gelu(F.linear(h, self.per_layer_input_gate), approximate="tanh") * per_layer_input
            h = h + self.post_per_layer_input_norm.forward(F.linear(gate, self.per_layer_projection))[0]
        return h * self.layer_scalar, None


class Gemma4CausalLM(GemmaCausalLM):
    def __init__(self, cfg: ModelConfig, max_model_len: int | None = None):
        super().__init__(cfg, max_model_len)
        P = cfg.extra["per_layer_input"]
        if P:
            L = cfg.num_layers
            self.register_buffer("embed_tokens_per_layer", torch.empty(cfg.vocab_size, L * P))
            self.register_buffer("per_layer_model_projection", torch.empty(L * P, cfg.hidden_size))
            self.per_layer_projection_norm = RMSNorm(P, cfg.rms_norm_eps)
        self.per_layer_scale = 1.0
        ids = cfg.extra["placeholders"]
        self.placeholders = torch.tensor(ids, device="cpu") if ids else None

    def make_layer(self, cfg: ModelConfig, index: int):
        return Gemma4DecoderLayer(cfg, index)

    def per_layer_inputs(self, input_ids: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """[T] ids, [T, hidden] scaled embeddings -> [T, L, P] (transformers' get_per_layer_inputs
        then project_per_layer_inputs)."""
        cfg = self.cfg
        T, L, P = h.shape[0], cfg.num_layers, cfg.extra["per_layer_input"]
        table = self.embed_tokens_per_layer[input_ids] * self.per_layer_scale
        proj = F.linear(h, self.per_layer_model_projection) * cfg.hidden_size ** -0.5
        proj = self.per_layer_projection_norm.forward(proj.reshape(T, L, P).contiguous())[0]
        return (proj + table.reshape(T, L, P)) * 2.0 ** -0.5

    @torch.inference_mode()
    def forward(self, input_ids, positions, meta, kv_caches: list, num_layers: int | None = None, embeds=None):
        """embeds: (rows, values), an image's rows (encoder.py) in place of its placeholders'. Their
        per-layer inputs look the pad token up in the per-layer table and project the image's rows,
        as transformers' text model does with the embeddings it is handed."""
        if self.placeholders is not None:  # the multimodal model's text path embeds them as the pad token
            input_ids = torch.where(torch.isin(input_ids, self.placeholders.to(input_ids.device)),
                                    self.cfg.extra["pad_token_id"], input_ids)
        with section("embed"):
            h = self.embed(input_ids)
        if embeds is not None:
            h = h.index_copy(0, embeds[0], embeds[1].to(h.dtype))
        per_layer = self.per_layer_inputs(input_ids, h) if self.cfg.extra["per_layer_input"] else None
        residual = None
        sources = self.cfg.extra["kv_source"]
        for i, layer in enumerate(self.layers[: num_layers or len(self.layers)]):
            kv = kv_caches[i if sources[i] is None else sources[i]]
            h, residual = layer.forward(h, residual, positions, self.rope_for(layer), meta, kv,
                                        None if per_layer is None else per_layer[:, i], from_model=True)
        return self.norm.forward(h, residual)[0]

    def load_globals(self, sd, device, dtype, freq_factors=None) -> None:
        # freq_factors: a GGUF's rope_freqs, the full layers' proportional RoPE, which gemma4/gguf.py
        # reads into rope_scaling; the tables below are built from that
        super().load_globals(sd, device, dtype)
        cfg = self.cfg
        if cfg.global_head_dim is not None:  # the full layers' table, over their wider heads
            self.cos_sin = rope_cos_sin(cfg.global_head_dim, self.max_model_len, cfg.rope_theta,
                                        cfg.rope_scaling).to(device)
        P = self.cfg.extra["per_layer_input"]
        if P:
            for name in ("embed_tokens_per_layer", "per_layer_model_projection"):
                setattr(self, name, sd[name + ".weight"].to(device=device, dtype=dtype))
            # transformers: the table times torch.tensor(sqrt(P)) cast to the weights' dtype
            self.per_layer_scale = float(torch.tensor(P ** 0.5).to(dtype))

    def load_layer(self, i, sd, device, dtype) -> None:
        super().load_layer(i, sd, device, dtype)
        layer, p = self.layers[i], f"layers.{i}."
        layer.layer_scalar = sd[p + "layer_scalar"].to(device=device, dtype=dtype)
        layer.v_scale = torch.ones(layer.cfg.head_dim, device=device)
        if layer.per_layer:
            for name in ("per_layer_input_gate", "per_layer_projection"):
                setattr(layer, name, sd[p + name + ".weight"].to(device=device, dtype=dtype))
        if layer.experts is not None:  # the router in fp32, as every family's (layers/moe.py)
            for ours, name in (("weight", "weight"), ("input_scale", "scale"), ("per_expert_scale", "per_expert_scale")):
                setattr(layer.router, ours, sd[p + "router." + name].float().to(device))
            layer.experts.load({k[len(p) + 8:]: t for k, t in sd.items() if k.startswith(p + "experts.")}, device, dtype)
