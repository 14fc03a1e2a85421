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
def test_cpu_small_step_copy_matches_fp32(M):
    """The CPU's bf16 copy (packed once for oneDNN where torch has it) computes the exact
    e4m3 values with bf16 activations: close to the fp32 path, odd shapes included."""
    from ridge.kernels.cpu_linear import ShapeFormat, bf16_linear, pack_bf16
    from ridge.quant.linear import FP8Linear

    torch.manual_seed(M)
    w = torch.randn(301, 77)
    q, scale = quantize_fp8(w)
    lin = FP8Linear(77, 301)
    lin.load(q, scale, None, torch.device("cpu"), torch.float32)
    x = torch.randn(M, 77)
    ref = lin(x)
    lin.cpu.use(ShapeFormat.bf16_up_to(64))
    got = lin(x)
    assert got.dtype == torch.float32 and got.shape == (M, 301)
    assert_close(got, ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)
    wb = torch.randn(50, 33).bfloat16()
    xb = torch.randn(M, 33).bfloat16()
    assert torch.allclose(bf16_linear(xb, pack_bf16(wb)).float(), torch.nn.functional.linear(xb, wb).float(),
                          rtol=1e-2, atol=1e-2)
