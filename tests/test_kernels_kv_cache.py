"""KV-cache write: the Triton kernel under the interpreter against write_kv_ref, bit for bit."""
import pytest
import torch
from kernel_utils import poison_empty, HUGE_NUM_BLOCKS

from ridge.kernels import native, ops
from ridge.kernels.attention import _load_f32
from ridge.kernels.kv_cache import FP8, _FP8_NATIVE, _all_slots_valid, _launch_write, rotation, write_kv_ref, write_kv_triton
from ridge.kernels.metadata import AttentionMetadata
from ridge.kernels.triton_utils import jit, tl

pytestmark = pytest.mark.usefixtures(poison_empty.__name__)


def fresh_cache(shape, dtype, fp8, empty=False):
    """[k, v, k_scale, v_scale]; scales NaN-poisoned unless `empty` (huge, left unallocated)."""
    make = torch.empty if empty else torch.zeros
    caches = [make(shape, dtype=dtype) for _ in range(2)]
    scales = [torch.empty(shape[:3], dtype=torch.float16) for _ in range(2)] if fp8 else [None, None]
    for s in scales if fp8 and not empty else ():
        s.fill_(float("nan"))
    return caches + scales


def same(a, b):
    if a is None:
        return b is None
    if a.dtype == FP8:
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    return torch.equal(a.nan_to_num(-7.0), b.nan_to_num(-7.0))


def key_value(num_tokens, heads, dim, dtype, seed=0):
    # Rows of a fused qkv output, so key/value are strided views; a wide spread of magnitudes
    # exercises saturation, the 2**-14 scale floor (an all-zero head) and fp16 scale rounding.
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, 4 * heads * dim, generator=g) * torch.logspace(-6, 3, num_tokens)[:, None]
    qkv[0, heads * dim: 2 * heads * dim] = 0.0
    qkv = qkv.to(dtype)
    key = qkv[:, heads * dim: 2 * heads * dim].view(num_tokens, heads, dim)
    value = qkv[:, 2 * heads * dim: 3 * heads * dim].view(num_tokens, heads, dim)
    return key, value


@pytest.mark.parametrize("cache_dtype,x_dtype", [(FP8, torch.bfloat16), (FP8, torch.float32),
                                                 (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
                         ids=["fp8-bf16", "fp8-fp32", "bf16", "fp32"])
def test_matches_reference_bitwise(cache_dtype, x_dtype):
    num_tokens, heads, dim, block_size, num_blocks = 37, 3, 80, 16, 9
    key, value = key_value(num_tokens, heads, dim, x_dtype)
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    slots[[3, 10, 36]] = -1  # skipped tokens (padding, already-cached prefix)
    shape = (num_blocks, block_size, heads, dim)
    ref, tri = fresh_cache(shape, cache_dtype, cache_dtype == FP8), fresh_cache(shape, cache_dtype, cache_dtype == FP8)
    write_kv_ref(key, value, *ref, slots)
    write_kv_triton(key, value, *tri, slots)
    assert all(same(a, b) for a, b in zip(ref, tri))


def test_slots_past_int32_offsets():
    # slot * heads * head_dim passes 2**31: the kernel must address the cache in int64.
    heads, dim, block_size = 1, 64, 16
    shape = (HUGE_NUM_BLOCKS, block_size, heads, dim)
    key, value = key_value(5, heads, dim, torch.bfloat16)
    top = HUGE_NUM_BLOCKS * block_size
    slots = torch.tensor([top - 1, top - 40, -1, top - 17, 3])
    ref, tri = fresh_cache(shape, FP8, True, empty=True), fresh_cache(shape, FP8, True, empty=True)
    write_kv_ref(key, value, *ref, slots)
    write_kv_triton(key, value, *tri, slots)
    keep = slots[slots >= 0]
    for a, b in zip(ref, tri):
        a, b = a.view(-1, heads, *a.shape[3:]), b.view(-1, heads, *b.shape[3:])
        assert same(a[keep], b[keep])


def test_native_fp8_path_runs():
    # The GPU path quantizes in the kernel. The interpreter's fp32 -> fp8 cast is wrong for a
    # few percent of values (machine-facts), so here it only has to run, write the exact
    # scales and agree on the great majority of bytes.
    heads, dim, shape = 2, 64, (4, 16, 2, 64)
    key, _ = key_value(40, heads, dim, torch.float32)
    slots = torch.randperm(64)[:40]
    ref_k, ref_v, ref_ks, ref_vs = fresh_cache(shape, FP8, True)
    write_kv_ref(key, key, ref_k, ref_v, ref_ks, ref_vs, slots)
    cache, scale = torch.zeros(shape, dtype=FP8), torch.zeros(shape[:3], dtype=torch.float16)
    _launch_write(key, slots, cache, scale, cache, _FP8_NATIVE)
    assert torch.equal(scale[ref_ks.isfinite()], ref_ks[ref_ks.isfinite()])
    agree = (cache.view(torch.uint8) == ref_k.view(torch.uint8)).float().mean().item()
    assert agree > 0.9, agree


@jit
def _decode_bits_kernel(src, dst, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(dst + i, _load_f32(src + i, i < n, MODE), mask=i < n)


def test_e4m3_software_decode_all_bytes():
    # Pre-sm_89 GPUs decode e4m3 from its bits; every finite byte must match torch's cast.
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = bits.view(FP8).float()
    out = torch.full((256,), float("nan"))
    _decode_bits_kernel[(1,)](bits, out, 256, 2, 256)
    finite = expected.isfinite()
    assert torch.equal(out[finite], expected[finite])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, FP8])
@pytest.mark.parametrize("padded", [False, True])
def test_cpu_path_matches_reference_and_asks_once_a_step(cache_dtype, padded):
    """ops.write_kv on CPU: write_kv_ref's bytes; whether a slot is padding is asked at the first
    layer and kept in the torch path's own state on the step's metadata for the others."""
    num_tokens, heads, dim, block_size, num_blocks = 21, 3, 64, 16, 5
    slots = torch.randperm(num_blocks * block_size)[:num_tokens]
    if padded:
        slots[[0, 7]] = -1
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0]], slots.tolist())
    shape = (num_blocks, block_size, heads, dim)
    ref, cpu = fresh_cache(shape, cache_dtype, cache_dtype == FP8), fresh_cache(shape, cache_dtype, cache_dtype == FP8)
    for layer in range(2):
        key, value = key_value(num_tokens, heads, dim, torch.float32, seed=layer)
        write_kv_ref(key, value, *ref, meta.slot_mapping)
        ops.write_kv(key, value, *cpu, meta.slot_mapping, meta)
        assert all(same(a, b) for a, b in zip(ref, cpu))
    if native.library() is not None:
        assert meta.states == {}  # the C write skips -1 slots itself: nothing to ask
    else:
        assert meta.states == {_all_slots_valid: (None, not padded)}
    other = slots.flip(0)  # not this step's slot mapping: asked afresh, not taken from meta
    key, value = key_value(num_tokens, heads, dim, torch.float32, seed=5)
    write_kv_ref(key, value, *ref, other)
    ops.write_kv(key, value, *cpu, other, meta)
    assert all(same(a, b) for a, b in zip(ref, cpu))


def test_the_fp8_cache_rotation_is_exact_and_the_model_attends_through_it(tmp_path):
    """H H / D = I exactly; a tiny model with an FP8 cache writes K H (ridge/models/layers/decoder.py) and its
    logits stay within FP8's error of the fp32 cache's."""
    from tiny_models import make_tiny

    from ridge.models.fp8_calibrate import build
    from ridge.models.oneshot import prompt_logits
    from ridge.models.registry import convert

    h, hd = rotation(64, torch.float32, torch.device("cpu"))
    assert torch.equal(h @ hd, torch.eye(64)) and torch.equal(h, h.t()) and rotation(48, torch.float32, "cpu") is None
    assert torch.equal(rotation(64, torch.bfloat16, torch.device("cpu"))[1].float(), hd)  # exact in bf16
    conv = convert(make_tiny(tmp_path)[0], quantize=False, use_cache=False, show_progress=False)
    assert rotation(conv.config.head_dim, torch.float32, torch.device("cpu")) is not None
    model = build(conv.config, conv.state_dict, conv.freq_factors)
    ids = list(range(3, 40))
    ref, fp8 = prompt_logits(model, ids), prompt_logits(model, ids, kv_dtype="fp8")
    assert (fp8 - ref).abs().max() < 0.05 * ref.abs().max()
