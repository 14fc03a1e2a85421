"""On-disk cache of converted models, so a second start skips parsing and quantization.

The key is the source's path, size and modification time plus the quantizer's
version and options: hashing a many-GB file on every start would defeat it."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .fp8 import QUANT_VERSION

FORMAT = 2  # 2: ModelConfig gained the per-family fields (issue 25); older entries lack them


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "ridge" / "models"


def _fingerprint(src: Path) -> list:
    files = [src] if src.is_file() else sorted(p for p in src.iterdir() if p.is_file())
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def cache_key(src: Path, options: dict) -> str:
    blob = json.dumps({"src": _fingerprint(src), "quant": QUANT_VERSION, "format": FORMAT, "options": options},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def load(key: str) -> tuple[dict, dict[str, torch.Tensor]] | None:
    """-> (meta, tensors) or None on a miss or an unreadable entry."""
    from safetensors.torch import load_file

    d = cache_root() / key
    try:
        meta = json.loads((d / "meta.json").read_text())
        return meta, load_file(str(d / "weights.safetensors"))
    except (OSError, ValueError):
        return None


def save(key: str, meta: dict, tensors: dict[str, torch.Tensor]) -> Path:
    """Written to a temporary folder and renamed, so a crash never leaves half an entry."""
    from safetensors.torch import save_file

    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    try:
        seen: set[int] = set()
        flat = {}
        for name, t in tensors.items():  # safetensors refuses shared storage
            ptr = t.untyped_storage().data_ptr()
            flat[name] = t.contiguous().clone() if ptr in seen else t.contiguous()
            seen.add(ptr)
        save_file(flat, str(tmp / "weights.safetensors"))
        (tmp / "meta.json").write_text(json.dumps(meta))
        final = root / key
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
