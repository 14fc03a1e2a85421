"""ridge's own CPU kernels (kernels/csrc/*.c): compiled on first use with the system's C
compiler, cached, and called through ctypes on tensors' memory.

Why C and not torch: a CPU step of few rows is bound by bytes and by the number of ops,
and torch has neither an e4m3 weight product (it casts the whole weight first) nor an
attention over a paged cache (the reference gathers every context into fresh tensors and
builds masks, about a fifth of a batch-1 step and more at batch 64); and each small op
(norm, RoPE, the KV write, the activation) is several torch ops of a few microseconds of
dispatch each where the arithmetic takes less than one. Each kernel keeps
its torch reference as the oracle in tests, and the engine takes a kernel only where it
is measured or known faster (kernels/cpu_linear_plan.py, kernels/ops.py).

The library is built once per source, compiler and machine type into
$XDG_CACHE_HOME/ridge/native/, in a background thread started with the engine so that
the build overlaps loading the model. No compiler, a failed build or RIDGE_NATIVE=0:
the engine runs torch's paths, as before, and says so once. The .so links libgomp by its
soname, so it shares the OpenMP runtime torch already loaded: one thread team, no two
pools spinning against each other."""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import torch

log = logging.getLogger("ridge.kernels")
SRC = Path(__file__).with_name("csrc")
SOURCES = ("fp8_linear.c", "paged_attention.c", "small_ops.c", "fp8_quant.c", "recurrent.c", "decoder.c")
FLAGS = ("-O3", "-fPIC", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-Wall", "-Wno-psabi")

_lock = threading.Lock()
_state: dict = {}  # "lib": CDLL | None once tried; "why": the reason it is None


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ridge" / "native"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _flags() -> tuple[str, ...]:
    """FLAGS, capped like torch: an AVX-512 machine run as an AVX2 one (ATEN_CPU_CAPABILITY)
    must not take AVX-512 clones behind its back."""
    cap = torch.backends.cpu.get_cpu_capability()
    if platform.machine() not in ("x86_64", "AMD64") or cap.startswith("AVX512"):
        return FLAGS
    return FLAGS + (("-DRIDGE_MAX_AVX2",) if cap == "AVX2" else ("-DRIDGE_BASELINE",))


def _digest(cc: str) -> str:
    """The sources, the header they share, the flags, the machine type and the compiler: its
    resolved file, size and mtime stand for its version (asking it would start a process on
    every start of the engine), so an upgraded compiler builds afresh."""
    h = hashlib.sha256(source_digest().encode())
    try:
        real = os.path.realpath(shutil.which(cc) or cc)
        st = os.stat(real)
        compiler = f"{real}:{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        compiler = cc
    h.update(f"{compiler}|{_flags()}|{platform.machine()}|{SOURCES}".encode())  # SOURCES: which files link
    return h.hexdigest()[:16]


def source_digest() -> str:
    """The kernels' sources and shared header: what a timing of them is valid for (the CPU format
    cache keys its e4m3 timings by it, so that a changed kernel is timed afresh)."""
    if "src" not in _state:
        h = hashlib.sha256()
        for path in sorted(SRC.glob("*.[ch]")):
            h.update(path.name.encode() + path.read_bytes())
        _state["src"] = h.hexdigest()[:12]
    return _state["src"]


def _build(cc: str, out: Path) -> None:
    """Compile each source in its own process (they build in parallel), then link."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".build-{os.getpid()}-{threading.get_ident()}"
    tmp.mkdir(exist_ok=True)
    try:
        objs = [tmp / (name[:-2] + ".o") for name in SOURCES]
        procs = [subprocess.Popen([cc, *_flags(), "-c", str(SRC / name), "-o", str(o)],
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for name, o in zip(SOURCES, objs)]
        output = [p.communicate()[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("".join(output)[-2000:])
        so = tmp / "libridge_cpu.so"
        link = subprocess.run([cc, "-shared", "-fopenmp", *map(str, objs), "-o", str(so), "-lm"],
                              capture_output=True, text=True)
        if link.returncode:
            raise RuntimeError(link.stdout + link.stderr)
        so.replace(out)  # atomic: a concurrent start loads one whole library or builds its own
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
    lib.fp8_linear_isa.argtypes, lib.fp8_linear_isa.restype = [], i32
    lib.fp8_linear_force_conversion.argtypes, lib.fp8_linear_force_conversion.restype = [i32], i32  # tests
    lib.fp8_linear_grouped.argtypes = [p, i64, i64, p, p, i32, i64, i64, p, i32, i32, p, i32]
    lib.fp8_special_map.argtypes, lib.fp8_special_map.restype = [p, i64, i64, p, i32], i64
    lib.fp8_linear_shifts.argtypes, lib.fp8_linear_shifts.restype = [], i32
    lib.fp8_linear_grouped.restype = i32
    lib.fp8_linear_tiles.argtypes = [p, i64, i64, p, p, i32, i64, i64, p, i64, p, i32, i32, i32]
    lib.fp8_linear_tiles.restype = i32
    lib.fp8_linear_amx.argtypes, lib.fp8_linear_amx.restype = [], i32
    lib.fp8_widen.argtypes = [p, i64, p, i32, i64, i64, i64, p, i64, i32]
    lib.fp8_widen.restype = i32
    lib.fp8_rows.argtypes = [p, i64, i64, p, i32, i64, p, i64, p, i32, i32]
    lib.q8_pack.argtypes = [p, i32, i64, i64, i64, i64, p, p, i32]
    lib.q8_pack.restype = None
    lib.fp8_rows.restype = i32
    lib.bf16_linear.argtypes, lib.bf16_linear.restype = [p, i64, i64, p, i64, p, i32], i32
    lib.fp8_moe.argtypes = [p, i64, i64, i64, i64, i64, p, p, p, p, p, p, p, p, i32, f32, f32, p, i32, i32]
    lib.fp8_moe.restype = i32
    lib.paged_attention.argtypes = [p, i64, i32, i32, i32, p, p, p, p, i32, p, i64, p, p, i64, i32, f32, i32, f32,
                                    p, p, i32, p, p, i32]
    lib.paged_attention.restype = i32
    lib.argmax_rows.argtypes, lib.argmax_rows.restype = [p, i64, i64, i64, p, i32], i32
    lib.moe_route.argtypes, lib.moe_route.restype = [p, i64, i64, p, p, i64, i64, i32, i32, p, p, i32], i32
    lib.paged_attention_isa.argtypes, lib.paged_attention_isa.restype = [i32], i32
    lib.paged_attention_wide.argtypes, lib.paged_attention_wide.restype = [], i32
    lib.rms_norm.argtypes = [p, p, p, f32, p, i64, i64, i32]
    lib.rope.argtypes = [p, i64, i64, i64, i64, i64, p, p, i32]
    lib.write_kv.argtypes = [p, p, i64, i64, i64, i64, i64, p, i64, p, p, p, p, i32]
    lib.silu_and_mul.argtypes = [p, i64, i64, p, i32]
    lib.read_bytes.argtypes, lib.read_bytes.restype = [p, i64, i32], ctypes.c_uint64
    lib.fp8_search_scale.argtypes = [p, p, i64, i64, p, i32, i32, i32, i32, p, i32]
    lib.fp8_search_scale.restype = i32
    for fn in (lib.rms_norm, lib.rope, lib.write_kv, lib.silu_and_mul):
        fn.restype = i32
    # recurrent.c: the gated delta rule, the causal conv and the Mamba2 state update (issue 41)
    lib.gdn_recurrent.argtypes = [p, p, p, i64, i64, i64, p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, f32,
                                  i32, i32]
    lib.conv1d_varlen.argtypes = [p, i64, p, p, p, p, p, p, p, p, i64, i64, i64, i32, i32]
    lib.ssd_update.argtypes = [p, i64, p, i64, p, p, i64, p, i64, p, p, i32, f32, f32, p, p, p, p, p, p, i64, i64,
                               i64, i64, i64, i32]
    for fn in (lib.gdn_recurrent, lib.conv1d_varlen, lib.ssd_update):
        fn.restype = i32
    # decoder.c: a dense decoder's layers in one call (kernels/decoder_native.py declares the structs)
    lib.decoder_layers.argtypes, lib.decoder_layers.restype = [p, i64, p], i32  # layers' address, count, step


def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("RIDGE_NATIVE", "1") == "0":
        return None, "RIDGE_NATIVE=0"
    cc = _compiler()
    if cc is None:
        return None, "no C compiler (cc) found"
    path = _cache_dir() / _digest(cc) / "libridge_cpu.so"
    try:
        if not path.exists():
            _build(cc, path)
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, RuntimeError, AttributeError) as e:
        return None, f"build failed: {str(e).strip()[:500]}"
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The compiled kernels, building them on first call; None where they cannot be had."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                lib, why = _load()
                if lib is None:
                    log.warning("ridge's CPU kernels are off (%s): torch's paths run instead", why)
                _state.update(lib=lib, why=why)
    return _state["lib"]


@contextmanager
def off():
    """Run torch's paths within, as where the library is not built: tests check those paths, and
    benchmarks compare the two in one process."""
    library()
    saved = _state["lib"]
    _state["lib"] = None
    try:
        yield
    finally:
        _state["lib"] = saved


def start_build() -> threading.Thread:
    """Build (or find) the library in the background; library() then waits for it."""
    t = threading.Thread(target=library, name="ridge-native-build", daemon=True)
    t.start()
    return t


def fp8_linear_isa() -> int:
    """2: AVX-512 BF16, 1: AVX2, 0: no fp8 product here. Capped by torch's own instruction
    set, so that ATEN_CPU_CAPABILITY=avx2 runs an AVX-512 machine as an AVX2 one throughout."""
    lib = library()
    if lib is None:
        return 0
    cap = {"AVX512": 2, "AVX2": 1}.get(torch.backends.cpu.get_cpu_capability(), 0)
    return min(lib.fp8_linear_isa(), cap)


def scale_blocks(scale256: torch.Tensor) -> torch.Tensor:
    """Scales as the e4m3 products read them fastest: [ceil(K/G), N] per column and group ->
    [N/16, ceil(K/G), 16], each 16-column block's scales together, as its weights are (one
    per column, [N], is that layout already). fp32, or bf16 (groups: the stored scales' own
    dtype, times 256 exactly). Made once per weight, at load."""
    if scale256.dim() == 1:
        return scale256.contiguous()
    g, n = scale256.shape
    return scale256.reshape(g, n // 16, 16).transpose(0, 1).contiguous()


def _scales(packed: torch.Tensor, scale256: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """-> (the scales in the kernels' layout, their group size along K, 1 where they are bf16),
    checked against the packed weight. scale256: [N] fp32, or [N/16, ceil(K/G), 16] as
    scale_blocks makes them (or [ceil(K/G), N] as kernels/fp8_scales.column_groups gives them,
    rearranged here on every call: for tests)."""
    nb, kp, sixteen, two = packed.shape
    k = 2 * kp
    assert (sixteen, two) == (16, 2) and packed.dtype == torch.uint8 and packed.is_contiguous(), packed.shape
    if scale256.dim() == 2:
        scale256 = scale_blocks(scale256)
    groups = 1 if scale256.dim() == 1 else scale256.shape[1]
    gk = k if groups == 1 else 1 << (-(-k // groups) - 1).bit_length()
    assert scale256.dtype in (torch.float32, torch.bfloat16) and scale256.numel() == nb * 16 * groups
    assert scale256.dim() == 1 or scale256.shape == (nb, groups, 16), scale256.shape
    assert scale256.is_contiguous() and -(-k // gk) == groups and gk % 2 == 0, (scale256.shape, k)
    return scale256, gk, int(scale256.dtype == torch.bfloat16)


def _product(x: torch.Tensor, packed: torch.Tensor, scale256: torch.Tensor, call) -> torch.Tensor:
    """The e4m3 products' common checks and output; call(x, packed, scale256, gk, sbf, y) runs the
    kernel (x contiguous, y [M, N] fp32) and returns its status."""
    nb, kp = packed.shape[:2]
    m, k = x.shape
    assert k == 2 * kp and x.dtype == torch.float32, (x.shape, packed.shape)
    scale256, gk, sbf = _scales(packed, scale256)
    y = torch.empty((m, nb * 16), dtype=torch.float32)
    if m:  # the kernels write whole tiles of rows
        assert call(x.contiguous(), scale256, gk, sbf, y) == 0, f"{call.__name__}: not built here"
    return y


def fp8_linear(x: torch.Tensor, packed: torch.Tensor, scale256: torch.Tensor, isa: int,
               i8: bool = False, special: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] fp32 @ (e4m3 weight * scale).T -> [M, N] fp32, streaming the bytes (the product of
    few rows). packed: cpu_linear.pack_fp8's [N/16, K/2, 16, 2] bytes; scale256: the scales times
    256, as _scales takes them. i8: the bytes are int8 codes (pack_q8) and the scales as they are.
    special: packed's special_map, which lets AVX-512 convert by shifts (None: by tables)."""
    mp = _map_ptr(packed, special)

    def fp8_linear_grouped(x, s, gk, sbf, y):
        return library().fp8_linear_grouped(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), s.data_ptr(),
                                            sbf, y.shape[1], gk, y.data_ptr(), isa, int(i8), mp,
                                            torch.get_num_threads())
    return _product(x, packed, scale256, fp8_linear_grouped)


def fp8_linear_call(packed: torch.Tensor, scale256: torch.Tensor, isa: int, i8: bool = False,
                    special: torch.Tensor | None = None):
    """fp8_linear bound to one weight: its checks and pointers taken once, so that each of a
    step's products pays one ctypes call (fp8_linear's checks cost about 25 us a call, more than
    a one-row product of a small layer's bytes). -> call(x) -> y [M, N padded] fp32, or None
    where the library is off (native.off) or x is not a contiguous fp32 [M, K]."""
    scale256, gk, sbf = _scales(packed, scale256)
    n, k = packed.shape[0] * 16, packed.shape[1] * 2
    wp, sp, i8, mp = packed.data_ptr(), scale256.data_ptr(), int(i8), _map_ptr(packed, special)
    f32, empty, threads = torch.float32, torch.empty, torch.get_num_threads

    def call(x: torch.Tensor) -> torch.Tensor | None:
        lib = _state.get("lib")
        if lib is None or x.dtype is not f32 or x.dim() != 2 or x.shape[1] != k or not x.is_contiguous():
            return None
        m = x.shape[0]
        y = empty((m, n), dtype=f32)
        if m and lib.fp8_linear_grouped(x.data_ptr(), m, k, wp, sp, sbf, n, gk, y.data_ptr(), isa, i8, mp, threads()):
            raise RuntimeError("fp8_linear_grouped: not built here")
        return y
    call.weights = (packed, scale256, special)  # held: the pointers above are theirs
    return call


def special_map(packed: torch.Tensor) -> torch.Tensor | None:
    """The map of a packed e4m3 weight's k pairs that hold a subnormal or NaN code (a bit a pair,
    [N/16, K/16 + 2] bytes): with it the AVX-512 product converts every other pair by shifts
    (kernels/csrc/fp8_linear.c). None where the library is not built or the CPU does not convert
    by shifts (AVX-512 BF16 and VBMI; an ISA capped below it, ATEN_CPU_CAPABILITY): no pass over
    the weights at load where no product reads the map."""
    nb, kp = packed.shape[:2]
    assert packed.dtype == torch.uint8 and packed.is_contiguous() and packed.shape[2:] == (16, 2), packed.shape
    lib = library()
    if lib is None or fp8_linear_isa() < 2 or not lib.fp8_linear_shifts():
        return None
    out = torch.empty((nb, kp // 8 + 2), dtype=torch.uint8)
    marked = lib.fp8_special_map(packed.data_ptr(), nb, kp, out.data_ptr(), torch.get_num_threads())
    return out if marked >= 0 else None


def _map_ptr(packed: torch.Tensor, special: torch.Tensor | None) -> int | None:
    if special is None:
        return None
    assert special.dtype == torch.uint8 and special.shape == (packed.shape[0], packed.shape[1] // 8 + 2) \
        and special.is_contiguous(), (special.shape, packed.shape)
    return special.data_ptr()


def sgemm() -> int | None:
    """The address of the Fortran sgemm that torch's own BLAS (MKL) exports, for the blocked
    product's tiles (one single-threaded call per tile, from each thread); None where this torch
    build exports none (the blocked product is then not offered)."""
    if "sgemm" not in _state:
        addr = None
        for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
            path = Path(torch.__file__).parent / "lib" / name
            if path.exists():
                try:
                    addr = ctypes.cast(getattr(ctypes.CDLL(str(path)), "sgemm_"), ctypes.c_void_p).value
                except (OSError, AttributeError):
                    addr = None
                break
        _state["sgemm"] = addr
    return _state["sgemm"]


def tiles_bf16() -> bool:
    """Whether the blocked product can run on AMX's tile unit here (x rounded to bf16, each weight
    times its scale as two bf16 halves that add up to it, fp32 sums): a CPU with AMX-BF16 and
    AVX-512 BF16. A layer runs it where asked (CpuLinear.bf16_tiles, --cpu-amx); elsewhere the
    blocked product runs fp32 tiles and torch's sgemm, fp32-exact."""
    if "amx" not in _state:
        lib = library()
        _state["amx"] = bool(lib is not None and fp8_linear_isa() == 2 and lib.fp8_linear_amx())
    return _state["amx"]


def tile_blocks(k: int) -> int:
    """16-column blocks per tile of the blocked product's fp32 tiles: the widened tile (blocks * 16
    * K fp32) within TILE_BYTES, to stay in a core's L2 beside the GEMM's own packed panels, but 2
    to 8 blocks whatever K (a GEMM of 16 columns ran slower at every K; 2-8 timed alike on AVX2 at
    K = 2048 and 8192, issue 39)."""
    return min(8, max(2, TILE_BYTES // (16 * k * 4)))


TILE_BYTES = 512 << 10


def fp8_linear_tiles(x: torch.Tensor, packed: torch.Tensor, scale256: torch.Tensor,
                     blocks: int | None = None, i8: bool = False, bf16: bool = False) -> torch.Tensor:
    """x [M, K] fp32 @ (e4m3 weight * scale).T -> [M, N] fp32 by the blocked product: tiles of
    `blocks` 16-column blocks (tile_blocks(K) by default) widened to fp32 once each and multiplied
    by torch's BLAS sgemm, one tile per thread at a time; or (bf16, where tiles_bf16()) on AMX:
    each weight times its scale as two bf16 halves (exact for e4m3 with bf16 scales), x rounded
    to bf16 (as the AVX-512 streaming kernel rounds it), fp32 sums. Arguments as fp8_linear's."""
    def fp8_linear_tiles(x, s, gk, sbf, y):
        k = x.shape[1]
        return library().fp8_linear_tiles(x.data_ptr(), x.shape[0], k, packed.data_ptr(), s.data_ptr(), sbf,
                                          y.shape[1], gk, y.data_ptr(), blocks or tile_blocks(k), sgemm(),
                                          int(bf16), int(i8), torch.get_num_threads())
    return _product(x, packed, scale256, fp8_linear_tiles)


def fp8_widen(packed: torch.Tensor, scale256: torch.Tensor, b0: int = 0, b1: int | None = None,
              i8: bool = False) -> torch.Tensor:
    """Blocks [b0, b1) of a packed weight widened to fp32 [(b1 - b0) * 16, K], e4m3 * scale (the
    blocked product's widening, for tests against the torch upcast)."""
    nb, kp = packed.shape[:2]
    b1 = nb if b1 is None else b1
    scale256, gk, sbf = _scales(packed, scale256)
    out = torch.empty((2 * kp, (b1 - b0) * 16), dtype=torch.float32)
    rc = library().fp8_widen(packed.data_ptr(), 2 * kp, scale256.data_ptr(), sbf, gk, b0, b1, out.data_ptr(),
                             out.shape[1], int(i8))
    assert rc == 0, "fp8_widen: no AVX2 here"
    return out.t()


def fp8_rows(packed: torch.Tensor, scale256: torch.Tensor, ids: torch.Tensor, i8: bool = False) -> torch.Tensor:
    """Rows ids of a packed weight times their scales -> [len(ids), K] fp32 (an embedding lookup:
    only the gathered rows are read). Arguments as fp8_linear's; ids any integer tensor."""
    nb, kp = packed.shape[:2]
    scale256, gk, sbf = _scales(packed, scale256)
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty((ids.numel(), 2 * kp), dtype=torch.float32)
    rc = library().fp8_rows(packed.data_ptr(), nb * 16, 2 * kp, scale256.data_ptr(), sbf, gk, ids.data_ptr(),
                            ids.numel(), out.data_ptr(), int(i8), torch.get_num_threads())
    assert rc == 0, "token id out of range"
    return out


def q8_pack(w: torch.Tensor, gk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [N, K] fp32 or bf16 weight (rows may be a strided view, K even) -> (int8 codes in the
    products' packed layout [ceil(N/16), K/2, 16, 2] as uint8, bf16 scales [ceil(N/16),
    ceil(K/gk), 16]) in one pass: 1 x gk groups, scale amax / 127 rounded up to bf16
    (kernels/cpu_linear.py quantize_q8 is its torch form)."""
    n, k = w.shape
    assert w.dtype in (torch.float32, torch.bfloat16) and k % 2 == 0 and 0 < gk <= 256 and gk % 2 == 0 \
        and w.stride(1) == 1, \
        (w.dtype, w.shape, gk)
    nb, groups = -(-n // 16), -(-k // gk)
    packed = torch.empty((nb, k // 2, 16, 2), dtype=torch.uint8)
    scales = torch.empty((nb, groups, 16), dtype=torch.bfloat16)
    library().q8_pack(w.data_ptr(), int(w.dtype == torch.bfloat16), n, k, w.stride(0), gk, packed.data_ptr(),
                      scales.data_ptr(), torch.get_num_threads())
    return packed, scales


def bf16_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 (rounded to bf16) @ w.T -> [M, N] fp32 with fp32 sums, for a bf16 weight as
    cpu_linear.pack_bf16 lays it out for this kernel: [N/16, K/2, 16, 2] int16 words. Only where
    fp8_linear_isa() is 2 (AVX-512 BF16)."""
    nb, kp, sixteen, two = packed.shape
    m, k = x.shape
    assert (sixteen, two) == (16, 2) and k == 2 * kp and packed.dtype == torch.int16, (x.shape, packed.shape)
    assert x.dtype == torch.float32 and packed.is_contiguous()
    x = x.contiguous()
    y = torch.empty((m, nb * 16), dtype=torch.float32)
    rc = library().bf16_linear(x.data_ptr(), m, k, packed.data_ptr(), nb * 16, y.data_ptr(), torch.get_num_threads())
    assert rc == 0, "bf16_linear: no AVX-512 BF16 kernel here"
    return y


def fp8_search_scale(tiles: torch.Tensor, weight: torch.Tensor | None, bf16: bool, clips: tuple[float, ...],
                     refine: int, iters: int) -> torch.Tensor | None:
    """quant/fp8.py search_scale's "mse" search in C (kernels/csrc/fp8_quant.c): tiles [..., G]
    fp32 (weight: the same shape, or None) -> each tile's scale [...] fp32, bf16-exact where bf16;
    None where the library is not built or the tile is too long for it."""
    lib = library()
    g = tiles.shape[-1]
    if lib is None or g > 16384:
        return None
    t = tiles.reshape(-1, g).float().contiguous()
    w = None if weight is None else weight.expand_as(tiles).reshape(-1, g).float().contiguous()
    out = torch.empty(t.shape[0], dtype=torch.float32)
    c = torch.tensor(clips, dtype=torch.float32)
    rc = lib.fp8_search_scale(t.data_ptr(), None if w is None else w.data_ptr(), t.shape[0], g, c.data_ptr(),
                              len(clips), refine, iters, int(bf16), out.data_ptr(), torch.get_num_threads())
    return out.view(tiles.shape[:-1]) if rc == 0 else None


def last_level_cache() -> int | None:
    """The CPU's largest cache in bytes (Linux sysfs), or None where it does not say. A server part's
    can hold a small model whole (300 MiB on a Sapphire Rapids VM): a step then reads cache, not memory."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        if text.rstrip("KMG").isdigit():
            sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=None)


def read_bandwidth(nbytes: int | None = None, rounds: int = 5) -> float | None:
    """The machine's read bandwidth in bytes/s as the products' thread team sees it (torch's thread
    count, OpenMP): the best of `rounds` passes over a buffer far past the caches (512 MiB, or four
    times the last-level cache where that is larger); None where the library is not built."""
    lib = library()
    if lib is None:
        return None
    nbytes = nbytes or max(1 << 29, 4 * (last_level_cache() or 0))
    buf = torch.ones(nbytes, dtype=torch.uint8)  # touched: its pages exist before the clock starts
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        lib.read_bytes(buf.data_ptr(), nbytes, torch.get_num_threads())
        best = min(best, time.perf_counter() - t)
    return nbytes / best

