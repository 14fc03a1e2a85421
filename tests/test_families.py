"""Every family ridge runs from HF directories, against transformers as the oracle.

Each variant is a tiny random model built by transformers from a config
(AutoConfig.for_model), saved as safetensors and loaded through ridge's loader:
teacher-forced logits over 96 positions (six 16-token KV blocks, past each
window) with fp32 weights, and with FP8 weights against transformers run on
ridge's e4m3 weights; greedy tokens through the engine, its prefill in one pass
and in chunks, with and without a prefix-cache hit. Then the config fidelity
rule: every field of transformers' config classes is declared by the family
(its HFFamily: ridge/models/<family>/), and each value ridge cannot run is refused by name."""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch

from engine_utils import assert_no_leak, greedy, make_engine
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import REGISTRY, read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED
from tiny_models import tiny_vocab, write_gguf, write_tokenizer_files

transformers = pytest.importorskip("transformers")

V = len(tiny_vocab()[0])
N = 96  # teacher-forced positions
BASE = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2,
            pad_token_id=0, initializer_range=0.08)
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.2 * i for i in range(8)],
            "long_factor": [1.5 + 0.5 * i for i in range(8)]}

# id -> (model_type, config fields, ridge's max_model_len). Windows of 16 and 20 tokens against
# blocks of 16: one equal to a block, one not; every prompt is longer than both.
VARIANTS = {
    "llama": ("llama", {}, None),
    "llama-biases-gelu": ("llama", dict(attention_bias=True, mlp_bias=True, hidden_act="gelu"), None),
    "llama-tied-gelu_tanh": ("llama", dict(tie_word_embeddings=True, hidden_act="gelu_pytorch_tanh"), None),
    "llama-rope-linear": ("llama", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), None),
    "llama-rope-llama3": ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                         "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 64}), None),
    "llama-rope-yarn": ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 16.0,
                                                       "original_max_position_embeddings": 64}), None),
    "mistral-window16": ("mistral", dict(sliding_window=16), None),
    "qwen2-window20-from-layer1": ("qwen2", dict(use_sliding_window=True, sliding_window=20, max_window_layers=1,
                                                 tie_word_embeddings=True), None),
    "qwen3-biases": ("qwen3", dict(attention_bias=True), None),
    "phi3-partial-window20": ("phi3", dict(partial_rotary_factor=0.5, sliding_window=20), None),
    # longrope: transformers takes short_factor while the sequence is within the original 64
    # positions and long_factor past them; ridge takes the one its context calls for.
    "phi3-longrope-short": ("phi3", dict(rope_parameters=LONGROPE, original_max_position_embeddings=64), 64),
    "phi3-longrope-long": ("phi3", dict(rope_parameters=LONGROPE, original_max_position_embeddings=64), None),
    "olmo2": ("olmo2", {}, None),
    "olmo2-biases-tied": ("olmo2", dict(attention_bias=True, tie_word_embeddings=True), None),
    "granite": ("granite", dict(embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.1,
                                logits_scaling=4.0, attention_bias=True, mlp_bias=True), None),
}
SU = {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}  # longrope's old name; 4 = 8 rotary dims / 2
# The families llama.cpp's converter writes under their own architecture (Mistral is written as llama).
GGUF_VARIANTS = ["phi3-partial-window20", "phi3-longrope-long", "olmo2", "olmo2-biases-tied", "granite"]
ENGINE_VARIANTS = ["mistral-window16", "qwen2-window20-from-layer1", "phi3-partial-window20", "olmo2", "granite"]


def build_hf(tmp, model_type: str, fields: dict, seed: int = 0, edit=None):
    """-> (transformers model in fp32, its saved directory). Norm weights and biases drawn away
    from their init (ones, zeros), so that a misplaced norm or a dropped bias shows; edit(model)
    changes more before it is saved (tests/test_moe.py: the routers)."""
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn_like(p))
        if edit is not None:
            edit(model)
    path = tmp / model_type
    model.save_pretrained(path)
    write_tokenizer_files(path)
    return model, path


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """name -> (name, transformers model, its directory, token ids, max_model_len), built once."""
    built = {}

    def get(name):
        if name not in built:
            model_type, fields, max_len = VARIANTS[name]
            model, path = build_hf(tmp_path_factory.mktemp(name), model_type, fields)
            ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
            built[name] = name, model, path, ids[: min(N, max_len or N)], max_len
        return built[name]
    return get


@pytest.fixture(params=list(VARIANTS))
def variant(request, variants):
    return variants(request.param)


def hf_logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def assert_match(out: torch.Tensor, ref: torch.Tensor) -> None:
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    top1 = (out.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert rel <= 1e-5 and top1 == 1.0, f"relative error {rel:.2e}, top-1 {top1:.3f}"


def with_ridge_weights(model, lm):
    """A copy of the transformers model computing with ridge's weights as ridge computes with them
    (FP8: e4m3 times its scale, exact in fp32; on CPU the embedding table and head too)."""
    hf = copy.deepcopy(model)
    cfg = lm.config
    with torch.no_grad():
        hf.get_input_embeddings().weight.copy_(_dequantized(lm.model.embed_tokens))
        if not lm.config.tie_word_embeddings:
            hf.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
        for ours, theirs in zip(lm.model.layers, hf.model.layers):
            attn = theirs.self_attn
            qkv = ours.qkv_proj.dequantized()
            if hasattr(attn, "qkv_proj"):  # phi3 ships them fused, as ridge keeps them
                attn.qkv_proj.weight.copy_(qkv)
            else:
                for proj, w in zip((attn.q_proj, attn.k_proj, attn.v_proj),
                                   qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size])):
                    proj.weight.copy_(w)
            attn.o_proj.weight.copy_(ours.o_proj.dequantized())
            _copy_mlp(ours, theirs.mlp, cfg)
    return hf


def _dequantized(embedding) -> torch.Tensor:
    return embedding.dequantized() if hasattr(embedding, "dequantized") else embedding.weight.float()


def _copy_mlp(ours, mlp, cfg) -> None:
    """ridge's MLP weights into transformers': fused (phi3), gate and up, or a mixture of
    experts' stacked experts (tests/test_moe.py), whose router stays as shipped."""
    if hasattr(ours, "experts"):
        gate_up, down = ours.experts.dequantized()  # [E, 2I, H], [E, H, I]
        if hasattr(mlp, "router"):  # gpt-oss: [E, H, 2I] with gate and up interleaved, [E, I, H]
            gate, up = gate_up.transpose(1, 2).chunk(2, dim=-1)
            gate_up, down = torch.stack((gate, up), dim=-1).flatten(-2), down.transpose(1, 2)
        mlp.experts.gate_up_proj.copy_(gate_up)
        mlp.experts.down_proj.copy_(down)
        router = mlp.router if hasattr(mlp, "router") else mlp.gate
        assert torch.equal(router.weight, ours.router.weight), "the router stays as shipped"
        return
    gate_up = ours.gate_up_proj.dequantized()
    if hasattr(mlp, "gate_up_proj"):
        mlp.gate_up_proj.weight.copy_(gate_up)
    else:
        mlp.gate_proj.weight.copy_(gate_up[: cfg.intermediate_size])
        mlp.up_proj.weight.copy_(gate_up[cfg.intermediate_size:])
    mlp.down_proj.weight.copy_(ours.down_proj.dequantized())


@pytest.mark.parametrize("name", GGUF_VARIANTS)
def test_gguf_logits_match_transformers(tmp_path, variants, name):
    """The same weights written as llama.cpp's converter writes them (tests/tiny_models.py): tensor
    names and metadata keys as the gguf package defines them."""
    name, model, path, ids, max_len = variants(name)
    gguf_path = write_gguf(tmp_path / f"{name}.gguf", read_hf_config(path), model.state_dict())
    lm = load_model(gguf_path, device="cpu", weights="fp32", max_model_len=max_len, use_cache=False,
                    show_progress=False)
    assert lm.config.arch == VARIANTS[name][0]
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model, ids)[-1].argmax()))
    return ids[len(prompt):]


def test_fp32_logits_match_transformers(variant):
    name, model, path, ids, max_len = variant
    lm = load_model(path, device="cpu", weights="fp32", max_model_len=max_len, use_cache=False, show_progress=False)
    assert lm.config.arch == VARIANTS[name][0]
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def test_fp8_logits_match_transformers_on_ridges_weights(variant):
    name, model, path, ids, max_len = variant
    lm = load_model(path, device="cpu", weights="fp8", max_model_len=max_len, use_cache=False, show_progress=False)
    hf = with_ridge_weights(model, lm)
    assert any(not torch.equal(a, b) for a, b in zip(hf.parameters(), model.parameters())), "weights not quantized"
    assert_match(prompt_logits(lm.model, ids), hf_logits(hf, ids))


@pytest.mark.parametrize("weights,chunk", [("fp32", 128), ("fp32", 16), ("fp32", 7), ("fp8", 16)],
                         ids=["one-pass", "chunks-of-a-block", "chunks-of-7", "fp8-chunks-of-a-block"])
@pytest.mark.parametrize("name", ENGINE_VARIANTS)
def test_greedy_through_the_engine(variants, name, weights, chunk):
    """Prompts of 50 tokens (past a window and three block boundaries), prefilled at once or in
    chunks; the second shares 32 tokens (two blocks) with the first and must hit the prefix cache.
    FP8: against transformers on ridge's e4m3 weights."""
    name, model, path, ids, _ = variants(name)
    lm = load_model(path, device="cpu", weights=weights, use_cache=False, show_progress=False)
    check_greedy_through_engine(lm, with_ridge_weights(model, lm) if weights == "fp8" else model, ids, chunk)


def check_greedy_through_engine(lm, model, ids: list[int], chunk: int) -> None:
    """ridge's engine (lm) against transformers (model) on two requests of the prompt ids."""
    first, second = ids[:50], ids[:32] + ids[60:78]
    eng = make_engine(lm, prefill_chunk=chunk, max_num_seqs=2)
    got, cached = {}, {}
    for rid, prompt in (("first", first), ("second", second)):
        eng.add_request(rid, prompt, greedy(12))
        got[rid] = []
        while eng.has_unfinished():
            for o in eng.step():
                got[rid] += o.new_token_ids
                cached[rid] = o.num_cached_tokens
    assert cached == {"first": 0, "second": 32}
    assert got == {"first": hf_greedy(model, first, 12), "second": hf_greedy(model, second, 12)}
    assert_no_leak(eng)


# -- config fidelity ---------------------------------------------------------------------------
CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
                  "phi3": "Phi3Config", "olmo2": "Olmo2Config", "granite": "GraniteConfig",
                  "gemma2": "Gemma2Config", "gemma3_text": "Gemma3TextConfig",
                  "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig",
                  "gpt_oss": "GptOssConfig"}  # the last three: tests/test_moe.py


@pytest.mark.parametrize("model_type", list(CONFIG_CLASSES))
def test_every_field_of_transformers_config_is_declared(model_type):
    """Each field of the config class is read (with transformers' default) or declared ignored:
    a field transformers adds fails here until a family says what it does."""
    fam = REGISTRY[model_type].hf
    cls = getattr(transformers, CONFIG_CLASSES[model_type])
    fields = {f.name: f.default for f in dataclasses.fields(cls)}
    undeclared = sorted(set(fields) - fam.fields - fam.ignored - BASE_IGNORED)
    assert not undeclared, f"{model_type}: fields neither read nor ignored: {undeclared}"
    wrong = {k: (v, fields[k]) for k, v in fam.defaults.items() if k in fields and fields[k] != v}
    assert not wrong, f"{model_type}: defaults differ from transformers' (ours, theirs): {wrong}"


def _write_config(tmp_path, model_type: str, **fields):
    d = tmp_path / model_type
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **BASE, **fields}))
    return d


REFUSED = [  # (model_type, fields, what the message names)
    ("llama", dict(hidden_act="relu"), "hidden_act='relu'"),
    ("granite", dict(hidden_act="gelu_fast"), "hidden_act='gelu_fast'"),
    ("llama", dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0}), "rope_parameters.rope_type='dynamic'"),
    ("qwen2", dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}),
     "rope_parameters.rope_type='longrope'"),
    ("llama", dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "mrope_section": [1, 2]}),
     "rope_parameters.mrope_section"),
    ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}),
     "rope_parameters.low_freq_factor"),
    ("llama", dict(partial_rotary_factor=0.5), "partial_rotary_factor=0.5"),
    ("phi3", dict(partial_rotary_factor=0.1875), "partial_rotary_factor=0.1875"),
    ("phi3", dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_parameters.rope_type='linear'"),
    ("phi3", dict(rope_parameters={**LONGROPE, "short_factor": [1.0] * 3}), "rope_parameters.short_factor"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=8, layer_types=["chunked_attention"] * 2), "layer_types"),
    ("qwen3", dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention"]), "layer_types"),
    ("mistral", dict(sliding_window=0), "sliding_window=0"),
    ("llama", dict(attention_bias="yes"), "attention_bias='yes'"),
    ("granite", dict(logits_scaling="four"), "logits_scaling='four'"),
    ("granite", dict(logits_scaling=0), "logits_scaling=0"),
    ("llama", dict(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config.quant_method='gptq'"),
    ("llama", dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
     "quantization_config.weight_block_size"),
    ("dbrx", {}, "unsupported model_type 'dbrx'"),
]


@pytest.mark.parametrize("model_type,fields,named", REFUSED, ids=[r[2].split("=")[0] for r in REFUSED])
def test_values_ridge_cannot_run_are_refused_by_name(tmp_path, model_type, fields, named):
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[").replace(".", r"\.")):
        read_hf_config(_write_config(tmp_path, model_type, **fields))


def test_fields_transformers_reads_are_honoured(tmp_path):
    """What each declared field becomes; the defaults are transformers' where a file leaves one out."""
    qwen = read_hf_config(_write_config(tmp_path, "qwen2", use_sliding_window=True, sliding_window=8,
                                        max_window_layers=1))
    assert qwen.layer_types == ["full_attention", "sliding_attention"] and qwen.sliding_window == 8
    assert qwen.attention_bias and not qwen.o_bias
    off = read_hf_config(_write_config(tmp_path, "qwen3", sliding_window=8))  # use_sliding_window defaults false
    assert off.layer_types is None and off.sliding_window is None and off.qk_norm
    fields = dict(BASE)
    del fields["max_position_embeddings"]
    d = tmp_path / "mistral"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "mistral", **fields}))
    mistral = read_hf_config(d)  # MistralConfig's defaults: a 4096 window on every layer
    assert mistral.arch == "mistral" and mistral.sliding_window == 4096 and mistral.max_position == 131072
    assert mistral.layer_types == ["sliding_attention"] * 2
    phi = read_hf_config(_write_config(tmp_path, "phi3", rope_scaling={**SU},
                                       partial_rotary_factor=0.5, original_max_position_embeddings=64))
    assert phi.rope_scaling["rope_type"] == "longrope" and phi.rotary_dim == 8
    assert phi.rope_scaling["original_max_position_embeddings"] == 64 and phi.rope_scaling["factor"] == 4.0
    granite = read_hf_config(_write_config(tmp_path, "granite", attention_multiplier=0.25, mlp_bias=True))
    assert granite.softmax_scale == 0.25 and granite.mlp_bias and not granite.attention_bias
    gelu = read_hf_config(_write_config(tmp_path, "olmo2", hidden_act="gelu_new"))
    assert gelu.hidden_act == "gelu_pytorch_tanh" and gelu.qk_norm and gelu.rms_norm_eps == 1e-5


def test_a_checkpoint_that_disagrees_with_its_config_is_refused(tmp_path):
    model, path = build_hf(tmp_path, "llama", dict(attention_bias=True))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "attention_bias": False}))
    with pytest.raises(ModelLoadError, match=r"q_proj\.bias, which the config does not declare"):
        load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    (path / "config.json").write_text(json.dumps({**cfg, "mlp_bias": True}))
    with pytest.raises(ModelLoadError, match=r"missing tensor model\.layers\.0\.mlp\.gate_proj\.bias"):
        load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)


@pytest.mark.parametrize("key,value,named", [
    ("llama.expert_shared_count", 1, "llama.expert_shared_count"),
    ("llama.rope.dimension_count", 8, "llama.rope.dimension_count=8"),
    ("olmo2.attention.sliding_window", 0, "olmo2.attention.sliding_window=0"),  # Olmo 3's (ridge/models/olmo3/)
    ("gemma2.expert_count", 8, "gemma2.expert_count"),
    ("gemma3.attn_logit_softcapping", 50, "gemma3.attn_logit_softcapping"),
    ("gemma3.attention.sliding_window_pattern", 3, "gemma3.attention.sliding_window_pattern=3"),
], ids=["unknown-key", "partial-rotary-outside-phi3", "olmo3-window", "gemma-unknown-key", "gemma3-attn-softcap",
        "gemma-pattern"])
def test_gguf_keys_ridge_does_not_honour_are_refused(tmp_path, key, value, named):
    """The GGUF side of the rule: a metadata key under the architecture that no reader honours."""
    import gguf

    from ridge.models.registry import read_gguf_config as read_config
    from ridge.quant.gguf_loader import open_gguf

    arch = key.split(".")[0]
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (("block_count", 2), ("embedding_length", 64), ("feed_forward_length", 96),
                 ("attention.head_count", 4), ("vocab_size", V), (key[len(arch) + 1:], value)):
        w.add_uint32(f"{arch}.{k}", v)
    w.add_tensor("token_embd.weight", torch.zeros(V, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.")):
        read_config(open_gguf(path), path)
