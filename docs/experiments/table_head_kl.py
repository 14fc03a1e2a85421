"""The table and head of SmolLM2 (g16+act, widened to fp32) replaced by each 8-bit format: KL and top-1 against fp32
(docs/benchmarks.md, issue 39 part 4). Run: python -P docs/experiments/table_head_kl.py [case ...]."""
import sys, torch
from pathlib import Path
from ridge.models.registry import convert
from ridge.models.fp8_calibrate import build, calibrate
from ridge.models.oneshot import prompt_logits
from ridge.bench.accuracy import agreement, _model, EVAL_TEXTS
from ridge.quant.fp8 import quantize_fp8, FP8
from ridge.kernels.fp8_scales import dequantize
torch.set_num_threads(2)
conv = convert(None, quantize=False, use_cache=False, show_progress=False)
chosen = convert(None, calibrate=calibrate, show_progress=False)
print("recipe", chosen.recipe)
texts = {Path(t).stem: conv.tokenizer.encode(Path(t).read_text()) for t in EVAL_TEXTS}
ref = _model(conv, conv.state_dict)
refs = {n: prompt_logits(ref, ids) for n, ids in texts.items()}
m = build(conv.config, chosen.state_dict, conv.freq_factors)
table = conv.state_dict["embed_tokens.weight"].float()
def int8(w, g):
    r, k = w.shape
    x = w.view(r, k // g, g)
    s = x.abs().amax(-1, keepdim=True) / 127
    s = s.to(torch.bfloat16).float()  # bf16 scales
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = (x / s).round().clamp(-127, 127)
    return (q * s).view(r, k)
def e4m3(w, g):
    q, s = quantize_fp8(w, "mse", f"g{g}")
    return dequantize(q, s, torch.float32)
cases = {"wide": table, "int8 g32": int8(table, 32), "int8 g64": int8(table, 64), "int8 row": int8(table, table.shape[1]), "e4m3 g16": e4m3(table, 16)}
if len(sys.argv) > 1: cases = {k: v for k, v in cases.items() if k in sys.argv[1:]}
for name, w in cases.items():
    m.embed_tokens.weight.data.copy_(w)
    m.lm_head.weight = m.embed_tokens.weight.data
    row = {n: agreement(prompt_logits(m, ids), refs[n]) for n, ids in texts.items()}
    print(name, {n: (round(a["kl"], 5), round(a["top1"], 4)) for n, a in row.items()}, flush=True)
