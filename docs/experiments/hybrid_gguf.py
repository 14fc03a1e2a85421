"""The `ridge bench hybrid` model (Qwen3.5-shaped, random) as llama.cpp's converter writes a qwen35
GGUF (F32; tests/test_gguf_2026.py's writer, which does what convert_hf_to_gguf.py's class does to
each tensor), its vocabulary padded with unused tokens to the model's rows as the converter pads
one, for `ridge bench server` against llama-server on the same file (docs/benchmarks.md, issue 41).

    python -P docs/experiments/hybrid_gguf.py HF_DIR OUT.gguf
    llama-quantize OUT.gguf OUT-Q8_0.gguf Q8_0"""
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import test_gguf_2026 as writer  # noqa: E402
from tiny_models import CHATML, tiny_vocab  # noqa: E402


def main(hf_dir: str, out: str) -> None:
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    rows = model.config.vocab_size

    def padded(w) -> None:
        tokens, types, merges = tiny_vocab()
        tokens = tokens + [f"[PAD{i}]" for i in range(rows - len(tokens))]
        types = types + [5] * (rows - len(types))  # 5: UNUSED, as the converter marks padding
        for add, value in ((w.add_tokenizer_model, "gpt2"), (w.add_tokenizer_pre, "default"),
                           (w.add_token_list, tokens), (w.add_token_types, types), (w.add_token_merges, merges),
                           (w.add_bos_token_id, 1), (w.add_eos_token_id, 2), (w.add_chat_template, CHATML)):
            add(value)

    writer._tokenizer = padded
    writer.write_gguf(Path(out), model, "qwen3_5_text", mtp=False)


if __name__ == "__main__":
    main(*sys.argv[1:3])
