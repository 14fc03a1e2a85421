"""Mixtures of experts in GGUF, as llama.cpp's converter writes them (convert_hf_to_gguf.py:
Qwen3MoeModel, and Mixtral through LlamaModel) and llama.cpp reads them (llama-model.cpp):

- qwen3moe: general.architecture "qwen3moe"; Mixtral: "llama" with llama.expert_count;
- {arch}.expert_count (E), {arch}.expert_used_count (k) and, for qwen3moe,
  {arch}.expert_feed_forward_length (the experts' width; Mixtral's is feed_forward_length);
- per layer blk.{i}.ffn_gate_inp [E, H] (the router) and the experts stacked,
  ffn_gate_exps and ffn_up_exps [E, I, H], ffn_down_exps [E, H, I]; a layer without
  ffn_gate_inp is dense (its ffn_gate / ffn_up / ffn_down);
- routing: llama.cpp's softmax over the experts, the top k, and their weights renormalised
  (norm_w in both graphs). The format has no norm_topk_prob: a file is read as llama.cpp runs it;
- Mixtral's Q and K rows are permuted as llama's, Qwen3-MoE's are not;
- gpt-oss (general.architecture "gpt-oss", GptOssModel in the converter, llama_model_openai_moe
  in llama.cpp): the experts' gate and up rows split out of HF's interleaved gate_up, each
  stacked tensor with a .bias, the weights usually MXFP4 (ggml's own block layout, which the
  gguf package reads); the router ffn_gate_inp with a bias; blk.N.attn_sinks [heads];
  post_attention_norm; attention.sliding_window on the even layers (llama.cpp's pattern of 2);
  llama.cpp takes the top k logits and softmaxes them, and fixes the clamped SwiGLU's alpha at
  1.702 and its limit at 7.0, as gpt-oss's config does. Its Q and K rows are not permuted (NEOX)."""
from __future__ import annotations

import torch

from .errors import ModelLoadError
from .fuse import EXPERT_NAMES

MOE_KEYS = {"llama": {"expert_count", "expert_used_count"},
            "qwen3moe": {"expert_count", "expert_used_count", "expert_feed_forward_length"},
            "gpt-oss": {"expert_count", "expert_used_count", "expert_feed_forward_length", "attention.sliding_window"}}
_STACKED = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# gpt-oss's layer tensors beyond llama's, by their HF names (quant/gpt_oss.py reads the experts')
GPT_OSS_LAYER_NAMES = {"attn_output.bias": "self_attn.o_proj.bias", "attn_sinks.weight": "self_attn.sinks",
                       "post_attention_norm.weight": "post_attention_layernorm.weight"}
GPT_OSS_EXPERTS = {"ffn_gate_inp.weight": "router.weight", "ffn_gate_inp.bias": "router.bias",
                   **{f"ffn_{p}_exps.{k}": f"experts.{p}_exps" + ("" if k == "weight" else "_bias")
                      for p in ("gate", "up", "down") for k in ("weight", "bias")}}
LLAMA_CPP_SWIGLU = dict(swiglu_alpha=1.702, swiglu_limit=7.0)  # LLM_FFN_SWIGLU_OAI_MOE's constants


def moe_arch(arch: str, a) -> str:
    """general.architecture -> ModelConfig.arch (a(key): the architecture's metadata)."""
    if arch == "qwen3moe":
        return "qwen3_moe"
    if arch == "gpt-oss":
        return "gpt_oss"
    return "mixtral" if arch == "llama" and a("expert_count") else arch


def moe_fields(arch: str, a, kw: dict, names: set[str], path) -> dict:
    """The experts' ModelConfig fields; arch: ModelConfig's, kw: the common fields read."""
    experts, k = a("expert_count"), a("expert_used_count")
    if not isinstance(experts, int) or experts < 1 or not isinstance(k, int) or not 1 <= k <= experts:
        raise ModelLoadError(path, f"expert_count={experts!r}, expert_used_count={k!r}: need 1 <= used <= count")
    n = kw["num_layers"]
    layers = [i for i in range(n) if f"blk.{i}.ffn_gate_inp.weight" in names]
    if not layers:
        raise ModelLoadError(path, f"expert_count={experts} but no layer has a router (blk.N.ffn_gate_inp)")
    inter = a("expert_feed_forward_length") if arch in ("qwen3_moe", "gpt_oss") else kw["intermediate_size"]
    if not isinstance(inter, int) or inter < 1:
        raise ModelLoadError(path, f"expert_feed_forward_length={inter!r}: expected a positive integer")
    out = dict(num_experts=int(experts), num_experts_per_tok=int(k), moe_intermediate_size=int(inter),
               moe_router="softmax_topk", norm_topk_prob=True, moe_layers=None if len(layers) == n else layers)
    if arch == "gpt_oss":
        out.update(_gpt_oss(a, kw, names, path, len(layers) == n))
    return out


def _gpt_oss(a, kw: dict, names: set[str], path, every_layer: bool) -> dict:
    n = kw["num_layers"]
    if not every_layer:
        raise ModelLoadError(path, "gpt-oss: a layer without a router (blk.N.ffn_gate_inp); every layer is a mixture")
    for t in ("attn_sinks.weight", "attn_output.bias", "ffn_gate_inp.bias", "ffn_gate_exps.bias"):
        if f"blk.0.{t}" not in names:
            raise ModelLoadError(path, f"gpt-oss: missing tensor blk.0.{t}")
    window = a("attention.sliding_window")
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(path, f"gpt-oss.attention.sliding_window={window!r}: expected a positive integer")
    return dict(o_bias=True, attention_sinks=True, sliding_window=int(window),
                layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
                norm_topk_prob=False, moe_router="topk_softmax", moe_bias=True, moe_act="swigluoai",
                **LLAMA_CPP_SWIGLU)


def expert_tensors(gguf_name: str, w: torch.Tensor, arch: str) -> dict[str, torch.Tensor] | None:
    """A stacked expert tensor or a router -> its Hugging Face names (the experts one tensor
    each, as the checkpoints ship them: quant/fuse.py stacks them again); None for any other."""
    if arch == "gpt_oss" and gguf_name.startswith("blk."):
        _, idx, rest = gguf_name.split(".", 2)
        return {f"model.layers.{idx}.mlp.{GPT_OSS_EXPERTS[rest]}": w} if rest in GPT_OSS_EXPERTS else None
    if not gguf_name.startswith("blk.") or arch not in EXPERT_NAMES:
        return None
    _, idx, rest = gguf_name.split(".", 2)
    block, gate, *projections = EXPERT_NAMES[arch][-1]
    layer = f"model.layers.{idx}.{block}"
    if rest == "ffn_gate_inp.weight":
        return {f"{layer}{gate}.weight": w}
    if rest not in _STACKED:
        return None
    proj = projections[_STACKED.index(rest)]
    return {f"{layer}experts.{e}.{proj}.weight": t for e, t in enumerate(w.unbind(0))}
