"""`ridge bench recurrent`: one layer's recurrent ops at decode and in a prefill chunk, per backend.

A hybrid model's decode step runs, in each linear-attention layer, the causal convolution's
one-token update and the gated delta rule's (Qwen3.5, Qwen3-Next), or the convolution and Mamba2's
state update (Granite 4 hybrid, Nemotron-H): each reads and writes every request's state, the
same bytes at 1K context as at 1M. This times those calls on their own, over states in a slot
pool, for each backend the device has: on CPU ridge's C kernels (what kernels/ops.py takes where
they are built) against the torch references; on CUDA the Triton kernels against the references.
The prefill rows time one chunk of --prefill tokens a request through the chunked forms (on CPU,
ops takes the C token loop for them too: kernels/ops.py says why)."""
from __future__ import annotations

import time

GDN = dict(k_heads=16, v_heads=32, k_dim=128, v_dim=128, conv_taps=4)
SSD = dict(ssd_heads=64, ssd_head_dim=64, ssd_state=128, ssd_groups=1)


def add_recurrent_parser(sub, common) -> None:
    r = sub.add_parser("recurrent", help="one layer's recurrent ops (gated delta rule, conv, Mamba2) per backend")
    common(r, workload=False)
    r.add_argument("--batches", default="1,16", help="decode batch sizes (requests)")
    r.add_argument("--prefill", type=int, default=256, help="tokens a request in the prefill rows (0: none)")
    r.add_argument("--steps", type=int, default=10, help="timed calls per row (the best is kept)")
    for key, value in {**GDN, **SSD}.items():
        r.add_argument(f"--{key.replace('_', '-')}", type=int, default=value, help=f"shape (default {value})")


def _best(fn, steps: int) -> float:
    fn()
    best = float("inf")
    for _ in range(steps):
        t = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t)
    return best


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _backends(device):
    """name -> (gdn chunk, gdn recurrent, conv, conv update, ssd chunk, ssd update) on this device."""
    from ridge.kernels import causal_conv as cc
    from ridge.kernels import gated_delta as gd
    from ridge.kernels import native, ops
    from ridge.kernels import ssd_scan as ss

    out = {"torch reference": (gd.gated_delta_rule_chunk_ref, gd.gated_delta_rule_recurrent_ref,
                               cc.causal_conv1d_ref, cc.causal_conv1d_update_ref, ss.ssd_chunk_scan_ref,
                               ss.ssd_state_update_ref)}
    if device.type == "cuda" and ops.load_triton():
        out["triton"] = (gd.gated_delta_rule_chunk_triton, gd.gated_delta_rule_recurrent_triton,
                         cc.causal_conv1d_triton, cc.causal_conv1d_update_triton, ss.ssd_chunk_scan_triton,
                         ss.ssd_state_update_triton)
    elif device.type == "cpu" and native.library() is not None:
        out["C (ops)"] = (ops.gated_delta_rule_chunk, gd.gated_delta_rule_recurrent_native, cc.causal_conv1d_native,
                          cc.causal_conv1d_update_native, ops.ssd_chunk_scan, ss.ssd_state_update_native)
    return out


def _calls(fns, n: int, length: int, a, device):
    """(name, fn() -> None) for the three layers' calls over n requests of `length` tokens."""
    import torch

    gdn_chunk, gdn_rec, conv, conv_update, ssd_chunk, ssd_update = fns
    g = torch.Generator(device="cpu").manual_seed(0)
    t = n * length

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    cu = torch.arange(n + 1, device=device) * length
    slots = torch.arange(n, device=device)
    channels = 2 * a.k_heads * a.k_dim + a.v_heads * a.v_dim  # the convolved q, k, v
    conv_pool = rnd(n, a.conv_taps - 1, channels)
    x, w = rnd(t, channels), rnd(channels, a.conv_taps, scale=0.5)
    q, k = rnd(t, a.k_heads, a.k_dim), rnd(t, a.k_heads, a.k_dim)
    v = rnd(t, a.v_heads, a.v_dim)
    decay, beta = -torch.rand(t, a.v_heads, generator=g).to(device), torch.rand(t, a.v_heads, generator=g).to(device)
    gdn_pool = rnd(n, a.v_heads, a.k_dim, a.v_dim, scale=0.1)
    sx, sdt = rnd(t, a.ssd_heads, a.ssd_head_dim), rnd(t, a.ssd_heads)
    sB, sC = rnd(t, a.ssd_groups, a.ssd_state, scale=a.ssd_state ** -0.5), rnd(t, a.ssd_groups, a.ssd_state)
    sA, sD = -torch.rand(a.ssd_heads, generator=g).to(device), rnd(a.ssd_heads)
    ssd_pool = rnd(n, a.ssd_heads, a.ssd_head_dim, a.ssd_state, scale=0.1)
    ssd_kw = dict(D=sD, dt_bias=rnd(a.ssd_heads, scale=0.5), dt_softplus=True)
    if length == 1:
        return [("conv update", lambda: conv_update(x, w, None, conv_pool, slots, activation="silu")),
                ("gated delta rule", lambda: gdn_rec(q, k, v, decay, beta, gdn_pool, cu, slots, use_qk_l2norm=True)),
                ("mamba2 update", lambda: ssd_update(sx, sdt, sA, sB, sC, ssd_pool, cu, slots, **ssd_kw))]
    return [("conv", lambda: conv(x, w, None, conv_pool, cu, slots, activation="silu")),
            ("gated delta rule", lambda: gdn_chunk(q, k, v, decay, beta, gdn_pool, cu, slots, use_qk_l2norm=True)),
            ("mamba2 scan", lambda: ssd_chunk(sx, sdt, sA, sB, sC, ssd_pool, cu, slots, **ssd_kw))]


def run_recurrent(args, rep) -> list[dict]:
    import torch

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rep.set_env(None, args)
    backends = _backends(device)
    cases = [(int(b), 1) for b in args.batches.split(",") if b.strip()]
    if args.prefill:
        cases.append((1, args.prefill))
    rows = []
    for n, length in cases:
        names = None
        times = {}
        for backend, fns in backends.items():
            calls = _calls(fns, n, length, args, device)
            names = [c[0] for c in calls]
            for name, fn in calls:
                times[backend, name] = _best(fn, args.steps)
        for name in names:
            row = {"requests": n, "tokens_each": length, "op": name}
            row.update({b: 1e3 * times[b, name] for b in backends})
            rows.append(row)
    rep.add("recurrent", {"rows": rows, "shape": {k: getattr(args, k) for k in {**GDN, **SSD}}})
    cols = list(backends)
    rep.table(f"one layer's recurrent ops (ms, best of {args.steps}): gated delta rule {args.k_heads} x {args.k_dim} "
              f"key / {args.v_heads} x {args.v_dim} value heads, conv of {args.conv_taps} taps over q/k/v, Mamba2 "
              f"{args.ssd_heads} heads x {args.ssd_head_dim}, state {args.ssd_state}, {args.ssd_groups} group(s)",
              ["requests", "tokens each", "op", *cols],
              [[r["requests"], r["tokens_each"], r["op"], *(f"{r[c]:.3f}" for c in cols)] for r in rows])
    return rows
