"""The embedded default model: exactness against transformers, and what FP8
costs in accuracy (thresholds measured and justified in docs/benchmarks.md)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ridge.config import kv_bytes_per_token
from ridge.models.layers.decoder import CausalLM
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import convert
from ridge.quant.fp8 import quantize_state_dict
from ridge.quant.source import default_model_path

pytestmark = pytest.mark.slow
EVAL_TEXT = (Path(__file__).parent / "data" / "eval_text.txt").read_text()


def build(conv, sd):
    with torch.device("meta"):
        m = CausalLM(conv.config)
    m.load_weights(sd, torch.device("cpu"), torch.float32, conv.freq_factors)
    return m


@pytest.fixture(scope="module")
def smol():
    conv = convert(quantize=False, use_cache=False, show_progress=False)
    return conv, build(conv, conv.state_dict)


@pytest.fixture(scope="module")
def eval_ids(smol):
    ids = smol[0].tokenizer.encode(EVAL_TEXT)
    assert 300 <= len(ids) <= 400
    return ids


@pytest.fixture(scope="module")
def ref_logits(smol, eval_ids):
    return prompt_logits(smol[1], eval_ids)


def agreement(logits, ref):
    top1 = (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
    kl = F.kl_div(logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none").sum(-1).mean().item()
    return top1, kl


def test_fp32_logits_match_transformers(smol):
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    conv, model = smol
    ids = conv.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(prompt_logits(model, ids), ref, atol=1e-4, rtol=1e-4)


def test_fp8_weights_against_fp32(smol, eval_ids, ref_logits):
    # Measured 0.961 top-1 / 0.0138 KL over these 337 positions (mse scales);
    # the margins allow for summation-order differences between CPUs, and
    # would not hide a wrong scale or a quantized head (0.929 / 0.027).
    conv, _ = smol
    fp8 = build(conv, quantize_state_dict(conv.state_dict))
    top1, kl = agreement(prompt_logits(fp8, eval_ids), ref_logits)
    assert top1 >= 0.94 and kl <= 0.02, (top1, kl)


def test_fp8_kv_against_fp32_kv(smol, eval_ids, ref_logits):
    # Measured 0.976 top-1 / 0.0037 KL with per-(token, head) scales; a
    # per-tensor scale measured 0.967 / 0.0045, bf16 KV 1.000 / 0.00002.
    top1, kl = agreement(prompt_logits(smol[1], eval_ids, kv_dtype="fp8"), ref_logits)
    assert top1 >= 0.96 and kl <= 0.006, (top1, kl)


def test_fp8_kv_fits_at_least_1_9x_bf16(smol):
    cfg = smol[0].config
    assert kv_bytes_per_token(cfg, "bf16") == 2 * 30 * 3 * 64 * 2
    assert kv_bytes_per_token(cfg, "bf16") / kv_bytes_per_token(cfg, "fp8") >= 1.9


def test_greedy_answer_is_paris():
    from ridge.engine.engine import EngineConfig, LLMEngine
    from ridge.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=64))
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = engine.generate([ids], SamplingParams(max_tokens=24))[0]
    assert "Paris" in out.new_text and out.finish_reason == "stop"


@pytest.fixture(scope="module")
def smol_loaded():
    from ridge.models.loader import load_model
    return load_model(device="cpu")


def _greedy_run(loaded, spec: str, prompts: list[list[int]], logprobs: int = 0, **kw) -> dict:
    from ridge.engine.engine import EngineConfig, LLMEngine
    from ridge.engine.sampling_params import SamplingParams

    # fp32 weights and KV: batch shape changes only the fp32 summation order.
    cfg = EngineConfig(device="cpu", kv_dtype="fp32", cpu_weight_format="fp32", num_kv_blocks=256,
                       speculative=spec, ridge_point=100.0, kv_disk=False, **kw)  # no hits from earlier runs
    eng = LLMEngine(cfg, loaded=loaded)
    ids = [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=40, logprobs=logprobs)) for i, p in enumerate(prompts)]
    toks, margins = {i: [] for i in ids}, {i: [] for i in ids}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            for _, top in o.logprobs or []:
                margins[o.request_id].append(top[0][1] - top[1][1])
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks
    return {"tokens": toks, "margins": margins, "stats": eng.stats()["speculative"]}


def _same_up_to_near_tie(ref: list[int], margins: list[float], got: list[int]) -> bool:
    """Identical up to the first position where the reference's top-2 margin is below 1e-3."""
    for i, t in enumerate(ref):
        if margins[i] < 1e-3:
            return True
        if i >= len(got) or got[i] != t:
            return False
    return len(got) == len(ref)


@pytest.fixture(scope="module")
def spec_reference(smol_loaded):
    tok = smol_loaded.tokenizer
    prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in (
        # Its end-of-sequence token arrives inside a run of accepted drafts (a client saw
        # tokens twice when the engine reported the drafts past it).
        "Repeat the following text exactly, word for word:\n\nThe quick brown fox jumps over the lazy dog. A journey "
        "of a thousand miles begins with a single step. All that glitters is not gold. The early bird catches the worm.",
        "Repeat exactly: the quick brown fox jumps over the lazy dog, the quick brown fox jumps over the lazy dog.",
        "Write a short poem about rain.")]
    return prompts, _greedy_run(smol_loaded, "off", prompts, logprobs=2)


@pytest.mark.parametrize("spec", ["ngram", "self:8", "auto"])
def test_speculative_greedy_equals_plain_on_smollm2(smol_loaded, spec_reference, spec):
    prompts, ref = spec_reference
    alone = _greedy_run(smol_loaded, spec, prompts[:1])
    batch = _greedy_run(smol_loaded, spec, prompts)
    assert alone["stats"]["total"]["drafted"] > 0
    for run, n in ((alone, 1), (batch, len(prompts))):
        for i in range(n):
            rid = f"r{i}"
            assert _same_up_to_near_tie(ref["tokens"][rid], ref["margins"][rid], run["tokens"][rid]), (spec, rid)
