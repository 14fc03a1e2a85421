"""FP8 linear: every path under the interpreter (or torch on CPU) against fp8_linear_ref
and against an exact W8A8 emulation."""
import pytest
import torch
from kernel_utils import assert_close, poison_empty

from ridge.kernels.linear import (FP8, fp8_linear_ref, fp8_linear_triton, fp8_scaled_mm, fp8_w8a8_triton,
                                  fp8_weight_only_triton, quantize_rows_triton)
from ridge.quant.fp8 import quantize_fp8

pytestmark = pytest.mark.usefixtures(poison_empty.__name__)


def layer(M, N, K, dtype, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, K, generator=g) * torch.logspace(-2, 1, M)[:, None]).to(dtype)
    w8, ws = quantize_fp8(torch.randn(N, K, generator=g) * 0.05)
    b = torch.randn(N, generator=g).to(dtype) if bias else None
    return x, w8, ws, b


def w8a8_emulated(x, w8, ws, b):
    """What W8A8 computes exactly: torch-quantized activations, fp64 product, both scales."""
    scale = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    a = (x.float() / scale).clamp(-448, 448).to(FP8)
    out = (a.double() @ w8.double().t()) * scale.double() * ws.double()
    return (out + (b.double() if b is not None else 0)).to(x.dtype)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_quantize_rows_matches_torch(dtype):
    x, *_ = layer(17, 8, 300, dtype)
    x[3] = 0.0  # an all-zero token keeps a finite scale
    q, scale = quantize_rows_triton(x)
    ref_scale = (x.float().abs().amax(1, keepdim=True) / 448.0).clamp(min=1e-12)
    assert torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), (x.float() / ref_scale).clamp(-448, 448).to(FP8).view(torch.uint8))


@pytest.mark.parametrize("M", [1, 17, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_w8a8_triton_dot(M, dtype):
    x, w8, ws, b = layer(M, 96, 200, dtype)
    out = fp8_w8a8_triton(x, w8, ws, b)
    assert out.dtype == dtype and out.shape == (M, 96)
    assert_close(out, w8a8_emulated(x, w8, ws, b), atol=1e-3 if dtype == torch.float32 else 2e-2)
    assert rel_err(out, fp8_linear_ref(x, w8, ws, b)) < 0.06  # activation rounding: ~2**-4 / sqrt(3)


@pytest.mark.parametrize("M", [1, 17, 129])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_weight_only(M, dtype):
    x, w8, ws, b = layer(M, 80, 136, dtype)
    out = fp8_weight_only_triton(x, w8, ws, b)
    # The reference rounds the dequantized weight to x's dtype; the kernel scales after the dot.
    assert_close(out, fp8_linear_ref(x, w8, ws, b), atol=1e-4 if dtype == torch.float32 else 3e-2)


def test_scaled_mm_path_on_cpu():
    x, w8, ws, b = layer(33, 64, 128, torch.bfloat16)
    assert_close(fp8_scaled_mm(x, w8, ws, b), w8a8_emulated(x, w8, ws, b))


def test_dispatch_keeps_leading_dims_and_no_bias():
    x, w8, ws, _ = layer(6, 48, 64, torch.float32, bias=False)
    out = fp8_linear_triton(x.view(2, 3, 64), w8, ws)
    assert out.shape == (2, 3, 48)
    assert_close(out.view(6, 48), w8a8_emulated(x, w8, ws, None), atol=1e-3)


def test_weight_only_software_fp8_decode(monkeypatch):
    # Ampere has no e4m3 conversion: the weight tile is decoded from its bits.
    import ridge.kernels.linear as linear

    monkeypatch.setattr(linear, "native_fp8", lambda t: False)
    x, w8, ws, b = layer(9, 48, 96, torch.float32)
    assert_close(fp8_weight_only_triton(x, w8, ws, b), fp8_linear_ref(x, w8, ws, b), atol=1e-4)


@pytest.mark.parametrize("M", [1, 2, 3, 9, 64])
def test_cpu_e4m3_products_match_the_torch_upcast(M):
    """An FP8 layer on CPU keeps its e4m3 bytes (no fp32 or bf16 copy) and each of its products
    computes the exact e4m3 values: close to the torch upcast, odd shapes included (301 rows:
    a block of 16 left over; 77 inputs: odd, upcast once at load instead)."""
    from ridge.kernels import native
    from ridge.kernels.cpu_linear import ShapeFormat, bf16_linear, pack_bf16
    from ridge.kernels.fp8_scales import dequantize
    from ridge.quant.linear import FP8Linear

    torch.manual_seed(M)
    for k in (76, 77):
        w = torch.randn(301, k)
        q, scale = quantize_fp8(w)
        lin = FP8Linear(k, 301)
        lin.load(q, scale, None, torch.device("cpu"), torch.float32)
        x = torch.randn(M, k)
        ref = x @ dequantize(q, scale).T
        if k % 2 or not native.fp8_linear_isa():
            assert lin.weight.dtype == torch.float32  # no e4m3 product takes it: upcast once
            assert_close(lin(x), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4)
            continue
        assert lin.weight.dtype == FP8 and lin.weight.numel() == 304 * k  # one byte a weight, rows to 16
        for plan in ([(1, True)], [(1, False)]):
            lin.cpu.use(ShapeFormat([], fp8=plan), native.fp8_linear_isa())
            got = lin(x)
            assert got.dtype == torch.float32 and got.shape == (M, 301) and lin.cpu.copies == {}
            atol = (0.02 if plan[0][1] and native.fp8_linear_isa() == 2 else 1e-5) * ref.abs().max().item()
            assert_close(got, ref, atol=atol, rtol=1e-3)
    wb = torch.randn(50, 33).bfloat16()
    xb = torch.randn(M, 33).bfloat16()
    assert torch.allclose(bf16_linear(xb, pack_bf16(wb)).float(), torch.nn.functional.linear(xb, wb).float(),
                          rtol=1e-2, atol=1e-2)
