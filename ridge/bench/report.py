"""Tables and JSON for `ridge bench`. Every table is headed by the figures' labels:
device, threads, KV dtype, model, and the exact command that made them."""
from __future__ import annotations

import os
import platform
import sys


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git() -> str | None:
    """The source tree the figures came from: commit, and '-dirty' with local edits."""
    import subprocess
    from pathlib import Path

    try:
        return subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _amx_mode(engine) -> str:
    """Where the engine's CPU products ran AMX's bf16 tiles (--cpu-amx), "off" where none could."""
    from ridge.kernels import native

    mode = getattr(engine.config, "cpu_amx", "off")
    return mode if engine.device.type == "cpu" and native.tiles_bf16() else "off"


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:.0f}" if x >= 0.1 else f"{1e3 * x:.1f}"


def _f(x, fmt="{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _lat(d: dict) -> str:
    return f"{_ms(d.get('p50'))} / {_ms(d.get('p99'))}"


class Report:
    def __init__(self, command: str, md: bool = False, out=None):
        self.md, self.out = md, out or sys.stdout
        self.data: dict = {"command": command, "env": {}, "results": {}}

    def add(self, key: str, value) -> None:
        self.data["results"][key] = value

    def set_env(self, engine=None, args=None) -> None:
        import torch

        env = {"command": self.data["command"], "threads": torch.get_num_threads(), "cpu": _cpu_name(),
               "cores": os.cpu_count(), "torch": torch.__version__, "loadavg_start": list(os.getloadavg()),
               "git": _git()}
        if engine is not None:
            c = engine.config
            env.update(device=str(engine.device), kv_dtype=engine.kv_dtype, model=engine.loaded.path.name,
                       block_size=c.block_size, prefix_caching=c.enable_prefix_caching,
                       prefill_chunk=engine.budget_info.get("prefill_chunk"),
                       max_num_batched_tokens=engine.sched_config.max_num_batched_tokens,
                       kv_pool_blocks=engine.kv_cache_manager.num_blocks, max_model_len=engine.max_model_len,
                       cpu_lowp_max_tokens=getattr(engine, "lowp_max_tokens", 0),
                       cpu_fp8_max_tokens=getattr(engine, "fp8_max_tokens", 0), cpu_amx=_amx_mode(engine))
            if engine.device.type == "cuda":
                env["gpu"] = torch.cuda.get_device_name(engine.device)
        elif args is not None:
            env.update(device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
                       kv_dtype=args.kv_dtype or "(engine default)")
        self.data["env"] = {**self.data["env"], **env}

    # -- printing -------------------------------------------------------------------------
    def header(self) -> str:
        e = self.data["env"]
        label = (f"device={e.get('device')} threads={e.get('threads')} kv={e.get('kv_dtype')} "
                 f"block={e.get('block_size', '-')} model={e.get('model', '-')} git={e.get('git', '-')}")
        if e.get("cpu_fp8_max_tokens"):
            label += f" weights=e4m3 kernel where fastest (up to {e['cpu_fp8_max_tokens']} tok)"
        if e.get("cpu_lowp_max_tokens"):
            label += (", " if e.get("cpu_fp8_max_tokens") else " weights=") + \
                f"bf16 where faster (up to {e['cpu_lowp_max_tokens']} tok), else fp32"
        amx = {True: "all", False: "off", None: "off"}.get(e.get("cpu_amx"), e.get("cpu_amx"))  # older files: a bool
        if amx != "off":
            which = "decode " if amx == "decode" else ""
            label += f" cpu-amx={amx} (the large {which}steps' activations in bf16 on AMX)"
        return f"[{label}]\n$ {self.data['command']}"

    def table(self, title: str, headers: list[str], rows: list[list], note: str | None = None) -> None:
        rows = [[str(c) for c in r] for r in rows]
        p = lambda s="": print(s, file=self.out)  # noqa: E731
        p()
        if self.md:
            p(f"**{title}**  ")
            p("`" + self.header().replace("\n", "`  \n`") + "`")
            p()
            p("| " + " | ".join(headers) + " |")
            p("|" + "|".join("---" for _ in headers) + "|")
            for r in rows:
                p("| " + " | ".join(r) + " |")
        else:
            p(f"== {title}")
            p(self.header())
            w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
            p("  ".join(h.rjust(w[i]) for i, h in enumerate(headers)))
            for r in rows:
                p("  ".join(c.rjust(w[i]) for i, c in enumerate(r)))
        if note:
            p(note)
        self.out.flush()

    def throughput_table(self, title: str, rows: list[dict], flat: dict | None = None) -> None:
        t_rows, l_rows = [], []
        for r in rows:
            c, s = r["continuous"], r.get("static")
            wl = r["workload"]
            name = r.get("level", wl["name"])
            t_rows.append([name, wl["lengths"], wl["requests"], r["in_flight"], _f(wl["mean_output"]),
                           _f(c["useful_tok_s"]), _f(s and s["useful_tok_s"]), _f(r.get("ratio"), "{:.2f}x"),
                           _f(r["bound"], "{:.2f}x"), _f(r.get("ratio_of_bound") and 100 * r["ratio_of_bound"], "{:.0f}%"),
                           _f(r["bound_with_drain"], "{:.2f}x"),
                           _f(r.get("ratio_of_bound_with_drain") and 100 * r["ratio_of_bound_with_drain"], "{:.0f}%")])
            for m in (c, s):
                if m:
                    l_rows.append([name, m["mode"], _f(m["wall_s"]), m["steps"], m["useful_tokens"],
                                   m["generated_tokens"], _f(m["generated_tok_s"]), _lat(m["ttft_s"]),
                                   _lat(m["itl_s"]), _lat(m["e2e_s"]), _f(m.get("cpu_util"), "{:.2f}") + ("" if m.get("clean", True) else "*")])
        note = None
        if flat:
            note = (f"continuous useful tok/s across levels: {flat['continuous_min_tok_s']:.1f} .. "
                    f"{flat['continuous_max_tok_s']:.1f} (spread {flat['continuous_spread_pct']:.1f}% of the max)")
        self.table(title + ": useful tokens/s", ["level", "lengths", "reqs", "in-flight", "mean out", "continuous",
                                                 "static", "cont/static", "bound", "of bound", "bound+drain",
                                                 "of b+d"], t_rows, note)
        self.table(title + ": latency (ms, p50 / p99)", ["level", "mode", "wall s", "steps", "useful tok",
                                                          "generated", "gen tok/s", "TTFT", "ITL", "E2E", "cpu util"], l_rows,
                   "cpu util: this process's CPU seconds per wall second (about the thread count when the "
                   "machine is otherwise idle); * = other processes took the cores in every try")

    def waste_table(self, res: dict) -> None:
        w = res["continuous"]["kv_waste"]
        self.table(f"KV waste at steady state ({res['workload']['name']}, {res['in_flight']} in flight, "
                   f"sampled each step while >= {res['in_flight'] / 2:g} run)",
                   ["samples", "mean live", "reserved slots", "filled slots", "paged waste", "half-block theory",
                    "contig. max_model_len", "contig. prompt+max_tokens"],
                   [[w["samples"], _f(w["mean_live"]), _f(w["mean_reserved_slots"], "{:.0f}"),
                     _f(w["mean_filled_slots"], "{:.0f}"), _f(w["paged_waste_pct"], "{:.2f}%"),
                     _f(w["half_block_pct"], "{:.2f}%"), _f(w["contiguous_max_len_waste_pct"], "{:.2f}%"),
                     _f(w["contiguous_own_max_waste_pct"], "{:.2f}%")]],
                   f"block size {w['block_size']}, max_model_len {w['max_model_len']}")

    def baseline_table(self, title: str, res: dict, key: str, label: str) -> None:
        rows = []
        for name, m in (("ridge (continuous)", res.get("ridge")), (label, res.get(key))):
            if m:
                rows.append([name, m["requests"], m["in_flight"], _f(m["wall_s"]), m["useful_tokens"],
                             _f(m["useful_tok_s"]), _lat(m["ttft_s"]), _lat(m["itl_s"])])
        notes = []
        if res.get("ratio"):
            notes.append(f"ridge / {label}: {res['ratio']:.2f}x ({label} / ridge: {1 / res['ratio']:.3f})")
        if len(res.get("rounds", ())) > 1:
            notes.append("rounds (tok/s): " + "; ".join(", ".join(f"{k} {v:.1f}" for k, v in r.items())
                                                      for r in res["rounds"]) + "; best of each kept")
            if "server_over_ridge_median" in res:
                notes.append(f"{label} / ridge by round: " + ", ".join(
                    f"{x:.3f}" for x in res["server_over_ridge_by_round"]) +
                    f" (median {res['server_over_ridge_median']:.3f})")
        if res.get("peer_note"):
            notes.append(res["peer_note"])
        cpu = (res.get(key) or {}).get("server_cpu")
        if cpu:
            notes.append(f"{label} CPU while serving: " + ", ".join(
                f"{k.removesuffix('_s')} {v:.2f} s ({cpu[k.removesuffix('_s') + '_cores']:.3f} cores)"
                for k, v in cpu.items() if k.endswith("_s")))
        self.table(title, ["engine", "reqs", "in-flight", "wall s", "useful tok", "useful tok/s",
                           "TTFT ms p50/p99", "ITL ms p50/p99"], rows, "\n".join(notes) or None)

    def overhead_table(self, rows: list[dict], bandwidth: float | None = None, llc: int | None = None) -> None:
        keys = ["attention", "kv_write", "norm", "rope", "act", "embed", "lm_head", "sample", "schedule",
                "batch_build", "sched_update", "outputs", "other"]
        if any(r["breakdown_ms"].get("moe") for r in rows):  # a mixture of experts' layers and routers
            keys[:0] = ["moe", "router"]
        if any(r["breakdown_ms"].get("layers") for r in rows):  # the CPU layers in one C call: their sections unseen
            keys[:0] = ["layers"]
        note = ("matmul = every linear layer (qkv, o, gate_up, down x layers, and the logits) over the step's "
                "rows, run as the step ran (one CUDA graph replay, or eagerly), synchronized, median; per-op step = "
                "the same step with the layers one op at a time, alternating with the one-call step (CPU); "
                "read = the weights' bytes as held (a mixture of experts: the share of its experts a step "
                "of that many rows reaches under uniform routing) plus each sequence's KV over its context, "
                "per step")
        if bandwidth:
            note += f"; of bound = read GB/s over the memory's read bandwidth with this thread team, {bandwidth / 1e9:.1f} GB/s"
        weights = min((r["read_bytes_per_token"] * r["batch"] for r in rows), default=0)
        if llc and weights and weights <= llc:  # a step then reads the cache, which beats the memory's bound
            note += (f". The weights ({weights / 2 ** 20:.0f} MiB) fit in the CPU's last-level cache "
                     f"({llc / 2 ** 20:.0f} MiB): a step reads them from there, and may pass that bound")
        self.table("engine step vs its matrix products alone (pure decode, medians, interleaved)",
                   ["batch", "context", "step ran", "step ms", "per-op step ms", "matmul ms", "overhead", "tok/s",
                    "MB read/token", "read GB/s", "of bound", "cpu util"],
                   [[r["batch"], _f(r["context"], "{:.0f}"), r.get("mode", "eager"), _f(r["step_ms"]),
                     _f(r.get("per_op_step_ms")),
                     _f(r["matmul_ms"]), _f(r["overhead_pct"], "{:+.1f}%"), _f(r["tok_s"]),
                     _f(r.get("read_bytes_per_token", 0) / 1e6, "{:.1f}"), _f(r.get("read_gbs"), "{:.1f}"),
                     _f(100 * r["of_bandwidth"], "{:.0f}%") if r.get("of_bandwidth") else "-",
                     _f(r.get("cpu_util"), "{:.2f}")] for r in rows], note)
        self.table("where a step's time goes (ms per step, exclusive, from the engine's timing sections; "
                   "linear includes the logits' product; a CUDA graph replay hides the model's sections, and one C call "
                   "for the layers (step ran: one call) holds them in layers)",
                   ["batch", "total", "linear"] + keys,
                   [[r["batch"], _f(r["breakdown_ms"].get("total")), _f(r["breakdown_ms"].get("linear"))]
                    + [_f(r["breakdown_ms"].get(k), "{:.2f}") for k in keys] for r in rows])

    def kv_table(self, res: dict, best: str, default: str) -> None:
        rows = [[r["kv_dtype"], r["kv_bytes_per_token"], r["batch"], _f(r["context"], "{:.0f}"), _f(r["step_ms"]),
                 _f(r["vs_fp32"], "{:.2f}x"), _f(r["tok_s"]), _f(r["breakdown_ms"].get("attention")),
                 _f(r["breakdown_ms"].get("kv_write"), "{:.2f}"), _f(r.get("cpu_util"), "{:.2f}")] for r in res.values()]
        note = f"fastest: {best}; the engine's default KV dtype on this device: {default}"
        if best != default:
            note += "  <-- the measurement disagrees with the default"
        self.table("decode step time by KV dtype (pure decode, medians, interleaved)",
                   ["kv dtype", "bytes/token", "batch", "context", "step ms", "vs fp32", "tok/s", "attention ms",
                    "kv write ms", "cpu util"], rows, note)
