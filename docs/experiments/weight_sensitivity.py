"""Every decoder linear weight's share of the FP8 error: the KL from fp32 on the calibration
text's first 256 tokens with that weight alone quantized (MSE scales), for each grouping given
(docs/benchmarks.md, issue 29).

    python docs/experiments/weight_sensitivity.py channel,g16"""
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import cal, ref, sd  # noqa: E402

from ridge.models.fp8_calibrate import sensitivity  # noqa: E402
from ridge.quant.recipe import short_name  # noqa: E402

for g in (sys.argv[1] if len(sys.argv) > 1 else "channel").split(","):
    t = time.time()
    s = {short_name(k): v for k, v in sensitivity(ref, sd, cal[:256], g).items()}
    total, top = sum(s.values()), sorted(s.items(), key=lambda kv: -kv[1])
    kinds = {}
    for k, v in s.items():
        kinds[k.split(".")[1]] = kinds.get(k.split(".")[1], 0) + v
    print(f"{g}: {len(s)} weights in {time.time() - t:.0f} s, sum of KLs {total:.5f}")
    print("  largest:", ", ".join(f"{k} {v:.2e} ({v / total:.1%})" for k, v in top[:10]))
    print("  top 2 / 8 / 16:", " / ".join(f"{sum(v for _, v in top[:n]) / total:.1%}" for n in (2, 8, 16)))
    print("  by kind:", ", ".join(f"{k} {v / total:.0%}" for k, v in kinds.items()))
