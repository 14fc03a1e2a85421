"""Gemma 2 and Gemma 3 (text) against transformers: tiny random models built by transformers
from a config, saved as safetensors, loaded through ridge's loader; teacher-forced logits,
FP8 weights against transformers on the same e4m3 weights, greedy tokens through the engine
(one pass, prefill chunks, a prefix-cache hit), and the config fields ridge refuses."""
from __future__ import annotations

import json

import pytest
import torch

from engine_utils import greedy, make_engine, prompts, run
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import read_hf_config
from ridge.quant.errors import ModelLoadError
from tiny_models import tiny_config, random_state_dict, tiny_vocab, write_gguf, write_tokenizer_files

transformers = pytest.importorskip("transformers")

VOCAB = len(tiny_vocab()[0])
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6, query_pre_attn_scalar=24,
            pad_token_id=0, bos_token_id=1, eos_token_id=2)
# Windows smaller than the prompt and not a multiple of the engine's 16-token blocks; soft-caps
# small enough that tanh bends the random models' scores and logits.
VARIANTS = {
    "gemma2": ("gemma2", dict(num_hidden_layers=4, sliding_window=12, attn_logit_softcapping=1.5,
                              final_logit_softcapping=2.0)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=5, sliding_window_pattern=3, sliding_window=20,
                                   rope_theta=10000.0, rope_local_base_freq=100.0,
                                   rope_scaling={"rope_type": "linear", "factor": 8.0})),
    "gemma3-untied-bias-cap": ("gemma3_text", dict(num_hidden_layers=3, sliding_window_pattern=2, sliding_window=9,
                                                   tie_word_embeddings=False, attention_bias=True,
                                                   final_logit_softcapping=3.0)),
}
PROMPT = prompts(VOCAB, [80], seed=5)[0]  # 80 positions: five blocks, several windows


def build_hf(kind: str, over: dict, path, seed: int = 0):
    cfg = transformers.AutoConfig.for_model(kind, **{**BASE, **over})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():  # transformers' init leaves norms at 0 and scores near 0: widen both
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("norm.weight") else 0.15)
    model.eval()
    model.save_pretrained(str(path))
    write_tokenizer_files(path)
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, f"relative logit error {err:.2e}"
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() == 1.0


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma(request, tmp_path_factory):
    kind, over = VARIANTS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = build_hf(kind, over, path)
    return path, hf, load_model(path, device="cpu", weights="fp32", use_cache=False)


def test_config_read(gemma):
    path, hf, lm = gemma
    c, cfg = hf.config, lm.config
    assert cfg.arch == c.model_type and cfg.layer_types == c.layer_types
    assert {"sliding_attention", "full_attention"} <= set(cfg.layer_types)
    assert [cfg.layer_window(i) for i in range(cfg.num_layers)] == [
        c.sliding_window if t == "sliding_attention" else None for t in c.layer_types]
    assert cfg.softmax_scale == 24 ** -0.5 and cfg.tie_word_embeddings == c.tie_word_embeddings
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (c.attn_logit_softcapping,
                                                                           c.final_logit_softcapping)
    if c.model_type == "gemma3_text":
        assert cfg.rope_theta == c.rope_parameters["full_attention"]["rope_theta"]
        assert cfg.rope_local_theta == c.rope_parameters["sliding_attention"]["rope_theta"]


def test_fp32_logits_match_transformers(gemma):
    path, hf, lm = gemma
    assert_matches(prompt_logits(lm.model, PROMPT), hf_logits(hf, PROMPT))


def _on_ridge_weights(hf, lm):
    """transformers' model with the weights ridge runs (its e4m3 values times their scales,
    FP8Linear.dequantized: on CPU the layers hold the packed e4m3 bytes; the table and head its
    8-bit codes times their scales there), unfused."""
    import copy

    ref = copy.deepcopy(hf)
    cfg = lm.config
    with torch.no_grad():
        emb = lm.model.embed_tokens
        ref.get_input_embeddings().weight.copy_(emb.dequantized() if hasattr(emb, "dequantized") else emb.weight)
        if not cfg.tie_word_embeddings:
            ref.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
        for ours, theirs in zip(lm.model.layers, ref.model.layers):
            a, m = theirs.self_attn, theirs.mlp
            for w, t in zip(ours.qkv_proj.dequantized().split([cfg.q_size, cfg.kv_size, cfg.kv_size]),
                            (a.q_proj, a.k_proj, a.v_proj)):
                t.weight.copy_(w)
            a.o_proj.weight.copy_(ours.o_proj.dequantized())
            gate, up = ours.gate_up_proj.dequantized().split(cfg.intermediate_size)
            m.gate_proj.weight.copy_(gate)
            m.up_proj.weight.copy_(up)
            m.down_proj.weight.copy_(ours.down_proj.dequantized())
    return ref


def test_fp8_weights_match_transformers_on_the_same_weights(gemma):
    path, hf, _ = gemma
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False)
    first = lm.model.layers[0].o_proj.dequantized()
    assert not torch.equal(first, hf.model.layers[0].self_attn.o_proj.weight)  # really quantized
    assert_matches(prompt_logits(lm.model, PROMPT), hf_logits(_on_ridge_weights(hf, lm), PROMPT))


def _greedy_reference(hf, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' argmax after each prefix of prompt + tokens (teacher-forced)."""
    logits = hf_logits(hf, prompt + tokens)
    return logits[len(prompt) - 1: len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


def test_engine_greedy_one_pass_chunks_and_prefix_hit(gemma):
    path, hf, lm = gemma
    prompt = PROMPT[:70]
    one = run(make_engine(lm, prefill_chunk=128, enable_prefix_caching=False, cpu_weight_format="fp32"),
              [prompt], greedy(20))["r0"]
    assert one == _greedy_reference(hf, prompt, one)
    chunked = run(make_engine(lm, prefill_chunk=16, enable_prefix_caching=False, cpu_weight_format="fp32"),
                  [prompt], greedy(20))["r0"]
    assert chunked == one
    eng = make_engine(lm, prefill_chunk=32, cpu_weight_format="fp32")
    run(eng, [prompt], greedy(4))
    eng.add_request("again", prompt + [7, 8], greedy(20))
    toks, cached = [], 0
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 64  # four full blocks, more than any window
    assert toks == _greedy_reference(hf, prompt + [7, 8], toks)


# llama.cpp's Gemma GGUFs: no query_pre_attn_scalar (head_dim's is used), Gemma 3's period of 6 and
# its sliding layers' RoPE base of 10000.
GGUF_VARIANTS = {
    "gemma2": ("gemma2", dict(num_hidden_layers=4, sliding_window=12, attn_logit_softcapping=1.5,
                              final_logit_softcapping=2.0, query_pre_attn_scalar=16)),
    "gemma3": ("gemma3_text", dict(num_hidden_layers=7, sliding_window=20, rope_theta=20000.0,
                                   rope_scaling={"rope_type": "linear", "factor": 8.0}, query_pre_attn_scalar=16,
                                   tie_word_embeddings=False)),
}


@pytest.mark.parametrize("variant", list(GGUF_VARIANTS))
def test_gguf_matches_transformers(tmp_path, variant):
    kind, over = GGUF_VARIANTS[variant]
    hf = build_hf(kind, over, tmp_path / "hf")
    want = read_hf_config(tmp_path / "hf")
    path = write_gguf(tmp_path / "m.gguf", want, hf.state_dict())  # norms + 1, as llama.cpp's converter
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    got = lm.config
    for field in ("arch", "layer_types", "sliding_window", "softmax_scale", "attn_logit_softcapping",
                  "final_logit_softcapping", "rope_theta", "rope_local_theta", "tie_word_embeddings", "qk_norm"):
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope_scaling == want.rope_scaling or got.rope_scaling["factor"] == want.rope_scaling["factor"]
    assert_matches(prompt_logits(lm.model, PROMPT), hf_logits(hf, PROMPT))


@pytest.mark.parametrize("kind, layers, scalar", [("gemma2", 46, 16), ("gemma2", 26, 32), ("gemma3_text", 62, 16),
                                                  ("gemma3_text", 34, 32)])
def test_gguf_attention_scale_is_llama_cpps(tmp_path, kind, layers, scalar):
    """The 27B models scale by (hidden / heads) ** -0.5, the others by head_dim ** -0.5."""
    from ridge.models.registry import read_config

    cfg = tiny_config(kind, num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=32, max_position=64,
                      sliding_window=8, layer_types=["sliding_attention"] * layers)
    path = write_gguf(tmp_path / "m.gguf", cfg, random_state_dict(cfg, seed=1))
    assert read_config(path).softmax_scale == scalar ** -0.5


def _write_config(tmp_path, kind: str, **over) -> dict:
    c = transformers.AutoConfig.for_model(kind, **BASE, num_hidden_layers=4, sliding_window=8).to_dict()
    c.update(over)
    (tmp_path / "config.json").write_text(json.dumps(c))
    return c


def test_older_config_fields_read_as_transformers_reads_them(tmp_path):
    """Gemma 3 files written before transformers 5: rope_theta, rope_scaling (full layers only),
    rope_local_base_freq and sliding_window_pattern instead of rope_parameters and layer_types."""
    new = _write_config(tmp_path, "gemma3_text", sliding_window_pattern=3,
                        rope_parameters=None, layer_types=None)
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=20000.0, rope_local_base_freq=500.0, rope_scaling={"rope_type": "linear", "factor": 4.0})
    (tmp_path / "config.json").write_text(json.dumps(old))
    cfg = read_hf_config(tmp_path)
    ref = transformers.Gemma3TextConfig(**{k: v for k, v in old.items() if k != "model_type"})
    assert cfg.layer_types == ref.layer_types == ["sliding_attention", "sliding_attention", "full_attention",
                                                  "sliding_attention"]
    assert cfg.rope_theta == ref.rope_parameters["full_attention"]["rope_theta"] == 20000.0
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    assert cfg.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"] == 500.0
    assert cfg.rope_local_scaling is None


@pytest.mark.parametrize("kind, field, value", [
    ("gemma2", "hidden_activation", "gelu"),
    ("gemma3_text", "hidden_activation", "silu"),
    ("gemma3_text", "use_bidirectional_attention", True),
    ("gemma3_text", "attn_logit_softcapping", 50.0),
    ("gemma2", "attn_logit_softcapping", -1.0),
    ("gemma2", "final_logit_softcapping", 0),
    ("gemma2", "query_pre_attn_scalar", 0),
    ("gemma2", "sliding_window", 0),
    ("gemma3_text", "sliding_window", None),
    ("gemma2", "layer_types", ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]),
    ("gemma2", "layer_types", ["full_attention"]),
    ("gemma2", "rope_parameters", {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}),
    ("gemma3_text", "rope_parameters", {"full_attention": {"rope_type": "dynamic", "factor": 2.0},
                                        "sliding_attention": {"rope_type": "default"}}),
    ("gemma3_text", "rope_parameters", {"full_attention": {"rope_type": "default"},
                                        "sliding_attention": {"rope_type": "llama3", "factor": 8.0}}),
])
def test_unsupported_fields_are_refused_by_name(tmp_path, kind, field, value):
    _write_config(tmp_path, kind, **{field: value})
    with pytest.raises(ModelLoadError) as e:
        read_hf_config(tmp_path)
    assert field in str(e.value)


def test_bench_window_model(tmp_path):
    """`ridge bench window`'s random model: the Gemma 3 shape and pattern it claims, and a
    tokenizer its fixtures can prompt."""
    from ridge.bench.window import write_model
    from ridge.tokenizer import Tokenizer

    write_model(tmp_path, "gemma3", window=8, layers=7, vocab=600, max_position=128)
    cfg = read_hf_config(tmp_path)
    assert cfg.arch == "gemma3_text" and (cfg.hidden_size, cfg.num_kv_heads, cfg.head_dim) == (640, 1, 256)
    assert cfg.layer_types == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
    assert (cfg.sliding_window, cfg.rope_theta, cfg.rope_local_theta) == (8, 1_000_000.0, 10000.0)
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert len(tok.encode_chat([{"role": "user", "content": "hello"}])) > 5



# -- Gemma 3 as the Hub ships 4B/12B/27B: Gemma3ForConditionalGeneration (model_type gemma3),
# served as its text model. A tiny random one with a one-layer vision tower, saved by
# transformers; against its logits on text-only input.
VISION = dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=1,
              num_attention_heads=2, image_size=28, patch_size=14)
MM_VARIANTS = {
    "tied": dict(text=dict(num_hidden_layers=4, sliding_window_pattern=2, sliding_window=20,
                           rope_local_base_freq=100.0, rope_scaling={"rope_type": "linear", "factor": 8.0})),
    # the wrapper's tie_word_embeddings decides, not text_config's
    "untied": dict(text=dict(num_hidden_layers=3, sliding_window=9, tie_word_embeddings=True),
                   tie_word_embeddings=False),
}


def build_multimodal(over: dict, path, seed: int = 0):
    text = {**BASE, **over["text"]}
    cfg = transformers.Gemma3Config(text_config=text, vision_config=VISION, mm_tokens_per_image=4,
                                    image_token_index=VOCAB - 1, boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 2,
                                    **{k: v for k, v in over.items() if k != "text"})
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if name.endswith("norm.weight") else 0.15)
    model.eval()
    model.config._attn_implementation = "eager"
    model.save_pretrained(str(path))
    write_tokenizer_files(path)
    return model


@pytest.fixture(scope="module", params=list(MM_VARIANTS))
def multimodal(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-mm-" + request.param)
    return path, build_multimodal(MM_VARIANTS[request.param], path)


def test_multimodal_gemma3_serves_its_text_model(multimodal, caplog):
    path, hf = multimodal
    names = list(hf.state_dict())
    assert any(n.startswith("model.vision_tower.") for n in names)  # a real tower is beside the text
    with caplog.at_level("INFO", logger="ridge.quant"):
        lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    skipped = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(skipped) == 1, skipped
    vision = sum(n.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for n in names)
    assert f"its {vision} vision tower and projector tensors" in skipped[0]
    cfg, text = lm.config, hf.config.text_config
    assert cfg.arch == "gemma3_text" and cfg.layer_types == text.layer_types
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings  # "untied": text_config's says tied
    tied = hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    assert tied == hf.config.tie_word_embeddings
    assert_matches(prompt_logits(lm.model, PROMPT), hf_logits(hf, PROMPT))


def test_multimodal_gemma3_older_layout(multimodal, tmp_path):
    """Files saved before transformers 5 (most of the Hub's): language_model.model.*,
    language_model.lm_head.*, vision_tower.vision_model.*, multi_modal_projector.*."""
    import shutil

    from safetensors.torch import save_file

    path, hf = multimodal
    old = {}
    for name, t in hf.state_dict().items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        for new, was in (("model.language_model.", "language_model.model."), ("lm_head.", "language_model.lm_head."),
                         ("model.vision_tower.", "vision_tower."),
                         ("model.multi_modal_projector.", "multi_modal_projector.")):
            if name.startswith(new):
                old[was + name[len(new):]] = t.contiguous().clone()
                break
        else:
            raise AssertionError(name)
    for f in path.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    save_file(old, str(tmp_path / "model.safetensors"))
    lm = load_model(tmp_path, device="cpu", weights="fp32", use_cache=False)
    assert_matches(prompt_logits(lm.model, PROMPT), hf_logits(hf, PROMPT))
    # a tensor outside the language model, the tower and the projector is refused by name
    save_file({**old, "audio_tower.proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="audio_tower.proj.weight"):
        load_model(tmp_path, device="cpu", weights="fp32", use_cache=False)


def test_multimodal_gemma3_config_fields_are_declared():
    import dataclasses

    from ridge.models.gemma3.config import WRAPPER_DEFAULTS as GEMMA3_WRAPPER_DEFAULTS
    from ridge.models.gemma3.config import WRAPPER_IGNORED as GEMMA3_WRAPPER_IGNORED
    from ridge.models.gemma3.config import WRAPPER_READ as GEMMA3_WRAPPER_READ
    from ridge.quant.hf_config import BASE_IGNORED

    fields = {f.name: f.default for f in dataclasses.fields(transformers.Gemma3Config)}
    assert not set(fields) - GEMMA3_WRAPPER_READ - GEMMA3_WRAPPER_IGNORED - BASE_IGNORED
    assert {k: fields[k] for k in GEMMA3_WRAPPER_DEFAULTS} == GEMMA3_WRAPPER_DEFAULTS


def _write_multimodal_config(tmp_path, text: dict | None = None, **top) -> None:
    c = transformers.Gemma3Config(text_config={**BASE, "num_hidden_layers": 2, "sliding_window": 8},
                                  vision_config=VISION, image_token_index=VOCAB - 1).to_dict()
    c["text_config"].update(text or {})
    c.update(top)
    (tmp_path / "config.json").write_text(json.dumps(c))


@pytest.mark.parametrize("text, top, named", [
    ({"final_logit_softcapping": 30.0}, {}, "text_config.final_logit_softcapping=30.0"),
    ({"sliding_window": 0}, {}, "text_config.sliding_window=0"),
    ({"hidden_activation": "silu"}, {}, "text_config.hidden_activation='silu'"),
    ({"model_type": "siglip_text_model"}, {}, "text_config.model_type"),
    ({}, {"image_token_index": VOCAB}, f"image_token_index={VOCAB}"),
    ({}, {"tie_word_embeddings": "yes"}, "tie_word_embeddings='yes'"),
    ({}, {"text_config": [1]}, "text_config=[1]"),
    ({}, {"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method='gptq'"),
])
def test_multimodal_gemma3_refusals_name_the_field(tmp_path, text, top, named):
    _write_multimodal_config(tmp_path, text, **top)
    with pytest.raises(ModelLoadError) as e:
        read_hf_config(tmp_path)
    assert named in str(e.value)


def test_multimodal_gemma3_older_config(tmp_path):
    """A 4.50-era file: text_config lists only what differs from Gemma3TextConfig's defaults."""
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "mm_tokens_per_image": 256,
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model"}}))
    cfg = read_hf_config(tmp_path)
    ref = transformers.AutoConfig.from_pretrained(str(tmp_path))
    text = ref.text_config
    assert (cfg.hidden_size, cfg.num_layers, cfg.vocab_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        text.hidden_size, text.num_hidden_layers, text.vocab_size, text.num_attention_heads,
        text.num_key_value_heads, text.head_dim)
    assert cfg.layer_types == text.layer_types and cfg.sliding_window == 1024
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0} and cfg.rope_theta == 1_000_000.0
    assert cfg.rope_local_theta == text.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
    assert cfg.tie_word_embeddings is ref.tie_word_embeddings is True


def test_multimodal_gemma3_through_the_engine(multimodal):
    """Greedy tokens through the engine (16-token prefill chunks) against transformers' wrapper,
    teacher-forced."""
    path, hf = multimodal
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    prompt = PROMPT[:40]
    toks = run(make_engine(lm, prefill_chunk=16, cpu_weight_format="fp32"), [prompt], greedy(12))["r0"]
    assert toks == _greedy_reference(hf, prompt, toks)
