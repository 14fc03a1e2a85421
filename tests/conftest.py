import os
import shutil
import sys
from pathlib import Path

# The Triton interpreter must be chosen before the first `import triton`
# (machine-facts: set later, tl.sum fails outside a kernel scope).
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests never touch the user's cache of converted models, nor the user's KV tiers.
os.environ.setdefault("XDG_CACHE_HOME", str(Path(__file__).resolve().parent.parent / ".pytest_cache" / "xdg-cache"))
# The converted models are kept between runs; the disk KV tier's blocks are not.
shutil.rmtree(Path(os.environ["XDG_CACHE_HOME"]) / "ridge" / "kv", ignore_errors=True)
sys.path.insert(0, str(Path(__file__).resolve().parent))
# The card's folders (kernels/, daemon/, quant/, cache/, tui/) are reachable only as ridge.*: no
# subprocess a test starts from the repository root may put it on sys.path, where `kernels/`
# shadows the PyPI package transformers imports (`make test` runs pytest under -P likewise).
os.environ["PYTHONSAFEPATH"] = "1"

import torch  # noqa: E402

# Under pytest-xdist (`make test` runs a worker per core) the workers share the cores: each
# gets its part, so two workers on two cores do not each start a two-thread team.
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _workers)))
