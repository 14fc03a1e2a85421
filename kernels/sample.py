"""The index of each row's largest value: a greedy token (the sampler's argmax, and the
exponential race's over p / E).

    argmax(x [R, V] fp32) -> [R] int64

torch.argmax's rule: the first of equal maxima, a row's first NaN where it has one. argmax_ref
is torch's own; argmax_native ridge's C kernel (kernels/csrc/small_ops.c, argmax_rows): rows
shared by the thread team, 16 lanes a step. torch's CPU argmax reads a 64 x 49,152 block in
2.2-2.4 ms on the 2-vCPU VM of docs/benchmarks.md (torch.max's indices in 1.3-1.6): a few
percent of a 64-row decode step."""
from __future__ import annotations

import torch

from . import native


def argmax_ref(x: torch.Tensor) -> torch.Tensor:
    return x.argmax(dim=-1)


def native_fits(x: torch.Tensor) -> bool:
    """Whether argmax_native takes x: the library built, fp32 rows of contiguous columns."""
    return (native.library() is not None and x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] > 0
            and x.shape[1] > 0 and x.stride(1) == 1)


def argmax_native(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = native.library().argmax_rows(x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(),
                                      torch.get_num_threads())
    assert rc == 0, "argmax_rows refused a call native_fits took"
    return out
