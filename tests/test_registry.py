"""One folder per architecture (issue 39).

Every family ridge runs is a package under ridge/models/, registered by one line in
ridge/models/registry.py. Its names (the model_type of its configs and of the checkpoints read
through it, the general.architecture of its GGUFs) are what code dispatches on, so they appear
as strings only in its folder and in the registry; quant/, which reads every family alike,
names none, not even in prose (llama.cpp, the program, aside). Docs and tests may name any."""
from __future__ import annotations

import ast
import re
from pathlib import Path
from importlib import import_module

from test_layers import ROOT, modules

from ridge.models.registry import FAMILIES, REGISTRY

MODELS = ROOT / "ridge" / "models"
# Strings equal to a family's name that are not that family: (file, name) -> what they are.
NOT_THE_ARCHITECTURE = {
    ("ridge/tokenizer.py", "llama"): "tokenizer.ggml.model's kind: a SentencePiece vocabulary",
    ("ridge/tokenizer.py", "qwen2"): "a tokenizer.ggml.pre pre-tokenizer, as llama.cpp names it",
    ("daemon/frontend/chat_format.py", "mistral"): "the tool-call format Mistral's chat templates write",
    ("daemon/frontend/chat_format.py", "gemma4"): "the tool-call format Gemma 4's chat templates write",
    ("daemon/frontend/harmony.py", "gpt-oss"): "prose in a refusal: the model whose chat format harmony is",
    ("ridge/bench/command.py", "llama"): "llama-server's completion API (--api llama)",
    ("ridge/bench/external.py", "llama"): "llama-server's completion API (--api llama)",
    ("ridge/bench/speculative.py", "llama"): "llama-server's completion API (--api llama)",
    ("ridge/bench/embeddings.py", "qwen3"): "a random checkpoint the benchmark writes, as tests do",
    ("ridge/bench/moe.py", "qwen3_moe"): "a random checkpoint the benchmark writes, as tests do",
    ("ridge/bench/moe.py", "qwen3"): "a random checkpoint the benchmark writes, as tests do",
    ("ridge/bench/window.py", "gemma3_text"): "a random checkpoint the benchmark writes, as tests do",
    ("ridge/bench/hybrid.py", "qwen3_5_text"): "a random checkpoint the benchmark writes, as tests do",
    ("ridge/bench/hybrid.py", "qwen3"): "a random checkpoint the benchmark writes, as tests do",
    ("ridge/bench/vision.py", "gemma3"): "a random checkpoint the benchmark writes, as tests do",
    ("ridge/bench/window.py", "gemma3"): "the benchmark's layer pattern, 5 sliding : 1 full",
}


def owners() -> dict[str, set[str]]:
    """Each family name -> the folders that may write it (llama.cpp writes two families as llama)."""
    out: dict[str, set[str]] = {}
    for folder in FAMILIES:
        spec = import_module(f"ridge.models.{folder}").SPEC
        names = {spec.arch, *(w.model_type for w in spec.hf_wrappers)}
        if spec.gguf is not None:
            names.add(spec.gguf.arch)
        for name in names:
            out.setdefault(name, set()).add(folder)
    return out


def _pattern(names) -> re.Pattern:
    alternatives = "|".join(sorted(map(re.escape, names), key=len, reverse=True))
    return re.compile(rf"(?<![\w-])({alternatives})(?![\w-]|\.cpp)")


def _strings(tree: ast.AST):
    """(line, text) of every string constant but docstrings."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for n in ast.walk(tree):
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs:
            yield n.lineno, n.value


def test_every_family_folder_is_registered_once():
    folders = {d.name for d in MODELS.iterdir() if (d / "__init__.py").is_file()} - {"layers"}
    assert folders == set(FAMILIES), f"folders {sorted(folders - set(FAMILIES))} unregistered, " \
                                     f"registered {sorted(set(FAMILIES) - folders)} missing"
    assert len(list(REGISTRY)) == len(FAMILIES) == len({s.arch for s in REGISTRY})


def test_a_family_is_named_only_in_its_folder_and_the_registry():
    own = owners()
    pattern = _pattern(own)
    found = []
    for name, path in sorted(modules().items()):
        rel = path.relative_to(ROOT).as_posix()
        if rel == "ridge/models/registry.py":
            continue
        folder = path.relative_to(MODELS).parts[0] if path.is_relative_to(MODELS) else None
        for line, text in _strings(ast.parse(path.read_text(), rel)):
            for arch in pattern.findall(text):
                if folder not in own[arch] and (rel, arch) not in NOT_THE_ARCHITECTURE:
                    found.append(f"{rel}:{line}: {arch!r} in {text!r}")
    assert not found, "a family's name outside its folder:\n" + "\n".join(found)


def test_quant_names_no_family_even_in_prose():
    pattern = _pattern(owners())
    found = [f"{path.relative_to(ROOT)}:{i}: {line.strip()}"
             for name, path in sorted(modules().items()) if name.startswith("ridge.quant")
             for i, line in enumerate(path.read_text().splitlines(), 1) if pattern.search(line)]
    assert not found, "quant/ names a family:\n" + "\n".join(found)


def test_the_rule_sees_a_name_outside_its_folder():
    """The scan itself: a string naming a family is found, prose and llama.cpp are not."""
    pattern = _pattern(owners())
    src = 'def f(cfg):\n    """qwen3_moe in a docstring"""\n    return cfg.arch == "qwen3_moe" or "llama.cpp"\n'
    hits = [(line, pattern.findall(text)) for line, text in _strings(ast.parse(src))]
    assert [(line, names) for line, names in hits if names] == [(3, ["qwen3_moe"])]


def test_every_package_is_in_the_wheel():
    """pyproject.toml lists the packages a wheel holds (the card's folders install under ridge.):
    a folder with an __init__.py that it leaves out works in an editable install and is missing
    from a built one."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    tool = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for name, folder in tool["package-dir"].items():
        for init in (root / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(root / folder)
            if "__pycache__" not in rel.parts and "csrc" not in rel.parts:
                found.add(".".join((name, *rel.parts)))
    assert found - listed == set(), f"pyproject.toml [tool.setuptools] packages lacks {sorted(found - listed)}"
