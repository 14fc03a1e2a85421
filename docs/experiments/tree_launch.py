"""Run ridge's CLI from a source tree ROOT (its folders mapped under `ridge` as pyproject's package-dir does)."""
import importlib.util
import sys

root = sys.argv.pop(1)
spec = importlib.util.spec_from_file_location("ridge", f"{root}/ridge/__init__.py",
                                              submodule_search_locations=[f"{root}/ridge", root])
mod = importlib.util.module_from_spec(spec)
sys.modules["ridge"] = mod
spec.loader.exec_module(mod)
from ridge.cli import main  # noqa: E402

import ridge.engine.engine as e; print("engine from", e.__file__, file=sys.stderr); sys.exit(main())
