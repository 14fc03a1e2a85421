"""The gated delta rule (kernels/gated_delta.py): the torch references against transformers' own
(torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule), then Triton under the
interpreter and the C kernel against the references, over varlen batches whose states live in a
slot pool; and the rule of chunked prefill: one go == odd chunks == token by token."""
import pytest
import torch
import torch.nn.functional as F
from kernel_utils import assert_close, poison_empty

from ridge.kernels import gated_delta as gd
from ridge.kernels import native, ops

pytestmark = pytest.mark.usefixtures(poison_empty.__name__)

FP32 = dict(atol=2e-5, rtol=2e-5)


def transformers_gdn():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m
    return m.torch_chunk_gated_delta_rule, m.torch_recurrent_gated_delta_rule


class Batch:
    """A varlen batch: requests of `lens` tokens at distinct slots among the pool's highest."""

    def __init__(self, lens, hk, hv, dk, dv, dtype=torch.float32, l2norm=True, num_slots=None, seed=0,
                 fused=False):
        g = torch.Generator().manual_seed(seed)
        t = sum(lens)
        self.lens, self.dtype, self.l2norm = lens, dtype, l2norm
        # unnormalized keys are kept short, else beta |k|^2 > 2 and the rule diverges
        amp = 1.0 if l2norm else dk ** -0.5
        if fused:  # q, k, v as views of one projection's rows, as the model's conv output gives them
            width = 2 * hk * dk + hv * dv
            qkv = (torch.randn(t, width + 3, generator=g) * amp).to(dtype)
            self.q = qkv[:, :hk * dk].view(t, hk, dk)
            self.k = qkv[:, hk * dk:2 * hk * dk].view(t, hk, dk)
            self.v = (qkv[:, 2 * hk * dk:width] / amp).view(t, hv, dv)
        else:
            self.q = (torch.randn(t, hk, dk, generator=g) * amp).to(dtype)
            self.k = (torch.randn(t, hk, dk, generator=g) * amp).to(dtype)
            self.v = torch.randn(t, hv, dv, generator=g).to(dtype)
        self.g = -F.softplus(torch.randn(t, hv, generator=g)) * 0.5  # log decay: the models' fp32
        self.beta = torch.sigmoid(torch.randn(t, hv, generator=g)).to(dtype)
        num_slots = num_slots or len(lens) + 5
        self.pool = (torch.randn(num_slots, hv, dk, dv, generator=g) * 0.1)
        self.slots = num_slots - 1 - torch.randperm(len(lens) + 3, generator=g)[:len(lens)]
        self.cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)

    def args(self, pool):
        return (self.q, self.k, self.v, self.g, self.beta, pool, self.cu, self.slots)


@pytest.mark.parametrize("hk,hv,dk,dv", [(2, 2, 16, 16), (1, 3, 24, 40), (2, 4, 32, 8)])
@pytest.mark.parametrize("l2norm", [True, False], ids=["l2norm", "raw"])
def test_references_match_transformers(hk, hv, dk, dv, l2norm):
    """Each request against transformers' chunked and recurrent rules on its own batch of one,
    from its slot's state or from none; lengths about the chunk, and of one token."""
    b = Batch([70, 1, 64, 5], hk, hv, dk, dv, l2norm=l2norm, seed=dk)
    init = torch.tensor([True, False, True, False])
    tf_chunk, tf_rec = transformers_gdn()
    ours_chunk, ours_rec = b.pool.clone(), b.pool.clone()
    out_chunk = gd.gated_delta_rule_chunk_ref(*b.args(ours_chunk), init, use_qk_l2norm=l2norm)
    out_rec = gd.gated_delta_rule_recurrent_ref(*b.args(ours_rec), init, use_qk_l2norm=l2norm)
    for n in range(len(b.lens)):
        a, e, slot = int(b.cu[n]), int(b.cu[n + 1]), int(b.slots[n])
        one = [x[None, a:e] for x in (b.q, b.k, b.v, b.g, b.beta)]
        state = b.pool[slot][None].clone() if init[n] else None
        want, want_state = tf_chunk(*one, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        assert_close(out_chunk[a:e], want[0], **FP32)
        assert_close(ours_chunk[slot], want_state[0], **FP32)
        want, want_state = tf_rec(*one, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        assert_close(out_rec[a:e], want[0], **FP32)
        assert_close(ours_rec[slot], want_state[0], **FP32)
    untouched = torch.ones(b.pool.shape[0], dtype=torch.bool)
    untouched[b.slots] = False
    assert torch.equal(ours_chunk[untouched], b.pool[untouched]), "a slot no request owns was written"


def test_scale_is_honoured():
    b = Batch([9, 3], 1, 2, 16, 16, seed=3)
    p1, p2 = b.pool.clone(), b.pool.clone()
    half = gd.gated_delta_rule_recurrent_ref(*b.args(p1), scale=0.125, use_qk_l2norm=True)
    default = gd.gated_delta_rule_recurrent_ref(*b.args(p2), use_qk_l2norm=True)  # 16 ** -0.5 = 0.25
    assert_close(2 * half, default, **FP32)
    assert torch.equal(p1, p2), "the scale reads the state; it does not change it"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("hk,hv,dk,dv,lens", [(1, 3, 24, 40, [70, 1, 0, 5]), (2, 2, 16, 96, [129, 2])])
def test_triton_chunk_matches_reference(dtype, hk, hv, dk, dv, lens):
    """Odd head counts and dims (not powers of two), a Dv over two blocks, lengths not multiples
    of the chunk, an empty request; a request without an initial state must not read its slot."""
    b = Batch(lens, hk, hv, dk, dv, dtype=dtype, seed=dv)
    init = torch.tensor([i % 2 == 1 for i in range(len(lens))])
    b.pool[b.slots[~init]] = float("nan")
    ref_pool, tri_pool = b.pool.clone(), b.pool.clone()
    ref = gd.gated_delta_rule_chunk_ref(*b.args(ref_pool), init, use_qk_l2norm=True)
    out = gd.gated_delta_rule_chunk_triton(*b.args(tri_pool), init, use_qk_l2norm=True)
    assert out.dtype == dtype
    assert_close(out, ref, **(FP32 if dtype == torch.float32 else {}))
    assert_close(tri_pool, ref_pool, **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_recurrent_matches_reference_and_keeps_each_tokens_state(dtype):
    """A speculative verification batch: 1, 4 and 3 tokens, q/k/v views of one fused projection;
    token_state_slots keeps the state after chosen tokens (-1: not kept)."""
    b = Batch([1, 4, 3], 2, 4, 24, 20, dtype=dtype, seed=5, num_slots=20, fused=True)
    tok = torch.tensor([-1, 0, 1, -1, 2, -1, 3, 4])
    ref_pool, tri_pool = b.pool.clone(), b.pool.clone()
    ref = gd.gated_delta_rule_recurrent_ref(*b.args(ref_pool), use_qk_l2norm=True, token_state_slots=tok)
    out = gd.gated_delta_rule_recurrent_triton(*b.args(tri_pool), use_qk_l2norm=True, token_state_slots=tok)
    assert_close(out, ref, **(FP32 if dtype == torch.float32 else {}))
    assert_close(tri_pool, ref_pool, **FP32)
    # the kept state after token 2 of request 1 is where a rollback to it starts
    one = Batch([1, 4, 3], 2, 4, 24, 20, dtype=dtype, seed=5, num_slots=20, fused=True)
    pool = one.pool.clone()
    cu = torch.tensor([0, 2])
    gd.gated_delta_rule_recurrent_ref(*(x[1:3] for x in (one.q, one.k, one.v, one.g, one.beta)), pool, cu,
                                      one.slots[1:2], use_qk_l2norm=True)
    assert_close(ref_pool[1], pool[one.slots[1]], **FP32)


def test_native_recurrent_matches_reference():
    if native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([1, 1, 3, 1, 2], 2, 6, 32, 24, seed=7, fused=True, num_slots=20)
    init = torch.tensor([True, True, False, True, True])
    b.pool[b.slots[2]] = float("nan")
    tok = torch.tensor([-1, -1, 0, 1, -1, -1, 2, 3])
    assert gd.native_fits(b.q, b.k, b.v, b.g, b.beta, b.pool)
    ref_pool, c_pool = b.pool.clone(), b.pool.clone()
    ref = gd.gated_delta_rule_recurrent_ref(*b.args(ref_pool), init, use_qk_l2norm=True, token_state_slots=tok)
    out = gd.gated_delta_rule_recurrent_native(*b.args(c_pool), init, use_qk_l2norm=True, token_state_slots=tok)
    assert_close(out, ref, **FP32)
    assert_close(c_pool, ref_pool, **FP32)
    # ops picks the C kernel for it on CPU, and the reference where it does not fit
    ops_pool = b.pool.clone()
    assert_close(ops.gated_delta_rule_recurrent(*b.args(ops_pool), init, use_qk_l2norm=True), ref, **FP32)
    assert not gd.native_fits(b.q.to(torch.bfloat16), b.k, b.v, b.g, b.beta, b.pool)


# ~2**31 floats past the pool's start for 2 heads of 16 x 16 (512 floats a slot): offsets in int32
# wrap there. torch.empty leaves the pages unallocated; only the slots a test touches cost memory.
HUGE_SLOTS = (1 << 31) // 512 + 64


@pytest.mark.parametrize("backend", ["triton_chunk", "triton_recurrent", "c"])
def test_slots_past_2_31_elements(backend):
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([3, 2], 1, 2, 16, 16, seed=11)
    huge = torch.empty(HUGE_SLOTS, 2, 16, 16)
    slots = torch.tensor([HUGE_SLOTS - 1, HUGE_SLOTS - 40])
    huge[slots] = b.pool[:2]
    small = b.pool[:2].clone()
    ref = gd.gated_delta_rule_recurrent_ref(b.q, b.k, b.v, b.g, b.beta, small, b.cu, torch.tensor([0, 1]),
                                            use_qk_l2norm=True)
    fn = {"triton_chunk": gd.gated_delta_rule_chunk_triton, "triton_recurrent": gd.gated_delta_rule_recurrent_triton,
          "c": gd.gated_delta_rule_recurrent_native}[backend]
    out = fn(b.q, b.k, b.v, b.g, b.beta, huge, b.cu, slots, use_qk_l2norm=True)
    assert_close(out, ref, **FP32)
    assert_close(huge[slots], small, **FP32)


def _run(backend, form, b: Batch, pool, rows, cu, slots, init):
    args = [x[rows] for x in (b.q, b.k, b.v, b.g, b.beta)] + [pool, torch.tensor(cu), torch.tensor(slots),
                                                              torch.tensor(init)]
    fns = {("ref", "chunk"): gd.gated_delta_rule_chunk_ref, ("ref", "rec"): gd.gated_delta_rule_recurrent_ref,
           ("triton", "chunk"): gd.gated_delta_rule_chunk_triton,
           ("triton", "rec"): gd.gated_delta_rule_recurrent_triton,
           ("c", "chunk"): ops.gated_delta_rule_chunk, ("c", "rec"): gd.gated_delta_rule_recurrent_native}
    return fns[backend, form](*args, use_qk_l2norm=True)


def _steps(lens, pieces):
    """Varlen steps where request n advances by pieces[n][i] tokens at step i (0: not scheduled)
    -> [(rows into the packed tokens, cu_seqlens, request ids)]."""
    starts = [0] + torch.tensor(lens).cumsum(0).tolist()
    done = [0] * len(lens)
    steps = []
    for i in range(max(map(len, pieces))):
        rows, cu, ids = [], [0], []
        for n, p in enumerate(pieces):
            if i < len(p) and p[i]:
                rows += range(starts[n] + done[n], starts[n] + done[n] + p[i])
                done[n] += p[i]
                cu.append(len(rows))
                ids.append(n)
        steps.append((torch.tensor(rows, dtype=torch.long), cu, ids))
    assert done == list(lens)
    return steps


@pytest.mark.parametrize("backend", ["ref", "triton", "c"])
def test_one_go_equals_odd_chunks_equals_token_by_token(backend):
    """Continuous batching's rule: a request's prefill in one call, in chunks of odd sizes each
    starting from the state the last one left (packed with another request's chunks, which
    start and stop at other steps), and token by token (the decode form) all give the same
    outputs and the same final state."""
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    lens = [75, 40]
    b = Batch(lens, 1, 2, 16, 24, seed=13)
    slots = b.slots.tolist()
    whole = b.pool.clone()
    want = _run(backend, "chunk", b, whole, torch.arange(sum(lens)), b.cu.tolist(), slots, [False, False])

    def replay(pieces, form):
        pool = b.pool.clone()
        out = torch.empty_like(want)
        started = [False, False]
        for rows, cu, ids in _steps(lens, pieces):
            out[rows] = _run(backend, form, b, pool, rows, cu, [slots[n] for n in ids], [started[n] for n in ids])
            for n in ids:
                started[n] = True
        return out, pool

    tol = FP32
    out, pool = replay([[37, 1, 29, 8], [0, 13, 0, 27]], "chunk")
    assert_close(out, want, **tol)
    assert_close(pool[b.slots], whole[b.slots], **tol)
    out, pool = replay([[1] * 75, [1] * 40], "rec")
    assert_close(out, want, **tol)
    assert_close(pool[b.slots], whole[b.slots], **tol)


@pytest.mark.parametrize("field,change,message", [
    ("k", lambda a: a.update(k=a["k"][:, :, :8]), "k: want"),
    ("v", lambda a: a.update(v=a["v"][:, :1]), "v: its 1 heads"),
    ("g", lambda a: a.update(g=a["g"][:-1]), "g: want"),
    ("state_pool", lambda a: a.update(state_pool=a["state_pool"][..., :4]), "state_pool: want"),
    ("cu_seqlens", lambda a: a.update(cu_seqlens=torch.tensor([0, 2, 3])), "cu_seqlens: must run from 0"),
    ("state_slots", lambda a: a.update(state_slots=torch.tensor([1, 1])), "state_slots: two requests share"),
    ("state_slots", lambda a: a.update(state_slots=torch.tensor([1, 99])), "state_slots: each in"),
])
def test_bad_input_names_the_field(field, change, message):
    b = Batch([3, 2], 2, 4, 16, 16)
    args = dict(q=b.q, k=b.k, v=b.v, g=b.g, beta=b.beta, state_pool=b.pool.clone(), cu_seqlens=b.cu,
                state_slots=b.slots)
    change(args)
    for fn in (gd.gated_delta_rule_chunk_ref, gd.gated_delta_rule_recurrent_ref, gd.gated_delta_rule_chunk_triton):
        with pytest.raises(AssertionError, match=message):
            fn(**args)


def test_token_state_slots_may_not_be_a_requests_own_slot():
    """The kernels run requests at once: a kept state written to another request's slot would race
    with that request's reads."""
    b = Batch([2, 1], 1, 2, 16, 16)
    tok = torch.tensor([int(b.slots[1]), -1, -1])
    for fn in (gd.gated_delta_rule_recurrent_ref, gd.gated_delta_rule_recurrent_triton):
        with pytest.raises(AssertionError, match="also a request's state slot"):
            fn(*b.args(b.pool.clone()), token_state_slots=tok)
        with pytest.raises(AssertionError, match="a slot taken twice"):
            fn(*b.args(b.pool.clone()), token_state_slots=torch.tensor([0, 0, -1]))


def test_ops_registers_every_recurrent_triton_kernel():
    """ops sends CUDA tensors (and everything under use_triton) to these six kernels."""
    from ridge.kernels import causal_conv as cc
    from ridge.kernels import ssd_scan as ss
    assert ops.load_triton()
    want = {"gated_delta_rule_chunk": gd.gated_delta_rule_chunk_triton,
            "gated_delta_rule_recurrent": gd.gated_delta_rule_recurrent_triton,
            "causal_conv1d": cc.causal_conv1d_triton, "causal_conv1d_update": cc.causal_conv1d_update_triton,
            "ssd_chunk_scan": ss.ssd_chunk_scan_triton, "ssd_state_update": ss.ssd_state_update_triton}
    for name, fn in want.items():
        assert ops._TRITON[name] is fn, name
    b = Batch([5, 2], 1, 2, 16, 16, seed=17)
    ref_pool, tri_pool = b.pool.clone(), b.pool.clone()
    ref = gd.gated_delta_rule_chunk_ref(*b.args(ref_pool), use_qk_l2norm=True)
    with ops.use_triton():
        out = ops.gated_delta_rule_chunk(*b.args(tri_pool), use_qk_l2norm=True)
    assert_close(out, ref, **FP32)
    assert_close(tri_pool, ref_pool, **FP32)


@pytest.mark.parametrize("form", ["chunk", "recurrent"])
def test_bf16_state_pool(form):
    """A bf16 pool (half the bytes a request): read widened to fp32, written rounded once a call."""
    b = Batch([70, 3], 1, 2, 16, 24, seed=19)
    b.pool = b.pool.to(torch.bfloat16)
    ref_pool, tri_pool = b.pool.clone(), b.pool.clone()
    ref_fn, tri_fn = ((gd.gated_delta_rule_chunk_ref, gd.gated_delta_rule_chunk_triton) if form == "chunk" else
                      (gd.gated_delta_rule_recurrent_ref, gd.gated_delta_rule_recurrent_triton))
    ref = ref_fn(*b.args(ref_pool), use_qk_l2norm=True)
    out = tri_fn(*b.args(tri_pool), use_qk_l2norm=True)
    assert_close(out, ref, **FP32)
    assert_close(tri_pool, ref_pool)  # bf16's tolerance: the interpreter truncates where torch rounds
    assert not gd.native_fits(b.q, b.k, b.v, b.g, b.beta, b.pool)


def test_a_batch_changed_in_place_is_checked_again():
    """varlen.check_varlen reuses the last batch's check while its tensors are the same objects,
    unmodified: an in-place change is seen."""
    b = Batch([3, 2], 1, 2, 16, 16)
    gd.gated_delta_rule_recurrent_ref(*b.args(b.pool.clone()), use_qk_l2norm=True)
    gd.gated_delta_rule_recurrent_ref(*b.args(b.pool.clone()), use_qk_l2norm=True)
    b.slots[1] = b.slots[0]
    with pytest.raises(AssertionError, match="two requests share a slot"):
        gd.gated_delta_rule_recurrent_ref(*b.args(b.pool.clone()), use_qk_l2norm=True)
