"""The model against transformers: RoPE scaling variants, and the context cap."""
from __future__ import annotations

import json

import pytest
import torch

from ridge.models.oneshot import prompt_logits
from ridge.models.loader import load_model
from tiny_models import random_state_dict, tiny_config, write_hf_dir, write_tokenizer_files

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rope_scaling_matches_transformers(tmp_path, kind):
    transformers = pytest.importorskip("transformers")
    arch = "qwen2" if kind == "yarn" else "llama"
    cfg = tiny_config(arch, rope_theta=500.0)
    d = write_hf_dir(tmp_path / kind, cfg, random_state_dict(cfg, seed=7))
    write_tokenizer_files(d)
    c = json.loads((d / "config.json").read_text())
    c["rope_scaling"] = SCALINGS[kind]
    (d / "config.json").write_text(json.dumps(c))
    ids = [(i * 37) % cfg.vocab_size for i in range(200)]  # reaches far past the original 64 positions
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0]
    lm = load_model(d, device="cpu", weights="fp32", use_cache=False)
    assert lm.config.rope_scaling["rope_type"] == kind
    torch.testing.assert_close(prompt_logits(lm.model, ids), ref, atol=2e-4, rtol=2e-4)


def test_max_model_len_caps_the_context(tmp_path):
    from tiny_models import make_tiny
    path, cfg, _ = make_tiny(tmp_path, "llama")
    assert load_model(path, device="cpu", max_model_len=100, use_cache=False).model.max_model_len == 100
    assert load_model(path, device="cpu", max_model_len=10**6, use_cache=False).model.max_model_len == cfg.max_position
