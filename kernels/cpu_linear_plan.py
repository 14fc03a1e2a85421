"""The CPU product per matrix shape and step size, chosen by measurement at start-up.

An FP8 weight stays e4m3 on a CPU and has two products (kernels/cpu_linear.py): ridge's
streaming kernel, which converts the bytes as it reads them, and the blocked product, which
widens a tile of rows to fp32 once and runs torch's BLAS GEMM on it. The first wins where a
step is bound by the bytes it reads (few rows), the second where it is bound by arithmetic;
the crossover differs per shape and per CPU (AVX2 against AVX-512, machine-facts), so every
shape class is timed in both at every step size the scheduler makes (powers of two up to the
step budget, and the budget), and each size takes the faster.

A weight never quantized (--weights fp32 / bf16, a recipe's bf16 exceptions) keeps the formats
of old: fp32 against a bf16 copy, each size taking the faster with a margin (on AVX2 CPUs bf16
GEMMs run far slower than fp32 at larger batch, with AMX bf16 wins everywhere), and one-row
steps ATen's own bf16 GEMV on a plain copy where that beats both.

A step streams every layer's weights through the cache, so a shape is timed cold: over as
many of the model's own weights of that shape as it takes to overflow the last-level cache
(timing one weight again and again kept small ones cache-resident and chose wrong). The
timings are cached per CPU model, instruction set, torch version and thread count, so only the
first start on a machine pays for them. The layers then run what was chosen (cpu_linear.CpuLinear)."""
from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from . import native
from .cpu_linear import (AMX_MODES, CpuLinear, ShapeFormat, bf16_linear, decode_step, gemv_bf16, gemv_offered,
                         native_bf16, pack_bf16, tiles_offered)

log = logging.getLogger("ridge.kernels")
MIN_WEIGHT_BYTES = 64 << 20  # below this the weights sit in cache and bf16 buys nothing
# bf16 must take at most this fraction of fp32's time, the blocked e4m3 product of the streaming
# one's: the blocked product widens the whole weight on every call, so a timing taken beside other
# work that puts it level at few rows is noise (it chose tiles at one row on a loaded 2-core VM)
MARGIN = 0.9
# A format still running once it has taken this many times the leader's time has lost: past the
# "close" band (1.5 * MARGIN) that would call for a second round, so its partial time decides.
LOSER_STOP = 1.5
# 2: timed cold, over several weights; 3: the one-row GEMV timed too; 4: fp8 too; 5: e4m3 weights
# timed in their two products only (streaming, blocked)
CACHE_VERSION = 5


def llc_bytes() -> int:
    """The largest CPU cache's size (sysfs), 32 MiB where unknown."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (d / "size").read_text().strip().upper()
        except OSError:
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * mult)
    return best or 32 << 20


def cold_set(weights: list, bytes_per_weight: int = 4, numel: int | None = None) -> list:
    """Enough of the weights (all, if they fit) to overflow the last-level cache twice in the
    format timed (fp32 unless bytes_per_weight says otherwise); numel: each one's, where the
    items are not tensors."""
    one = (numel or weights[0].numel()) * bytes_per_weight
    return weights[: max(1, min(len(weights), -(-2 * llc_bytes() // one)))]


def step_sizes(max_tokens: int) -> list[int]:
    sizes, n = [], 1
    while n < max_tokens:
        sizes.append(n)
        n *= 2
    return sizes + [max_tokens]


def _cpu_key(amx: bool = False) -> str:
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    # The instruction sets torch and oneDNN may use are part of the machine: ATEN_CPU_CAPABILITY and
    # ONEDNN_MAX_CPU_ISA can cap them below what the CPU has (an AVX-512 CPU run as an AVX2 one).
    # Where ridge's own bf16 product runs, the bf16 timings are its kernel's: a timing of another
    # build of it says nothing of this one.
    isa = (f"{torch.backends.cpu.get_cpu_capability()}/{os.environ.get('ONEDNN_MAX_CPU_ISA', 'all')}"
           f"/fp8 {native.fp8_linear_isa()}" + (f"/bf16 {native.source_digest()}" if native_bf16() else "")
           + ("/amx tiles" if amx else ""))
    return (f"v{CACHE_VERSION}|{name or os.uname().machine}|{isa}|torch {torch.__version__}"
            f"|threads {torch.get_num_threads()}")


def _cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ridge" / "cpu-format.json"


def _load_cache() -> dict:
    try:
        return json.loads(_cache_path().read_text())
    except (OSError, ValueError):
        return {}


def _save_cache(data: dict) -> None:
    path = _cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as e:  # a read-only home only costs the next start its measurement
        log.warning("could not cache the CPU format timings in %s: %s", path, e)


def _pass(run, ws: list[torch.Tensor], x: torch.Tensor, stop_after: float = float("inf")) -> float:
    """Seconds per product over the weights; stops early once stop_after seconds have passed
    (the average of the products done is then already known to be that slow)."""
    t0 = time.perf_counter()
    for i, w in enumerate(ws, 1):
        run(x, w)
        if (elapsed := time.perf_counter() - t0) > stop_after:
            return elapsed / i
    return (time.perf_counter() - t0) / len(ws)


def measure_shape(weights: list[torch.Tensor], sizes: list[int],
                  packed: list[torch.Tensor] | None = None) -> dict[int, tuple[float, float]]:
    """{size: (fp32 seconds, bf16 seconds)} for one x @ weight.T at each step size, averaged over
    the weights (all of one shape, together larger than the cache: each product runs cold).
    The format that was faster at the previous size runs first; the other stops once it has
    taken LOSER_STOP times as long (it has lost by then, whatever the rest would take), which keeps a
    format that is far slower at large sizes cheap to rule out. A second round (best of two)
    only where the first left the choice close. One bf16 product first primes oneDNN's kernel
    for the size (where the copies are oneDNN's). packed: the weights' bf16 copies, where made."""
    packed = packed or [pack_bf16(w.to(torch.bfloat16)) for w in weights]
    times = {}
    first = 1  # bf16 first until a size shows otherwise
    for n in sizes:
        x = torch.randn(n, weights[0].shape[1])
        xb = x.to(torch.bfloat16)
        if packed[0].is_mkldnn:  # a plain bf16 fallback has no kernel to prime
            bf16_linear(xb, packed[0])
        runs = ((F.linear, weights, x), (bf16_linear, packed, x if packed[0].dim() == 4 else xb))
        best = [float("inf"), float("inf")]
        for round_ in range(2):
            if round_ and not 0.6 * MARGIN < best[1] / best[0] < 1.5 * MARGIN:
                break
            lead = _pass(*runs[first])
            best[first] = min(best[first], lead)
            best[1 - first] = min(best[1 - first], _pass(*runs[1 - first], stop_after=LOSER_STOP * lead * len(weights)))
        times[n] = (best[0], best[1])
        first = 0 if best[0] < best[1] else 1
    return times


def measure_gemv(plain: list[torch.Tensor]) -> float:
    """Seconds for one row through gemv_bf16, averaged over the weights' plain bf16 copies
    (cold, as in measure_shape); best of two passes."""
    x = torch.randn(1, plain[0].shape[1], dtype=torch.bfloat16)
    gemv_bf16(x, plain[0])
    best = float("inf")
    for _ in range(2):
        t0 = time.perf_counter()
        for w in plain:
            gemv_bf16(x, w)
        best = min(best, (time.perf_counter() - t0) / len(plain))
    return best


def measure_e4m3(layers: list[CpuLinear], sizes: list[int], isa: int) -> dict[int, tuple[float, float]]:
    """{size: (streaming seconds, blocked seconds)} for one product of e4m3 weights (layers: of
    one shape, cold as in measure_shape) at each step size; inf for a product that does not run
    here. The one faster at the previous size runs first, the other stops once it has taken
    LOSER_STOP times as long; a second round (best of two) where the first left it close."""
    n_out, k = layers[0].shape
    cold = cold_set(layers, bytes_per_weight=1, numel=n_out * k)
    runs = ((lambda x, m: m._stream(x, isa)) if isa else None, (lambda x, m: m._tiles(x)) if tiles_offered() else None)
    times = {}
    first = 0 if runs[0] is not None else 1
    for n in sizes:
        x = torch.randn(n, k)
        best = [float("inf"), float("inf")]
        for r in runs:
            if r is not None:
                r(x, cold[0])  # its buffers and the GEMM's first call, untimed
        for round_ in range(2):
            if round_ and not 0.67 < best[1] / best[0] < 1.5:
                break
            lead = _pass(runs[first], cold, x)
            best[first] = min(best[first], lead)
            if runs[1 - first] is not None:
                best[1 - first] = min(best[1 - first],
                                      _pass(runs[1 - first], cold, x, stop_after=LOSER_STOP * lead * len(cold)))
        times[n] = (best[0], best[1])
        first = 0 if best[0] <= best[1] else 1
    return times


def plan_from_times(times: dict[int, tuple[float, float]]) -> list[tuple[int, bool]]:
    """-> [(size bound, use bf16)]: each measured size takes the faster format."""
    return [(n, t16 <= MARGIN * t32) for n, (t32, t16) in sorted(times.items())]


def measure_plans(layers: list[CpuLinear], head_shape: tuple[int, int], max_tokens: int, max_head_rows: int,
                  made: dict[tuple[int, str], torch.Tensor] | None = None) -> dict[tuple, ShapeFormat]:
    """The formats of each weight class among the layers ((shape, e4m3 scale layout or None) ->
    ShapeFormat), from timings cached on disk where this machine has them. The head (head_shape)
    sees only the rows that sample (at most max_head_rows), the other products every token. made
    (out): (id(weight), "packed" | "plain") -> a bf16 copy made to time a weight in the compute
    dtype, for the layer to keep."""
    classes: dict[tuple, list[CpuLinear]] = {}
    for layer in layers:
        classes.setdefault(shape_class(layer), []).append(layer)
    isa = native.fp8_linear_isa()
    cache, key, dirty = _load_cache(), _cpu_key(any(m.tiles_in_bf16() for m in layers)), False
    mine = cache.setdefault(key, {})
    wall0, cpu0 = time.perf_counter(), time.process_time()
    plans = {}
    for cls, group in classes.items():
        shape, e4m3 = cls
        sizes = step_sizes(min(max_head_rows, max_tokens) if shape == tuple(head_shape) else max_tokens)
        name = f"{shape[0]}x{shape[1]}"
        entry = mine.get(name, {})
        if e4m3 is not None:
            known = {int(n): tuple(t) for n, t in entry.get(e4m3, {}).items()}
            todo = [n for n in sizes if n not in known]
            if todo:
                known.update(measure_e4m3(group, todo, isa))
                mine[name] = {**entry, e4m3: {str(n): list(t) for n, t in sorted(known.items())}}
                dirty = True
            plans[cls] = ShapeFormat([], fp8=[(n, not known[n][1] <= MARGIN * known[n][0]) for n in sizes])
            continue
        ws = [m.weight for m in group]
        known = {int(n): tuple(t) for n, t in entry.items() if n.isdigit()}
        gemv_s = entry.get("gemv")
        todo = [n for n in sizes if n not in known]
        if todo or gemv_s is None:
            cold = cold_set(ws)
            plain = [w.to(torch.bfloat16) for w in cold]
            packed = [pack_bf16(w) for w in plain]
            if made is not None:
                made.update(((id(w), "packed"), pk) for w, pk in zip(cold, packed))
                made.update(((id(w), "plain"), pl) for w, pl in zip(cold, plain))
            known.update(measure_shape(cold, todo, packed) if todo else {})
            gemv_s = measure_gemv(plain) if gemv_offered() else float("inf")  # not a format here: untimed
            mine[name] = {**entry, **{str(n): list(t) for n, t in sorted(known.items())}, "gemv": gemv_s}
            dirty = True
        plans[cls] = _format(sizes, known, gemv_s)
    if dirty and _had_the_cores(time.perf_counter() - wall0, time.process_time() - cpu0):
        _save_cache(cache)
    elif dirty:
        log.info("CPU format timings taken beside another process's work: used for this start, not cached")
    return plans


def shape_class(layer: CpuLinear) -> tuple:
    """(shape, the e4m3 timings' name, None for a weight in the compute dtype): a product's time
    depends on the shape and, for e4m3, on the scales' layout (a multiply-add per group as it
    closes, fp32 or bf16 scales) and the kernels' source (a timing of another build of them says
    nothing of this one)."""
    if not layer.is_packed:
        return tuple(layer.shape), None
    s = layer.scale
    layout = "" if s.dim() == 1 else f" {s.shape[1]} groups {str(s.dtype).removeprefix('torch.')}"
    return tuple(layer.shape), f"{layer.code}{layout} {native.source_digest()}"  # e4m3, or i8 (int8 codes)


def _had_the_cores(wall: float, cpu: float) -> bool:
    """Whether a measurement had its threads' cores to itself (it used at least 80 % of them). A
    timing taken beside another process's work is kept out of the cache: one taken so once kept
    a head's 16-row product in bf16 at 211 ms where fp32 takes 35 (docs/benchmarks.md, issue 26)."""
    return wall <= 0 or cpu >= 0.8 * wall * torch.get_num_threads()


def _format(sizes: list[int], known: dict[int, tuple[float, float]], gemv_s: float) -> ShapeFormat:
    """A weight in the compute dtype: bf16 against fp32 with a margin at each size, and one row
    through the GEMV where that beats both."""
    gemv = gemv_offered() and gemv_s <= MARGIN * min(known[1])
    return ShapeFormat(plan_from_times({n: known[n] for n in sizes}), gemv)


def describe(plan: list[tuple[int, bool]]) -> str:
    """[(1, T), (2, T), (4, F)] -> "bf16 <= 2, fp32 4+"-style runs."""
    runs, start = [], 0
    for i, (n, use) in enumerate(plan):
        if i + 1 == len(plan) or plan[i + 1][1] != use:
            lo = plan[start][0] if start == 0 else plan[start - 1][0] + 1
            runs.append(f"{'bf16' if use else 'fp32'} {lo}-{n}")
            start = i + 1
    return ", ".join(runs)


def describe_format(f: ShapeFormat, e4m3: bool = False) -> str:
    if e4m3:
        stream = [n for n, use in f.fp8 or [] if use]
        return f"streaming at {','.join(map(str, stream))} rows, else tiles" if stream else "tiles"
    return ("gemv 1 row, " if f.gemv else "") + describe(f.plan)


def choose(layers: list[CpuLinear], head_shape: tuple[int, int], weight_bytes: int, mode: str = "auto",
           max_tokens: int = 64, max_head_rows: int = 64, amx: str = "off") -> int:
    """Give each CPU layer the products that run fastest at each step size; -> the largest step
    size that runs a bf16 copy anywhere (0 = none). mode: auto (measured); fp32 (e4m3 weights
    through the blocked product, fp32 GEMM on their own values; others fp32); or bf16:N (e4m3
    weights through the streaming kernel up to N rows, the blocked product above; others a bf16
    copy up to N rows). amx (cpu_linear.AMX_MODES): the steps whose blocked product runs on AMX's
    tile unit where the CPU has it, activations rounded to bf16 (CpuLinear.bf16_tiles); the others
    run fp32 tiles, fp32-exact; none in the fp32 mode. The step sizes are timed as decode steps
    run them."""
    if amx not in AMX_MODES:
        raise ValueError(f"cpu_amx {amx!r}: choose {', '.join(AMX_MODES)}")
    head_shape = tuple(head_shape)
    isa = native.fp8_linear_isa()
    if not layers:
        return 0
    # fp32 products asked for (or a model too small to measure, whose products are fp32): no
    # activation is rounded to bf16 on AMX either
    fp32 = mode == "fp32" or (mode == "auto" and weight_bytes < MIN_WEIGHT_BYTES)
    for m in layers:
        m.bf16_tiles = "off" if fp32 else amx
    with decode_step():
        return _choose(layers, head_shape, weight_bytes, mode, max_tokens, max_head_rows, amx, isa)


def _choose(layers: list[CpuLinear], head_shape: tuple[int, int], weight_bytes: int, mode: str, max_tokens: int,
            max_head_rows: int, amx: str, isa: int) -> int:
    if mode == "fp32" or (mode == "auto" and weight_bytes < MIN_WEIGHT_BYTES):
        for m in layers:
            m.use(ShapeFormat([]), isa)
        return 0
    if mode != "auto":
        limit = int(mode.split(":")[1])
        for m in layers:
            m.use(ShapeFormat.bf16_up_to(limit), isa)
        log.info("CPU weights: the streaming e4m3 kernel / bf16 copies for steps of <= %d tokens, tiles / fp32 "
                 "above (set)", limit)
        return limit if any(not m.is_packed for m in layers) else 0
    if not any(m.is_packed for m in layers):
        # An unquantized model (--weights fp32 or bf16) asked for its own weights: a bf16 copy would round them.
        return 0
    t0 = time.perf_counter()
    made: dict[tuple[int, str], torch.Tensor] = {}
    # The never-quantized weights beside e4m3 ones (a recipe's bf16 exceptions) were bf16: a copy holds them exactly.
    formats = measure_plans(layers, head_shape, max_tokens, max_head_rows, made)
    for m in layers:
        w = m.weight
        m.use(formats[shape_class(m)], isa, {k: made[(id(w), k)] for k in ("packed", "plain") if (id(w), k) in made})
    log.info("CPU weights by matrix and step size (%.1f s): %s", time.perf_counter() - t0,
             "; ".join(f"{o}x{i}{'' if e is None else ' ' + e.split()[0]}: {describe_format(f, e is not None)}"
                       for ((o, i), e), f in formats.items()))
    if amx == "off" and native.tiles_bf16():
        log.info("this CPU has AMX: --cpu-amx decode runs the decode steps past the streaming sizes (many "
                 "streams) about 2x faster, their activations rounded to bf16 as the streaming kernel rounds them")
    return max((n for (_, e), f in formats.items() if e is None for n, use in f.plan if use), default=0)


def fp8_max_tokens(layers: list[CpuLinear]) -> int:
    """The largest step size any layer runs through the streaming e4m3 kernel (0 = none)."""
    return max((m.max_rows("fp8") for m in layers), default=0)


# -- batch-invariant formats (deterministic mode) ----------------------------------------------
# A row's product must not depend on how many rows share its step: a request's tokens would then
# change with its batch mates, its prefill chunks and its speculation's draft length. Measured on
# an AVX2 EPYC with torch 2.13 (docs/benchmarks.md): MKL's fp32 GEMM rounds a row one way at 1 row
# (its GEMV), another at 2-3, others at 5-7 and 9-11, and alike at 4, 8 and 12 or more; the e4m3
# kernel's AVX2 path accumulates every row alike at any count; its AVX-512 path takes a
# two-accumulator loop for one row only. So each matrix runs one product at every step size:
# an e4m3 weight the streaming kernel where that is invariant here, else the blocked product
# (whose tiles are fixed by the shape, not by the rows or threads; its GEMM is MKL's, so it is
# padded as MKL's fp32 is); a weight in the compute dtype MKL fp32. MKL runs on a row count it
# rounds alike (fp32_rows: 4, 8, or 12 on; 4x a GEMV's arithmetic at one row, which a one-row
# step's bandwidth hides), padded to 16 rows where that fails. Each is checked on the machine.
INVARIANT_ROWS = 16


def fp32_rows(n: int) -> int:
    """The rows MKL's fp32 GEMM runs n rows as, so that each row gets the bits it gets at 12 rows
    or more: fewer than 12 are padded to a multiple of 4 (at least 4)."""
    return n if n >= 12 else max(4, -(-n // 4) * 4)


def invariant_unavailable(device: torch.device) -> str | None:
    """Why this device cannot run steps batch-invariant (None: it can). On CPU the attention needs
    ridge's C kernel (the torch reference batches its decodes); on a GPU the FP8 GEMMs choose
    their tiles and the attention its KV splits by the batch, and no invariant set is built yet."""
    if device.type != "cpu":
        return "batch-invariant kernels are built for the CPU only (the GPU's GEMM tiles and attention splits follow the batch)"
    if native.library() is None:
        return "ridge's C kernels are not built here (no C compiler?), and the torch attention is not batch-invariant"
    return None


def _pad_rows(run, rows):
    """run on rows(n) rows (rows: a count, the least it runs on, or a function of n): the padding
    rows are zeros and their outputs cut off."""
    target = rows if callable(rows) else (lambda n: max(n, rows))

    def padded(x: torch.Tensor):
        n = x.shape[0]
        m = target(n)
        if m == n:
            return run(x)
        y = run(torch.cat((x, x.new_zeros(m - n, x.shape[1]))))
        return None if y is None else y[:n]
    return padded


def invariant_sizes(max_tokens: int) -> list[int]:
    """Row counts an invariance check compares: the step sizes, their odd neighbours, 3 and 5."""
    return sorted({n for s in step_sizes(max_tokens) + [3, 5] for n in (s, s + 1) if n <= max_tokens})


def is_invariant(run, in_features: int, max_tokens: int) -> bool:
    """Whether run (x -> x @ W.T) gives every row the same bits at every row count up to max_tokens
    and on one thread (the thread governor shrinks the team under load): each prefix of one random
    batch, and rows alone, against the whole batch's rows."""
    x = torch.randn(max(max_tokens, 2), in_features, generator=torch.Generator().manual_seed(0))
    full = run(x)
    prefixes = all(torch.equal(run(x[:n]), full[:n]) for n in invariant_sizes(max_tokens))
    alone = all(torch.equal(run(x[i:i + 1].clone()), full[i:i + 1]) for i in (0, x.shape[0] - 1))
    threads = torch.get_num_threads()
    if threads == 1 or not (prefixes and alone):
        return prefixes and alone
    torch.set_num_threads(1)
    try:
        return torch.equal(run(x[:3]), full[:3]) and torch.equal(run(x), full)
    finally:
        torch.set_num_threads(threads)


def _use_fp8(layer: CpuLinear, isa: int) -> None:
    """The streaming e4m3 kernel at every step size."""
    layer.use(ShapeFormat([], fp8=[(1, True)]), isa)


def _fp32_run(layer: CpuLinear, rows=fp32_rows):
    """MKL's fp32 GEMM at every size, padded to `rows`: on the e4m3 weight's fp32 tiles (the bf16
    ones, where the CPU has them, were never checked for invariance), or the weight itself."""
    if layer.is_packed:
        layer.bf16_tiles = "off"
    return _pad_rows(layer._tiles if layer.is_packed else (lambda x: F.linear(x, layer.weight)), rows)


def _set_fp32(layer: CpuLinear, run) -> None:
    layer.bounds, layer.runs, layer.kinds, layer.copies = [1], [run], ["tiles" if layer.is_packed else "fp32"], {}


def use_invariant(layer: CpuLinear, isa: int, max_tokens: int) -> str:
    """Give the layer one batch-invariant product for every step size; -> its kind ("fp8", or
    "fp32" / "fp32/16": MKL's GEMM padded as fp32_rows or to 16 rows)."""
    k = layer.shape[1]
    if layer.is_packed and isa > 0:
        _use_fp8(layer, isa)
        if is_invariant(layer.runs[0], k, max_tokens):
            return "fp8"
        log.warning("the streaming e4m3 product of %s is not batch-invariant on this CPU: the blocked one instead",
                    layer.shape)
    for rows, kind in ((fp32_rows, "fp32"), (INVARIANT_ROWS, "fp32/16")):
        run = _fp32_run(layer, rows)
        if is_invariant(run, k, max_tokens):
            _set_fp32(layer, run)
            return kind
    raise RuntimeError(f"deterministic mode: no batch-invariant product for a {layer.shape} weight "
                       "on this CPU (MKL's fp32 GEMM changed a row's bits with the row count, even padded to 16 rows)")


def choose_invariant(layers: list[CpuLinear], head_shape: tuple[int, int], max_tokens: int,
                     max_head_rows: int) -> dict[str, int]:
    """use_invariant for every layer, checking one layer per weight class (a product's arithmetic
    depends on the shape and scale layout, not the values) up to the rows it sees (the head:
    max_head_rows); -> {kind: layers}."""
    isa = native.fp8_linear_isa()
    t0 = time.perf_counter()
    checked: dict[tuple, str] = {}
    counts: dict[str, int] = {}
    for layer in layers:
        cls = shape_class(layer)
        if cls not in checked:
            rows = min(max_head_rows, max_tokens) if cls[0] == tuple(head_shape) else max_tokens
            checked[cls] = use_invariant(layer, isa, rows)
        elif checked[cls] == "fp8":
            _use_fp8(layer, isa)
        else:
            _set_fp32(layer, _fp32_run(layer, INVARIANT_ROWS if checked[cls] == "fp32/16" else fp32_rows))
        counts[checked[cls]] = counts.get(checked[cls], 0) + 1
    log.info("CPU weights, batch-invariant (checked in %.1f s): %s", time.perf_counter() - t0,
             ", ".join(f"{k} for {n} layers" for k, n in sorted(counts.items())))
    return counts
