"""The CPU mixture-of-experts kernel (kernels/csrc/fp8_linear.c, fp8_moe; kernels/moe.py's
fused_moe_native) against fused_moe_ref, and FP8Experts' packed CPU layout (the e4m3 bytes
only, no upcast)."""
from __future__ import annotations

import pytest
import torch

from ridge.kernels import native, ops
from ridge.kernels.moe import CpuExperts, fused_moe_native, fused_moe_ref, native_fits
from ridge.quant.experts import FP8Experts
from test_moe import _experts, _rel, _routing

pytestmark = pytest.mark.skipif(native.fp8_linear_isa() < 1, reason="needs ridge's C kernels with AVX2")


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_the_kernel_matches_the_reference(k):
    """Uneven loads (the last experts get no tokens), one token and many (more than an expert's
    3-row tile), odd widths in whole 16-column blocks."""
    E, H, inter = 12, 80, 48
    w13, s13, w2, s2, _, _ = _experts(E, H, inter, seed=k, fp8=True)
    cpu = CpuExperts.packed_from(w13, s13, w2, s2)
    for T in (1, 2, 5, 43):
        ids, w = _routing(T, E, k, seed=T)
        x = torch.randn(T, H)
        ref = fused_moe_ref(x, w13, s13, w2, s2, ids, w)
        assert _rel(fused_moe_native(x, w13, s13, w2, s2, ids, w, cpu=cpu), ref) <= 1e-6, (T, k)
        if T == 43:
            assert torch.bincount(ids.reshape(-1), minlength=E)[-1] == 0, "an expert without tokens"


def _loaded(E: int, H: int, inter: int, act: str, seed: int):
    """An FP8Experts with biases loaded on CPU from random e4m3 experts, and those tensors."""
    w13, s13, w2, s2, b13, b2 = _experts(E, H, inter, seed=seed, fp8=True, bias=True)
    mod = FP8Experts(E, H, inter, act=act, bias=True)
    mod.load({"gate_up_proj.weight": w13, "gate_up_proj.weight_scale": s13, "gate_up_proj.bias": b13,
              "down_proj.weight": w2, "down_proj.weight_scale": s2, "down_proj.bias": b2},
             torch.device("cpu"), torch.float32)
    return mod, dict(w_gate_up=w13, w_gate_up_scale=s13, w_down=w2, w_down_scale=s2, b_gate_up=b13, b_down=b2)


def _ref(x, ids, w, t: dict, act: str):
    return fused_moe_ref(x, t["w_gate_up"], t["w_gate_up_scale"], t["w_down"], t["w_down_scale"], ids, w,
                         b_gate_up=t["b_gate_up"], b_down=t["b_down"], act=act)


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "swigluoai"])
def test_every_activation_with_biases_through_ops(act):
    """A layer's forward (ops.fused_moe -> the kernel) with biases, each contract activation,
    int32 ids, inputs past swigluoai's clamp at 7."""
    mod, t = _loaded(6, 48, 16, act, seed=3)
    ids, w = _routing(19, 6, 3, seed=5, skew=False)
    x = torch.randn(19, 48) * 3
    assert native_fits(x, ids, mod.cpu, act)
    assert _rel(mod.forward(x, ids.int(), w), _ref(x, ids, w, t, act)) <= 1e-6


def test_a_row_gets_the_same_bits_at_any_batch():
    """Batch-invariant: a token's output does not depend on the other tokens in the step (its
    products accumulate in one order whatever tile its expert's row count picks)."""
    E, H, inter, T, k = 8, 64, 32, 24, 2
    w13, s13, w2, s2, _, _ = _experts(E, H, inter, seed=7, fp8=True)
    cpu = CpuExperts.packed_from(w13, s13, w2, s2)
    ids, w = _routing(T, E, k, seed=8)
    x = torch.randn(T, H)
    whole = fused_moe_native(x, w13, s13, w2, s2, ids, w, cpu=cpu)
    for t in (0, 11, 23):
        alone = fused_moe_native(x[t:t + 1], w13, s13, w2, s2, ids[t:t + 1], w[t:t + 1], cpu=cpu)
        assert torch.equal(alone[0], whole[t])


def test_experts_load_packed_on_cpu_and_run_the_kernel():
    """On CPU with the kernel the layer holds the kernel's packed e4m3 bytes alone (1 byte a
    weight: its stacked buffers are one-byte stand-ins, no fp32 upcast) and has no per-expert
    formats to measure; under native.off() it falls back to the grouped torch path on the same
    bytes, and the references read them too."""
    E, H, inter, k, T = 8, 64, 32, 2, 9
    mod, t = _loaded(E, H, inter, "swigluoai", seed=1)
    assert mod.w_gate_up.dtype == mod.w_down.dtype == torch.float8_e4m3fn and mod.cpu_weights() == []
    packed = [c for c in mod.cpu_copies() if c.dtype == torch.uint8]
    assert sum(c.numel() for c in packed) == t["w_gate_up"].numel() + t["w_down"].numel()
    assert mod.w_gate_up.untyped_storage().nbytes() == mod.w_down.untyped_storage().nbytes() == 1
    ids, w = _routing(T, E, k, seed=2)
    x = torch.randn(T, H)
    ref = _ref(x, ids, w, t, "swigluoai")
    assert _rel(mod.forward(x, ids, w), ref) <= 1e-6
    with native.off():
        assert not native_fits(x, ids, mod.cpu, mod.act)
        assert _rel(mod.forward(x, ids, w), ref) <= 1e-6
    with ops.use_triton(False):
        assert _rel(mod.forward(x, ids, w), ref) == 0.0


def _kernel_at(isa: int, x, cpu, ids, w, H: int, inter: int, E: int) -> torch.Tensor:
    """fp8_moe called with an explicit instruction set (1: the AVX2 tiles; 2: their 16-lane form
    for an expert's 1-2 rows), SiLU, no biases."""
    gu, s_gu, dn, s_dn = cpu.packed
    ids, w = ids.to(torch.int64).contiguous(), w.contiguous()
    out = torch.empty(x.shape[0], H)
    rc = native.library().fp8_moe(x.data_ptr(), x.shape[0], H, inter, E, ids.shape[1], ids.data_ptr(), w.data_ptr(),
                                  gu.data_ptr(), s_gu.data_ptr(), None, dn.data_ptr(), s_dn.data_ptr(), None, 0,
                                  1.702, 7.0, out.data_ptr(), isa, torch.get_num_threads())
    assert rc == 0
    return out


@pytest.mark.skipif(native.fp8_linear_isa() < 2, reason="the AVX-512 form of the experts' row tiles")
def test_the_avx512_row_tiles_give_the_avx2_bits():
    """On an AVX-512 machine an expert's 1-2 rows run 16-lane tiles with the AVX2 tiles' lanes and
    order: the same bits at one token (every expert 1 row: two blocks at once, gate with up and
    down blocks in pairs where H has an even count of them, 96), a few (1-2 rows each) and many
    (the 3-row tiles over a widened block, which neither form changes)."""
    E, inter = 12, 48
    for H in (80, 96):
        w13, s13, w2, s2, _, _ = _experts(E, H, inter, seed=45, fp8=True)
        cpu = CpuExperts.packed_from(w13, s13, w2, s2)
        for T in (1, 2, 5, 43):
            ids, w = _routing(T, E, 4, seed=T)
            x = torch.randn(T, H)
            got = _kernel_at(2, x, cpu, ids, w, H, inter, E)
            assert torch.equal(got, _kernel_at(1, x, cpu, ids, w, H, inter, E)), (H, T)


@pytest.mark.skipif(native.fp8_linear_isa() < 2, reason="the AVX-512 form of the experts' row tiles")
def test_the_scaled_conversion_keeps_every_bit():
    """The 16-lane tiles read e4m3 as fp32 times 2^-120 and take the activations times 2^112:
    against the AVX2 tiles (the fp16 conversion, activations as they are) bit for bit with
    subnormal, zero and NaN codes in the experts, bf16-denormal-small and zero activations,
    and activations past 2^16 in the gate's input (x) or the down product's (its input made
    from them), where a phase takes the fp16 conversion whole."""
    E, H, inter = 8, 96, 48
    w13, s13, w2, s2, _, _ = _experts(E, H, inter, seed=9, fp8=True)
    cpu = CpuExperts.packed_from(w13, s13, w2, s2)
    g = torch.Generator().manual_seed(9)
    for t in (cpu.packed[0], cpu.packed[2]):
        flat = t.view(-1)
        at = torch.randint(0, flat.numel(), (200,), generator=g)
        codes = torch.tensor([0x00, 0x80, 0x01, 0x87, 0x05, 0x7F, 0xFF, 0x83], dtype=torch.uint8)
        flat[at] = codes[torch.arange(200) % len(codes)]
    for T in (1, 3, 17):
        ids, w = _routing(T, E, 2, seed=T)
        for scale in (1.0, 2000.0, 1e5):
            x = torch.randn(T, H, generator=g) * scale
            x[0, :4] = torch.tensor([0.0, -0.0, 1e-40, -3e-39])
            got, want = _kernel_at(2, x, cpu, ids, w, H, inter, E), _kernel_at(1, x, cpu, ids, w, H, inter, E)
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (T, scale)


@pytest.mark.parametrize("kind", ["softmax_topk", "topk_softmax"])
@pytest.mark.parametrize("T,E,H,k", [(1, 32, 1024, 4), (39, 128, 96, 8), (5, 7, 48, 7), (3, 1024, 16, 1)])
def test_the_router_in_c_takes_the_experts_torch_takes(kind, T, E, H, k):
    """moe_route (kernels/csrc/small_ops.c) against the torch reference: the same experts, the
    weights within fp32 rounding, with and without a bias and renormalization; up to 1024 experts."""
    from ridge.kernels.moe import moe_route_native, moe_route_ref, route_fits

    g = torch.Generator().manual_seed(T * E + k)
    h, w = torch.randn(T, H, generator=g), torch.randn(E, H, generator=g) * 0.05
    for bias in (None, torch.randn(E, generator=g)):
        for norm in (False, True):
            assert route_fits(w, bias, kind, k)
            ids, weights = moe_route_native(h, w, bias, kind, k, norm)
            want_ids, want = moe_route_ref(h, w, bias, kind, k, norm)
            assert torch.equal(ids.sort(-1)[0], want_ids.sort(-1)[0])
            torch.testing.assert_close(weights.gather(1, ids.argsort(-1)), want.gather(1, want_ids.argsort(-1)),
                                       atol=1e-6, rtol=1e-5)
    assert not route_fits(torch.randn(1025, H), None, kind, k) and not route_fits(w, None, "topk_sigmoid", k)


def test_a_tie_across_the_routers_cut_is_broken_as_torch_breaks_it():
    """Equal router rows tie for every token: which of them is taken is torch.topk's rule (what
    transformers runs), so the C router hands such a call to torch; it matches it exactly."""
    from ridge.kernels.moe import moe_route_native, moe_route_ref

    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(40, 64, generator=g), torch.randn(8, 64, generator=g)
    w[3] = w[1]
    w[5] = w[1]
    for kind in ("softmax_topk", "topk_softmax"):
        ids, weights = moe_route_native(h, w, None, kind, 2, True)
        want_ids, want = moe_route_ref(h, w, None, kind, 2, True)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want)
