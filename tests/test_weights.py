"""`--weights fp8|bf16|fp32`: what the loaded model holds, on a tiny random model written as a
real HF directory, checked against transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from ridge.daemon.cli.commands import weights_label
from ridge.engine.config import EngineConfig
from ridge.engine.engine import LLMEngine
from ridge.engine.kv_tiers import disk_key
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.quant.errors import ModelLoadError
from ridge.quant.linear import FP8Linear
from tiny_models import random_state_dict, tiny_config, write_hf_dir, write_tokenizer_files

PROMPT = [1, 40, 71, 200, 33, 5, 90, 12, 140, 7, 260, 3, 88, 99, 100, 101, 17, 18, 19, 44]


def hf_dir(path, sd, cfg, **kw):
    d = write_hf_dir(path, cfg, sd, **kw)
    write_tokenizer_files(d)
    return d


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = tiny_config("llama")
    sd = random_state_dict(cfg, seed=3)
    return cfg, sd, hf_dir(tmp_path_factory.mktemp("weights") / "hf", sd, cfg)


def linears(model) -> dict[str, FP8Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear) and n != "lm_head"}


def test_an_fp32_weights_engine_computes_the_unquantized_model(tiny):
    """The engine's model against transformers in fp32, logits and greedy tokens."""
    transformers = pytest.importorskip("transformers")
    cfg, sd, d = tiny
    engine = LLMEngine(EngineConfig(model=str(d), weights="fp32", device="cpu", kv_dtype="fp32", num_kv_blocks=64,
                                    max_num_seqs=4, prefill_chunk=64, ridge_point=8.0, kv_disk=False, kv_host_gib=0))
    assert engine.loaded.weights == "fp32" and engine.model_info()["weights"] == "fp32"
    assert all(m.weight.dtype == torch.float32 and m.weight_scale is None for m in linears(engine.model).values())
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([PROMPT])).logits[0]
        want = ref_model.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False,
                                  min_new_tokens=8)[0, len(PROMPT):].tolist()
    torch.testing.assert_close(prompt_logits(engine.model, PROMPT), ref, atol=1e-4, rtol=1e-4)
    from engine_utils import greedy, run
    assert run(engine, [PROMPT], greedy(8)) == {"r0": want}


def test_fp8_stays_the_default(tiny):
    _, _, d = tiny
    lm = load_model(d, device="cpu", use_cache=False)
    assert lm.weights == "fp8"
    assert all(m.cpu.scale is not None for m in linears(lm.model).values())  # e4m3 values, upcast on CPU


def test_bf16_weights_on_cpu_are_the_bf16_values_held_in_fp32(tiny, tmp_path):
    """The numbers a GPU holds for --weights bf16 (linear weights and embeddings rounded, norms
    not), computed in fp32: the same logits as an fp32 model of those rounded weights."""
    cfg, sd, d = tiny
    lm = load_model(d, device="cpu", weights="bf16", use_cache=False)
    full = load_model(d, device="cpu", weights="fp32", use_cache=False)
    for name, m in linears(lm.model).items():
        w = linears(full.model)[name].weight
        assert m.weight.dtype == torch.float32 and torch.equal(m.weight, w.bfloat16().float()), name
    assert torch.equal(lm.model.embed_tokens.weight, full.model.embed_tokens.weight.bfloat16().float())
    assert torch.equal(lm.model.norm.weight, full.model.norm.weight)  # norms stay fp32
    rounded = {k: v if "norm" in k else v.bfloat16().float() for k, v in sd.items()}
    by_hand = load_model(hf_dir(tmp_path / "rounded", rounded, cfg), device="cpu", weights="fp32", use_cache=False)
    assert torch.equal(prompt_logits(lm.model, PROMPT), prompt_logits(by_hand.model, PROMPT))


def test_what_the_weights_hold_keys_the_disk_tier_and_the_status_line(tiny):
    """bf16 and fp32 weights held the same way on CPU make different KV: different disk-tier keys."""
    _, _, d = tiny
    lm = {w: load_model(d, device="cpu", weights=w, use_cache=False) for w in ("bf16", "fp32")}
    assert disk_key(lm["bf16"], None, "fp32", 16, 1)[0] != disk_key(lm["fp32"], None, "fp32", 16, 1)[0]
    model = {"fp8_weights": False, "quantized": False, "weight_dtype": "float32"}
    assert weights_label({**model, "weights": "bf16"}) == "float32 (bf16 values)"
    assert weights_label({**model, "weights": "fp32"}) == "float32"
    assert weights_label({**model, "weights": "fp8", "quantized": True}) == "float32 (FP8-quantized)"


def test_unknown_weights_are_refused_naming_the_option(tiny):
    _, _, d = tiny
    with pytest.raises(ValueError, match="--weights 'int4': choose fp8, bf16, fp32"):
        load_model(d, device="cpu", weights="int4", use_cache=False)


@pytest.mark.parametrize("weights", ["bf16", "fp32"])
def test_an_fp8_checkpoint_refuses_unquantized_weights(tmp_path, weights):
    """Its values are e4m3 times a scale: no unquantized weights to hold."""
    cfg = tiny_config("llama")
    d = hf_dir(tmp_path / "fp8", random_state_dict(cfg, seed=6), cfg, fp8_scales="channel")
    with pytest.raises(ModelLoadError, match=f"FP8 already .*--weights {weights} needs unquantized weights"):
        load_model(d, device="cpu", weights=weights, use_cache=False)
