"""Pure-decode measurements of `ridge bench`: a step against its matrix products
alone (overhead), and the step time per KV dtype. A fixture holds `batch`
requests at about `context` tokens, so that every timed step is the same
shape: one new token per request, nothing else."""
from __future__ import annotations

import statistics
import time

import torch

from ridge.kernels.cpu_linear import decode_step

from .runs import greedy_params
from .workloads import QUESTIONS, long_prompt


class DecodeFixture:
    """`batch` requests prefilled to about `context` tokens, then stepping in pure
    decode (every step: one new token per request, nothing else)."""

    def __init__(self, engine, batch: int, context: int, tag: str, max_tokens: int = 4096):
        self.engine, self.batch, self.tag = engine, batch, tag
        cfg = engine.scheduler.config
        if batch > engine.config.max_num_seqs:  # the step buffers are sized for it at start-up
            raise ValueError(f"batch {batch} > --max-num-seqs {engine.config.max_num_seqs}")
        cfg.max_num_seqs = batch
        room = engine.max_model_len - context - 1
        self.ids = []
        for i in range(batch):
            prompt = long_prompt(engine.tokenizer, QUESTIONS[i % len(QUESTIONS)] + f" ({i})", context)
            self.ids.append(engine.add_request(f"{tag}-{i}", prompt, greedy_params(max(1, min(max_tokens, room)))))
        seen: set[str] = set()
        while len(seen) < batch:
            for o in engine.step():
                if o.new_token_ids:
                    seen.add(o.request_id)
                if o.finished:
                    raise RuntimeError(f"fixture request {o.request_id} finished early ({o.finish_reason}: {o.error})")
        self.context = statistics.mean(len(r.prompt_token_ids) for r in engine.scheduler.running)

    def step(self) -> float:
        t = time.perf_counter()
        outs = self.engine.step()
        dt = time.perf_counter() - t
        if len(outs) != self.batch or any(len(o.new_token_ids) != 1 for o in outs):
            raise RuntimeError("the fixture left pure decode (a request finished or was preempted)")
        return dt

    def close(self) -> None:
        for rid in self.ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished():
            self.engine.step()


def linear_modules(model) -> list:
    from ridge.quant.linear import FP8Linear
    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def step_mode(engine, batch: int) -> str:
    """How the engine ran a pure-decode step of `batch` sequences: "cuda graph" (one
    replay), "one call" (a CPU step's layers in one C call) or "eager" (a launch per kernel,
    which on a GPU can cost more than the work)."""
    graphs = engine.runner.graphs
    if engine.device.type == "cuda" and graphs is not None and graphs.can_run(batch):
        return "cuda graph"
    stack = engine.model.__dict__.get("_native_stack")  # the CPU layers in one C call (kernels/decoder_native.py)
    return "one call" if stack is not None and stack.took(batch) else "eager"


class Products:
    """Every linear layer's product once over `tokens` rows (qkv, o, gate_up, down per
    layer, and the logits): the step's matrix products alone, run the way the step runs
    (`mode`) and timed the way it is, warmed up and synchronized on both sides. Eager
    products against a graph-replayed step would charge the products with launch
    costs the step does not pay (14.7 ms against a 2.8 ms step at batch 1, issue 12)."""

    def __init__(self, model, tokens: int, mode: str = "eager", warmup: int = 3):
        mods = linear_modules(model)
        self.device = model.embed_tokens.weight.device
        dt = model.dtype
        xs = {m.in_features: torch.randn(tokens, m.in_features, device=self.device, dtype=dt) for m in mods}

        @torch.inference_mode()
        def run_all() -> None:
            with decode_step():  # as a pure-decode step runs them (AMX's bf16 tiles where --cpu-amx says so)
                for m in mods:
                    m(xs[m.in_features])

        for _ in range(warmup):  # lazy init, and kernels compiled or tuned for this shape
            run_all()
        self.mode, self._run = mode, run_all
        if mode == "cuda graph":
            self._sync()
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                run_all()
            self._run = self._graph.replay
            for _ in range(warmup):
                self._run()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self) -> float:
        """-> seconds for one pass."""
        self._sync()
        t = time.perf_counter()
        self._run()
        self._sync()
        return time.perf_counter() - t


def _uncontended(timed, retries: int) -> tuple[object, float, int]:
    """Run timed() -> result until this process had the cores (CPU use >= 90% of the
    thread count) or retries run out; -> (result, cpu util, attempts)."""
    want = 0.9 * torch.get_num_threads()
    for attempt in range(1 + retries):
        c0, w0 = time.process_time(), time.perf_counter()
        r = timed()
        util = (time.process_time() - c0) / (time.perf_counter() - w0)
        if util >= want:
            break
    return r, util, attempt + 1


def weights_read(model, rows: int = 1) -> int:
    """Bytes a decode step of `rows` rows reads of the weights with its products: every linear
    layer's weight as held (packed bytes and scales on a CPU), the head's included; of a mixture
    of experts, the share of its experts such a step reaches under uniform routing (k of E at
    one row, 1 - (1 - k/E)^rows of them in general: the expected count, not the routed one)."""
    from ridge.quant.experts import FP8Experts
    from ridge.quant.linear import FP8Linear

    share = {}
    for m in model.modules():  # a router beside its experts (models/layers/moe.py's SparseMlp)
        experts, router = getattr(m, "experts", None), getattr(m, "router", None)
        if isinstance(experts, FP8Experts) and router is not None:
            num = experts.shapes["gate_up_proj"][0]
            share[id(experts)] = 1.0 - (1.0 - min(router.k, num) / num) ** rows
    seen, total = set(), 0.0
    for m in model.modules():
        if isinstance(m, FP8Linear):
            tensors = (m.weight, m.weight_scale)
        elif isinstance(m, FP8Experts):
            tensors = tuple(t for t in vars(m).values() if isinstance(t, torch.Tensor)) + tuple(m._buffers.values())
        else:
            continue
        for t in tensors:
            if t is not None and t.numel() and t.data_ptr() not in seen:  # a tied head: the table's bytes, once
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size() * share.get(id(m), 1.0)
    return int(total)


def run_overhead(engine, batch: int, context: int, steps: int, profile_steps: int = 4, retries: int = 2,
                 bandwidth: float | None = None) -> dict:
    """Engine step time against the same step's matrix products alone, interleaved
    step by step in one run, at pure decode with `batch` sequences (and, where the layers ran in
    one C call, against the same step one op at a time)."""
    from ridge.kernels import decoder_native

    fx = DecodeFixture(engine, batch, context, tag=f"ovh{batch}",
                       max_tokens=2 * steps * (1 + retries) + 2 * profile_steps + 40)
    try:
        for _ in range(2):  # a step of this size once, so that step_mode sees how it ran
            fx.step()
        mode = step_mode(engine, batch)
        mm = Products(engine.model, batch, "eager" if mode == "one call" else mode)
        for _ in range(2):
            fx.step(), mm()

        def timed():
            # Where the layers ran in one C call, the same step one op at a time too, alternating
            # (the per-op path's cost, in the same run).
            st, mt, pt = [], [], []
            for _ in range(steps):
                st.append(fx.step())
                mt.append(mm())
                if mode == "one call":
                    with decoder_native.off():
                        pt.append(fx.step())
            return st, mt, pt
        (step_t, mm_t, per_op_t), util, tries = _uncontended(timed, retries)
        (_, bd), _, _ = _uncontended(lambda: (None, _breakdown(fx, profile_steps)), retries)
        s, m = statistics.median(step_t), statistics.median(mm_t)
        # What the step reads: the weights once, and each sequence's KV over its context.
        read = weights_read(engine.model, batch) + batch * fx.context * engine.memory.kv_bytes_per_token
        return {"batch": batch, "context": fx.context, "steps": steps, "mode": mode,
                "read_bytes_per_token": read / batch, "read_gbs": read / s / 1e9,
                "of_bandwidth": read / s / bandwidth if bandwidth else None,
                "step_ms": 1e3 * s, "matmul_ms": 1e3 * m, "overhead_pct": 100 * (s / m - 1),
                "per_op_step_ms": 1e3 * statistics.median(per_op_t) if per_op_t else None,
                "step_ms_min": 1e3 * min(step_t), "matmul_ms_min": 1e3 * min(mm_t),
                "tok_s": batch / s, "cpu_util": util, "tries": tries, "breakdown_ms": bd}
    finally:
        fx.close()


def _breakdown(fx: DecodeFixture, steps: int) -> dict:
    from .profile import step_breakdown

    with step_breakdown(fx.engine) as bd:
        for _ in range(steps):
            bd.step(fx.step)
    return bd.per_step_ms()


def interleaved_steps(fixtures: dict, steps: int, retries: int, warm: int) -> tuple[dict, float, int]:
    """fixtures: name -> a DecodeFixture. `warm` untimed steps each, then `steps` timed, one step
    of each fixture in turn so that drifting machine load hits all alike; -> (name -> step
    seconds, cpu util, attempts), rerun while another process took the cores (_uncontended)."""
    for _ in range(warm):
        for fx in fixtures.values():
            fx.step()

    def timed():
        times = {name: [] for name in fixtures}
        for _ in range(steps):
            for name, fx in fixtures.items():
                times[name].append(fx.step())
        return times
    return _uncontended(timed, retries)


def run_kv_dtypes(engines: dict, batch: int, context: int, steps: int, profile_steps: int = 3,
                  retries: int = 2) -> dict:
    """W1-like decode step time per KV dtype; engines: dtype -> engine (same weights).
    Steps are interleaved across dtypes so that drifting machine load hits all alike."""
    fixtures = {dt: DecodeFixture(e, batch, context, tag=f"kv{dt}",
                                  max_tokens=steps * (1 + retries) + 2 * profile_steps + 40)
                for dt, e in engines.items()}
    try:
        times, util, tries = interleaved_steps(fixtures, steps, retries, warm=1)
        out = {}
        for dt, fx in fixtures.items():
            bd, _, _ = _uncontended(lambda: _breakdown(fx, profile_steps), retries)
            s = statistics.median(times[dt])
            e = fx.engine
            out[dt] = {"kv_dtype": dt, "batch": batch, "context": fx.context, "step_ms": 1e3 * s,
                       "step_ms_min": 1e3 * min(times[dt]), "tok_s": batch / s, "cpu_util": util, "tries": tries,
                       "kv_bytes_per_token": e.memory.kv_bytes_per_token, "breakdown_ms": bd}
        base = out.get("fp32")
        for r in out.values():
            r["vs_fp32"] = r["step_ms"] / base["step_ms"] if base else None
        return out
    finally:
        for fx in fixtures.values():
            fx.close()
