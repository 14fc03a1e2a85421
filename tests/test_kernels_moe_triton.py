"""The Triton MoE experts under the interpreter: both paths (sorted grouped GEMM, decode gemv)
against fused_moe_ref, and the W8A8 sorted path against an exact emulation of what it computes,
with uneven expert loads, experts with no tokens, top-k 1 to 8, odd T, H and I."""
import pytest
import torch
from kernel_utils import assert_close, poison_empty

from ridge.kernels import ops
from ridge.kernels.linear import FP8
from ridge.kernels.moe import act_and_mul, fused_moe_ref
from ridge.kernels.moe_triton import align_block_size, fused_moe_triton
from ridge.quant.fp8 import quantize_fp8

pytestmark = pytest.mark.usefixtures(poison_empty.__name__)

GEMV = dict(path="gemv", BLOCK_M=1, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)
SORTED = dict(path="sorted", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, num_warps=4, num_stages=1)


def routing(T: int, k: int, E: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token drawn with skewed odds: expert 0 takes most tokens, the last
    two none (each token picks among E - 2)."""
    g = torch.Generator().manual_seed(seed)
    odds = torch.cat([torch.tensor([8.0]), torch.linspace(1.0, 0.2, E - 3), torch.zeros(2)])
    ids = torch.stack([torch.multinomial(odds, k, replacement=False, generator=g) for _ in range(T)])
    weights = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return ids.to(torch.int32), weights


def layer(T, k, E, H, inter, *, fp8=True, bias=False, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w1 = torch.randn(E, 2 * inter, H, generator=g) * H ** -0.5
    w2 = torch.randn(E, H, inter, generator=g) * inter ** -0.5
    (w1, s1), (w2, s2) = (quantize_fp8(w1), quantize_fp8(w2)) if fp8 else ((w1, None), (w2, None))
    b1 = torch.randn(E, 2 * inter, generator=g) * 0.5 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.5 if bias else None
    x = (torch.randn(T, H, generator=g) * 2).to(dtype)
    ids, weights = routing(T, k, E, seed)
    return (x, w1, s1, w2, s2, ids, weights), dict(b_gate_up=b1, b_down=b2)


def quant_rows(x: torch.Tensor) -> torch.Tensor:
    """W8A8's per-row activation rounding, dequantized (torch's round-to-nearest-even)."""
    scale = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    return (x.float() / scale).clamp(-448, 448).to(FP8).float() * scale


def w8a8_emulated(x, w1, s1, w2, s2, ids, weights, b_gate_up=None, b_down=None, act="silu"):
    """What the W8A8 sorted path computes: x and the activations h rounded per row to e4m3 with
    their own scale, the products of the fp8 values in fp32, h held in x's dtype."""
    T, k = ids.shape
    out = torch.zeros(x.shape, dtype=torch.float64)
    a = quant_rows(x)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            h = a[t] @ (w1[e].float() * s1[e][:, None]).t()
            h = act_and_mul(h if b_gate_up is None else h + b_gate_up[e], act)[None].to(x.dtype)
            y = quant_rows(h)[0] @ (w2[e].float() * s2[e][:, None]).t()
            out[t] += float(weights[t, j]) * (y if b_down is None else y + b_down[e]).double()
    return out.float()


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_align_block_size_pads_each_expert_run():
    ids, _ = routing(13, 3, 8, seed=4)
    slots, block_expert, num_padded = align_block_size(ids, 8, 4)
    used = int(num_padded)
    counts = torch.bincount(ids.reshape(-1).long(), minlength=8)
    assert used == int(((counts + 3) // 4 * 4).sum()) and counts[-2:].sum() == 0
    assert slots.shape[0] >= used and slots.shape[0] % 4 == 0 and slots.shape[0] == block_expert.shape[0] * 4
    real = slots[:used][slots[:used] < 39]
    assert sorted(real.tolist()) == list(range(39)) and (slots[used:] == 39).all()  # each slot once; padding past
    for b in range(used // 4):
        rows = slots[4 * b: 4 * b + 4]
        rows = rows[rows < 39].long()
        assert rows.numel() > 0 and (ids.reshape(-1)[rows] == block_expert[b]).all()
        assert rows.tolist() == sorted(rows.tolist())  # slot order within an expert
    assert block_expert[:used // 4].tolist() == sorted(block_expert[:used // 4].tolist())


# (T, k, E, H, I): top-k 1, 2, 4 and 8; odd token, hidden and intermediate sizes.
SHAPES = [(1, 1, 4, 40, 24), (3, 2, 8, 37, 19), (5, 4, 8, 48, 33), (2, 8, 10, 32, 16), (17, 2, 6, 24, 40)]


@pytest.mark.parametrize("cfg", [GEMV, SORTED], ids=["gemv", "sorted"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}k{s[1]}" for s in SHAPES])
def test_weight_only_matches_reference(shape, cfg):
    args, kw = layer(*shape)
    out = fused_moe_triton(*args, **kw, cfg=cfg, w8a8=False)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    assert_close(out, fused_moe_ref(*args, **kw), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"T{s[0]}k{s[1]}" for s in SHAPES])
def test_w8a8_sorted_matches_its_emulation(shape):
    args, kw = layer(*shape, bias=shape[1] == 2)
    out = fused_moe_triton(*args, **kw, cfg=SORTED)
    assert rel_err(out, w8a8_emulated(*args, **kw)) < 2e-3
    # Against the weight-only oracle: x and h rounded to e4m3 (~2**-4 / sqrt(3) each), gate and up
    # both carrying x's rounding into their product; a sanity bound, the emulation is the exact check.
    assert rel_err(out, fused_moe_ref(*args, **kw)) < 0.15


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "swigluoai"])
@pytest.mark.parametrize("cfg", [GEMV, SORTED], ids=["gemv", "sorted"])
def test_activations_and_biases(act, cfg):
    # gpt-oss's clamped SwiGLU with its biases; big inputs so that the clamps at +-7 bite.
    args, kw = layer(4, 2, 6, 32, 24, bias=True, seed=7)
    args = (args[0] * 4, *args[1:])
    akw = dict(kw, act=act, swiglu_alpha=1.702, swiglu_limit=7.0)
    assert_close(fused_moe_triton(*args, **akw, cfg=cfg, w8a8=False), fused_moe_ref(*args, **akw),
                 atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cfg", [GEMV, SORTED], ids=["gemv", "sorted"])
def test_float_weights(cfg):
    args, kw = layer(6, 2, 5, 40, 24, fp8=False, bias=True)
    assert_close(fused_moe_triton(*args, **kw, cfg=cfg), fused_moe_ref(*args, **kw), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cfg", [GEMV, SORTED], ids=["gemv", "sorted"])
def test_bf16_activations(cfg):
    args, kw = layer(5, 4, 8, 48, 32, dtype=torch.bfloat16)
    out = fused_moe_triton(*args, **kw, cfg=cfg, w8a8=False)
    assert out.dtype == torch.bfloat16
    assert_close(out, fused_moe_ref(*args, **kw), atol=3e-2, rtol=3e-2)


def test_int64_ids_and_a_block_of_many_slots():
    # One expert owning more slots than a block (BLOCK_M 16): its run spans several blocks.
    args, kw = layer(40, 1, 4, 32, 16, seed=3)
    ids = torch.zeros_like(args[5], dtype=torch.int64)
    ids[::7] = 2
    args = (*args[:5], ids, torch.ones_like(args[6]))
    assert_close(fused_moe_triton(*args, **kw, cfg=SORTED, w8a8=False), fused_moe_ref(*args, **kw),
                 atol=1e-4, rtol=1e-4)


def test_software_fp8_decode(monkeypatch):
    # Pre-sm_89: the weight tiles are decoded from their bits, and the sorted path stays weight-only.
    import ridge.kernels.moe_triton as moe_triton

    monkeypatch.setattr(moe_triton, "native_fp8", lambda t: False)
    args, kw = layer(3, 2, 8, 37, 19)
    for cfg in (GEMV, SORTED):
        assert_close(fused_moe_triton(*args, **kw, cfg=cfg), fused_moe_ref(*args, **kw), atol=1e-4, rtol=1e-4)


def test_ops_dispatch_and_default_choice():
    # Through ops under use_triton(): the interpreter takes the first candidate for the size.
    for T in (2, 9):
        args, kw = layer(T, 2, 6, 32, 16, seed=T)
        with ops.use_triton():
            out = ops.fused_moe(*args, **kw)
        assert rel_err(out, w8a8_emulated(*args, **kw) if T > 4 else fused_moe_ref(*args, **kw)) < 2e-3


def test_empty_batch_and_bad_shapes():
    args, kw = layer(3, 2, 6, 32, 16)
    x, w1, s1, w2, s2, ids, weights = args
    assert fused_moe_triton(x[:0], w1, s1, w2, s2, ids[:0], weights[:0]).shape == (0, 32)
    with pytest.raises(AssertionError):
        fused_moe_triton(x[:, :31], w1, s1, w2, s2, ids, weights)
    with pytest.raises(AssertionError):
        fused_moe_triton(x, w1, None, w2, s2, ids, weights)
