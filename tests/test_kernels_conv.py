"""The causal depthwise convolution with per-slot windows (kernels/causal_conv.py): the torch
reference against transformers' causal_conv1d_update, then Triton under the interpreter and the
C kernel against it, over varlen batches; and the rule of chunked prefill: one go == odd chunks
== token by token."""
import pytest
import torch
from kernel_utils import assert_close, poison_empty

from ridge.kernels import causal_conv as cc
from ridge.kernels import native, ops

pytestmark = pytest.mark.usefixtures(poison_empty.__name__)

FP32 = dict(atol=2e-5, rtol=2e-5)


class Batch:
    def __init__(self, lens, channels, taps, dtype=torch.float32, bias=True, num_slots=None, seed=0):
        g = torch.Generator().manual_seed(seed)
        t = sum(lens)
        self.lens = lens
        # x: a strided view, as the slice of a fused projection the models convolve
        self.x = torch.randn(t, channels + 7, generator=g).to(dtype)[:, 3:3 + channels]
        self.w = torch.randn(channels, taps, generator=g) * 0.5
        self.bias = torch.randn(channels, generator=g) if bias else None
        num_slots = num_slots or len(lens) + 5
        self.pool = torch.randn(num_slots, taps - 1, channels, generator=g)
        self.slots = num_slots - 1 - torch.randperm(len(lens) + 3, generator=g)[:len(lens)]
        self.cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("channels,taps", [(40, 4), (19, 3), (8, 2)])
@pytest.mark.parametrize("activation", ["silu", None])
def test_reference_matches_transformers(channels, taps, activation):
    """Each request against transformers' causal_conv1d_update on its own batch of one, its state
    in their layout [1, C, K - 1]; no initial window is zeros."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_update
    b = Batch([20, 1, 2, 0, 37], channels, taps, seed=channels)
    init = torch.tensor([True, False, True, True, False])
    pool = b.pool.clone()
    out = cc.causal_conv1d_ref(b.x, b.w, b.bias, pool, b.cu, b.slots, init, activation=activation)
    for n in range(len(b.lens)):
        a, e, slot = int(b.cu[n]), int(b.cu[n + 1]), int(b.slots[n])
        state = b.pool[slot].T[None].clone() if init[n] else torch.zeros(1, channels, taps - 1)
        if e > a:
            want = causal_conv1d_update(b.x[a:e].T[None].contiguous(), state, b.w, b.bias, activation=activation)
            assert_close(out[a:e], want[0].T, **FP32)
            assert_close(pool[slot], state[0].T, **FP32)
        else:  # nothing new: the window stays what it was
            assert torch.equal(pool[slot], state[0].T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("channels,taps,bias", [(300, 4, True), (19, 3, False)])
def test_triton_matches_reference(dtype, channels, taps, bias):
    """Channels over two blocks and odd, lengths shorter than the window, an empty request, and
    NaN in the slots of requests without an initial window (which must not be read)."""
    b = Batch([20, 1, 2, 0, 37], channels, taps, dtype=dtype, bias=bias, seed=taps)
    init = torch.tensor([True, False, True, False, True])
    b.pool[b.slots[~init]] = float("nan")
    ref_pool, tri_pool = b.pool.clone(), b.pool.clone()
    ref = cc.causal_conv1d_ref(b.x, b.w, b.bias, ref_pool, b.cu, b.slots, init, activation="silu")
    out = cc.causal_conv1d_triton(b.x, b.w, b.bias, tri_pool, b.cu, b.slots, init, activation="silu")
    assert out.dtype == dtype
    assert_close(out, ref, **(FP32 if dtype == torch.float32 else {}))
    assert_close(tri_pool, ref_pool, **FP32)


@pytest.mark.parametrize("backend", ["triton", "c"])
def test_decode_update_matches_reference(backend):
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([1] * 5, 300, 4, seed=3, num_slots=12)
    ref_pool, pool = b.pool.clone(), b.pool.clone()
    ref = cc.causal_conv1d_update_ref(b.x, b.w, b.bias, ref_pool, b.slots, activation="silu")
    fn = cc.causal_conv1d_update_triton if backend == "triton" else cc.causal_conv1d_update_native
    assert_close(fn(b.x, b.w, b.bias, pool, b.slots, activation="silu"), ref, **FP32)
    assert_close(pool, ref_pool, **FP32)


@pytest.mark.parametrize("taps", [4, 3, 2, 6])  # the C kernel writes out 4 and 3 (LFM2), loops the rest
def test_native_matches_reference_and_ops_picks_it(taps):
    if native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([20, 1, 2, 0, 37], 300, taps, seed=9)
    init = torch.tensor([True, False, True, False, True])
    b.pool[b.slots[~init]] = float("nan")
    assert cc.native_fits(b.x, b.w, b.bias, b.pool)
    ref_pool, c_pool, ops_pool = b.pool.clone(), b.pool.clone(), b.pool.clone()
    ref = cc.causal_conv1d_ref(b.x, b.w, b.bias, ref_pool, b.cu, b.slots, init, activation="silu")
    assert_close(cc.causal_conv1d_native(b.x, b.w, b.bias, c_pool, b.cu, b.slots, init, activation="silu"), ref,
                 **FP32)
    assert_close(c_pool, ref_pool, **FP32)
    assert_close(ops.causal_conv1d(b.x, b.w, b.bias, ops_pool, b.cu, b.slots, init, activation="silu"), ref, **FP32)
    assert_close(ops_pool, ref_pool, **FP32)
    assert not cc.native_fits(b.x.to(torch.bfloat16), b.w, b.bias, b.pool)


@pytest.mark.parametrize("backend", ["triton", "c"])
def test_speculative_batch_keeps_each_tokens_window(backend):
    """A verification batch (1, 4 and 3 tokens; 4 > the window of 3): token_state_slots keeps the
    window after chosen tokens, each what a request that stopped there would hold."""
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([1, 4, 3], 40, 4, seed=6, num_slots=20)
    tok = torch.tensor([-1, 0, 1, 2, 3, -1, 4, 5])
    ref_pool, pool = b.pool.clone(), b.pool.clone()
    ref = cc.causal_conv1d_ref(b.x, b.w, b.bias, ref_pool, b.cu, b.slots, activation="silu", token_state_slots=tok)
    fn = cc.causal_conv1d_triton if backend == "triton" else cc.causal_conv1d_native
    assert_close(fn(b.x, b.w, b.bias, pool, b.cu, b.slots, activation="silu", token_state_slots=tok), ref, **FP32)
    assert_close(pool, ref_pool, **FP32)
    for j, kept in enumerate([0, 1, 2, 3]):  # request 1 stopped after its token j
        alone = b.pool.clone()
        cc.causal_conv1d_ref(b.x[1:2 + j], b.w, b.bias, alone, torch.tensor([0, j + 1]), b.slots[1:2])
        assert torch.equal(ref_pool[kept], alone[b.slots[1]])


HUGE_SLOTS = (1 << 31) // (3 * 64) + 64  # slot * (K - 1) * C past 2**31 floats for 64 channels, 4 taps


@pytest.mark.parametrize("backend", ["triton", "c"])
def test_slots_past_2_31_elements(backend):
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([3, 2], 64, 4, seed=4)
    huge = torch.empty(HUGE_SLOTS, 3, 64)
    slots = torch.tensor([HUGE_SLOTS - 1, HUGE_SLOTS - 70])
    huge[slots] = b.pool[:2]
    small = b.pool[:2].clone()
    ref = cc.causal_conv1d_ref(b.x, b.w, b.bias, small, b.cu, torch.tensor([0, 1]))
    fn = cc.causal_conv1d_triton if backend == "triton" else cc.causal_conv1d_native
    assert_close(fn(b.x, b.w, b.bias, huge, b.cu, slots), ref, **FP32)
    assert_close(huge[slots], small, **FP32)


@pytest.mark.parametrize("backend", ["ref", "triton", "c"])
def test_one_go_equals_odd_chunks_equals_token_by_token(backend):
    """A request's prefill in one call, in chunks of odd sizes (1 and 2, shorter than the window,
    among them) packed with another request's, and token by token through the decode form."""
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    varlen = {"ref": cc.causal_conv1d_ref, "triton": cc.causal_conv1d_triton, "c": cc.causal_conv1d_native}[backend]
    update = {"ref": cc.causal_conv1d_update_ref, "triton": cc.causal_conv1d_update_triton,
              "c": cc.causal_conv1d_update_native}[backend]
    lens = [23, 9]
    b = Batch(lens, 40, 4, seed=21)
    whole = b.pool.clone()
    want = varlen(b.x, b.w, b.bias, whole, b.cu, b.slots, torch.tensor([False, False]), activation="silu")
    starts = b.cu.tolist()
    # chunks: request 0 in 5, 1, 2, 15; request 1 in 0, 3, 6, 0 (starts at the second step)
    pool = b.pool.clone()
    out = torch.empty_like(want)
    done, started = [0, 0], [False, False]
    for step in ([5, 0], [1, 3], [2, 6], [15, 0]):
        ids = [n for n in (0, 1) if step[n]]
        rows = torch.cat([torch.arange(starts[n] + done[n], starts[n] + done[n] + step[n]) for n in ids])
        cu = torch.tensor([0] + torch.tensor([step[n] for n in ids]).cumsum(0).tolist())
        out[rows] = varlen(b.x[rows], b.w, b.bias, pool, cu, b.slots[ids], torch.tensor([started[n] for n in ids]),
                           activation="silu")
        for n in ids:
            done[n] += step[n]
            started[n] = True
    assert_close(out, want, **FP32)
    assert_close(pool, whole, **FP32)
    # token by token: the first token of each from a zeroed window (a fresh slot)
    pool = b.pool.clone()
    pool[b.slots] = 0
    for i in range(max(lens)):
        ids = [n for n in (0, 1) if i < lens[n]]
        rows = torch.tensor([starts[n] + i for n in ids])
        out[rows] = update(b.x[rows], b.w, b.bias, pool, b.slots[ids], activation="silu")
    assert_close(out, want, **FP32)
    assert_close(pool, whole, **FP32)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(weight=a["weight"][:-1]), "weight: want"),
    (lambda a: a.update(weight=a["weight"][:, :1]), "weight: want"),
    (lambda a: a.update(bias=a["bias"][:3]), "bias: want"),
    (lambda a: a.update(conv_state=a["conv_state"][:, :2]), "conv_state: want"),
    (lambda a: a.update(activation="gelu"), "activation: one of"),
    (lambda a: a.update(cu_seqlens=torch.tensor([0, 4, 3, 5])), "cu_seqlens: must"),
])
def test_bad_input_names_the_field(change, message):
    b = Batch([3, 2], 16, 4)
    args = dict(x=b.x, weight=b.w, bias=b.bias, conv_state=b.pool.clone(), cu_seqlens=b.cu, state_slots=b.slots)
    change(args)
    if args["cu_seqlens"].numel() != 3:
        args["state_slots"] = torch.arange(args["cu_seqlens"].numel() - 1)
    for fn in (cc.causal_conv1d_ref, cc.causal_conv1d_triton):
        with pytest.raises(AssertionError, match=message):
            fn(**args)
