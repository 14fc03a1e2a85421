"""Qwen3.5-MoE (Qwen3_5MoeTextConfig): Qwen3.5's hybrid layers (ridge/models/qwen3_5/: Gated DeltaNet
beside gated attention, its tensors and their names, mrope read as the plain rotation for text)
with Qwen3-Next's sparse MLP in every layer (ridge/models/qwen3_next/: num_experts_per_tok of
num_experts experts of moe_intermediate_size, the softmax's top k always renormalised, beside a
shared expert of shared_expert_intermediate_size scaled by sigmoid(shared_expert_gate . h)). The
config class has no dense MLP, nor intermediate_size, decoder_sparse_step, mlp_only_layers or
norm_topk_prob: its model reads none of them; num_experts 0 is refused.

The Hub ships it as Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe): text_config (a
qwen3_5_moe_text) is the text model, the wrapper's tie_word_embeddings tying the head (as
transformers ties it). Its vision tower (model.visual.) is Qwen3.5's (Qwen3_5MoeVisionConfig and
Qwen3_5MoeVisionModel subclass Qwen3.5's unchanged: ridge/models/qwen3_5/vision.py loads it beside
the text model); an image's tokens rotate by mrope's three positions, interleaved, from the
mrope_section read_qwen3_5 keeps in extra. The multi-token-prediction layers (mtp.) are not read
here (ridge/models/qwen3_5/mtp.py loads them apart)."""
from __future__ import annotations

from ridge.quant.fuse import WeightLayout
from ridge.quant.hf_config import (MOE_IGNORED, HFConfig, HFFamily, HFWrapper, experts_count, moe_fields,
                                    nested_text_config, wrapper_names)
from ridge.quant.spec import ModelSpec

from .. import qwen3_5, qwen3_next
from ..qwen3_5 import gguf
from ..qwen3_5.vision import load_vision, read_vision
from ..qwen3_next import Qwen3NextCausalLM

DEFAULTS = dict(vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                num_key_value_heads=2, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
                tie_word_embeddings=False, rope_parameters=None, attention_bias=False, head_dim=256,
                linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                num_experts_per_tok=8, num_experts=256, layer_types=None, full_attention_interval=4,
                partial_rotary_factor=0.25, rope_theta=10000.0)


def read_qwen3_5_moe(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    experts, k = experts_count(c, "num_experts")
    if not experts:
        c.refuse("num_experts", experts, "every Qwen3.5-MoE layer routes to experts")
    width = qwen3_next.experts_width(c)
    # intermediate_size: the dense MLP's, which no layer keeps (each is built, then its MLP replaced)
    return dict(qwen3_next.shared_expert(c, qwen3_5.read_qwen3_5(c, kw)),
                **moe_fields(experts, k, width, list(range(n)), n, True), intermediate_size=width)


# -- Qwen3_5MoeForConditionalGeneration (model_type qwen3_5_moe): the text model and its vision tower.
WRAPPER_DEFAULTS = dict(qwen3_5.WRAPPER_DEFAULTS)  # the same token ids and tie default as Qwen3.5's wrapper


def text_config(c: HFConfig) -> HFConfig:
    text = nested_text_config(c, "qwen3_5_moe_text", DEFAULTS, "Qwen3.5-MoE")
    # one model: a tower ridge cannot run is refused however the checkpoint is served
    vision = read_vision(c) if "vision_config" in c else None
    if vision is not None and vision.out_hidden_size != text.positive_int("hidden_size"):
        c.refuse("vision_config.out_hidden_size", vision.out_hidden_size,
                 f"the merger's rows replace embeddings of hidden_size={text.get('hidden_size')}")
    return text


text_name = wrapper_names((("model.language_model.", "model."), ("lm_head.", "lm_head.")), ("model.visual.", "mtp."),
                          "vision tower's or the multi-token-prediction layers", "Qwen3_5MoeForConditionalGeneration")

SPEC = ModelSpec("qwen3_5_moe_text", Qwen3NextCausalLM,
                 HFFamily(DEFAULTS, read_qwen3_5_moe, MOE_IGNORED, tensors=qwen3_5.shift_norms),
                 gguf=gguf.family("qwen35moe", moe=True),  # GGUF as llama.cpp writes it: qwen3_5/gguf.py
                 weights=WeightLayout(experts=qwen3_next.experts, attention=gguf.mixer(qwen3_5.fuse_mixer)),
                 hf_wrappers=(HFWrapper("qwen3_5_moe", WRAPPER_DEFAULTS, text_config, text_name,
                                        "vision tower and multi-token-prediction", vision=load_vision),))
