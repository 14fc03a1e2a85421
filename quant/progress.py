"""A progress bar for loading, shown only on a terminal."""
from __future__ import annotations

import sys

from tqdm import tqdm


def progress(items, desc: str, total: int | None = None, enabled: bool = True):
    show = enabled and sys.stderr.isatty()
    return tqdm(items, desc=desc, total=total, disable=not show, unit="tensor", leave=False, file=sys.stderr)
