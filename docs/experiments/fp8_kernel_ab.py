"""Two builds of ridge's e4m3 kernel source (kernels/csrc/fp8_linear.c) side by side in one
process, called in turn, so that a machine's drift between runs does not decide the ratio
(docs/benchmarks.md, issue 29). Each build is compiled as the engine compiles it; the best of
21 rounds of 20 calls is kept, per shape, row count and grouping.

    git show 69036cf:kernels/csrc/fp8_linear.c > /tmp/old.c
    python docs/experiments/fp8_kernel_ab.py /tmp/old.c kernels/csrc/fp8_linear.c 1 1,2,4 [isa]

isa: 1 the AVX2 path (the default), 2 the AVX-512 BF16 one.

Both builds are handed the scales by 16-column block (native.scale_blocks); a source from before
that layout reads them as [groups][N], which costs it nothing but which columns it scales."""
import ctypes
import subprocess
import sys
import time
from pathlib import Path

import torch

from ridge.kernels import native
from ridge.kernels.cpu_linear import pack_fp8

SRC = Path(native.__file__).with_name("csrc")


def build(source: str, i: int):
    so = f"/tmp/ridge-ab{i}.so"
    subprocess.check_call(["cc", *native.FLAGS, "-shared", "-I", str(SRC), "-o", so, source])
    lib = ctypes.CDLL(so)
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.fp8_linear_grouped.argtypes = [p, i64, i64, p, p, i64, i64, p, i32, i32]
    return lib


libs = [build(src, i) for i, src in enumerate(sys.argv[1:3])]
threads = int(sys.argv[3]) if len(sys.argv) > 3 else 1
rows = [int(a) for a in (sys.argv[4] if len(sys.argv) > 4 else "1,4").split(",")]
isa = int(sys.argv[5]) if len(sys.argv) > 5 else 1
torch.set_num_threads(threads)
torch.manual_seed(0)
for N, K in ((1536, 576), (576, 1536), (3072, 1024)):
    packed = pack_fp8((torch.randn(N, K) * 0.05).to(torch.float8_e4m3fn), torch.ones(N))
    for M in rows:
        x, y = torch.randn(M, K), torch.empty(M, N)
        line = f"{N}x{K} rows={M}:"
        for gk in (K, 32, 16):
            groups = -(-K // gk)
            s = native.scale_blocks(torch.rand(groups, N) * 0.01 + 0.01) if gk < K else torch.rand(N) * 0.01 + 0.01
            best = [float("inf")] * 2
            for _ in range(21):
                for j, lib in enumerate(libs):
                    t = time.perf_counter()
                    for _ in range(20):
                        lib.fp8_linear_grouped(x.data_ptr(), M, K, packed.data_ptr(), s.data_ptr(), N, gk,
                                               y.data_ptr(), isa, threads)
                    best[j] = min(best[j], (time.perf_counter() - t) / 20)
            line += f"  {'channel' if gk == K else f'1x{gk}'} {best[0] * 1e6:.0f} / {best[1] * 1e6:.0f} us"
        print(line, flush=True)
