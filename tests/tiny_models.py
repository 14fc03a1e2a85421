"""Tiny random models written as real files (GGUF with the gguf writer, HF
directories with safetensors), so that tests load them through the real loaders."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ridge.config import ModelConfig


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert permute (HF rotate-half rows -> GGUF interleaved rows)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "a n"]


def _byte_chars() -> list[str]:
    # GPT-2's byte -> printable unicode table, which byte-level BPE vocabularies use.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    tokens = SPECIALS + _byte_chars() + ["".join(m.split()) for m in MERGES]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, MERGES


def tiny_config(arch: str = "llama", **kw) -> ModelConfig:
    base = dict(arch=arch, vocab_size=len(tiny_vocab()[0]), hidden_size=64, intermediate_size=96,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                rope_theta=10000.0, max_position=256, tie_word_embeddings=arch != "qwen2",
                attention_bias=arch == "qwen2", qk_norm=arch == "qwen3", name=f"tiny-{arch}")
    base.update(kw)
    return ModelConfig(**base)


def random_state_dict(cfg: ModelConfig, seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """device: where to draw (a GPU draws a 1B-shaped model in seconds); the values differ by device."""
    g = torch.Generator(device).manual_seed(seed)

    def r(*shape, std=0.08):
        return torch.randn(*shape, generator=g, device=device) * std

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g, device=device)

    H, I = cfg.hidden_size, cfg.intermediate_size
    sd = {"model.embed_tokens.weight": r(cfg.vocab_size, H, std=0.1), "model.norm.weight": norm(H)}
    if not cfg.tie_word_embeddings:
        sd["lm_head.weight"] = r(cfg.vocab_size, H)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = norm(H)
        sd[p + "post_attention_layernorm.weight"] = norm(H)
        for name, rows in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            sd[p + f"self_attn.{name}.weight"] = r(rows, H)
            if cfg.attention_bias:
                sd[p + f"self_attn.{name}.bias"] = r(rows, std=0.2)
        sd[p + "self_attn.o_proj.weight"] = r(H, cfg.q_size)
        if cfg.qk_norm:
            sd[p + "self_attn.q_norm.weight"] = norm(cfg.head_dim)
            sd[p + "self_attn.k_norm.weight"] = norm(cfg.head_dim)
        sd[p + "mlp.gate_proj.weight"] = r(I, H)
        sd[p + "mlp.up_proj.weight"] = r(I, H)
        sd[p + "mlp.down_proj.weight"] = r(H, I)
    return sd


_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias", "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.o_proj.bias": "attn_output.bias", "mlp.gate_proj.bias": "ffn_gate.bias",
    "mlp.up_proj.bias": "ffn_up.bias", "mlp.down_proj.bias": "ffn_down.bias",
}
# Phi-3's fused projections and OLMo 2's post-norms, as llama.cpp's converter names them.
_FAMILY_GGUF_NAMES = {
    "phi3": {**_GGUF_NAMES, "self_attn.qkv_proj.weight": "attn_qkv.weight", "mlp.gate_up_proj.weight": "ffn_up.weight"},
    "olmo2": {**_GGUF_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
              "post_feedforward_layernorm.weight": "post_ffw_norm.weight"},
    "seed_oss": {**_GGUF_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight"},
}
_FAMILY_GGUF_NAMES["olmo3"] = _FAMILY_GGUF_NAMES["olmo2"]  # llama.cpp writes Olmo 3 as olmo2
_FAMILY_GGUF_NAMES["exaone4"] = _FAMILY_GGUF_NAMES["olmo2"]
_PERMUTED = ("llama", "granite", "mixtral", "smollm3")  # the converter interleaves Q and K rows for llama.cpp's NORM rope


# Gemma's four norms a layer, as llama.cpp's converter names them.
_GEMMA_GGUF_NAMES = {**_GGUF_NAMES, "post_attention_layernorm.weight": "post_attention_norm.weight",
                     "pre_feedforward_layernorm.weight": "ffn_norm.weight",
                     "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
_GEMMA = {"gemma2": "gemma2", "gemma3_text": "gemma3"}  # ModelConfig.arch -> general.architecture
_GGUF_ARCH = {**_GEMMA, "qwen3_moe": "qwen3moe", "mixtral": "llama", "olmo3": "olmo2"}  # llama.cpp writes Mixtral as llama


def _moe_metadata(w, cfg: ModelConfig) -> None:
    """What llama.cpp's converter writes for the experts (Qwen2MoeModel, LlamaModel for Mixtral)."""
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        if cfg.arch == "qwen3_moe":
            w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def _moe_gguf_tensors(cfg: ModelConfig, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' stacked experts (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I])
    and router (mlp.gate) as the converter stacks them: blk.N.ffn_{gate,up,down}_exps and
    ffn_gate_inp. Removes them from sd."""
    out = {}
    for i in range(cfg.num_layers):
        m = f"model.layers.{i}.mlp."
        if m + "experts.gate_up_proj" not in sd:
            continue
        gate, up = sd.pop(m + "experts.gate_up_proj").chunk(2, dim=1)
        out.update({f"blk.{i}.ffn_gate_exps.weight": gate, f"blk.{i}.ffn_up_exps.weight": up,
                    f"blk.{i}.ffn_down_exps.weight": sd.pop(m + "experts.down_proj"),
                    f"blk.{i}.ffn_gate_inp.weight": sd.pop(m + "gate.weight")})
    return out


def _gguf_name(hf: str, arch: str = "llama") -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, idx, rest = hf.split(".", 3)
    return f"blk.{idx}.{(_GEMMA_GGUF_NAMES if arch in _GEMMA else _FAMILY_GGUF_NAMES.get(arch, _GGUF_NAMES))[rest]}"


def _gemma_metadata(w, cfg: ModelConfig) -> None:
    """What llama.cpp's converter writes for Gemma beyond llama's keys (no query_pre_attn_scalar:
    the format has none, so a model must use head_dim's)."""
    if cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    if cfg.attn_logit_softcapping is not None:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if cfg.final_logit_softcapping is not None:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if cfg.rope_scaling:
        import gguf
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling["factor"])


def _family_metadata(w, cfg: ModelConfig) -> None:
    """What llama.cpp's converter writes for Phi-3 (Phi3MiniModel) and Granite (GraniteModel)
    beyond llama's keys; the LongRoPE factors go in as tensors (write_gguf)."""
    if cfg.arch == "phi3":
        w.add_rope_dimension_count(cfg.rotary_dim or cfg.head_dim)
        w.add_sliding_window(cfg.sliding_window or 0)  # 0: none (Phi-4)
        s = cfg.rope_scaling
        if s:
            old = s["original_max_position_embeddings"]
            w.add_rope_scaling_orig_ctx_len(old)
            scale = cfg.max_position / old
            w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(old)) if scale > 1.0 else 1.0)
    elif cfg.arch in ("olmo3", "exaone4") and cfg.sliding_window:  # the window and a flag a layer
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    elif cfg.arch == "granite":
        if cfg.softmax_scale:
            w.add_attention_scale(cfg.softmax_scale)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)


def write_gguf(path: Path, cfg: ModelConfig, sd: dict[str, torch.Tensor], qtype: str = "F32",
               tokenizer: bool = True, raw: dict | None = None, split_max_tensors: int = 0,
               extra_tokens: tuple[str, ...] = ()) -> Path:
    """Matrices in `qtype` (norms and biases stay F32), llama's Q/K rows permuted
    as llama.cpp's converter does. raw: GGUF tensor name -> (bytes array, type
    name), written as given instead (types gguf-py can read but not write). split_max_tensors: as
    llama.cpp's gguf-split --split-max-tensors, parts PATH.stem-0000k-of-0000n.gguf beside PATH;
    the first part's path is returned. extra_tokens: control tokens after the tiny vocabulary's."""
    import gguf
    from gguf.quants import quantize

    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(path), _GGUF_ARCH.get(cfg.arch, cfg.arch), split_max_tensors=split_max_tensors)
    w.add_name(cfg.name)
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.arch in _GEMMA:
        _gemma_metadata(w, cfg)
    _family_metadata(w, cfg)
    _moe_metadata(w, cfg)
    if tokenizer:
        tokens, types, merges = tiny_vocab()
        tokens, types = tokens + list(extra_tokens), types + [3] * len(extra_tokens)  # 3: CONTROL
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(CHATML)
    sd = dict(sd)
    for name, t in _moe_gguf_tensors(cfg, sd).items():
        w.add_tensor(name, t.float().contiguous().numpy())
    for name, t in sd.items():
        t = t.float()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # transformers' state dict names the tied table twice; the converter writes it once
        if cfg.arch in _GEMMA and name.endswith("norm.weight"):
            t = t + 1.0  # llama.cpp's converter stores Gemma's multiplier 1 + w
        if cfg.arch in _PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):  # as LlamaModel.modify_tensors
            t = permute_qk(t, cfg.num_heads)
        elif cfg.arch in _PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute_qk(t, cfg.num_kv_heads)
        arr = t.numpy()
        if raw and _gguf_name(name, cfg.arch) in raw:
            data, kind = raw[_gguf_name(name, cfg.arch)]
            w.add_tensor(_gguf_name(name, cfg.arch), data, raw_shape=data.shape, raw_dtype=gguf.GGMLQuantizationType[kind])
        elif arr.ndim == 2 and qtype != "F32":
            w.add_tensor(_gguf_name(name, cfg.arch), quantize(arr, qt), raw_shape=quantize(arr, qt).shape, raw_dtype=qt)
        else:
            w.add_tensor(_gguf_name(name, cfg.arch), arr)
    if cfg.arch == "phi3" and cfg.rope_scaling:
        for kind in ("long", "short"):
            w.add_tensor(f"rope_factors_{kind}.weight", np.array(cfg.rope_scaling[f"{kind}_factor"], dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return w.format_shard_names(path)[0] if split_max_tensors else path


def hf_config_dict(cfg: ModelConfig) -> dict:
    return {"model_type": cfg.arch, "architectures": [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                                        "qwen3": "Qwen3ForCausalLM"}[cfg.arch]],
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "max_position_embeddings": cfg.max_position,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
            "hidden_act": "silu", "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


def write_hf_dir(path: Path, cfg: ModelConfig, sd: dict[str, torch.Tensor], dtype=torch.float32,
                 fp8_scales: str | None = None) -> Path:
    """fp8_scales: None (plain dtype), "tensor" or "channel": a vLLM-style FP8 checkpoint."""
    from safetensors.torch import save_file

    from ridge.quant.fp8 import quantize_fp8

    path.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in sd.items():
        linear = name.endswith("_proj.weight") or name == "lm_head.weight"
        if fp8_scales and linear:
            if fp8_scales == "channel":
                q, s = quantize_fp8(t)
                out[name], out[name + "_scale"] = q, s[:, None].contiguous()
            else:
                s = t.abs().max() / 448.0
                out[name], out[name + "_scale"] = (t / s).to(torch.float8_e4m3fn), s.reshape(())
        else:
            out[name] = t.to(device="cpu", dtype=dtype).contiguous()
    save_file(out, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(hf_config_dict(cfg)))
    return path


def write_tokenizer_files(path: Path) -> None:
    """tokenizer.json + tokenizer_config.json for the tiny vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens, _, merges = tiny_vocab()
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split()) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "add_bos_token": False}))


def make_tiny(tmp: Path, arch: str = "llama", fmt: str = "gguf", seed: int = 0, qtype: str = "F32", **kw):
    """-> (path, cfg, hf state dict)."""
    cfg = tiny_config(arch, **kw)
    sd = random_state_dict(cfg, seed)
    if fmt == "gguf":
        return write_gguf(tmp / f"tiny-{arch}-{qtype}.gguf", cfg, sd, qtype), cfg, sd
    d = write_hf_dir(tmp / f"tiny-{arch}-hf", cfg, sd)
    write_tokenizer_files(d)
    return d, cfg, sd
