"""Random models of Llama-3.1-8B's shape for the real-size figures in docs/benchmarks.md (issue 39):
a bf16 safetensors directory written by transformers, and a GGUF of it as users download one
(Q8_0 or Q4_K matrices, llama.cpp's converter's names, Q/K row order, llama3 rope factors).

    python docs/experiments/write_llama8b.py hf DIR
    python docs/experiments/write_llama8b.py gguf DIR OUT.gguf [Q8_0|Q4_K]
    SHAPE=1b python docs/experiments/write_llama8b.py ...   (Llama-3.2-1B's shape instead)

The GGUF is written a tensor at a time from the directory's memory maps (the header first, then
each tensor's data), so neither step holds more than the model itself (hf) or one tensor (gguf).
The tokenizer is the tests' tiny byte-level one: the figures are about weights."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from tiny_models import CHATML, permute_qk, tiny_vocab, write_tokenizer_files  # noqa: E402

SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
             max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192})
# SHAPE=1b: Llama-3.2-1B's shape (1.24B parameters, tied embeddings), a model larger than any
# CPU cache for issue 45's bandwidth figures.
if __import__("os").environ.get("SHAPE") == "1b":
    SHAPE = dict(SHAPE, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, head_dim=64,
                 tie_word_embeddings=True,
                 rope_scaling=dict(SHAPE["rope_scaling"], factor=32.0))
NAMES = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
         "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
         "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
         "mlp.down_proj.weight": "ffn_down.weight", "input_layernorm.weight": "attn_norm.weight",
         "post_attention_layernorm.weight": "ffn_norm.weight"}


def write_hf(out: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", **SHAPE)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out, max_shard_size="5GB")
    write_tokenizer_files(out)


def rope(cfg: dict) -> dict:
    """The rope settings of a config.json: transformers 5 writes rope_parameters (rope_theta inside)."""
    return cfg.get("rope_parameters") or {**cfg["rope_scaling"], "rope_theta": cfg["rope_theta"]}


def rope_factors(cfg: dict) -> np.ndarray:
    """llama3 rope scaling as llama.cpp's converter writes it: one factor per frequency."""
    s, dim = rope(cfg), cfg["head_dim"]
    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = s["original_max_position_embeddings"]
    low, high = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < high:
            out.append(1.0)
        elif wavelen > low:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def gguf_name(hf: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if hf in fixed:
        return fixed[hf]
    _, _, idx, rest = hf.split(".", 3)
    return f"blk.{idx}.{NAMES[rest]}"


def write_gguf(src: Path, out: Path, qtype: str) -> None:
    import gguf
    from gguf.quants import quantize
    from safetensors import safe_open

    cfg = json.loads((src / "config.json").read_text())
    qt = gguf.GGMLQuantizationType[qtype]
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_name("llama-8b-shaped")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope(cfg)["rope_theta"])
    w.add_vocab_size(cfg["vocab_size"])
    tokens, types, merges = tiny_vocab()
    # llama.cpp holds the table to the token list's length: the rows past the tiny vocabulary as
    # unused tokens (GGUF token type 5), never produced by the tokenizer
    pad = cfg["vocab_size"] - len(tokens)
    tokens, types = list(tokens) + [f"<unused{i}>" for i in range(pad)], list(types) + [5] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    where = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                where[name] = (f, tuple(st.get_slice(name).get_shape()))
    names = sorted(where, key=lambda n: (n.count("layers."), n))

    def matrix(name: str, shape) -> bool:
        return len(shape) == 2

    factors = rope_factors(cfg)
    w.add_tensor_info("rope_freqs.weight", factors.shape, np.dtype(np.float32), factors.nbytes)
    for name in names:
        shape = where[name][1]
        if matrix(name, shape):
            block, size = gguf.GGML_QUANT_SIZES[qt]
            row = shape[1] // block * size  # a quantized tensor's shape is given in bytes, as quantize() returns it
            w.add_tensor_info(gguf_name(name), (shape[0], row), np.dtype(np.uint8), shape[0] * row, raw_dtype=qt)
        else:
            w.add_tensor_info(gguf_name(name), shape, np.dtype(np.float32), 4 * math.prod(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.write_tensor_data(factors)
    for name in names:
        f, shape = where[name]
        with safe_open(str(f), framework="pt") as st:
            t = st.get_tensor(name).float()
        if name.endswith("q_proj.weight"):  # as llama.cpp's LlamaModel.modify_tensors
            t = permute_qk(t, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            t = permute_qk(t, cfg["num_key_value_heads"])
        arr = t.numpy()
        w.write_tensor_data(quantize(arr, qt) if matrix(name, shape) else arr)
        del t, arr
    w.close()


if __name__ == "__main__":
    if sys.argv[1] == "hf":
        write_hf(Path(sys.argv[2]))
    else:
        write_gguf(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "Q8_0")
