"""The import layers, read from the source (every import, inside functions too).

Low to high: kernels < quant, cache < models < engine < daemon < bench, tui < cli.
A package imports only from layers below it; ridge/config.py, tokenizer.py,
plan.py, options.py, errors.py, durations.py and request.py are shared low-level modules that import only each
other. So no package imports one above it and the package graph has no cycle;
only the CLI imports ridge.bench. tui talks to the daemon's protocol and never
reaches torch; nothing outside tui imports textual. The HTTP gateway
(daemon/gateway) is a protocol client too: it never reaches the engine."""
from __future__ import annotations

import ast
from contextlib import contextmanager
from functools import cache
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
SHARED = 0
LAYERS = {
    "ridge.config": SHARED, "ridge.tokenizer": SHARED, "ridge.plan": SHARED, "ridge.options": SHARED,
    "ridge.errors": SHARED, "ridge.spawn": SHARED, "ridge.template_sandbox": SHARED, "ridge.durations": SHARED,
    "ridge.request": SHARED, "ridge.vision": SHARED,
    "ridge.kernels": 1,
    "ridge.quant": 2, "ridge.cache": 2,
    "ridge.models": 3,
    "ridge.engine": 4,
    "ridge.daemon": 5,
    "ridge.bench": 6, "ridge.tui": 6,
    "ridge.cli": 7,
}


@cache
def modules() -> dict[str, Path]:
    """Import name -> file, through pyproject's package-dir (daemon/ is ridge.daemon, ...)."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    out = {}
    for pkg, folder in dirs.items():
        base = ROOT / folder
        for f in base.rglob("*.py"):
            parts = pkg.split(".") + list(f.relative_to(base).with_suffix("").parts)
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out.setdefault(name, f)  # ridge/daemon does not exist; the mapped folder wins anyway
    return out


def from_base(node: ast.ImportFrom, package: str) -> str:
    """The absolute module a `from ... import` reads from, relative imports resolved in package."""
    if not node.level:
        return node.module or ""
    parts = package.split(".")
    return ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))


@cache
def imports(name: str) -> frozenset[str]:
    """Every module `name` imports, absolute, at module level or in a function."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = from_base(node, package)
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules())
    return frozenset(out)


def node(name: str) -> str | None:
    """A module's layer node: its package under ridge (ridge.engine.speculative.x -> ridge.engine), or a top module."""
    parts = name.split(".")
    if parts[0] != "ridge" or len(parts) < 2:
        return None
    return ".".join(parts[:2])


def edges() -> dict[tuple[str, str], list[str]]:
    """(from node, to node) -> the modules that make the edge."""
    out: dict[tuple[str, str], list[str]] = {}
    for name in modules():
        src = node(name)
        for target in imports(name):
            dst = node(target)
            if src and dst and dst != src:
                out.setdefault((src, dst), []).append(f"{name} -> {target}")
    return out


def test_every_module_has_a_layer():
    missing = {node(m) for m in modules() if node(m) not in LAYERS and m != "ridge"}
    assert not missing, f"give these a layer in tests/test_layers.py: {sorted(missing)}"


def test_imports_only_go_down():
    bad = [why for (src, dst), whys in edges().items()
           if not (LAYERS[dst] < LAYERS[src] or LAYERS[src] == LAYERS[dst] == SHARED) for why in whys]
    assert not bad, "imports that go up or sideways:\n" + "\n".join(sorted(bad))


def test_no_cycle_between_packages():
    graph: dict[str, set[str]] = {}
    for src, dst in edges():
        graph.setdefault(src, set()).add(dst)

    def on_cycle(start: str) -> bool:
        seen, todo = set(), list(graph.get(start, ()))
        while todo:
            n = todo.pop()
            if n == start:
                return True
            if n not in seen:
                seen.add(n)
                todo += graph.get(n, ())
        return False
    cycles = sorted(n for n in graph if on_cycle(n))
    assert not cycles, f"packages on an import cycle: {cycles}"


def reach(start: list[str]) -> set[str]:
    """Every module of ours that `start` imports, directly or not."""
    seen, todo = set(), list(start)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += [t for t in imports(m) if t in modules()]
    return seen


def test_tui_never_reaches_torch_and_only_tui_imports_textual():
    tui = reach([m for m in modules() if node(m) == "ridge.tui"])
    heavy = sorted(f"{m} -> {t}" for m in tui for t in imports(m) if t.split(".")[0] in ("torch", "triton"))
    assert not heavy, "ridge.tui reaches torch through:\n" + "\n".join(heavy)
    textual = sorted(m for m in modules() if node(m) != "ridge.tui"
                     and any(t.split(".")[0] == "textual" for t in imports(m)))
    assert not textual, f"textual outside ridge.tui: {textual}"


def test_the_gateway_is_a_protocol_client_only():
    """daemon/gateway speaks the ZeroMQ protocol: it never reaches the engine, the models or torch."""
    gateway = reach([m for m in modules() if m.startswith("ridge.daemon.gateway")])
    bad = sorted(f"{m} -> {t}" for m in gateway for t in imports(m)
                 if t.split(".")[0] in ("torch", "triton") or node(t) in ("ridge.engine", "ridge.models",
                                                                          "ridge.kernels", "ridge.quant", "ridge.cache"))
    assert not bad, "the gateway reaches the engine through:\n" + "\n".join(bad)


# kernels/ decides every implementation, per device and per shape (kernels/ops.py; the CPU weight
# formats in kernels/cpu_linear_plan.py). Outside it, code reaches kernels only through these
# names; None: any name of the module. ridge.bench is exempt: benchmarks compare implementations
# on purpose (native.off(), formats forced per layer).
KERNEL_ENTRIES = {
    "ridge.kernels.ops": None,  # the dispatch itself
    "ridge.kernels.metadata": {"AttentionMetadata"},
    "ridge.kernels.timing": None,
    "ridge.kernels.cuda_graph": None,  # capture and replay, whatever kernels a step runs
    "ridge.kernels.native": {"start_build"},  # the C kernels start compiling with the engine
    # a layer's CPU weight, its e4m3 bytes packed at load; the runner's word that a step has no prompt rows
    "ridge.kernels.cpu_linear": {"CpuLinear", "pack_fp8", "decode_step"},
    # the start-up measurement, its result, and the batch-invariant formats (deterministic mode)
    "ridge.kernels.cpu_linear_plan": {"choose", "fp8_max_tokens", "choose_invariant", "invariant_unavailable"},
    "ridge.kernels.moe": {"CpuExperts"},
    "ridge.kernels.decoder_native": {"LayerSpec", "MoeSpec"},  # what a model says its layers are, for the one-call CPU path  # a mixture of experts' CpuLinear per expert product, held as FP8Linear's
    "ridge.kernels.fp8_scales": None,  # the FP8 scale layouts: data the converter writes and every product reads
    "ridge.kernels.fp8_search": {"search_scale"},  # the converter's scale search, C or torch as kernels choose
}


def kernel_uses(name: str, prefix: str = "ridge.kernels") -> set[tuple[str, str]]:
    """(module, name) for every name `name` takes from the package `prefix` (ridge.kernels):
    imported from a module, or read as an attribute of a module it imported."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    aliases, uses = {}, set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            base = from_base(n, package)
            for a in n.names:
                if f"{base}.{a.name}" in modules() and base.startswith(prefix):
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif base.startswith(prefix):
                    uses.add((base, a.name))
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith(prefix + "."):
                    if a.asname:
                        aliases[a.asname] = a.name
                    else:
                        uses.add((a.name, "*"))
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in aliases:
            uses.add((aliases[n.value.id], n.attr))
    return uses


def test_only_kernels_decides_an_implementation():
    """No module outside kernels/ picks a kernel: none reaches a backend (a *_ref, *_cpu,
    *_triton or *_native function, the C library, Triton), only the entry points above."""
    bad = sorted(f"{m} -> {mod}.{attr}" for m in modules()
                 if node(m) not in ("ridge.kernels", "ridge.bench") and m != "ridge"
                 for mod, attr in kernel_uses(m)
                 if KERNEL_ENTRIES.get(mod, set()) is not None and attr not in KERNEL_ENTRIES.get(mod, set()))
    assert not bad, "implementation choices outside kernels/:\n" + "\n".join(bad)
    triton = sorted(m for m in modules() if node(m) != "ridge.kernels"
                    and any(t.split(".")[0] == "triton" for t in imports(m)))
    assert not triton, f"triton outside kernels/: {triton}"


@contextmanager
def probe_module(tmp_path, name: str, src: str):
    """A module of ours, for the scans, that exists only within the block."""
    path = tmp_path / "probe.py"
    path.write_text(src)
    modules()[name] = path
    try:
        yield name
    finally:
        del modules()[name]


def test_the_seam_rule_sees_a_backend_reached_from_outside(tmp_path):
    """The scan itself: a product module taking a CPU backend or the C library by either import form."""
    src = ("from ridge.kernels.attention import paged_attention_ref\n"
           "from ridge.kernels import native, ops\n"
           "def f(x):\n    return native.library(), ops.rms_norm, native.start_build\n")
    with probe_module(tmp_path, "ridge.models._seam_probe", src) as fake:
        assert kernel_uses(fake) == {("ridge.kernels.attention", "paged_attention_ref"),
                                     ("ridge.kernels.native", "library"), ("ridge.kernels.native", "start_build"),
                                     ("ridge.kernels.ops", "rms_norm")}


def _device_tests(tree: ast.AST) -> int:
    """Branches on the device: `.is_cuda`, `X.type == "cuda"` (or "cpu", either operator) and
    `torch.cuda.is_available()`."""
    n = 0
    for t in ast.walk(tree):
        if isinstance(t, ast.Attribute) and t.attr == "is_cuda":
            n += 1
        elif isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], (ast.Eq, ast.NotEq)):
            sides = (t.left, t.comparators[0])
            if (any(isinstance(s, ast.Attribute) and s.attr == "type" for s in sides)
                    and any(isinstance(s, ast.Constant) and s.value in ("cuda", "cpu") for s in sides)):
                n += 1
        elif isinstance(t, ast.Call) and ast.unparse(t.func) == "torch.cuda.is_available":
            n += 1
    return n


# Code outside kernels/ that branches on the device, and why no branch there picks a kernel. A
# module that starts to branch on the device must move the choice into kernels/ops.py (as
# ops.kv_dtype, ops.keeps_fp8 and ops.compute_dtype did) or be listed here with its reason.
DEVICE_BRANCHES = {
    "ridge.plan": "which devices the machine has, for the plan's report",
    "ridge.models.loader": "the default device",
    "ridge.engine.builder": "the default device, a GPU engine's host threads, the CPU allocator and threads, overlap's default",
    "ridge.engine.runner": "CUDA graphs' default (capture exists on CUDA only)",
    "ridge.engine.graphs": "the graph pool exists on CUDA only",
    "ridge.engine.sizing": "memory: a GPU's free bytes, RAM on CPU",
    "ridge.engine.budget": "the ridge point: a GPU's from its table, a CPU's by measurement",
    "ridge.engine.stats": "free memory, as sizing",
    "ridge.engine.sampler": "pinned host copies of a GPU's samples",
    "ridge.engine.sampler_keys": "pinned host copies of small per-request lists queued to a GPU",
    "ridge.engine.step_batch": "pinned staging on a GPU; on CPU the staging buffer is the device buffer",
    "ridge.engine.structured.step": "pinned token masks on a GPU",
    "ridge.engine.cpu_format": "CPU weight formats exist on CPU only (kernels/cpu_linear_plan.py chooses them)",
    "ridge.cache.block_io": "block copies: CUDA streams or host memcpy",
    "ridge.cache.tiers": "a pinned host tier beside a GPU",
    "ridge.cache.kv_cache": "a CPU pool zeroed lazily through calloc",
    "ridge.daemon.frontend.memory": "memory budgets (a GPU's, RAM on CPU) and parked weights: pinned host copies of a GPU's",
}


def test_device_branches_outside_kernels_are_not_kernel_choices():
    """The other half of the rule: a branch on the device outside kernels/ is where a kernel
    choice would creep back (`x.is_cuda` and a torch path beside the op). Only the modules listed
    above branch on it, each for a reason that is not a kernel, and every one listed still does."""
    found = {m for m in modules() if node(m) not in ("ridge.kernels", "ridge.bench", "ridge.tui")
             and _device_tests(ast.parse(modules()[m].read_text()))}
    assert not found - DEVICE_BRANCHES.keys(), (
        "device branches outside kernels/ (move the choice into kernels/ops.py, or list the module "
        f"in DEVICE_BRANCHES with why it is not a kernel choice): {sorted(found - DEVICE_BRANCHES.keys())}")
    assert not DEVICE_BRANCHES.keys() - found, f"listed but no longer branching: {sorted(DEVICE_BRANCHES.keys() - found)}"


# Inside kernels/, the modules offer implementations and ops.py chooses: only a predicate (fits,
# native_fits) or a C wrapper (*_native) reaches the C library, and only ops calls a predicate.
# native.py is the library; cpu_linear.py and cpu_linear_plan.py are the CPU weight formats,
# measured at start-up and held per layer (ops.fp8_linear runs the one a layer holds).
CHOOSERS = {"ridge.kernels.ops", "ridge.kernels.native", "ridge.kernels.cpu_linear", "ridge.kernels.cpu_linear_plan"}
PREDICATES = {"fits", "native_fits"}


def _library_reads(tree: ast.AST) -> list[str]:
    """The function (outermost) around every read of `native.library`, '<module>' outside one."""
    out = []

    def visit(n: ast.AST, fn: str) -> None:
        for child in ast.iter_child_nodes(n):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn == "<module>" else fn
            if isinstance(child, ast.Attribute) and child.attr == "library" and ast.unparse(child.value) == "native":
                out.append(name)
            visit(child, name)
    visit(tree, "<module>")
    return out


def _predicate_calls(tree: ast.AST) -> int:
    return sum(isinstance(n, ast.Call) and (getattr(n.func, "attr", None) or getattr(n.func, "id", None)) in PREDICATES
               for n in ast.walk(tree))


def test_only_ops_chooses_inside_kernels():
    bad = []
    for m in modules():
        if node(m) != "ridge.kernels" or m in CHOOSERS:
            continue
        tree = ast.parse(modules()[m].read_text())
        bad += [f"{m}.{fn} reaches the C library" for fn in _library_reads(tree)
                if fn not in PREDICATES and not fn.endswith("_native")]
        if _predicate_calls(tree):
            bad.append(f"{m} asks a backend whether it fits (ops.py's choice)")
    assert not bad, "\n".join(bad)


def test_the_kernels_rule_sees_a_module_choosing_its_backend():
    """The scan itself, on the shape this rule replaced: a CPU path that picks C or torch inside."""
    src = ("from . import native\n"
           "def native_fits(x):\n    return native.library() is not None\n"
           "def norm_native(x):\n    return native.library().rms_norm(x)\n"
           "def norm_cpu(x):\n    lib = native.library()\n    return norm_native(x) if native_fits(x) else x\n")
    tree = ast.parse(src)
    assert _library_reads(tree) == ["native_fits", "norm_native", "norm_cpu"]
    assert _predicate_calls(tree) == 1
    assert _device_tests(ast.parse("a = x.is_cuda\nb = d.type != 'cpu'\nc = torch.cuda.is_available()\n"
                                   "d = x.type == 'gguf'\n")) == 3


# Speculative decoding and structured output are one folder each: code outside the folder takes
# only these names from it, its hook interface (the package docstrings, docs/architecture.md).
# ridge.bench is exempt: benchmarks time the pieces on their own.
SEAMS = {
    "ridge.engine.speculative": {
        "Speculator", "SpeculationPlan", "plan_speculation", "build_speculator",
        "SpeculativeConfig",  # EngineConfig parses --speculative when it is built
        "Verified",  # the verify hook's result, held by the step it belongs to until it is read
    },
    "ridge.engine.structured": {
        "Constraints",
        "parse_response_format",  # SamplingParams checks a response_format's shape when it is built
        "GrammarCompiler",  # the daemon's validator compiles with the engine's compiler (engine.grammars)
        # the daemon's chat grammar (daemon/chat_grammar.py) writes JSON as structured output does and
        # embeds a response_format after the thinking
        "JSON_WHITESPACE", "named_grammars",
    },
}


def test_speculation_and_constraints_are_reached_through_their_hooks():
    """Nothing outside engine/speculative/ reads its policy, proposers or verification, and
    nothing outside engine/structured/ its masks or matchers' rules: a new hook point is a new
    method of the Speculator or of Constraints, called by name."""
    bad = sorted(f"{m} -> {mod}.{attr}" for folder, allowed in SEAMS.items() for m in modules()
                 if not m.startswith(folder) and node(m) != "ridge.bench"
                 for mod, attr in kernel_uses(m, folder) if attr not in allowed)
    assert not bad, "reached past the hook interface:\n" + "\n".join(bad)


def test_the_hook_rule_sees_a_concern_reached_past_its_interface(tmp_path):
    """The scan itself, on the wiring the hooks replaced: the scheduler holding the policy, the
    runner calling the mask function, relative imports resolved."""
    src = ("from .speculative.policy import SpecPolicy\n"
           "from .structured import step\n"
           "from .structured import Constraints\n"
           "def f(out):\n    return step.step_masks(out), SpecPolicy\n")
    with probe_module(tmp_path, "ridge.engine._hook_probe", src) as fake:
        assert kernel_uses(fake, "ridge.engine.speculative") == {("ridge.engine.speculative.policy", "SpecPolicy")}
        assert kernel_uses(fake, "ridge.engine.structured") == {("ridge.engine.structured", "Constraints"),
                                                                ("ridge.engine.structured.step", "step_masks")}
