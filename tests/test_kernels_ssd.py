"""Mamba2's selective scan (kernels/ssd_scan.py): the torch references against transformers' own
(mamba2_chunk_scan, mamba2_selective_state_update), then Triton under the interpreter and the C
kernel against them, over varlen batches whose states live in a slot pool; and the rule of
chunked prefill: one go == odd chunks == token by token."""
import math

import pytest
import torch
from kernel_utils import assert_close, poison_empty

from ridge.kernels import native, ops
from ridge.kernels import ssd_scan as ss

pytestmark = pytest.mark.usefixtures(poison_empty.__name__)

FP32 = dict(atol=5e-5, rtol=5e-5)  # sums of up to a chunk of products of O(1) terms


class Batch:
    def __init__(self, lens, heads, groups, head_dim, state, dtype=torch.float32, num_slots=None, seed=0,
                 fused=False):
        g = torch.Generator().manual_seed(seed)
        t = sum(lens)
        self.lens = lens
        if fused:  # x, B, C, dt as views of one projection's rows (Mamba2's in_proj output)
            widths = [heads * head_dim, groups * state, groups * state, heads]
            xbcdt = torch.randn(t, sum(widths) + 5, generator=g).to(dtype)
            x, B, C, dt = torch.split(xbcdt[:, :sum(widths)], widths, dim=1)
            self.x, self.dt = x.view(t, heads, head_dim), dt
            self.B, self.C = (B * state ** -0.5).view(t, groups, state), C.view(t, groups, state)
        else:
            self.x = torch.randn(t, heads, head_dim, generator=g).to(dtype)
            self.dt = torch.randn(t, heads, generator=g).to(dtype)
            self.B = (torch.randn(t, groups, state, generator=g) * state ** -0.5).to(dtype)
            self.C = torch.randn(t, groups, state, generator=g).to(dtype)
        self.A = -torch.exp(torch.rand(heads, generator=g) * 2 - 1)  # -exp(A_log)
        self.D = torch.randn(heads, generator=g)
        self.dt_bias = torch.randn(heads, generator=g) * 0.5
        num_slots = num_slots or len(lens) + 5
        self.pool = torch.randn(num_slots, heads, head_dim, state, generator=g) * 0.1
        self.slots = num_slots - 1 - torch.randperm(len(lens) + 3, generator=g)[:len(lens)]
        self.cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)

    def args(self, pool, rows=slice(None)):
        return (self.x[rows], self.dt[rows], self.A, self.B[rows], self.C[rows], pool)

    def kw(self, dt_limit=(0.0, math.inf)):
        return dict(D=self.D, dt_bias=self.dt_bias, dt_softplus=True, dt_limit=dt_limit)


@pytest.mark.parametrize("heads,groups,head_dim,state", [(4, 2, 24, 20), (3, 1, 16, 16), (2, 2, 8, 32)])
@pytest.mark.parametrize("dt_limit", [(0.0, math.inf), (0.01, 1.5)], ids=["free", "limited"])
def test_references_match_transformers(heads, groups, head_dim, state, dt_limit):
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import (mamba2_chunk_scan,
                                                                                mamba2_selective_state_update)
    b = Batch([70, 1, 64, 5], heads, groups, head_dim, state, seed=head_dim)
    init = torch.tensor([True, False, True, False])
    ours_chunk, ours_rec = b.pool.clone(), b.pool.clone()
    out_chunk = ss.ssd_chunk_scan_ref(*b.args(ours_chunk), b.cu, b.slots, init, **b.kw(dt_limit))
    out_rec = ss.ssd_state_update_ref(*b.args(ours_rec), b.cu, b.slots, init, **b.kw(dt_limit))
    for n in range(len(b.lens)):
        a, e, slot = int(b.cu[n]), int(b.cu[n + 1]), int(b.slots[n])
        state0 = b.pool[slot][None].clone() if init[n] else None
        want, want_state = mamba2_chunk_scan(b.x[None, a:e], b.dt[None, a:e], b.A, b.B[None, a:e], b.C[None, a:e],
                                             chunk_size=32, D=b.D, dt_bias=b.dt_bias, initial_states=state0,
                                             dt_softplus=True, dt_limit=dt_limit, return_final_states=True)
        assert_close(out_chunk[a:e], want[0], **FP32)
        assert_close(ours_chunk[slot], want_state[0], **FP32)
        if dt_limit[1] == math.inf:  # transformers' update takes no dt_limit
            s = state0.clone() if state0 is not None else torch.zeros_like(b.pool[slot][None])
            for i in range(a, e):
                y = mamba2_selective_state_update(
                    s, b.x[i][None], b.dt[i][None, :, None].expand(1, heads, head_dim),
                    b.A[:, None, None].expand(heads, head_dim, state), b.B[i][None], b.C[i][None],
                    b.D[:, None].expand(heads, head_dim), dt_bias=b.dt_bias[:, None].expand(heads, head_dim),
                    dt_softplus=True)
                assert_close(out_rec[i], y[0], **FP32)
            assert_close(ours_rec[slot], s[0], **FP32)
        else:
            assert_close(out_rec[a:e], want[0], **FP32)
            assert_close(ours_rec[slot], want_state[0], **FP32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,groups,head_dim,state,lens", [(4, 2, 24, 20, [70, 1, 0, 5]),
                                                              (3, 3, 80, 16, [129, 2])])
def test_triton_chunk_matches_reference(dtype, heads, groups, head_dim, state, lens):
    """Groups fewer than heads, odd dims, a head_dim over two blocks, lengths not multiples of the
    chunk, an empty request; a request without an initial state must not read its slot."""
    b = Batch(lens, heads, groups, head_dim, state, dtype=dtype, seed=head_dim, fused=dtype == torch.float32)
    init = torch.tensor([i % 2 == 1 for i in range(len(lens))])
    b.pool[b.slots[~init]] = float("nan")
    ref_pool, tri_pool = b.pool.clone(), b.pool.clone()
    kw = b.kw((0.0, 4.0))
    ref = ss.ssd_chunk_scan_ref(*b.args(ref_pool), b.cu, b.slots, init, **kw)
    out = ss.ssd_chunk_scan_triton(*b.args(tri_pool), b.cu, b.slots, init, **kw)
    assert out.dtype == dtype
    assert_close(out, ref, **(FP32 if dtype == torch.float32 else {}))
    assert_close(tri_pool, ref_pool, **FP32)


@pytest.mark.parametrize("backend", ["triton", "c"])
def test_state_update_matches_reference_and_keeps_each_tokens_state(backend):
    """A speculative verification batch (1, 4 and 3 tokens) of fused-projection views, no D and no
    dt_bias; token_state_slots keeps the state after chosen tokens (-1: not kept)."""
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([1, 4, 3], 4, 2, 24, 20, seed=5, num_slots=20, fused=True)
    tok = torch.tensor([-1, 0, 1, -1, 2, -1, 3, 4])
    init = torch.tensor([True, True, False])
    b.pool[b.slots[2]] = float("nan")
    kw = dict(dt_softplus=True, dt_limit=(0.0, 3.0), token_state_slots=tok)
    ref_pool, pool = b.pool.clone(), b.pool.clone()
    ref = ss.ssd_state_update_ref(*b.args(ref_pool), b.cu, b.slots, init, **kw)
    if backend == "c":
        assert ss.native_fits(b.x, b.dt, b.A, b.B, b.C, None, None, pool)
    fn = ss.ssd_state_update_triton if backend == "triton" else ss.ssd_state_update_native
    assert_close(fn(*b.args(pool), b.cu, b.slots, init, **kw), ref, **FP32)
    assert_close(pool, ref_pool, **FP32)
    # the kept state after token 2 of request 1 is where a rollback to it starts
    one = b.pool.clone()
    ss.ssd_state_update_ref(*b.args(one, slice(1, 3)), torch.tensor([0, 2]), b.slots[1:2],
                            dt_softplus=True, dt_limit=(0.0, 3.0))
    assert_close(ref_pool[1], one[b.slots[1]], **FP32)


def test_ops_on_cpu_runs_both_forms_as_the_reference():
    if native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([1, 1, 1], 4, 2, 24, 20, seed=8)
    ref_pool, pool = b.pool.clone(), b.pool.clone()
    ref = ss.ssd_state_update_ref(*b.args(ref_pool), b.cu, b.slots, **b.kw())
    assert_close(ops.ssd_state_update(*b.args(pool), b.cu, b.slots, **b.kw()), ref, **FP32)
    assert_close(pool, ref_pool, **FP32)
    assert_close(ops.ssd_chunk_scan(*b.args(b.pool.clone()), b.cu, b.slots, **b.kw()), ref, **FP32)
    assert not ss.native_fits(b.x.to(torch.bfloat16), b.dt, b.A, b.B, b.C, b.D, b.dt_bias, b.pool)


HUGE_SLOTS = (1 << 31) // (2 * 16 * 16) + 64  # slot * H * P * N past 2**31 floats


@pytest.mark.parametrize("backend", ["triton_chunk", "triton_update", "c"])
def test_slots_past_2_31_elements(backend):
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    b = Batch([3, 2], 2, 1, 16, 16, seed=4)
    huge = torch.empty(HUGE_SLOTS, 2, 16, 16)
    slots = torch.tensor([HUGE_SLOTS - 1, HUGE_SLOTS - 70])
    huge[slots] = b.pool[:2]
    small = b.pool[:2].clone()
    ref = ss.ssd_state_update_ref(*b.args(small), b.cu, torch.tensor([0, 1]), **b.kw())
    fn = {"triton_chunk": ss.ssd_chunk_scan_triton, "triton_update": ss.ssd_state_update_triton,
          "c": ss.ssd_state_update_native}[backend]
    assert_close(fn(*b.args(huge), b.cu, slots, **b.kw()), ref, **FP32)
    assert_close(huge[slots], small, **FP32)


@pytest.mark.parametrize("backend", ["ref", "triton", "c"])
def test_one_go_equals_odd_chunks_equals_token_by_token(backend):
    """A request's prefill in one call, in chunks of odd sizes each starting from the state the
    last one left (packed with another request's chunks), and token by token (the decode form)."""
    if backend == "c" and native.library() is None:
        pytest.fail("the C kernels are not built")
    chunk = {"ref": ss.ssd_chunk_scan_ref, "triton": ss.ssd_chunk_scan_triton, "c": ops.ssd_chunk_scan}[backend]
    update = {"ref": ss.ssd_state_update_ref, "triton": ss.ssd_state_update_triton,
              "c": ss.ssd_state_update_native}[backend]
    lens = [75, 40]
    b = Batch(lens, 2, 1, 16, 16, seed=13)
    whole = b.pool.clone()
    want = chunk(*b.args(whole), b.cu, b.slots, torch.tensor([False, False]), **b.kw())
    starts = b.cu.tolist()

    def replay(steps, fn):
        pool = b.pool.clone()
        out = torch.empty_like(want)
        done, started = [0, 0], [False, False]
        for step in steps:
            ids = [n for n in (0, 1) if step[n]]
            rows = torch.cat([torch.arange(starts[n] + done[n], starts[n] + done[n] + step[n]) for n in ids])
            cu = torch.tensor([0] + torch.tensor([step[n] for n in ids]).cumsum(0).tolist())
            out[rows] = fn(*b.args(pool, rows), cu, b.slots[ids], torch.tensor([started[n] for n in ids]), **b.kw())
            for n in ids:
                done[n] += step[n]
                started[n] = True
        assert done == lens
        return out, pool

    out, pool = replay([[37, 0], [1, 13], [29, 0], [8, 27]], chunk)
    assert_close(out, want, **FP32)
    assert_close(pool[b.slots], whole[b.slots], **FP32)
    out, pool = replay([[1, int(i < 40)] for i in range(75)], update)
    assert_close(out, want, **FP32)
    assert_close(pool[b.slots], whole[b.slots], **FP32)


@pytest.mark.parametrize("change,message", [
    (lambda a: a.update(dt=a["dt"][:, :1]), "dt: want"),
    (lambda a: a.update(A=a["A"][:1]), "A: want"),
    (lambda a: a.update(B=a["B"][:, :, :4]), "C: want"),
    (lambda a: a.update(B=a["B"].repeat(1, 3, 1), C=a["C"].repeat(1, 3, 1)), "B: its 3 groups"),
    (lambda a: a.update(D=a["D"][:1]), "D: want"),
    (lambda a: a.update(state_pool=a["state_pool"][..., :3]), "state_pool: want"),
    (lambda a: a.update(dt_limit=(1.0, 0.5)), "dt_limit: want"),
])
def test_bad_input_names_the_field(change, message):
    b = Batch([3, 2], 4, 1, 8, 16)
    args = dict(x=b.x, dt=b.dt, A=b.A, B=b.B, C=b.C, state_pool=b.pool.clone(), cu_seqlens=b.cu,
                state_slots=b.slots, D=b.D, dt_bias=b.dt_bias)
    change(args)
    for fn in (ss.ssd_chunk_scan_ref, ss.ssd_state_update_ref, ss.ssd_chunk_scan_triton):
        with pytest.raises(AssertionError, match=message):
            fn(**args)
