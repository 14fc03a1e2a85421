"""ridge's C kernels (kernels/csrc) against their torch references, the way the engine
calls them; and the build: cached per source, off without a compiler."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ridge.kernels import native
from ridge.kernels import attention_native, ops
from ridge.kernels.attention import paged_attention_ref
from ridge.kernels.attention_native import NATIVE_MAX_Q
from ridge.kernels.cpu_linear import ShapeFormat, kernel_scales, pack_fp8, unpack_fp8
from ridge.kernels.kv_cache import quantize_kv, write_kv_ref
from ridge.kernels.metadata import AttentionMetadata
from ridge.kernels.fp8_scales import expand_scale
from ridge.quant.fp8 import quantize_fp8
from ridge.quant.linear import FP8, FP8Linear

needs_cc = pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")


def _isas():
    return [isa for isa in (1, 2) if isa <= native.fp8_linear_isa()]


def _tile_kinds():
    """The blocked product's tiles that run here: fp32, and AMX's bf16 tiles where the CPU has them."""
    return [False] + ([True] if native.tiles_bf16() else [])


@needs_cc
@pytest.mark.parametrize("n,k,grouping", [(16, 2, "channel"), (48, 34, "channel"), (960, 576, "channel"),
                                            (576, 1536, "channel"), (4096 + 16, 130, "channel"), (40, 96, "channel"),
                                            (48, 32, "g16"), (960, 576, "g16"), (576, 1536, "g16"), (40, 96, "g16")])
def test_fp8_linear_matches_the_reference(n, k, grouping):
    """Both e4m3 products (streaming, blocked) against the torch upcast, per-channel fp32 scales
    and 1 x 16 groups' bf16 ones, rows left over past a block of 16 (40) included."""
    g = torch.Generator().manual_seed(n + k)
    # Rows of very different magnitudes: small ones land on e4m3 subnormals, which must convert exactly.
    w = torch.randn(n, k, generator=g) * torch.logspace(-4, 1, n)[:, None]
    q, scale = quantize_fp8(w, grouping=grouping)
    tiny = torch.randn(n, k, generator=g) * 1e-5
    tiny[:, 0] = 1.0  # each row's scale set by one large weight: the rest quantize to subnormals
    q2, s2 = quantize_fp8(tiny)
    assert ((q2.view(torch.uint8) & 0x78) == 0).float().mean() > 0.3, "the test needs subnormal weights"
    for qw, s in ((q, scale), (q2, s2)):
        packed, s256 = pack_fp8(qw), kernel_scales(s, (n, k))
        ref_w = (qw.float() * expand_scale(s, (n, k))).float()
        assert torch.equal(unpack_fp8(packed, s256, n), ref_w)  # the reference's own unpacking
        assert torch.equal(native.fp8_widen(packed, s256)[:n], ref_w)  # the blocked product's widening
        ids = torch.randint(0, n, (9,), generator=g)
        assert torch.equal(native.fp8_rows(packed, s256, ids), ref_w[ids])  # the embedding lookup
        for m in (1, 2, 3, 7, 8, 9, 17, 33):
            x = torch.randn(m, k, generator=g)
            for bf16 in _tile_kinds():  # AMX's tiles: x rounded to bf16, the weights exact (two bf16 halves)
                ref = (x.bfloat16().float() if bf16 else x) @ ref_w.T
                for blocks in (2, None):
                    y = native.fp8_linear_tiles(x, packed, s256, blocks=blocks, bf16=bf16)[:, :n]
                    torch.testing.assert_close(y, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4)
            for isa in _isas():
                y = native.fp8_linear(x, packed, s256, isa)[:, :n]
                # AVX-512 BF16 rounds activations to bf16, as the bf16 paths do; the weights are exact.
                xr = x.to(torch.bfloat16).float() if isa == 2 else x
                ref = xr @ ref_w.T
                torch.testing.assert_close(y, ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4)


@needs_cc
def test_groups_with_a_remainder_and_block_scales_match_the_reference():
    """1 x 16 groups over a K with a short last group, and B x B blocks (rows of B share a
    scale): the kernels' scale layouts against the torch upcast."""
    g = torch.Generator().manual_seed(7)
    for shape, grouping in (((32, 40), "g16"), ((48, 256), "b128"), ((64, 96), "g32")):
        q, s = quantize_fp8(torch.randn(*shape, generator=g), grouping=grouping)
        packed, s256 = pack_fp8(q), kernel_scales(s, shape)
        ref_w = q.float() * expand_scale(s, shape)
        x = torch.randn(5, shape[1], generator=g)
        ref = x @ ref_w.T
        for y in [native.fp8_linear_tiles(x, packed, s256)] + [native.fp8_linear(x, packed, s256, i) for i in _isas()]:
            tol = 1e-2 if y is not None and native.fp8_linear_isa() == 2 else 1e-5
            torch.testing.assert_close(y, ref, atol=tol * ref.abs().max().item(), rtol=1e-3)


@pytest.mark.skipif(native.fp8_linear_isa() < 2, reason="ridge's bf16 product needs AVX-512 BF16")
@pytest.mark.parametrize("n,k", [(16, 2), (48, 34), (960, 576), (4096 + 16, 130)])
def test_bf16_product_sums_and_returns_fp32(n, k):
    """ridge's bf16 product (where it runs, the CPU's bf16 format): the exact product of the
    bf16-rounded operands up to fp32 summation, returned in fp32 (oneDNN's result is rounded to
    bf16, so that logits tie), and a row's bits the same at every row count."""
    from ridge.kernels.cpu_linear import bf16_linear, pack_bf16

    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    packed = pack_bf16(w)
    assert packed.dim() == 4 and packed.dtype == torch.int16
    x = torch.randn(40, k, generator=g) * 30
    y = bf16_linear(x, packed)
    ref = x.to(torch.bfloat16).double() @ w.double().T
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-6)
    onednn = torch.nn.functional.linear(x.to(torch.bfloat16), w).double()
    assert (y.double() - ref).abs().max() < (onednn - ref).abs().max() / 8  # no bf16 rounding of the result
    for m in (1, 2, 3, 8, 9, 17, 40):
        assert torch.equal(bf16_linear(x[:m], packed)[:1], y[:1]), m


@needs_cc
def test_a_layer_runs_the_product_its_plan_marks():
    q, s = quantize_fp8(torch.randn(48, 32))
    lin = FP8Linear(32, 48)
    lin.load(q, s, None, torch.device("cpu"), torch.float32)
    lin.cpu.use(ShapeFormat([], fp8=[(1, True), (4, True), (8, False)]), isa=1)
    assert [lin.cpu.kind(n) for n in (1, 2, 4, 5, 8, 64)] == ["fp8"] * 3 + ["tiles"] * 3
    assert lin.cpu.max_rows("fp8") == 4
    x = torch.randn(3, 32)
    assert torch.equal(lin(x), native.fp8_linear(x, lin.cpu.packed, lin.cpu.scale, 1))
    x = torch.randn(6, 32)
    assert torch.equal(lin(x), native.fp8_linear_tiles(x, lin.cpu.packed, lin.cpu.scale))
    with native.off():  # the torch reference over the same bytes
        torch.testing.assert_close(lin(x), lin.cpu.reference(x))
    lin.cpu.use(ShapeFormat([], fp8=[(1, False)]), isa=1)
    assert lin.cpu.copies == {} and lin.cpu.kind(1) == "tiles"


H, HKV, D, BS = 12, 3, 64, 16


def _setup(lengths, query_lens, dtype, num_blocks=4096, d=D, h=H, hkv=HKV, seed=0):
    """Contexts written through write_kv_ref into blocks scattered over a large pool (block ids
    in the thousands), and the step's queries."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=g).tolist()
    kc = torch.zeros(num_blocks, BS, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    ks = vs = None
    if dtype == FP8:
        ks = torch.ones(num_blocks, BS, hkv, dtype=torch.float16)
        vs = torch.ones_like(ks)
    tables = []
    for L in lengths:
        table = [perm.pop() for _ in range(-(-L // BS))]
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(L)])
        write_kv_ref(torch.randn(L, hkv, d, generator=g) * 3, torch.randn(L, hkv, d, generator=g), kc, vc, ks, vs, slots)
        tables.append(table)
    meta = AttentionMetadata.build(query_lens, lengths, tables, [0] * sum(query_lens))
    return torch.randn(sum(query_lens), h, d, generator=g), kc, vc, ks, vs, meta


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("lengths,query_lens", [
    ([1], [1]),
    ([300], [1]),
    ([1, 17, 129, 33, 1000], [1, 1, 1, 1, 1]),  # decodes, one context ending mid-block
    ([129, 40, 5, 64, 300], [1, 18, 5, 1, NATIVE_MAX_Q + 40]),  # mixed; the last chunk goes to the reference
    ([70, 90], [NATIVE_MAX_Q, 7]),  # a chunk exactly at the kernel's limit
])
def test_paged_attention_cpu_matches_the_reference(dtype, lengths, query_lens):
    q, kc, vc, ks, vs, meta = _setup(lengths, query_lens, dtype)
    assert attention_native.fits(q, kc, vc, ks, vs, meta)  # ops takes the C kernel here
    out = ops.paged_attention(q, kc, vc, ks, vs, meta, D ** -0.5)
    ref = paged_attention_ref(q, kc, vc, ks, vs, meta, D ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)


@needs_cc
@pytest.mark.parametrize("d,h,hkv", [(32, 4, 4), (128, 8, 2), (80, 15, 5), (40, 4, 2)])
def test_paged_attention_cpu_other_head_shapes(d, h, hkv):
    """Head sizes and GQA groups of other models; 40 is not a multiple of 16: the reference runs."""
    q, kc, vc, ks, vs, meta = _setup([50, 200], [1, 9], torch.float32, num_blocks=64, d=d, h=h, hkv=hkv)
    assert attention_native.fits(q, kc, vc, ks, vs, meta) == (d % 16 == 0)
    out = ops.paged_attention(q, kc, vc, ks, vs, meta, d ** -0.5)
    torch.testing.assert_close(out, paged_attention_ref(q, kc, vc, ks, vs, meta, d ** -0.5), atol=2e-5, rtol=1e-4)


@needs_cc
def test_fp8_cache_with_real_scales():
    q, kc, vc, _, _, meta = _setup([150, 33], [1, 33], torch.float32)
    k8, ks = quantize_kv(kc.view(-1, HKV, D))
    v8, vs = quantize_kv(vc.view(-1, HKV, D))
    k8, v8 = k8.view(kc.shape), v8.view(vc.shape)
    ks, vs = ks.view(kc.shape[:3]), vs.view(kc.shape[:3])
    out = ops.paged_attention(q, k8, v8, ks, vs, meta, D ** -0.5)
    torch.testing.assert_close(out, paged_attention_ref(q, k8, v8, ks, vs, meta, D ** -0.5), atol=2e-5, rtol=1e-4)


def test_where_a_compiler_is_found_the_kernels_build():
    """The kernels' tests skip only on a machine without a C compiler: a build that fails where
    one is found fails here, not silently."""
    if native._compiler() is not None and os.environ.get("RIDGE_NATIVE", "1") != "0":
        assert native.library() is not None, native._state.get("why")


def test_without_a_compiler_the_kernels_are_off_and_attention_still_answers(tmp_path):
    code = ("import torch, logging; logging.basicConfig();"
            "from ridge.kernels import native, ops;"
            f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r});"
            "from test_native import _setup;"
            "q, kc, vc, ks, vs, meta = _setup([40], [1], torch.float32, num_blocks=8);"
            "print('LIB', native.library() is not None, tuple(ops.paged_attention(q, kc, vc, ks, vs, meta, 0.1).shape))")
    env = {**os.environ, "PATH": str(tmp_path / "empty"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop("CC", None)
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "LIB False (1, 12, 64)" in off.stdout and "no C compiler" in off.stderr, off.stderr


@needs_cc
def test_the_library_is_built_once_per_source(tmp_path):
    """A second process finds the built library instead of compiling it again."""
    code = ("import torch, logging; logging.basicConfig();"
            "from ridge.kernels import native, ops;"
            "print('LIB', native.library() is not None)")
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    env.pop("CC", None)
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "LIB True" in first.stdout, first.stderr
    built = list((tmp_path / "xdg" / "ridge" / "native").glob("*/libridge_cpu.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "LIB True" in again.stdout and built[0].stat().st_mtime_ns == mtime


@needs_cc
@pytest.mark.parametrize("rows", [1, 3, 200])
def test_small_ops_match_their_references(rows):
    from ridge.kernels.activation import silu_and_mul_native, silu_and_mul_ref
    from ridge.kernels.norm import rms_norm_native, rms_norm_ref
    from ridge.kernels.rope import rope_native, rope_ref
    from ridge.models.layers.rope import rope_cos_sin

    g = torch.Generator().manual_seed(rows)
    x, res, w = torch.randn(rows, 576, generator=g), torch.randn(rows, 576, generator=g), torch.rand(576, generator=g)
    normed, new_res = rms_norm_ref(x, w, 1e-5, res)
    x2 = x.clone()
    got, got_res = rms_norm_native(x2, w, 1e-5, res)
    assert got_res is x2  # the residual added in place, as the torch CPU path does
    torch.testing.assert_close(got, normed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_res, new_res)
    torch.testing.assert_close(rms_norm_native(x.clone(), w, 1e-5)[0], rms_norm_ref(x, w, 1e-5)[0], atol=1e-5,
                               rtol=1e-5)

    # RoPE on the fused qkv output's views (k's heads right after q's), and on separate tensors.
    cos_sin = rope_cos_sin(64, 4096, 10000.0, None).float()
    positions = torch.randint(0, 4096, (rows,), generator=g)
    qkv = torch.randn(rows, (9 + 3 + 3) * 64, generator=g)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.reshape(rows, 9, 64), k.reshape(rows, 3, 64)
    rq, rk = rope_ref(q, k, positions, cos_sin)
    got_q, got_k = rope_native(q, k, positions, cos_sin)
    torch.testing.assert_close(got_q, rq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, rk, atol=1e-5, rtol=1e-5)
    q, k = torch.randn(rows, 4, 64, generator=g), torch.randn(rows, 2, 64, generator=g)
    rq, rk = rope_ref(q, k, positions, cos_sin)
    torch.testing.assert_close(rope_native(q, k, positions, cos_sin), (rq, rk), atol=1e-5, rtol=1e-5)

    # silu(gate) * up, with gates far out on both sides.
    gu = torch.randn(rows, 2 * 1536, generator=g) * 30
    torch.testing.assert_close(silu_and_mul_native(gu), silu_and_mul_ref(gu), atol=1e-5, rtol=1e-5)


@needs_cc
def test_write_kv_native_matches_the_reference_and_rejects_a_slot_past_the_cache():
    from ridge.kernels.kv_cache import write_kv_native

    g = torch.Generator().manual_seed(3)
    kv = torch.randn(5, 2 * 3 * 64, generator=g)
    k, v = (t.reshape(5, 3, 64) for t in kv.split([192, 192], dim=-1))  # strided views, as in a layer
    slots = torch.tensor([7, -1, 4095, 0, 300])
    for dtype in (torch.bfloat16, torch.float32):  # bf16: rounded as torch's cast rounds
        caches = [torch.zeros(256, 16, 3, 64, dtype=dtype) for _ in range(4)]
        write_kv_ref(k, v, caches[0], caches[1], None, None, slots)
        write_kv_native(k, v, caches[2], caches[3], None, None, slots)
        assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    # FP8: the same bytes and fp16 scales as the reference, over magnitudes from e4m3's
    # subnormals to its top (and rows whose amax floors the scale at 2^-14).
    wide = torch.randn(5, 2 * 3 * 64, generator=g) * torch.logspace(-7, 3, 5)[:, None]
    k8, v8 = (t.reshape(5, 3, 64) for t in wide.split([192, 192], dim=-1))
    caches = [torch.zeros(256, 16, 3, 64, dtype=FP8) for _ in range(4)]
    scales = [torch.zeros(256, 16, 3, dtype=torch.float16) for _ in range(4)]
    write_kv_ref(k8, v8, caches[0], caches[1], scales[0], scales[1], slots)
    write_kv_native(k8, v8, caches[2], caches[3], scales[2], scales[3], slots)
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(caches[a].view(torch.uint8), caches[b].view(torch.uint8))
        assert torch.equal(scales[a], scales[b])
    caches = [torch.zeros(256, 16, 3, 64) for _ in range(2)]
    with pytest.raises(IndexError, match="past the cache"):
        write_kv_native(k, v, caches[0], caches[1], None, None, torch.tensor([1, 2, 3, 4096, 5]))
    assert not caches[0].any() and not caches[1].any()  # nothing written


@needs_cc
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
def test_ops_takes_the_c_kernels_for_the_calls_a_model_step_makes(tokens, cache_dtype):
    """The speed rule of the dispatch: every small op of a llama layer, called as the layer calls it
    (q, k and v split from the fused projection, the norm's residual, the fused gate/up), runs its
    C kernel; the torch paths only where the C kernel cannot take the call."""
    from ridge.kernels.activation import silu_and_mul_native, silu_and_mul_ref
    from ridge.kernels.kv_cache import write_kv_native
    from ridge.kernels.norm import rms_norm_native, rms_norm_ref, rms_norm_torch
    from ridge.kernels.rope import rope_native, rope_ref, rope_torch
    from ridge.models.layers.rope import rope_cos_sin

    h, res, w = torch.randn(tokens, 576), torch.randn(tokens, 576), torch.ones(576)
    assert ops.backend("rms_norm", h, w, 1e-5, res) is rms_norm_native
    assert ops.backend("rms_norm", h, w, 1e-5, None) is rms_norm_native
    q, k, v = torch.randn(tokens, (9 + 3 + 3) * 64).split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k, v = q.reshape(tokens, 9, 64), k.reshape(tokens, 3, 64), v.reshape(tokens, 3, 64)
    positions, cos_sin = torch.arange(tokens), rope_cos_sin(64, 4096, 10000.0, None).float()
    meta = AttentionMetadata.build([tokens], [tokens], [[0, 1, 2, 3]], list(range(tokens)))
    assert ops.backend("rope", q, k, positions, cos_sin, meta) is rope_native
    caches = [torch.zeros(4, 16, 3, 64, dtype=cache_dtype) for _ in range(2)]
    scales = [torch.zeros(4, 16, 3, dtype=torch.float16) for _ in range(2)] if cache_dtype == FP8 else [None, None]
    args = (k, v, *caches, *scales, meta.slot_mapping, meta)
    assert ops.backend("write_kv", *args) is write_kv_native
    assert ops.backend("silu_and_mul", torch.randn(tokens, 2 * 1536)) is silu_and_mul_native
    # Heads apart in memory (qwen3's per-head norm over the qkv rows) are copied together for it,
    # as the one-call layers do (kernels/csrc/decoder.c).
    assert ops.backend("rms_norm", q[:, :, :32], w[:32], 1e-6, None) is rms_norm_native
    torch.testing.assert_close(ops.rms_norm(q[:, :, :32], w[:32], 1e-6)[0], rms_norm_ref(q[:, :, :32], w[:32], 1e-6)[0])
    # Where the C kernel cannot take the call: a row's elements apart, non-fp32 tensors, an FP8
    # cache without scales, or the library off.
    assert ops.backend("rms_norm", q[:, :, ::2], w[:32], 1e-6, None) is rms_norm_torch
    assert ops.backend("rms_norm", h.bfloat16(), w, 1e-5, None) is rms_norm_ref
    assert ops.backend("rope", q.bfloat16(), k.bfloat16(), positions, cos_sin, meta) is rope_ref
    assert ops.backend("rope", q, k, positions.int(), cos_sin, meta) is rope_torch
    assert ops.backend("silu_and_mul", torch.randn(tokens, 4 * 1536)[:, ::2]) is silu_and_mul_ref
    if cache_dtype == FP8:
        assert ops.backend("write_kv", k, v, *caches, None, None, meta.slot_mapping, meta) is write_kv_ref
    with native.off():
        assert ops.backend("rms_norm", h, w, 1e-5, res) is rms_norm_torch
        assert ops.backend("rope", q, k, positions, cos_sin, meta) is rope_torch
        assert ops.backend("write_kv", *args) is write_kv_ref
        assert ops.backend("silu_and_mul", torch.randn(tokens, 2 * 1536)) is silu_and_mul_ref


CONVERSIONS = {"shift": 2, "vbmi": 1, "widen": 0}  # kernels/csrc/fp8_linear.c's conv_on


def _force_conversion(c: int) -> int:
    """kernels/csrc/fp8_linear.c's test hook: forces the narrower of AVX-512 e4m3 conversion c
    (CONVERSIONS) and the CPU's best; c < 0 restores the CPU's choice. -> the one in use after."""
    import ctypes

    lib = native.library()
    lib.fp8_linear_force_conversion.argtypes, lib.fp8_linear_force_conversion.restype = [ctypes.c_int], ctypes.c_int
    return lib.fp8_linear_force_conversion(c)


def _conversions() -> list[str]:
    """The AVX-512 e4m3 conversions this CPU can run: shifts with the tables for the rare chunk
    (VBMI and GFNI), VBMI's table lookups, and the widening CPUs without VBMI run."""
    best = _force_conversion(-1)
    return [name for name, c in CONVERSIONS.items() if c <= best]


def _product_by(conv, x, packed, s256):
    """native.fp8_linear on AVX-512 through one conversion (with the weight's map, which the
    shifts need); the CPU's own choice restored after."""
    _force_conversion(CONVERSIONS[conv])
    try:
        return native.fp8_linear(x, packed, s256, 2, special=native.special_map(packed))
    finally:
        _force_conversion(-1)


def _every_byte(n, k):
    """[n, k] e4m3 whose columns each hold all 256 codes across the rows (n >= 256)."""
    codes = (torch.arange(n)[:, None] + 37 * torch.arange(k)[None, :]) % 256
    return codes.to(torch.uint8).view(FP8)


@pytest.mark.skipif(native.fp8_linear_isa() < 2, reason="the AVX-512 BF16 product")
def test_every_e4m3_code_converts_exactly_at_every_row_count():
    """A weight holding every e4m3 code (subnormals, both zeros, NaN) times one-hot rows: each
    output is one weight times its scale, exact in fp32, so it must equal the torch upcast
    bit for bit, through the one-row path, the converting tiles (2-8 rows) and the widened
    panel (> 8 rows), by each conversion. NaN (0x7f, 0xff) poisons its output column, as in
    torch: the tables (and the shifts, which hand such a chunk to them) read it as NaN; the
    widening as 480, so those columns are held apart."""
    n, k = 256, 64
    q = _every_byte(n, k)
    g = torch.Generator().manual_seed(45)
    s = (torch.rand(n, k // 16, generator=g) * 0.01 + 1e-3).to(torch.bfloat16)
    packed, s256 = pack_fp8(q), kernel_scales(s, (n, k))
    ref_w = q.float() * expand_scale(s, (n, k))
    nan_col = torch.isnan(ref_w).any(1)
    assert nan_col.sum() == 2 * k and ((q.view(torch.uint8) & 0x78) == 0).any(1).all()
    eye = torch.eye(k)
    for conv in _conversions():
        steps = [(m, m + 1) for m in range(k)] + [(0, 2), (5, 8), (11, 16), (56, 64), (0, k)]  # 1, 2-8, > 8 rows
        for m0, m1 in steps:
            y, ref = _product_by(conv, eye[m0:m1], packed, s256), ref_w.T[m0:m1]
            assert torch.equal(y[:, ~nan_col], ref[:, ~nan_col]), (conv, m0, m1)
            if conv != "widen":
                assert torch.isnan(y[:, nan_col]).all()


def _sparse_specials(n, k, g):
    """[n, k] e4m3 of exponents 1-15 (the shifts' own chunks) with a few zeros, subnormals and
    NaN scattered, so that a row's chunks alternate between the shifts and the tables."""
    q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    q = (q & 0x87) | ((torch.randint(1, 16, (n, k), generator=g, dtype=torch.uint8)) << 3)
    q[(q & 0x7f) == 0x7f] = 0x7e
    hit = torch.rand(n, k, generator=g) < 0.004
    special = torch.tensor([0x00, 0x80, 0x01, 0x83, 0x07, 0x86, 0x7f, 0xff], dtype=torch.uint8)
    q[hit] = special[torch.randint(0, len(special), (int(hit.sum()),), generator=g)]
    return q


@pytest.mark.skipif(native.fp8_linear_isa() < 2 or not native.library().fp8_linear_shifts(),
                    reason="the map is made where the product converts by shifts")
def test_special_map_marks_the_pairs_holding_a_subnormal_or_nan():
    """The shifts' map against torch: bit p of block b's row set exactly where pair p's 32 bytes
    hold a subnormal (exponent 0, mantissa not 0) or NaN; zeros and normals unmarked."""
    g = torch.Generator().manual_seed(7)
    for n, k in ((32, 34), (48, 576), (16, 2)):
        q = _sparse_specials(n, k, g)
        packed = pack_fp8(q.view(FP8))
        got = native.special_map(packed)
        nb, kp = packed.shape[:2]
        assert got.shape == (nb, kp // 8 + 2)
        mag = packed.view(nb, kp, 32) & 0x7F
        want = (((mag >= 1) & (mag <= 7)) | (mag == 0x7F)).any(2)
        bits = (got[:, :, None] >> torch.arange(8, dtype=torch.uint8)) & 1
        assert torch.equal(bits.reshape(nb, -1)[:, :kp].bool(), want)
        assert not bits.reshape(nb, -1)[:, kp:].any()


@pytest.mark.skipif(native.fp8_linear_isa() < 2, reason="the AVX-512 BF16 product")
def test_shifts_scale_the_activations_without_changing_a_bit():
    """The shifts take the activations times 2^112: zeros and bf16 denormals (zeros to the dot
    product) stay zeros of their sign, and a step holding |x| >= 2^16 or a non-finite value goes
    to the tables whole; each gives the tables' bits, at 1, 2-8 and 9 rows."""
    if "shift" not in _conversions():
        pytest.skip("the shifts need VBMI")
    g = torch.Generator().manual_seed(3)
    n, k = 64, 96
    q = _sparse_specials(n, k, g)
    q[(q & 0x7F) == 0x7F] = 0x7E
    packed = pack_fp8(q.view(FP8))
    s256 = kernel_scales((torch.rand(n, k // 16, generator=g) * 0.01 + 1e-3).to(torch.bfloat16), (n, k))
    x = torch.randn(9, k, generator=g)
    x[0, :5] = torch.tensor([0.0, -0.0, 1e-39, -1e-39, 3e-40])
    x[1, 3] = 70000.0
    x[2, 7] = float("inf")
    x[3, :4] = torch.tensor([-65000.0, 32768.0, 2.0 ** -120, -(2.0 ** -126)])
    for rows in ([0], [0, 3], [0, 1], [2, 4, 5], list(range(9)), [3], [1]):
        a, b = (_product_by(c, x[rows], packed, s256) for c in ("shift", "vbmi"))
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), rows


@pytest.mark.skipif(native.fp8_linear_isa() < 2, reason="the AVX-512 BF16 product")
@pytest.mark.parametrize("codes", ["every", "sparse"])
@pytest.mark.parametrize("k,groups", [(34, 17), (34, 3), (34, 1), (576, 36), (130, 1)])
def test_conversions_give_the_same_bits(k, groups, codes):
    """Each AVX-512 conversion against the others, bit for bit: every code but NaN in each
    chunk (the shifts hand every chunk to the tables), or the shifts' own codes with a few
    zeros, subnormals and NaN scattered (chunks alternate); odd counts of k pairs per group and
    per row (one pair left over after the two-pair steps), fp32 channel and bf16 group scales,
    every path by row count; and a row's bits the same alone as in any step."""
    n = 256 + 16 * 3  # blocks left over past the one-row path's runs of four and two
    g = torch.Generator().manual_seed(k * groups)
    if codes == "every":
        q = _every_byte(n, k).view(torch.uint8)
        q[(q & 0x7f) == 0x7f] = 0x7e
    else:
        q = _sparse_specials(n, k, g)
    q = q.view(FP8)
    s = torch.rand(n, groups, generator=g) * 0.01 + 1e-3
    s = s[:, 0] if groups == 1 else s.to(torch.bfloat16)
    packed, s256 = pack_fp8(q), kernel_scales(s, (n, k))
    x = torch.randn(20, k, generator=g)

    def same(a, b):  # bit for bit, NaN where the other has NaN
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)

    ys = {}
    for conv in _conversions():
        ys[conv] = [_product_by(conv, x[:m], packed, s256) for m in (1, 2, 3, 5, 8, 9, 20)]
        for y in ys[conv][1:]:
            same(y[:1], ys[conv][0])
    ref = x.to(torch.bfloat16).float() @ (q.float() * expand_scale(s, (n, k))).T
    nan_col = torch.isnan(ref).any(0)
    assert (codes == "every") != bool(nan_col.any())
    ok = lambda y: y[:, :n][:, ~nan_col]  # noqa: E731
    torch.testing.assert_close(ok(ys["widen"][-1]), ref[:, ~nan_col], atol=1e-5 * ref[:, ~nan_col].abs().max().item(),
                               rtol=1e-4)
    tables = [c for c in ys if c != "widen"]  # the widening reads NaN as 480: its columns held apart
    for c in tables:
        for a, b in zip(ys[c], ys[tables[0]]):
            same(a, b)
        for a, b in zip(ys[c], ys["widen"]):
            same(ok(a), ok(b))
        assert torch.isnan(ys[c][-1][:, :n][:, nan_col]).all()
