"""Qwen3.5 (text), as transformers' modeling_qwen3_5 computes it: three layers in four (layer_types)
run Gated DeltaNet, a linear attention whose state lives in the slot pool beside the paged KV
(cache/state_cache.py); the others run gated attention over the paged KV.

Gated DeltaNet layer, per token (in_proj's rows [q k v | z | b | a], fused at load):
- q, k, v pass a causal depthwise convolution of linear_conv_kernel_dim taps, then SiLU (the
  window of the last K - 1 inputs is the request's conv state);
- beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias), the log decay;
- the gated delta rule over L2-normed q and k (kernels/gated_delta.py), each q/k head serving
  Hv / Hk value heads: the chunked form for prefill chunks, the recurrent one for decodes and
  speculative steps (which keep the state after each verified token: cache/state_cache.py);
- o = RMSNorm(o) * silu(z) over each value head (its weight plain, not 1 + w), then out_proj.

Gated attention layer: q_proj's rows are [q | gate] per head (split into qkv_proj's rows
[q | k | v | gate] at load); QK-norm per head; RoPE on the first partial_rotary_factor of each
head (text positions are one position for mrope's three sections: the plain rotation); the
attention's output times sigmoid(gate), then o_proj. Every other RMSNorm multiplies by 1 + w,
stored shifted at load (ridge/models/qwen3_5/__init__.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.kernels import ops
from ridge.quant.linear import FP8Linear

from ..layers.decoder import ACT_AND_MUL, DecoderLayer, RMSNorm
from ..layers.mrope import MRopeCausalLM


class GatedAttentionLayer(DecoderLayer):
    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__(cfg, index)
        # rows [q | k | v | gate]: the gate is a second q-sized output
        self.qkv_proj = FP8Linear(cfg.hidden_size, 2 * cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)

    def attention(self, h, positions, cos_sin, meta, kv):
        cfg = self.cfg
        T = h.shape[0]
        q, k, v, gate = self.qkv_proj.forward(h).split([cfg.q_size, cfg.kv_size, cfg.kv_size, cfg.q_size], dim=-1)
        q = q.reshape(T, cfg.num_heads, cfg.head_dim)  # [T, H, D]
        k = k.reshape(T, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        v = v.reshape(T, cfg.num_kv_heads, cfg.head_dim)
        q, k = self.norm_qk(q, k)
        q, k = ops.rope(q, k, positions, cos_sin, meta)
        gm = meta.group(self.kv_group) if self.kv_group else meta
        rot = ops.kv_rotation(kv.k, cfg.head_dim, k.dtype, k.device)
        if rot is not None:  # an FP8 cache holds K H and V H (kernels/kv_cache.py)
            q, k, v = q @ rot[1], k @ rot[0], v @ rot[0]
        ops.write_kv(k, v, kv.k, kv.v, kv.k_scale, kv.v_scale, gm.slot_mapping, gm)
        o = ops.paged_attention(q, kv.k, kv.v, kv.k_scale, kv.v_scale, gm, self.scale, window=self.window)
        if rot is not None:
            o = o @ rot[1]
        o = o.reshape(T, cfg.q_size) * torch.sigmoid(gate)
        return self.o_proj.forward(o)


class GatedDeltaNetLayer(nn.Module):
    """A linear-attention layer and its MLP; kv is its LayerState (cache/state_cache.py)."""

    def __init__(self, cfg: ModelConfig, index: int = 0):
        super().__init__()
        self.cfg = cfg
        la = cfg.linear_attention
        self.hk, self.hv = la["num_key_heads"], la["num_value_heads"]
        self.dk, self.dv = la["key_head_dim"], la["value_head_dim"]
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        self.conv_dim = 2 * self.key_dim + self.value_dim
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.in_proj = FP8Linear(h, self.conv_dim + self.value_dim + 2 * self.hv)  # [qkv | z | b | a]
        self.out_proj = FP8Linear(self.value_dim, h)
        self.gated_norm = RMSNorm(self.dv, cfg.rms_norm_eps)
        self.register_buffer("conv1d_weight", torch.empty(0))  # [conv_dim, K] fp32
        self.register_buffer("A_log", torch.empty(0))  # [Hv] fp32
        self.register_buffer("dt_bias", torch.empty(0))  # [Hv] fp32
        self.gate_up_proj = FP8Linear(h, 2 * cfg.intermediate_size)
        self.down_proj = FP8Linear(cfg.intermediate_size, h)
        self.act_and_mul = ACT_AND_MUL[cfg.hidden_act]

    def load_extra(self, sd, prefix: str, device: torch.device) -> None:
        """The tensors outside FP8Linear and RMSNorm: the convolution's taps, the decay's A_log and dt_bias."""
        for name in ("conv1d_weight", "A_log", "dt_bias"):
            setattr(self, name, sd[prefix + name].float().contiguous().to(device))

    def linear_attention(self, h, meta, state):
        T = h.shape[0]
        proj = self.in_proj.forward(h)
        x, z, b, a = proj.split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        # A step of decodes only (one token each, every one after its first) takes the one-token forms;
        # a speculative step the token-by-token ones, which keep the state after each token (keep).
        keep = meta.token_state_slots
        decode = keep is None and all(q == 1 and s > 1 for q, s in zip(meta.query_lens_host, meta.seq_lens_host))
        x = x.float()
        if decode:
            x = ops.causal_conv1d_update(x, self.conv1d_weight, None, state.conv, meta.state_slots,
                                         activation="silu")
        else:
            x = ops.causal_conv1d(x, self.conv1d_weight, None, state.conv, meta.query_start_loc, meta.state_slots,
                                  meta.has_initial_state, activation="silu", token_state_slots=keep)
        q, k, v = x.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.hk, self.dk)
        k = k.reshape(T, self.hk, self.dk)
        v = v.reshape(T, self.hv, self.dv)
        beta = torch.sigmoid(b.float()).contiguous()  # [T, Hv]
        g = (-torch.exp(self.A_log) * F.softplus(a.float() + self.dt_bias)).contiguous()  # [T, Hv], <= 0
        args = (q, k, v, g, beta, state.recurrent, meta.query_start_loc, meta.state_slots, meta.has_initial_state)
        if decode or keep is not None:
            o = ops.gated_delta_rule_recurrent(*args, use_qk_l2norm=True, token_state_slots=keep)  # [T, Hv, Dv]
        else:
            o = ops.gated_delta_rule_chunk(*args, use_qk_l2norm=True)
        o = self.gated_norm.forward(o.reshape(T * self.hv, self.dv))[0] * F.silu(z.float().reshape(T * self.hv, self.dv))
        return self.out_proj.forward(o.reshape(T, self.value_dim).to(h.dtype))

    def forward(self, h, residual, positions, cos_sin, meta, kv):
        h, residual = self.input_layernorm.forward(h, residual)
        h = self.linear_attention(h, meta, kv)
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return self.mlp(h), residual

    def mlp(self, h):  # a sparse layer's own (ridge/models/qwen3_next/model.py)
        return self.down_proj.forward(self.act_and_mul(self.gate_up_proj.forward(h)))


class Qwen35CausalLM(MRopeCausalLM):  # an image's tokens rotate by three positions (Qwen3.5 with vision)
    def make_layer(self, cfg: ModelConfig, index: int) -> nn.Module:
        return GatedDeltaNetLayer(cfg, index) if cfg.is_linear_layer(index) else GatedAttentionLayer(cfg, index)

    def load_layer(self, i: int, sd, device: torch.device, dtype: torch.dtype) -> None:
        super().load_layer(i, sd, device, dtype)
        layer = self.layers[i]
        if isinstance(layer, GatedDeltaNetLayer):
            layer.load_extra(sd, f"layers.{i}.", device)
