"""The command line of a ridge subprocess: this interpreter, with the working directory kept
off sys.path. From a checkout's root the card's folders (kernels/, daemon/, ...) would
otherwise shadow PyPI packages of the same name, such as the `kernels` transformers imports."""
from __future__ import annotations

import sys


def python(*args: str) -> list[str]:
    """[python, -P, *args]; -P needs Python 3.11 (3.10 has no way short of -I, which drops the
    environment's PYTHONPATH too)."""
    safe = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe, *args]
