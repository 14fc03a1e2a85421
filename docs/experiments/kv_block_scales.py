"""FP8 KV: per-(token, head) scales (ridge's) against per-(16-token block, head) scales, with fp32
weights so that only the cache's error shows (docs/benchmarks.md, issue 29). K and V are
fake-quantized where the model writes them; a block's scale is its amax over the whole block,
the best a block scale can do (a real cache fixes it before the block fills).

    python docs/experiments/kv_block_scales.py"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from _common import agree, ref, refs, texts  # noqa: E402

import ridge.kernels.kv_cache as kc  # noqa: E402
import ridge.models.layers.decoder as llama  # noqa: E402
from ridge.models.oneshot import prompt_logits  # noqa: E402


def hadamard(n):
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


H = hadamard(ref.cfg.head_dim)


def per_token(x):
    q, s = kc.quantize_kv(x)
    return q.float() * s.float()[..., None]


def per_block(x, bs=16):  # prompt_logits writes a prompt in one call, positions in order
    T, nh, D = x.shape
    xp = torch.cat([x, x.new_zeros((-T) % bs, nh, D)])
    xb = xp.view(-1, bs, nh, D)
    s = (xb.abs().amax(dim=(1, 3), keepdim=True).float() / kc.FP8_MAX).clamp(min=kc.MIN_SCALE)
    s = s.to(kc.SCALE_DTYPE).float()
    return ((xb.float() / s).clamp(-kc.FP8_MAX, kc.FP8_MAX).to(kc.FP8).float() * s).view(-1, nh, D)[:T]


def rotated(f):
    return lambda x: f(x @ H) @ H.t()


write = llama.ops.write_kv
fake = {}
llama.ops.write_kv = lambda k, v, *rest: write(fake["f"](k), fake["f"](v), *rest)
for name, f in (("per (token, head), rotated (ridge's)", rotated(per_token)),
                ("per (16-token block, head), rotated", rotated(per_block)),
                ("per (16-token block, head), plain", per_block)):
    fake["f"] = f
    cols = [f"{n}: KL {k:.5f} top-1 {t:.4f}" for n, ids in texts.items()
            for t, k in [agree(prompt_logits(ref, ids), refs[n])]]
    print(name, "|", " | ".join(cols), flush=True)
