"""`ridge bench moe`'s random Qwen3-MoE-shaped model (0.88B, 32 experts, top 4) as a GGUF llama.cpp
reads, for issue 45's side-by-side with llama-server: the FP8 checkpoint's weights dequantized
to fp32, the experts stacked as llama.cpp's converter stacks them (blk.N.ffn_{gate,up,down}_exps),
the tests' byte-level vocabulary padded to the table's rows with control tokens. Written F32;
requantize it with llama.cpp's own tool:

    python docs/experiments/moe_gguf.py OUT-F32.gguf
    llama-quantize OUT-F32.gguf OUT-Q8_0.gguf Q8_0"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from tiny_models import tiny_config, tiny_vocab, write_gguf  # noqa: E402

from ridge.bench.moe import SHAPE, _configs, _tensors  # noqa: E402


def main(out: Path) -> None:
    c = _configs(SHAPE)["qwen3_moe"]
    raw = _tensors("qwen3_moe", c, torch.Generator().manual_seed(0))
    sd = {}
    for name, t in raw.items():
        if name.endswith(".weight_scale"):
            continue
        scale = raw.get(name + "_scale")
        sd[name] = t.float() * scale if scale is not None else t.float()
    for i in range(c["num_hidden_layers"]):
        m = f"model.layers.{i}.mlp."
        e = range(c["num_experts"])
        gate = torch.stack([sd.pop(f"{m}experts.{j}.gate_proj.weight") for j in e])
        up = torch.stack([sd.pop(f"{m}experts.{j}.up_proj.weight") for j in e])
        sd[m + "experts.gate_up_proj"] = torch.cat((gate, up), dim=1)
        sd[m + "experts.down_proj"] = torch.stack([sd.pop(f"{m}experts.{j}.down_proj.weight") for j in e])
    cfg = tiny_config("qwen3_moe", vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                      intermediate_size=c["intermediate_size"], num_layers=c["num_hidden_layers"],
                      num_heads=c["num_attention_heads"], num_kv_heads=c["num_key_value_heads"],
                      head_dim=c["head_dim"], rms_norm_eps=c["rms_norm_eps"], max_position=c["max_position_embeddings"],
                      tie_word_embeddings=True, qk_norm=True, num_experts=c["num_experts"],
                      num_experts_per_tok=c["num_experts_per_tok"], moe_intermediate_size=c["moe_intermediate_size"],
                      norm_topk_prob=True, name="qwen3moe-bench")
    pad = c["vocab_size"] - len(tiny_vocab()[0])
    write_gguf(out, cfg, sd, "F32", extra_tokens=tuple(f"<unused{i}>" for i in range(pad)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
