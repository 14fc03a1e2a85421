"""Mixtures of experts (issue 26): the expert computation's CPU path against its reference and
the reference against transformers' own expert modules; Qwen3-MoE and Mixtral against
transformers as the oracle (tiny random models, as tests/test_families.py: fp32 logits, FP8
against transformers on ridge's e4m3 weights, greedy through the engine, GGUF); a token whose
experts tie in the router; the config fields; `ridge plan`'s MoE arithmetic."""
from __future__ import annotations

import json

import pytest
import torch

from ridge.config import ModelShape
from ridge.kernels import native, ops
from ridge.kernels.moe import CpuExperts, fused_moe_cpu, fused_moe_ref
from ridge.models.loader import load_model
from ridge.models.gpt_oss.config import ROPE as GPT_OSS_ROPE
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import read_hf_config
from ridge.plan import format_plan, make_plan, moe_token_budget_knee, token_budget_knee
from ridge.quant.errors import ModelLoadError
from ridge.quant.experts import FP8Experts
from ridge.quant.fp8 import quantize_fp8
from test_families import (BASE, V, _write_config, assert_match, build_hf, check_greedy_through_engine, hf_logits,
                           with_ridge_weights)
from tiny_models import write_gguf

transformers = pytest.importorskip("transformers")

N = 96


# -- the expert computation -----------------------------------------------------------------------
def _routing(T: int, E: int, k: int, seed: int, skew: bool = True):
    """k distinct experts a token, drawn unevenly (expert e weighted 2^-e where skew): some
    experts take most tokens, the last ones none."""
    g = torch.Generator().manual_seed(seed)
    p = torch.tensor([2.0 ** -e for e in range(E)]) if skew else torch.ones(E)
    ids = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(T)])
    w = torch.softmax(torch.randn(T, k, generator=g), dim=-1)
    return ids, w


def _experts(E: int, H: int, inter: int, seed: int, fp8: bool, bias: bool = False):
    g = torch.Generator().manual_seed(seed)
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g) * 0.1, torch.randn(E, H, inter, generator=g) * 0.1
    b13 = torch.randn(E, 2 * inter, generator=g) * 0.2 if bias else None
    b2 = torch.randn(E, H, generator=g) * 0.2 if bias else None
    if not fp8:
        return w13, None, w2, None, b13, b2
    (q13, s13), (q2, s2) = quantize_fp8(w13, "absmax"), quantize_fp8(w2, "absmax")
    return q13, s13, q2, s2, b13, b2


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_cpu_path_matches_the_reference(k, fp8):
    """Uneven loads (expert e drawn with weight 2^-e: the last experts get no tokens), one
    token and many; FP8 weights upcast per expert as the reference does."""
    E, H, inter = 16, 48, 40
    w13, s13, w2, s2, _, _ = _experts(E, H, inter, seed=k, fp8=fp8)
    for T in (1, 3, 37):
        ids, w = _routing(T, E, k, seed=T)
        x = torch.randn(T, H)
        ref = fused_moe_ref(x, w13, s13, w2, s2, ids, w)
        got = fused_moe_cpu(x, w13, s13, w2, s2, ids, w)
        assert _rel(got, ref) <= 1e-6, (T, k)
        if T == 37:
            assert torch.bincount(ids.reshape(-1), minlength=E)[-1] == 0, "an expert without tokens"


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_pytorch_tanh", "swigluoai"])
def test_cpu_path_activations_biases_and_int32_ids(act):
    E, H, inter, T, k = 8, 32, 24, 21, 2
    w13, s13, w2, s2, b13, b2 = _experts(E, H, inter, seed=3, fp8=True, bias=True)
    ids, w = _routing(T, E, k, seed=5)
    x = torch.randn(T, H) * 3  # past swigluoai's clamp at 7 somewhere
    kw = dict(b_gate_up=b13, b_down=b2, act=act, swiglu_alpha=1.702, swiglu_limit=7.0)
    ref = fused_moe_ref(x, w13, s13, w2, s2, ids, w, **kw)
    assert _rel(fused_moe_cpu(x, w13, s13, w2, s2, ids.int(), w, **kw), ref) <= 1e-6
    assert _rel(ops.fused_moe(x, w13, s13, w2, s2, ids, w, **kw), ref) <= 1e-6


def test_cpu_path_through_the_experts_cpu_formats():
    """FP8Experts on CPU without ridge's C kernels: the stacked weights upcast at load, a
    CpuLinear per expert product (what the format measurement chooses among); in bf16 copies
    for steps of up to 4 rows the products differ from fp32 by bf16's rounding of the
    activations and weights only. (With the kernels: tests/test_moe_native.py.)"""
    from ridge.kernels.cpu_linear import ShapeFormat

    E, H, inter, k = 8, 64, 32, 2
    w13, s13, w2, s2, _, _ = _experts(E, H, inter, seed=1, fp8=True)
    mod = FP8Experts(E, H, inter)
    with native.off():
        mod.load({"gate_up_proj.weight": w13, "gate_up_proj.weight_scale": s13, "down_proj.weight": w2,
                  "down_proj.weight_scale": s2}, torch.device("cpu"), torch.float32)
    assert mod.w_gate_up.dtype == torch.float32 and mod.w_gate_up_scale is None
    assert isinstance(mod.cpu, CpuExperts) and len(mod.cpu_weights()) == 2 * E
    assert mod.cpu.gate_up[3].weight.data_ptr() == mod.w_gate_up[3].data_ptr(), "a view of the stacked weight"
    ids, w = _routing(9, E, k, seed=2)
    x = torch.randn(9, H)
    ref = fused_moe_ref(x, w13, s13, w2, s2, ids, w)
    assert _rel(mod.forward(x, ids, w), ref) <= 1e-6
    for m in mod.cpu_weights():
        m.use(ShapeFormat.bf16_up_to(4))
    assert mod.cpu.gate_up[0].kind(4) == "bf16" and mod.cpu.gate_up[0].kind(5) == "fp32"
    assert 0 < _rel(mod.forward(x, ids, w), ref) <= 2e-2


def _hf_experts(model_type: str, **fields):
    config = transformers.AutoConfig.for_model(model_type, **{**BASE, **fields})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model.model.layers[0].mlp.experts


@pytest.mark.parametrize("k", [1, 2, 4])
def test_the_reference_is_transformers_experts(k):
    """fused_moe_ref against transformers' own expert module (Qwen3MoeExperts: [gate | up] rows
    in gate_up_proj [E, 2I, H], as ridge stacks them), on the same routing."""
    experts = _hf_experts("qwen3_moe", num_experts=8, num_experts_per_tok=k, moe_intermediate_size=32)
    ids, w = _routing(29, 8, k, seed=k)
    x = torch.randn(29, 64)
    with torch.no_grad():
        theirs = experts(x, ids, w)
    ours = fused_moe_ref(x, experts.gate_up_proj.data, None, experts.down_proj.data, None, ids, w)
    assert _rel(ours, theirs) <= 1e-6


def test_swigluoai_is_gpt_oss_experts():
    """act=swigluoai with biases against GptOssExperts (its gate_up_proj [E, H, 2I] with gate and
    up interleaved along the columns, down_proj [E, I, H]: transposed and split for ridge)."""
    experts = _hf_experts("gpt_oss", num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                          num_attention_heads=4, head_dim=16)
    with torch.no_grad():
        for p in (experts.gate_up_proj, experts.down_proj):
            p.normal_(0, 0.3)
        for p in (experts.gate_up_proj_bias, experts.down_proj_bias):
            p.normal_(0, 0.5)
    ids, w = _routing(17, 8, 2, seed=1)
    x = torch.randn(17, 64) * 2
    with torch.no_grad():
        theirs = experts(x, ids, w)
    gu, gub = experts.gate_up_proj.data.transpose(1, 2), experts.gate_up_proj_bias.data  # [E, 2I, H], [E, 2I]
    w13 = torch.cat([gu[:, 0::2], gu[:, 1::2]], dim=1)
    b13 = torch.cat([gub[:, 0::2], gub[:, 1::2]], dim=1)
    ours = fused_moe_ref(x, w13, None, experts.down_proj.data.transpose(1, 2).contiguous(), None, ids, w,
                         b_gate_up=b13, b_down=experts.down_proj_bias.data, act="swigluoai",
                         swiglu_alpha=experts.alpha, swiglu_limit=experts.limit)
    assert _rel(ours, theirs) <= 1e-6


# -- the families against transformers ----------------------------------------------------------
VARIANTS = {
    "qwen3_moe": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                    norm_topk_prob=True)),
    "qwen3_moe-unnormed-dense-layer-biases": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2,
                                                                moe_intermediate_size=24, norm_topk_prob=False,
                                                                mlp_only_layers=[1], attention_bias=True)),
    "qwen3_moe-window16": ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                             use_sliding_window=True, sliding_window=16)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral-window16-top1": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=1, sliding_window=16,
                                              tie_word_embeddings=True)),
    # gpt-oss: sinks, biases, the clamped SwiGLU (a limit of 0.3 clamps most values), YaRN (its
    # default rope_parameters), sliding (16) and full layers, the router's top-k-then-softmax.
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=16)),
    "gpt_oss-clamped-full-first": ("gpt_oss", dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32,
                                                   sliding_window=20, swiglu_limit=0.3,
                                                   layer_types=["full_attention", "sliding_attention"])),
}
# llama.cpp's qwen3moe has no dense layers, biases or unnormalised routing, and its llama
# (Mixtral) no window: the variants the format can hold.
GGUF_VARIANTS = ["qwen3_moe", "mixtral"]


def _routers(model) -> None:
    """Routers drawn wider than transformers' init, so that routing is decided by margins, not
    by rounding; gpt-oss's sinks drawn (their init is zeros)."""
    for layer in model.model.layers:
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is not None:
            router.weight.normal_(0, 0.5)
        if hasattr(layer.self_attn, "sinks"):
            layer.self_attn.sinks.normal_(0, 1)


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            model_type, fields = VARIANTS[name]
            model, path = build_hf(tmp_path_factory.mktemp(name), model_type, fields, edit=_routers)
            ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(7)).tolist()
            built[name] = name, model, path, ids
        return built[name]
    return get


@pytest.fixture(params=list(VARIANTS))
def variant(request, variants):
    return variants(request.param)


def test_fp32_logits_match_transformers(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    assert lm.config.arch == VARIANTS[name][0] and lm.config.num_experts
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def test_fp8_logits_match_transformers_on_ridges_weights(variant):
    name, model, path, ids = variant
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False)
    hf = with_ridge_weights(model, lm)
    assert any(not torch.equal(a, b) for a, b in zip(hf.parameters(), model.parameters())), "weights not quantized"
    assert_match(prompt_logits(lm.model, ids), hf_logits(hf, ids))


def test_the_layers_ridge_builds(variants):
    _, _, path, _ = variants("qwen3_moe-unnormed-dense-layer-biases")
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    cfg = lm.config
    assert cfg.moe_layers == [0] and [cfg.is_moe_layer(i) for i in range(2)] == [True, False]
    first, second = lm.model.layers
    assert hasattr(first, "experts") and not hasattr(first, "gate_up_proj")
    assert second.gate_up_proj.weight.shape == (2 * 96, 64) and not hasattr(second, "experts")
    assert not cfg.norm_topk_prob and cfg.o_bias


@pytest.mark.parametrize("name", GGUF_VARIANTS)
def test_gguf_logits_match_transformers(tmp_path, variants, name):
    """The experts stacked as llama.cpp's converter stacks them (ffn_{gate,up,down}_exps, the
    router ffn_gate_inp; Mixtral under general.architecture llama with its Q/K rows permuted)."""
    name, model, path, ids = variants(name)
    cfg = read_hf_config(path)
    gguf_path = write_gguf(tmp_path / f"{name}.gguf", cfg, model.state_dict())
    lm = load_model(gguf_path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    got = lm.config
    assert (got.arch, got.num_experts, got.num_experts_per_tok, got.moe_intermediate_size, got.norm_topk_prob) == \
        (cfg.arch, cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, True)
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


@pytest.mark.parametrize("weights,chunk", [("fp32", 128), ("fp32", 7), ("fp8", 16)],
                         ids=["one-pass", "chunks-of-7", "fp8-chunks-of-a-block"])
@pytest.mark.parametrize("name", ["qwen3_moe-unnormed-dense-layer-biases", "mixtral-window16-top1", "gpt_oss"])
def test_greedy_through_the_engine(variants, name, weights, chunk):
    """Prompts of 50 tokens, prefilled at once or in chunks; the second shares 32 tokens with the
    first and hits the prefix cache (tests/test_families.py's check)."""
    name, model, path, ids = variants(name)
    lm = load_model(path, device="cpu", weights=weights, use_cache=False, show_progress=False)
    check_greedy_through_engine(lm, with_ridge_weights(model, lm) if weights == "fp8" else model, ids, chunk)


def _tie(model) -> None:
    """Experts 1, 3 and 5 of every layer get one router row (so exactly equal logits for every
    token), scaled up: where that logit is large, two of the three take the token (top 2), as
    torch.topk breaks the tie. Their own weights differ, so another tie-break changes the output."""
    _routers(model)
    for layer in model.model.layers:
        g = layer.mlp.gate.weight
        g[3] = g[1] = g[5] = g[1] * 4


def test_experts_tied_in_the_router_break_as_transformers(tmp_path):
    model, path = build_hf(tmp_path, "qwen3_moe", VARIANTS["qwen3_moe"][1], edit=_tie)
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(3)).tolist()
    router = lm.model.layers[0].router
    h = torch.randn(N, 64)
    logits = torch.nn.functional.linear(h, router.weight)
    assert torch.equal(logits[:, 1], logits[:, 3]) and torch.equal(logits[:, 1], logits[:, 5])
    chosen, _ = router.forward(h)
    decided = sum(set(row) <= {1, 3, 5} for row in chosen.tolist())
    assert decided >= N // 4, f"the tie decides only {decided} of {N} tokens"
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))
    # The test can fail: ties broken towards the higher index give other logits.
    for layer in lm.model.layers:
        layer.router.forward = lambda h, r=layer.router: _reversed_tie(r, h)
    assert _rel(prompt_logits(lm.model, ids), hf_logits(model, ids)) > 1e-3


def _reversed_tie(router, h):
    """The router with ties broken the other way (torch.topk over the experts in reverse order)."""
    probs = torch.softmax(torch.nn.functional.linear(h.float(), router.weight), dim=-1)
    w, rev = torch.topk(probs.flip(-1), router.k, dim=-1)
    return probs.shape[-1] - 1 - rev, w / w.sum(-1, keepdim=True)


def test_stacked_checkpoints_load_as_per_expert_ones(tmp_path, variants):
    """transformers 5 saves experts one tensor each, as checkpoints ship them (Qwen3-MoE's
    mlp.experts.{e}.gate_proj, Mixtral's block_sparse_moe.experts.{e}.w1 / w3 / w2), reversing
    its in-memory stacking; its in-memory names (mlp.experts.gate_up_proj [E, 2I, H]) load too."""
    from safetensors.torch import load_file, save_file

    for name, per_expert in (("qwen3_moe", "mlp.experts.0.gate_proj.weight"),
                             ("mixtral", "block_sparse_moe.experts.0.w1.weight")):
        _, model, path, ids = variants(name)
        assert f"model.layers.0.{per_expert}" in load_file(str(path / "model.safetensors"))
        d = tmp_path / name
        d.mkdir()
        sd = model.state_dict()
        assert "model.layers.0.mlp.experts.gate_up_proj" in sd
        save_file({k: v.contiguous() for k, v in sd.items() if k != "lm_head.weight" or not model.config.tie_word_embeddings},
                  str(d / "model.safetensors"))
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            (d / f).write_text((path / f).read_text())
        lm = load_model(d, device="cpu", weights="fp32", use_cache=False, show_progress=False)
        assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


def _to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8), OCP MX: each 32
    values an e8m0 exponent (bias 127) and e2m1 codes, two a byte, the low nibble first."""
    from ridge.quant.mxfp4 import FP4_VALUES

    g = w.reshape(*w.shape[:-1], -1, 32)
    e = torch.floor(torch.log2(g.abs().amax(-1).clamp(min=2.0 ** -100) / 6)).clamp(-120, 120)
    lut = torch.tensor(FP4_VALUES)
    codes = ((g / torch.exp2(e)[..., None])[..., None] - lut).abs().argmin(-1).to(torch.uint8)  # [..., G, 32]
    return codes[..., 0::2] | (codes[..., 1::2] << 4), (e + 127).to(torch.uint8)


def test_gpt_oss_mxfp4_experts(tmp_path):
    """The released checkpoints' MXFP4 experts (gate_up_proj_blocks / _scales, down_proj_...),
    dequantized at load: against transformers' own dequantizer (convert_moe_packed_tensors) put
    into its model."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, path = build_hf(tmp_path, "gpt_oss", VARIANTS["gpt_oss"][1], edit=_routers)
    sd = load_file(str(path / "model.safetensors"))
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            ex, p = layer.mlp.experts, f"model.layers.{i}.mlp.experts."
            for name in ("gate_up_proj", "down_proj"):
                blocks, scales = _to_mxfp4(getattr(ex, name).transpose(1, 2))  # shipped [E, out, in]
                getattr(ex, name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                del sd[p + name]
                sd[p + name + "_blocks"], sd[p + name + "_scales"] = blocks, scales
    save_file(sd, str(path / "model.safetensors"))
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": {"quant_method": "mxfp4"}}))
    ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    assert_match(prompt_logits(lm.model, ids), hf_logits(model, ids))


# -- config fidelity -------------------------------------------------------------------------------
REFUSED = [
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok=5"),
    ("qwen3_moe", dict(num_experts=4, num_local_experts=8), "num_local_experts=8"),
    ("qwen3_moe", dict(decoder_sparse_step=0), "decoder_sparse_step=0"),
    ("qwen3_moe", dict(mlp_only_layers="all"), "mlp_only_layers='all'"),
    ("qwen3_moe", dict(norm_topk_prob="yes"), "norm_topk_prob='yes'"),
    ("qwen3_moe", dict(moe_intermediate_size=0), "moe_intermediate_size=0"),
    ("mixtral", dict(num_local_experts=0), "num_local_experts=0"),
    ("mixtral", dict(num_experts_per_tok=3, num_local_experts=2), "num_experts_per_tok=3"),
    ("mixtral", dict(sliding_window=0), "sliding_window=0"),
    ("gpt_oss", dict(swiglu_limit=0), "swiglu_limit=0"),
    ("gpt_oss", dict(num_local_experts=0), "num_local_experts=0"),
    ("gpt_oss", dict(layer_types=["sliding_attention"]), "layer_types"),
    ("gpt_oss", dict(quantization_config={"quant_method": "gptq"}), "quantization_config.quant_method='gptq'"),
    ("qwen3_moe", dict(quantization_config={"quant_method": "mxfp4"}), "quantization_config.quant_method='mxfp4'"),
    ("qwen2_moe", {}, "unsupported model_type 'qwen2_moe'"),
]


@pytest.mark.parametrize("model_type,fields,named", REFUSED, ids=[r[2].split("=")[0] for r in REFUSED])
def test_values_ridge_cannot_run_are_refused_by_name(tmp_path, model_type, fields, named):
    with pytest.raises(ModelLoadError, match=named.replace("[", r"\[").replace(".", r"\.")):
        read_hf_config(_write_config(tmp_path, model_type, **fields))


def test_fields_are_honoured(tmp_path):
    q = read_hf_config(_write_config(tmp_path, "qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2,
                                     num_experts=8, num_experts_per_tok=2, mlp_only_layers=[3]))
    assert q.moe_layers == [1] and q.num_experts == 8 and q.moe_intermediate_size == 768  # Qwen3MoeConfig's default
    assert q.qk_norm and q.moe_router == "softmax_topk" and not q.norm_topk_prob and q.sliding_window is None
    alias = read_hf_config(_write_config(tmp_path, "qwen3_moe", num_local_experts=16))  # the class's attribute_map
    assert alias.num_experts == 16 and alias.moe_layers is None
    dense = read_hf_config(_write_config(tmp_path, "qwen3_moe", num_experts=0))
    assert dense.num_experts == 0 and not dense.is_moe_layer(0)
    m = read_hf_config(_write_config(tmp_path, "mixtral", sliding_window=32))
    assert m.norm_topk_prob and m.moe_intermediate_size == 96 and m.layer_types == ["sliding_attention"] * 2
    assert m.num_experts == 8 and m.num_experts_per_tok == 2 and m.rope_theta == 1_000_000.0
    g = read_hf_config(_write_config(tmp_path, "gpt_oss", num_hidden_layers=4))  # GptOssConfig's defaults
    assert g.layer_types == ["sliding_attention", "full_attention"] * 2 and g.sliding_window == 128
    assert g.rope_scaling["rope_type"] == "yarn" and g.rope_scaling["factor"] == 32.0 and g.rope_theta == 150000.0
    assert (g.moe_router, g.moe_act, g.moe_bias, g.attention_sinks, g.o_bias) == ("topk_softmax", "swigluoai", True,
                                                                                  True, True)
    assert g.num_experts == 128 and g.num_experts_per_tok == 4 and g.moe_intermediate_size == 96


# -- ridge plan ------------------------------------------------------------------------------------
QWEN3_30B_A3B = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                     num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                     max_position_embeddings=40960, tie_word_embeddings=False)


def test_plan_counts_qwen3_30b_a3b(tmp_path):
    """Qwen3-30B-A3B's config: 30.5B parameters, 3.3B active (its model card's figures)."""
    d = tmp_path / "q"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", **QWEN3_30B_A3B}))
    s = read_hf_config(d).shape()
    assert s.num_experts == 128 and s.experts_per_tok == 8 and s.moe_layers == 48
    assert 30.4e9 < s.num_params < 30.6e9 and 3.3e9 < s.num_active_params < 3.4e9
    assert s.params_read(1) == pytest.approx(s.num_active_params)
    assert s.experts_touched(16) == pytest.approx(128 * (1 - (1 - 8 / 128) ** 16))
    plan = make_plan(s, gpu="h100", weights="fp8", block_size=16, batch=16)
    e = plan.moe
    assert e.bytes_per_token_1 == pytest.approx(s.num_active_params)  # fp8: a byte a parameter
    assert e.bytes_per_token_batch < e.bytes_per_token_1  # shared experts amortise over the batch
    dense_knee = token_budget_knee(plan.ridge["fp8"], 1)
    assert plan.knees["fp8 weights, fp8 math"] > 5 * dense_knee  # the experts see T * k / E rows each
    text = format_plan(plan)
    assert "128 experts, 8 a token, in 48 layers" in text and "3.35B active" in text


def test_moe_knee_reduces_to_the_dense_one():
    dense = ModelShape("d", 4, 2, 64, num_params=10**9)
    assert moe_token_budget_knee(dense, 295.0, 1) == pytest.approx(token_budget_knee(295.0, 1), rel=1e-6)
    one = ModelShape("m", 4, 2, 64, num_params=10**9, num_experts=8, experts_per_tok=8, expert_params=10**7,
                     moe_layers=4)  # every expert every token: dense
    assert moe_token_budget_knee(one, 295.0, 2) == pytest.approx(token_budget_knee(295.0, 2), rel=1e-6)


def test_a_moe_prefill_chunk_grows_by_experts_over_k():
    """Each expert sees the rows a dense layer's product sees at the dense chunk (T k / E rows at
    T tokens); never less than the dense chunk, never past MAX_BUDGET."""
    from ridge.engine.budget import MAX_BUDGET, default_token_budget, moe_prefill_chunk

    assert moe_prefill_chunk(64, 32, 4) == 512 and moe_prefill_chunk(64, 8, 8) == 64
    assert moe_prefill_chunk(64, 60, 4) == 960 and moe_prefill_chunk(64, 10, 3) == 224  # whole 16s, rounded up
    assert moe_prefill_chunk(1024, 128, 8) == MAX_BUDGET
    dense, _ = default_token_budget(torch.device("cpu"), 4, False, given_ridge=10.0)
    moe, info = default_token_budget(torch.device("cpu"), 4, False, given_ridge=10.0, experts=(32, 4))
    assert dense == 64 and moe == info["budget"] == 512


def test_plan_cli_moe_flags(capsys):
    from ridge.cli import main

    assert main(["plan", "--layers", "48", "--kv-heads", "4", "--head-dim", "128", "--params", "30.5B",
                 "--experts", "128", "--experts-per-tok", "8", "--expert-params", "4718592", "--batch", "32",
                 "--gpu", "4090"]) == 0
    out = capsys.readouterr().out
    assert "128 experts, 8 a token, in 48 layers" in out and "batch 32" in out
    assert main(["plan", "--layers", "4", "--kv-heads", "4", "--head-dim", "128", "--experts", "8"]) == 2


def test_cpu_format_measurement_sees_every_expert(variants):
    from ridge.engine.cpu_format import cpu_layers

    _, _, path, _ = variants("qwen3_moe-unnormed-dense-layer-biases")
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False)
    layers = cpu_layers(lm.model)
    # 2 layers x (qkv, o) + the dense layer's gate_up and down + 6 experts x 2 products + the head
    assert len(layers) == 2 * 2 + 2 + 6 * 2 + 1
    assert {m.shape for m in layers} >= {(48, 64), (64, 24)}
    assert all(m.is_packed == bool(native.fp8_linear_isa()) for m in layers if m.shape in ((48, 64), (64, 24)))


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_a_moe_model_step_through_triton(variants, name):
    """The whole model through ops.use_triton() (the interpreter: the grouped expert kernel,
    and for gpt-oss the sinks, biases and clamped SwiGLU in it) against the CPU path."""
    _, _, path, ids = variants(name)
    with native.off():  # the experts upcast at load, so that the grouped kernel runs fp32 as the CPU path does
        lm = load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False)
    expected = prompt_logits(lm.model, ids[:40])
    with ops.use_triton():
        got = prompt_logits(lm.model, ids[:40])
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def _write_gpt_oss_gguf(path, model, hf_cfg: dict):
    """A gpt-oss GGUF as llama.cpp's converter writes one (conversion/gpt_oss.py, GptOssModel):
    gate and up split out of the interleaved gate_up, the experts in MXFP4 (the gguf package's
    quantizer, ggml's block layout), biases and sinks in F32, the tiny vocabulary."""
    import gguf
    from gguf.quants import quantize

    from tiny_models import tiny_vocab

    mx = gguf.GGMLQuantizationType.MXFP4
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    c = hf_cfg
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(c["rope_parameters"]["factor"])
    w.add_rope_scaling_orig_ctx_len(c["rope_parameters"]["original_max_position_embeddings"])
    w.add_expert_count(c["num_local_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_sliding_window(c["sliding_window"])
    w.add_expert_feed_forward_length(c["intermediate_size"])
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def put(name, t, q=False):
        arr = t.detach().float().contiguous().numpy()
        if q:
            data = quantize(arr, mx)
            w.add_tensor(name, data, raw_shape=data.shape, raw_dtype=mx)
        else:
            w.add_tensor(name, arr)

    put("token_embd.weight", model.model.embed_tokens.weight)
    put("output_norm.weight", model.model.norm.weight)
    put("output.weight", model.lm_head.weight)
    for i, layer in enumerate(model.model.layers):
        a, m, b = layer.self_attn, layer.mlp, f"blk.{i}."
        put(b + "attn_norm.weight", layer.input_layernorm.weight)
        put(b + "post_attention_norm.weight", layer.post_attention_layernorm.weight)
        for p, proj in (("q", a.q_proj), ("k", a.k_proj), ("v", a.v_proj), ("output", a.o_proj)):
            put(b + f"attn_{p}.weight", proj.weight)
            put(b + f"attn_{p}.bias", proj.bias)
        put(b + "attn_sinks.weight", a.sinks)
        put(b + "ffn_gate_inp.weight", m.router.weight)
        put(b + "ffn_gate_inp.bias", m.router.bias)
        gate_up = m.experts.gate_up_proj.transpose(1, 2)  # [E, 2I, H], gate and up interleaved
        put(b + "ffn_gate_exps.weight", gate_up[:, 0::2], q=True)
        put(b + "ffn_up_exps.weight", gate_up[:, 1::2], q=True)
        put(b + "ffn_gate_exps.bias", m.experts.gate_up_proj_bias[:, 0::2])
        put(b + "ffn_up_exps.bias", m.experts.gate_up_proj_bias[:, 1::2])
        put(b + "ffn_down_exps.weight", m.experts.down_proj.transpose(1, 2), q=True)
        put(b + "ffn_down_exps.bias", m.experts.down_proj_bias)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _mxfp4_experts(model) -> None:
    """Experts drawn wider (so that MXFP4's steps are not all zero) and rounded through the gguf
    package's MXFP4, so that the file holds the model's weights exactly; routers and sinks as above."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    _routers(model)
    mx = GGMLQuantizationType.MXFP4
    for layer in model.model.layers:
        ex = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(ex, name)
            t = (p * 8).transpose(1, 2).contiguous().numpy()  # [E, out, in]: blocks along the input
            back = torch.from_numpy(dequantize(quantize(t, mx), mx).copy()).reshape(t.shape)
            p.copy_(back.transpose(1, 2))


def test_gpt_oss_gguf_with_mxfp4_experts_matches_transformers(tmp_path):
    """llama.cpp's gpt-oss layout read back: the config as the HF path reads it (YaRN with
    llama.cpp's truncated bounds, which the HF model is given), logits as transformers'."""
    rope = {**GPT_OSS_ROPE, "truncate": True, "rope_theta": 150000.0}
    model, path = build_hf(tmp_path, "gpt_oss", {**VARIANTS["gpt_oss"][1], "rope_parameters": rope},
                           edit=_mxfp4_experts)
    hf_cfg = json.loads((path / "config.json").read_text())
    gguf_path = _write_gpt_oss_gguf(tmp_path / "gpt-oss.gguf", model, hf_cfg)
    ours = load_model(gguf_path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    hf = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    fields = ("arch", "num_experts", "num_experts_per_tok", "moe_intermediate_size", "moe_router", "moe_act",
              "swiglu_alpha", "swiglu_limit", "sliding_window", "layer_types", "attention_sinks", "o_bias",
              "attention_bias")
    assert {f: getattr(ours.config, f) for f in fields} == {f: getattr(hf.config, f) for f in fields}
    assert ours.config.rope_scaling["rope_type"] == "yarn"  # its bounds are checked by the logits
    ids = torch.randint(3, V, (N,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_match(prompt_logits(ours.model, ids), hf_logits(model, ids))
