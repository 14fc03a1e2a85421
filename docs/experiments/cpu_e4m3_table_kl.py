"""KL / top-1 against fp32 of the engine's CPU model (every weight e4m3, the table and head too),
issue 39: python -P docs/experiments/cpu_e4m3_table_kl.py [absmax|mse] (the table's scale rule)."""
import sys, time, torch
import torch.nn.functional as F
from pathlib import Path
torch.set_num_threads(2)
from ridge.models.registry import convert
from ridge.models.loader import load_model
from ridge.models.registry import model_class
from ridge.models.oneshot import prompt_logits
import ridge.quant.embedding as emb
from ridge.quant.fp8 import quantize_fp8

def agreement(lg, ref):
    top1 = (lg.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = F.kl_div(lg.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()
    return top1, kl

conv = convert(quantize=False, use_cache=False, show_progress=False)
with torch.device("meta"):
    ref_model = model_class(conv.config)(conv.config)
ref_model.load_weights(conv.state_dict, torch.device("cpu"), torch.float32, conv.freq_factors)
texts = {n: conv.tokenizer.encode(Path(f"tests/data/eval_{n}.txt").read_text()) for n in ("text", "code")}
refs = {n: prompt_logits(ref_model, ids) for n, ids in texts.items()}
rule = sys.argv[1] if len(sys.argv) > 1 else "absmax"
if rule != "absmax":
    orig = emb.quantize_fp8
    emb.quantize_fp8 = lambda w, r, g: orig(w, rule, g)
t = time.time()
lm = load_model(device="cpu", show_progress=False)
print("load", round(time.time() - t, 1), "s; weight bytes", lm.weight_bytes, type(lm.model.embed_tokens).__name__)
for n, ids in texts.items():
    print(rule, n, len(ids), "top1 %.4f KL %.5f" % agreement(prompt_logits(lm.model, ids), refs[n]))
