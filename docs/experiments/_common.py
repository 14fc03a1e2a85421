"""Shared set-up of the FP8 experiments here: the embedded SmolLM2 in fp32 (the reference), the
two evaluation texts and the calibration text, and the scoring (top-1 agreement and mean KL
against the reference). Run from the repository root with the project's venv."""
import sys
import time
from pathlib import Path

import torch

from ridge.models.fp8_calibrate import build, calibration_ids, kl
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import convert

torch.set_num_threads(2)
DATA = Path(__file__).resolve().parents[2] / "tests" / "data"
conv = convert(None, quantize=False, use_cache=False, show_progress=False)
sd = conv.state_dict
texts = {n: conv.tokenizer.encode((DATA / f"eval_{n}.txt").read_text()) for n in ("text", "code")}
cal = calibration_ids(conv.tokenizer, conv.config)
t0 = time.time()
ref = build(conv.config, sd, conv.freq_factors)
refs = {n: prompt_logits(ref, ids) for n, ids in texts.items()}
print(f"reference in {time.time() - t0:.0f} s", file=sys.stderr)


def agree(logits, r):
    return (logits.argmax(-1) == r.argmax(-1)).float().mean().item(), kl(logits, r)
