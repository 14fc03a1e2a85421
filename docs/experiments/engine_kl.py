"""KL of the model the engine loads on this CPU (default recipe: e4m3 layers, int8 table/head) against fp32."""
import torch
from pathlib import Path
from ridge.models.registry import convert
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.bench.accuracy import agreement, _model, EVAL_TEXTS
torch.set_num_threads(2)
conv = convert(None, quantize=False, use_cache=False, show_progress=False)
texts = {Path(t).stem: conv.tokenizer.encode(Path(t).read_text()) for t in EVAL_TEXTS}
ref = _model(conv, conv.state_dict)
refs = {n: prompt_logits(ref, ids) for n, ids in texts.items()}
for recipe in (None, "g16+act+head"):
    lm = load_model(None, device="cpu", recipe=recipe, show_progress=False)
    print(recipe or "default", type(lm.model.embed_tokens).__name__, getattr(getattr(lm.model.embed_tokens, "cpu", None), "code", "-"),
          f"{lm.model.weight_bytes() / sum(t.numel() for n, t in conv.state_dict.items()):.3f} B/param",
          {n: (round(a["kl"], 5), round(a["top1"], 4)) for n, a in ((n, agreement(prompt_logits(lm.model, ids), refs[n])) for n, ids in texts.items())}, flush=True)
