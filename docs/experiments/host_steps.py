"""Host time of in-process decode steps at one stream on a tiny model (compute negligible): the
per-step cost of the engine's Python, tree ROOT (argv[1]) against another, same model file."""
import importlib.util
import statistics
import sys
import time

root, model = sys.argv[1], sys.argv[2]
spec = importlib.util.spec_from_file_location("ridge", f"{root}/ridge/__init__.py",
                                              submodule_search_locations=[f"{root}/ridge", root])
mod = importlib.util.module_from_spec(spec)
sys.modules["ridge"] = mod
spec.loader.exec_module(mod)
import torch  # noqa: E402
from ridge.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from ridge.engine.sampling_params import SamplingParams  # noqa: E402
from ridge.models.loader import load_model  # noqa: E402

torch.set_num_threads(1)
loaded = load_model(model, device="cpu", weights="fp32", use_cache=False, show_progress=False)
eng = LLMEngine(EngineConfig(device="cpu", kv_dtype="fp32", num_kv_blocks=256, max_num_seqs=16, prefill_chunk=64,
                             ridge_point=8.0, kv_disk=False, num_threads=1, adaptive_threads=False), loaded=loaded)
per = []
for rep in range(7):
    eng.add_request(f"r{rep}", list(range(5, 37)), SamplingParams(max_tokens=300, ignore_eos=True, stop=["zzzq"]))
    eng.step()  # the prefill
    t0, n = time.perf_counter(), 0
    while eng.has_unfinished():
        eng.step()
        n += 1
    per.append((time.perf_counter() - t0) / n * 1e6)
print(f"{root}: median {statistics.median(per):.1f} us a step ({', '.join(f'{p:.0f}' for p in per)})")
