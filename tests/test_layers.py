"""The import layers, read from the source (every import, inside functions too).

Low to high: kernels < quant, cache < models < engine < daemon < bench, tui < cli.
A package imports only from layers below it; ridge/config.py, tokenizer.py,
plan.py, options.py and errors.py are shared low-level modules that import only each
other. So no package imports one above it and the package graph has no cycle;
only the CLI imports ridge.bench. tui talks to the daemon's protocol and never
reaches torch; nothing outside tui imports textual. The HTTP gateway
(daemon/gateway) is a protocol client too: it never reaches the engine."""
from __future__ import annotations

import ast
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
    "ridge.errors": SHARED,
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
    "ridge.kernels.cpu_linear": {"CpuLinear", "pack_fp8"},  # a layer's CPU weight, its e4m3 bytes packed at load
    "ridge.kernels.cpu_linear_plan": {"choose", "fp8_max_tokens"},  # the start-up measurement, and its result
}


def kernel_uses(name: str) -> set[tuple[str, str]]:
    """(kernels module, name) for every name `name` takes from ridge.kernels: imported from a
    module, or read as an attribute of a module it imported."""
    path = modules()[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    aliases, uses = {}, set()
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom):
            base = from_base(n, package)
            for a in n.names:
                if f"{base}.{a.name}" in modules() and base.startswith("ridge.kernels"):
                    aliases[a.asname or a.name] = f"{base}.{a.name}"
                elif base.startswith("ridge.kernels"):
                    uses.add((base, a.name))
        elif isinstance(n, ast.Import):
            for a in n.names:
                if a.name.startswith("ridge.kernels."):
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


def test_the_seam_rule_sees_a_backend_reached_from_outside(tmp_path):
    """The scan itself: a product module taking a CPU backend or the C library by either import form."""
    src = ("from ridge.kernels.attention import paged_attention_ref\n"
           "from ridge.kernels import native, ops\n"
           "def f(x):\n    return native.library(), ops.rms_norm, native.start_build\n")
    fake = "ridge.models._seam_probe"
    path = tmp_path / "probe.py"
    path.write_text(src)
    modules()[fake] = path
    try:
        assert kernel_uses(fake) == {("ridge.kernels.attention", "paged_attention_ref"),
                                     ("ridge.kernels.native", "library"), ("ridge.kernels.native", "start_build"),
                                     ("ridge.kernels.ops", "rms_norm")}
    finally:
        del modules()[fake]
