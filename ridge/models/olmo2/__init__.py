"""OLMo 2 (Olmo2Config): its layer in model.py, norms after attention and the MLP
(post_attention_layernorm, post_feedforward_layernorm) and none before, QK-norm over the
whole projections.

GGUF olmo2 (llama.cpp's converter: Olmo2Model): post_attention_norm and post_ffw_norm, no input
norm; q and k norms over the whole projection; NEOX rope, stored unpermuted;
attention.sliding_window is Olmo 3's (a 3-sliding-to-1-full pattern), read by ridge/models/olmo3/."""
from __future__ import annotations

from ridge.quant.fuse import WeightLayout
from ridge.quant.gguf_config import GGUFFamily, output_biases, refuse_yarn_attn_factor
from ridge.quant.gguf_loader import BIAS_NAMES
from ridge.quant.hf_config import HFConfig, HFFamily, attention_biases, rope_fields
from ridge.quant.spec import ModelSpec

from ..llama import LLAMA_DEFAULTS
from .model import Olmo2CausalLM

__all__ = ["SPEC", "Olmo2CausalLM"]


def read_olmo2(c: HFConfig, kw: dict) -> dict:
    return dict(qk_norm=True, **attention_biases(c, mlp=False), **rope_fields(c, kw["head_dim"]))


def read_olmo2_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("olmo2", a, kw, path)
    return dict(output_biases(names), qk_norm=True)


SPEC = ModelSpec(
    "olmo2", Olmo2CausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, vocab_size=50304, rms_norm_eps=1e-5, attention_bias=False), read_olmo2),
    # A file with attention.sliding_window is Olmo 3's (ridge/models/olmo3/).
    GGUFFamily("olmo2", claims=lambda meta: meta("attention.sliding_window") is None, read=read_olmo2_gguf,
               keys=frozenset({"rope.scaling.attn_factor"}),
               names={"post_attention_norm.weight": "post_attention_layernorm.weight",
                      "post_ffw_norm.weight": "post_feedforward_layernorm.weight", **BIAS_NAMES}),
    WeightLayout(norms=("post_attention_layernorm", "post_feedforward_layernorm")),
)
