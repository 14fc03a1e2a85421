"""RMSNorm (+ residual), RoPE and SiLU-and-mul: Triton under the interpreter against the references."""
import pytest
import torch
from kernel_utils import poison_empty, assert_close

from ridge.kernels import native, ops
from ridge.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from ridge.kernels.metadata import AttentionMetadata
from ridge.kernels.norm import rms_norm_ref, rms_norm_triton
from ridge.kernels.rope import rope_ref, rope_triton
from ridge.models.layers.rope import rope_cos_sin

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
IDS = ["fp32", "bf16", "fp16"]

pytestmark = pytest.mark.usefixtures(poison_empty.__name__)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,cols", [(1, 64), (17, 123), (129, 576)])
def test_rms_norm_residual(dtype, rows, cols):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=g).to(dtype)
    res = torch.randn(rows, cols, generator=g).to(dtype)
    w = 1 + 0.1 * torch.randn(cols, generator=g)
    out, new_res = rms_norm_triton(x, w, 1e-5, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, res)
    assert_close(new_res, ref_res)
    assert_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rms_norm_no_residual_returns_input(dtype):
    x = torch.randn(5, 96).to(dtype)
    w = torch.rand(96)
    out, res = rms_norm_triton(x, w, 1e-6)
    assert res is x
    assert_close(out, rms_norm_ref(x, w, 1e-6)[0])


def test_rms_norm_per_head_on_strided_view():
    # Qwen3's q/k norm: rows are heads of a view into the fused qkv output.
    qkv = torch.randn(19, 7 * 32)
    q = qkv[:, : 4 * 32].view(19, 4, 32)
    w = torch.rand(32)
    assert_close(rms_norm_triton(q, w, 1e-6)[0], rms_norm_ref(q, w, 1e-6)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 2, 64), (9, 3, 64), (2, 1, 128), (3, 1, 18)])
def test_rope_in_place(dtype, heads, kv_heads, dim):
    num_tokens = 23
    cos_sin = rope_cos_sin(dim, 512, 10000.0)
    positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(dim))
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    ref_q, ref_k = rope_ref(q, k, positions, cos_sin)
    v_before = qkv[:, (heads + kv_heads) * dim:].clone()
    out_q, out_k = rope_triton(q, k, positions, cos_sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert_close(out_q, ref_q)
    assert_close(out_k, ref_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before), "V must be untouched"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,inter", [(1, 96), (17, 77), (129, 1536)])
def test_silu_and_mul(dtype, rows, inter):
    x = (2 * torch.randn(rows, 2 * inter)).to(dtype)
    assert_close(silu_and_mul_triton(x), silu_and_mul_ref(x))



# -- the CPU paths, through ops (which picks per call), against the same references ---------------
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,cols", [(1, 576), (17, 123)])
@pytest.mark.parametrize("c_kernels", [True, False], ids=["c", "torch"])
def test_rms_norm_cpu_adds_the_residual_in_place(dtype, rows, cols, c_kernels):
    if c_kernels:
        _rms_norm_in_place(dtype, rows, cols)
    else:
        with native.off():  # as where the C kernels are not built
            _rms_norm_in_place(dtype, rows, cols)


def _rms_norm_in_place(dtype, rows, cols):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=g).to(dtype)
    res = torch.randn(rows, cols, generator=g).to(dtype)
    w = 1 + 0.1 * torch.randn(cols, generator=g)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-5, res)
    out, new_res = ops.rms_norm(x.clone() if dtype != torch.float32 else x, w, 1e-5, res)
    assert_close(new_res, ref_res)
    assert_close(out, ref_out)
    if dtype == torch.float32:  # fp32 runs a fused path (C or torch): the sum lands in x itself
        assert new_res is x
    q = torch.randn(19, 7 * 32)[:, : 4 * 32].view(19, 4, 32)  # per-head norm of a strided view
    assert_close(ops.rms_norm(q, w[:32], 1e-6)[0], rms_norm_ref(q, w[:32], 1e-6)[0])


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (3, 1, 18)])
def test_rope_torch_in_place_with_the_steps_angles_kept(heads, kv_heads, dim):
    with native.off():  # as where the C kernels are not built (theirs: tests/test_native.py)
        _rope_in_place(heads, kv_heads, dim)


def _rope_in_place(heads, kv_heads, dim):
    num_tokens = 23
    cos_sin = rope_cos_sin(dim, 512, 10000.0)
    positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(dim))
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0]], list(range(num_tokens)))
    for layer in range(2):  # the second layer reuses the angles the first looked up
        qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim)
        q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
        k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
        ref_q, ref_k = rope_ref(q, k, positions, cos_sin)
        v_before = qkv[:, (heads + kv_heads) * dim:].clone()
        out_q, out_k = ops.rope(q, k, positions, cos_sin, meta)
        assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
        assert_close(out_q, ref_q)
        assert_close(out_k, ref_k)
        assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before), "V must be untouched"
        (key, angles), = meta.states.values()  # the torch path's own state, and no other
        assert angles.positions is positions and key == (id(positions), id(cos_sin))
    other = positions.flip(0)  # another step's positions: looked up again
    q, k = torch.randn(num_tokens, heads, dim), torch.randn(num_tokens, kv_heads, dim)
    ref_q, _ = rope_ref(q, k, other, cos_sin)
    assert_close(ops.rope(q, k, other, cos_sin, meta)[0], ref_q)


def test_rope_rotates_q_and_k_as_one_view_only_where_they_are_adjacent():
    from ridge.kernels.rope import _adjacent
    qkv = torch.randn(5, (9 + 2 * 3) * 64)
    q, k = qkv[:, : 9 * 64].view(5, 9, 64), qkv[:, 9 * 64: 12 * 64].view(5, 3, 64)
    (joint,) = _adjacent(q, k)
    assert joint.shape == (5, 12, 64) and torch.equal(joint[:, 9:], k)
    assert len(_adjacent(q, qkv[:, 12 * 64:].view(5, 3, 64))) == 2  # V's heads, not K's: apart
    assert len(_adjacent(torch.randn(5, 9, 64), torch.randn(5, 3, 64))) == 2


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("rows,inter", [(1, 96), (17, 77)])
@pytest.mark.parametrize("name", ["gelu_and_mul", "gelu_tanh_and_mul"])
def test_gelu_and_mul(dtype, rows, inter, name):
    """Both GELUs of transformers' ACT2FN (gelu: erf; gelu_pytorch_tanh: tanh), Triton and the
    CPU choice against the reference; the two differ, so each kernel runs its own."""
    from ridge.kernels import activation
    x = (3 * torch.randn(rows, 2 * inter)).to(dtype)
    ref = getattr(activation, name + "_ref")(x)
    assert_close(getattr(activation, name + "_triton")(x), ref)
    assert_close(getattr(ops, name)(x), ref)
    other = activation.gelu_tanh_and_mul_ref if name == "gelu_and_mul" else activation.gelu_and_mul_ref
    assert (other(x.float()) - ref.float()).abs().max() > 1e-4


@pytest.mark.parametrize("backend", ["ref", "triton", "c", "torch"])
@pytest.mark.parametrize("dim,rotary", [(64, 48), (16, 8), (32, 2)])
def test_partial_rotary_rotates_only_the_leading_dims(backend, dim, rotary):
    """A table narrower than head_dim (partial_rotary_factor) rotates each head's first `rotary`
    dims as rotate-half over them and leaves the rest as they were (transformers' Phi-3)."""
    heads, kv_heads, num_tokens = 3, 1, 19
    cos_sin = rope_cos_sin(rotary, 512, 10000.0)
    positions = torch.randint(0, 512, (num_tokens,), generator=torch.Generator().manual_seed(rotary))
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, : heads * dim].view(num_tokens, heads, dim)
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(num_tokens, kv_heads, dim)
    cos, sin = cos_sin[positions, None, : rotary // 2].repeat(1, 1, 2), cos_sin[positions, None, rotary // 2:].repeat(1, 1, 2)

    def oracle(x):  # transformers: q_rot * cos + rotate_half(q_rot) * sin, then q_pass
        r, rest = x[..., :rotary], x[..., rotary:]
        half = torch.cat((-r[..., rotary // 2:], r[..., : rotary // 2]), dim=-1)
        return torch.cat((r * cos + half * sin, rest), dim=-1)

    want_q, want_k, v_before = oracle(q), oracle(k), qkv[:, (heads + kv_heads) * dim:].clone()
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0]], list(range(num_tokens)))
    if backend == "ref":
        out_q, out_k = rope_ref(q, k, positions, cos_sin)
    elif backend == "triton":
        out_q, out_k = rope_triton(q, k, positions, cos_sin)
    elif backend == "c":
        if native.library() is None:
            pytest.fail("the C kernels are not built")
        out_q, out_k = ops.rope(q, k, positions, cos_sin, meta)
    else:
        with native.off():
            out_q, out_k = ops.rope(q, k, positions, cos_sin, meta)
    assert_close(out_q, want_q)
    assert_close(out_k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim:], v_before), "V must be untouched"


@pytest.mark.skipif(native.library() is None, reason="no C compiler on this machine")
@pytest.mark.parametrize("rows,cols", [(1, 49152), (64, 49152), (3, 17), (5, 1), (7, 33), (2, 151936)])
def test_argmax_is_torchs(rows, cols):
    """ops.argmax (kernels/sample.py's C kernel on a CPU) against torch.argmax: random rows, equal
    maxima in and past the 16-lane steps (the first wins), NaNs (the first wins), rows of -inf,
    and a strided view (the rows of a wider block)."""
    from ridge.kernels import sample

    g = torch.Generator().manual_seed(rows * cols)
    x = torch.randn(rows, cols + 5, generator=g)[:, :cols]
    assert sample.native_fits(x) and (rows == 1 or not x.is_contiguous())
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    x = x.contiguous()
    if cols > 20:
        x[:, 3] = x[:, cols - 1] = x[:, 19] = 1e3
        assert torch.equal(ops.argmax(x), torch.full((rows,), 3))
        x[rows - 1, 9] = x[rows - 1, cols - 2] = float("nan")
        assert torch.equal(ops.argmax(x), x.argmax(-1)) and ops.argmax(x)[rows - 1] == 9
    x[0] = float("-inf")
    assert torch.equal(ops.argmax(x), x.argmax(-1))
