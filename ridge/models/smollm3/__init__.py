"""SmolLM3 (SmolLM3Config): llama's decoder with some layers that apply no RoPE (NoPE):
no_rope_layers holds a flag a layer, 1 where the layer rotates q and k (by default every fourth
layer is NoPE, no_rope_layer_interval), and with use_sliding_window the NoPE layers slide
unless layer_types says otherwise.

GGUF smollm3 (llama.cpp's converter: SmolLM3Model, a LlamaModel): Q and K rows permuted as
llama's; llama.cpp makes every fourth layer NoPE (its n_no_rope_layer_step, not in the file)
and has no sliding window for it."""
from __future__ import annotations

from ridge.quant.gguf_config import GGUFFamily, refuse_yarn_attn_factor
from ridge.quant.hf_config import HFConfig, HFFamily, attention_biases, rope_fields, window_from_layer_types
from ridge.quant.spec import ModelSpec

from ..layers.decoder import CausalLM
from ..llama import LLAMA_DEFAULTS


def _rope_flags(c: HFConfig, n: int) -> list[bool]:
    """Whether each layer applies RoPE, as SmolLM3Config fills no_rope_layers."""
    flags = c.get("no_rope_layers")
    if flags is None:
        every = c.positive_int("no_rope_layer_interval")
        if every is None:
            c.refuse("no_rope_layer_interval", None, "expected a positive integer")
        return [(i + 1) % every != 0 for i in range(n)]
    if not isinstance(flags, list) or len(flags) != n or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        c.refuse("no_rope_layers", flags, f"expected {n} flags, 1 where the layer applies RoPE and 0 where not")
    return [bool(f) for f in flags]


def read_smollm3(c: HFConfig, kw: dict) -> dict:
    n = kw["num_layers"]
    rotary = _rope_flags(c, n)
    # transformers: a window only with use_sliding_window, and then on the NoPE layers by default
    window = c.positive_int("sliding_window") if c.flag("use_sliding_window") else None
    default = ["sliding_attention" if window is not None and not r else "full_attention" for r in rotary]
    types = c.get("layer_types")
    if window is None and isinstance(types, list) and "sliding_attention" in types:
        # transformers' masks slide these layers (by sliding_window) while its attention kernels do not
        c.refuse("layer_types", types, "sliding layers without use_sliding_window and a sliding_window")
    nope = [i for i, r in enumerate(rotary) if not r]
    return dict(**attention_biases(c, mlp=True), **rope_fields(c, kw["head_dim"]),
                **window_from_layer_types(c, n, window, default), nope_layers=nope or None)


def read_smollm3_gguf(a, kw: dict, names: set[str], reader, path) -> dict:
    refuse_yarn_attn_factor("smollm3", a, kw, path)
    nope = [i for i in range(kw["num_layers"]) if (i + 1) % 4 == 0]  # llama.cpp's n_no_rope_layer_step
    return dict(nope_layers=nope or None)


SPEC = ModelSpec(
    "smollm3", CausalLM,
    HFFamily(dict(LLAMA_DEFAULTS, vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                  num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=32768,
                  tie_word_embeddings=True, rope_theta=2_000_000.0, use_sliding_window=False, sliding_window=None,
                  no_rope_layers=None, no_rope_layer_interval=4, layer_types=None, attention_bias=False,
                  mlp_bias=False), read_smollm3),
    GGUFFamily("smollm3", read=read_smollm3_gguf, permuted_qk=True, keys=frozenset({"rope.scaling.attn_factor"})),
)
