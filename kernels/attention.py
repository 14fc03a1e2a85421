"""Paged attention over a mixed batch (prefill chunks and decodes in one call).

Reference implementation in torch. It is the oracle for the Triton kernel and
the path the engine runs on CPU, so it is written for CPU speed: every
single-token query (a decode) is handled in one batched call, and each
multi-token query (a prefill chunk) in one call of its own, O(batch) Python.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kv_cache import gather_kv
from .metadata import AttentionMetadata


def _attend(q, k, v, mask, scale):
    # q: [B, H, Tq, D]; k, v: [B, Hkv, L, D]; mask: [B, 1, Tq, L] bool (True = attend)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=q.shape[1] != k.shape[1])


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                        meta: AttentionMetadata, softmax_scale: float) -> torch.Tensor:
    """q: [T, H, D] -> out [T, H, D]. Query token j of a sequence with q_len n and
    context length L sits at position L - n + j and sees keys 0 .. L - n + j."""
    num_tokens, num_heads, head_dim = q.shape
    block_size = k_cache.shape[1]
    assert k_cache.shape[-1] == head_dim and num_heads % k_cache.shape[2] == 0
    assert num_tokens == sum(meta.query_lens_host)
    out = torch.empty_like(q)
    qlens, slens = meta.query_lens_host, meta.seq_lens_host
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)

    decodes = [i for i, n in enumerate(qlens) if n == 1]
    if decodes:
        max_len = max(slens[i] for i in decodes)
        nb = math.ceil(max_len / block_size)
        rows = torch.tensor([starts[i] for i in decodes])
        seqs = torch.tensor(decodes)
        blocks = meta.block_table.to(q.device)[seqs.to(q.device), :nb].long()
        k = gather_kv(k_cache, k_scale, blocks, q.dtype).transpose(1, 2)  # [Bd, Hkv, L, D]
        v = gather_kv(v_cache, v_scale, blocks, q.dtype).transpose(1, 2)
        lens = meta.seq_lens.to(q.device)[seqs.to(q.device)]
        mask = (torch.arange(nb * block_size, device=q.device) < lens[:, None])[:, None, None, :]
        o = _attend(q[rows.to(q.device)].unsqueeze(2), k, v, mask, softmax_scale)  # [Bd, H, 1, D]
        out[rows.to(q.device)] = o.squeeze(2)

    for i, n in enumerate(qlens):
        if n <= 1:
            continue
        L = slens[i]
        nb = math.ceil(L / block_size)
        blocks = meta.block_table[i, :nb].to(q.device).long()
        k = gather_kv(k_cache, k_scale, blocks, q.dtype)[:L].transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        v = gather_kv(v_cache, v_scale, blocks, q.dtype)[:L].transpose(0, 1).unsqueeze(0)
        qi = q[starts[i]:starts[i] + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        q_pos = torch.arange(L - n, L, device=q.device)
        mask = (torch.arange(L, device=q.device)[None, :] <= q_pos[:, None])[None, None]
        out[starts[i]:starts[i] + n] = _attend(qi, k, v, mask, softmax_scale)[0].transpose(0, 1)
    return out


def contiguous_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Plain causal attention over one whole sequence, the oracle for paging.
    q: [T, H, D]; k, v: [T, Hkv, D]."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       is_causal=True, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
    return o[0].transpose(0, 1)
