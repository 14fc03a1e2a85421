"""Start-up on CPU: the products of the model's linear layers (e4m3 weights: ridge's streaming
kernel or the blocked product; weights never quantized: fp32 or bf16 copies), chosen in
kernels/cpu_linear_plan.py (which measures them and decides per matrix shape and step size),
and the process's allocator setting that a CPU step depends on."""
from __future__ import annotations

from ridge.kernels import cpu_linear_plan
from ridge.kernels.cpu_linear import CpuLinear
from ridge.quant.experts import FP8Experts
from ridge.quant.linear import FP8Linear


def cpu_layers(model) -> list[CpuLinear]:
    """Every linear layer's CPU weight, the tied head's too (its bytes are the embedding's), and
    each expert's two products in a mixture of experts (an expert's product sees the rows routed
    to it, so its formats are chosen by row count as a dense layer's are by step size)."""
    return [m.cpu_weights() for m in model.modules() if isinstance(m, FP8Linear) and m.weight.numel()] + \
        [c for m in model.modules() if isinstance(m, FP8Experts) for c in m.cpu_weights()]


def choose_cpu_format(model, weight_bytes: int, mode: str = "auto", max_tokens: int = 64,
                      max_head_rows: int = 64, amx: str = "off") -> int:
    """Let kernels choose each layer's CPU formats (amx: the steps whose blocked product may run on
    AMX, activations rounded to bf16: off, decode or all); -> the largest step size that runs bf16 anywhere (0 = none;
    always on a GPU, whose FP8 weights have no CPU formats)."""
    if model.cos_sin.device.type != "cpu":
        return 0
    return cpu_linear_plan.choose(cpu_layers(model), (model.lm_head.out_features, model.lm_head.in_features), weight_bytes, mode,
                                  max_tokens, max_head_rows, amx)


class CpuFormats:
    """A CPU model's two sets of layer formats: the fastest per step size (as choose_cpu_format left
    them when this was made) and the batch-invariant ones (kernels' choose_invariant: one product
    per matrix, the same bits for a row at any row count), made on first need. A step runs one set
    (use); the engine asks for the invariant one while a deterministic request is in the step.
    Engines that share a loaded model (tests, benchmarks) each set their own before every step.
    Nothing on a GPU."""

    def __init__(self, model, max_tokens: int, max_head_rows: int, deterministic: bool):
        self.layers = cpu_layers(model) if model.cos_sin.device.type == "cpu" else []
        self.head_shape = (model.lm_head.out_features, model.lm_head.in_features)
        self.max_tokens, self.max_head_rows = max_tokens, max_head_rows
        self.sets: dict[bool, list[tuple]] = {False: [self._state(m) for m in self.layers]}
        if deterministic:
            self.use(True)

    @staticmethod
    def _state(layer: CpuLinear) -> tuple:
        return layer.bounds, layer.runs, layer.kinds, layer.copies, layer.bf16_tiles

    def use(self, invariant: bool) -> None:
        want = self.sets.get(invariant)
        if not self.layers or (want is not None and self.layers[0].runs is want[0][1]):
            return  # on already (a set's runs lists are its own objects)
        if want is None:  # made once, on the first step that needs it
            cpu_linear_plan.choose_invariant(self.layers, self.head_shape, self.max_tokens, self.max_head_rows)
            self.sets[invariant] = [self._state(m) for m in self.layers]
            return
        for m, state in zip(self.layers, want):
            m.bounds, m.runs, m.kinds, m.copies, m.bf16_tiles = state


def invariant_unavailable(device) -> str | None:
    """Why this device cannot run steps batch-invariant (None: it can): kernels decide."""
    return cpu_linear_plan.invariant_unavailable(device)


def fp8_max_tokens(model) -> int:
    """The largest step size any layer runs through the e4m3 kernel (0 = none)."""
    if model.cos_sin.device.type != "cpu":
        return 0
    return cpu_linear_plan.fp8_max_tokens(cpu_layers(model))


def keep_freed_memory() -> bool:
    """Make glibc keep freed buffers up to 32 MiB mapped instead of returning them to the
    kernel. A decode step allocates and frees the same few-MiB activations and gathered K/V
    every layer; by default each comes back as fresh pages, so every step pays a page fault
    per 4 KiB touched (SmolLM2 at batch 64: gathering K/V took 5.1 ms a layer against 1.2 ms
    with this). Process-wide and idempotent; False where libc is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 256 << 20))
