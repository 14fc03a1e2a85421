"""Every Triton kernel compiles to a cubin for sm_80, sm_89 and sm_90, without a GPU.

The interpreter runs kernels as numpy and never sees what only the compiler
rejects (dot shapes, fp8 on the wrong architecture, register and shared-memory
limits) nor whether loads get pipelined. Triton ships ptxas, so this test
compiles ahead of time, in a subprocess where TRITON_INTERPRET is unset, with
the specializations a real launch gets (16-aligned pointers and strides).
Run by hand: `python tests/test_kernels_compile.py [name filter]`."""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest

HINTED = ("N", "K", "n_cols", "inter")  # dims that are multiples of 16 in every LLM shape


def _compile(fn, sig: dict, consts: dict, cc: int, warps: int = 4, stages: int = 2):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    full = {n: "constexpr" if n in consts else sig[n] for n in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names) if n not in consts and
             (sig[n].startswith("*") or n.startswith("stride") or n in HINTED)}
    src = ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(num_warps=warps, num_stages=stages))


def _attn(cc, kv="*fp8e4nv", q="*bf16", mode=1, hd=128, group=4, bm=16, bn=64, splits=1, ones=(), sinks=False,
          spans=False):
    # ones: integer arguments equal to 1, which a launch specializes into constants.
    from ridge.kernels.attention import _paged_attn_kernel

    ptrs = dict(q_ptr=q, k_ptr=kv, v_ptr=kv, ks_ptr="*fp16", vs_ptr="*fp16", sinks_ptr="*fp32", out_ptr=q,
                part_acc="*fp32",
                part_m="*fp32", part_l="*fp32", block_table="*i32", seq_lens="*i32", query_start_loc="*i32",
                key_end_ptr="*i32")
    ints = dict.fromkeys(["num_seqs", "num_tokens", "num_splits", "stride_qt", "stride_qh", "stride_cb", "stride_ct", "stride_ch",
                          "stride_bt"], "i32")
    consts = dict(NUM_KV_HEADS=8, GROUP=group, HEAD_DIM=hd, DIM_P=hd, BLOCK_M=bm, BLOCK_Q=bm // group,
                  BLOCK_N=bn, BLOCK_SIZE=16, SPLIT=splits > 1, FP8_MODE=mode, DOT_F32=False, SINKS=sinks, SPANS=spans,
                  **dict.fromkeys(ones, 1))
    return _compile(_paged_attn_kernel, {**ptrs, **ints, "qk_scale": "fp32", "window": "i32", "softcap": "fp32"},
                    dict(consts, SOFTCAP=False), cc)


def _gemm(cc, bm, bn, bk, a="*fp8e4nv", b="*fp8e4nv", a_fp8=True, b_mode=1, warps=4, stages=3, scale_bn=0):
    # scale_bn 0: a scale per output channel; 1: per 1 x BLOCK_K group; 128: 128 x 128 blocks.
    # W8A8 with groups takes activation scales per token and group (A_GROUPS), as it runs.
    from ridge.kernels.linear import _fp8_gemm_kernel

    sig = dict(a_ptr=a, b_ptr=b, a_scale_ptr="*fp32", b_scale_ptr="*fp32", bias_ptr="*bf16", c_ptr="*bf16",
               M="i32", N="i32", K="i32", stride_am="i32", stride_bn="i32", stride_bs="i32")
    consts = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, A_FP8=a_fp8, B_MODE=b_mode, HAS_BIAS=True,
                  DOT_F32=False, SCALE_BN=scale_bn, A_GROUPS=a_fp8 and scale_bn > 0)
    return _compile(_fp8_gemm_kernel, sig, consts, cc, warps, stages)


def _moe_gemm(cc, bm, bn, bk, a="*fp8e4nv", w="*fp8e4nv", a_fp8=True, b_mode=1, gated=True, warps=4, stages=3):
    from ridge.kernels.moe_triton import _moe_gemm_kernel

    sig = dict(a_ptr=a, a_scale_ptr="*fp32", w_ptr=w, w_scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16",
               topk_w_ptr="*fp32", sorted_slots="*i32", block_expert="*i32", num_padded="*i32", num_slots="i32",
               N="i32", K="i32", stride_am="i32", stride_we="i32", stride_wn="i32", alpha="fp32", limit="fp32")
    consts = dict(A_DIV=8 if gated else 1, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, A_FP8=a_fp8,
                  B_MODE=b_mode, DOT_F32=False, HAS_BIAS=True, GATED=gated, ACT=3 if gated else 0, ROUTED=not gated)
    return _compile(_moe_gemm_kernel, sig, consts, cc, warps, stages)


def _moe_gemv(cc, down: bool, w="*fp8e4nv", b_mode=1, bn=16):
    from ridge.kernels import moe_triton

    common = dict(w_ptr=w, w_scale_ptr="*fp32", bias_ptr="*bf16", out_ptr="*bf16", topk_ids_ptr="*i32", N="i32",
                  K="i32", stride_we="i32", stride_wn="i32")
    consts = dict(TOP_K=8, BLOCK_N=bn, BLOCK_K=256, B_MODE=b_mode, HAS_BIAS=True)
    if down:
        return _compile(moe_triton._moe_gemv_down_kernel, dict(common, h_ptr="*bf16", topk_w_ptr="*fp32"), consts, cc)
    return _compile(moe_triton._moe_gemv_gate_up_kernel, dict(common, x_ptr="*bf16", stride_xm="i32",
                                                               alpha="fp32", limit="fp32"), dict(consts, ACT=3), cc)


def _write_kv(cc, x="*bf16", cache="*fp8e4nv", staged="*fp32", mode=1):
    from ridge.kernels.kv_cache import _write_kv_kernel

    sig = dict(x_ptr=x, slot_ptr="*i64", cache_ptr=cache, scale_ptr="*fp16", staged_ptr=staged, num_tokens="i32",
               stride_xt="i32", stride_xh="i32")
    return _compile(_write_kv_kernel, sig, dict(NUM_HEADS=8, HEAD_DIM=128, HEADS_P=8, DIM_P=128, BLOCK_T=2,
                                                MODE=mode), cc)


def _small_ops():
    from ridge.kernels import activation, attention, linear, norm, rope

    bf = "*bf16"
    return {
        "merge splits": lambda: _compile(attention._merge_splits_kernel, dict(
            part_acc="*fp32", part_m="*fp32", part_l="*fp32", out_ptr=bf, sinks_ptr="*fp32", num_splits="i32",
            num_heads="i32"), dict(HEAD_DIM=128, DIM_P=128, SPLITS_P=8, SINKS=True), 90),
        "rms_norm": lambda: _compile(norm._rms_norm_kernel, dict(
            x_ptr=bf, res_ptr=bf, w_ptr="*fp32", out_ptr=bf, new_res_ptr=bf, num_rows="i32", n_cols="i32",
            inner="i32", stride_outer="i32", stride_inner="i32", eps="fp32"),
            dict(BLOCK_R=1, BLOCK_N=4096, HAS_RES=True), 90, warps=8),
        "rope": lambda: _compile(rope._rope_kernel, dict(
            q_ptr=bf, k_ptr=bf, pos_ptr="*i64", cs_ptr="*fp32", num_tokens="i32", stride_qt="i32", stride_qh="i32",
            stride_kt="i32", stride_kh="i32", stride_cs="i32"),
            dict(NUM_Q=32, NUM_K=8, Q_P=32, K_P=8, HALF=64, HALF_P=64, BLOCK_T=1), 90),
        "silu_and_mul": lambda: _compile(activation._act_and_mul_kernel, dict(
            x_ptr=bf, out_ptr=bf, num_rows="i32", inter="i32", stride_x="i32"), dict(ACT=0, BLOCK_R=1, BLOCK_I=1024),
            90),
        "quantize rows": lambda: _compile(linear._quant_rows_kernel, dict(
            x_ptr=bf, q_ptr="*fp8e4nv", staged_ptr="*fp32", scale_ptr="*fp32", num_rows="i32", K="i32",
            stride_x="i32"), dict(BLOCK_R=1, BLOCK_K=2048, STAGED=False), 90),
    }


def jobs() -> dict:
    """name -> (compile thunk, strings the PTX must contain)."""
    j = {
        "attn fp8 sm90 decode": (lambda: _attn(90), ["cp.async", "e4m3"]),
        "attn fp8 sm90 split-K": (lambda: _attn(90, splits=4), []),
        "attn fp8 sm90 one sequence": (lambda: _attn(90, ones=("num_seqs", "num_tokens", "num_splits")), []),
        "attn fp8 sm90 prefill hd256": (lambda: _attn(90, hd=256, bm=64, bn=32), []),
        "attn bf16 sm90 hd64": (lambda: _attn(90, kv="*bf16", mode=0, hd=64, bm=64), []),
        "attn fp8-bits sm80": (lambda: _attn(80, kv="*u8", mode=2), []),
        "attn fp8 sm89 fp16 q": (lambda: _attn(89, q="*fp16"), []),
        "attn fp8 sm90 sinks hd64": (lambda: _attn(90, hd=64, group=8, sinks=True), []),
        "attn bf16 sm90 image spans": (lambda: _attn(90, kv="*bf16", mode=0, hd=64, bm=64, spans=True), []),
        "write_kv fp8 sm90": (lambda: _write_kv(90), ["e4m3"]),
        "write_kv staged sm80": (lambda: _write_kv(80, cache="*u8", mode=2), []),
        "write_kv bytes sm80": (lambda: _write_kv(80, x="*u8", cache="*u8", staged="*u8", mode=0), []),
        "gemm w8a8 sm90 128x256x128": (lambda: _gemm(90, 128, 256, 128, warps=8), ["wgmma", "cp.async"]),
        "gemm w8a8 sm90 16x64x256": (lambda: _gemm(90, 16, 64, 256), ["cp.async"]),
        "gemm w8a8 sm89 64x128x128": (lambda: _gemm(89, 64, 128, 128), []),
        "gemm w8a8 sm90 1x128 groups": (lambda: _gemm(90, 64, 128, 128, scale_bn=1), ["wgmma"]),
        "gemm w8a8 sm90 128x128 blocks": (lambda: _gemm(90, 128, 128, 128, warps=8, scale_bn=128), ["wgmma"]),
        "gemm w8a8 sm90 1x32 groups": (lambda: _gemm(90, 16, 64, 32, scale_bn=1), []),
        "gemm weight-only sm80 bits": (lambda: _gemm(80, 16, 64, 128, a="*bf16", b="*u8", a_fp8=False, b_mode=2),
                                       ["mma.sync"]),
        "moe gemm w8a8 sm90 gate_up 64x128": (lambda: _moe_gemm(90, 64, 128, 128), ["wgmma", "cp.async"]),
        "moe gemm w8a8 sm90 gate_up 64x256": (lambda: _moe_gemm(90, 64, 256, 128, warps=8), ["wgmma"]),
        "moe gemm w8a8 sm90 gate_up 128x128": (lambda: _moe_gemm(90, 128, 128, 128, warps=8), ["wgmma"]),
        "moe gemm w8a8 sm90 down 128x64": (lambda: _moe_gemm(90, 128, 64, 128, gated=False, stages=4), ["wgmma"]),
        "moe gemm w8a8 sm89 16x64": (lambda: _moe_gemm(89, 16, 64, 128), []),
        "moe gemm weight-only sm80 bits": (lambda: _moe_gemm(80, 16, 64, 128, a="*bf16", w="*u8", a_fp8=False,
                                                             b_mode=2), ["mma.sync"]),
        "moe gemv gate_up sm90": (lambda: _moe_gemv(90, False), ["e4m3"]),
        "moe gemv down sm90": (lambda: _moe_gemv(90, True, bn=32), []),
        "moe gemv down sm80 bits": (lambda: _moe_gemv(80, True, w="*u8", b_mode=2), []),
    }
    j.update({name: (fn, []) for name, fn in _small_ops().items()})
    return j


def _run_job(name: str) -> tuple[str, bool]:
    thunk, needles = jobs()[name]
    try:
        k = thunk()
        missing = [n for n in needles if n not in k.asm["ptx"]]
        status = "ok  " if not missing else f"MISS {missing}"
        return f"{status} {name:30s} shared={k.metadata.shared}", bool(missing)
    except Exception as e:  # noqa: BLE001 - report every kernel, then fail
        return f"FAIL {name:30s} {type(e).__name__}: {str(e)[:400]}", True


def main(filters: list[str]) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as e:
        print("SKIP no NVIDIA backend:", e)
        return 0
    names = [n for n in jobs() if not filters or any(f in n for f in filters)]
    # Each compile is one busy core for seconds (ptxas included), so the machine's cores share the list.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1)), mp_context=ctx) as pool:
        results = list(pool.map(_run_job, names))
    for line, _ in results:
        print(line)
    return 1 if any(bad for _, bad in results) else 0


def test_kernels_compile_for_gpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
