"""Qwen3.5's multi-token-prediction head (mtp.*) as a draft proposer (issue 41, "Their own draft
heads"). transformers ignores the mtp.* tensors, so the head's oracle is the definition written
out below in plain torch from the checkpoint's tensors. Tiny random Qwen3.5 dense and MoE models
are built by transformers and saved; random mtp.* tensors are added to their safetensors.

- greedy through the engine with the head (chosen with no flag) equals greedy with
  `--speculative off`, batch 1 and 16, with drafts made, some accepted and some rejected (which
  rolls the recurrent states back); a seeded sampled request is unchanged by it too;
- the head's logits over a prompt equal the plain torch definition (fp32, relative error <= 1e-5);
- mtp_num_hidden_layers: 0 (or no mtp.* tensors) runs without a head, 2 is refused by name;
- the memory plan counts the head's weights and its KV per token.

Acceptance needs a head that agrees with the target now and then: both are damped (their
layers' output projections scaled down, the embeddings tied), so the target tends to repeat the
token it reads and the head, whose fc leans on the embedding half, drafts that repeat."""
from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine_utils import assert_no_leak, make_engine, run_named
from ridge.cache.kv_cache import KVCache
from ridge.config import kv_bytes_per_token
from ridge.engine.sampling_params import SamplingParams
from ridge.kernels.metadata import AttentionMetadata
from ridge.models.loader import load_model
from ridge.models.qwen3_5.mtp import head_config, load_mtp
from ridge.quant.errors import ModelLoadError
from test_families import N, V, assert_match, build_hf
from test_qwen3_next import EXPERTS, LINEAR, centred_norms_and_decisive_routers

transformers = pytest.importorskip("transformers")

DAMP = 0.5  # the layers' output projections' scale: how often the target repeats its input token
SHAPE = dict(num_hidden_layers=4, tie_word_embeddings=True, **LINEAR)
VARIANTS = {"dense": ("qwen3_5_text", SHAPE), "moe": ("qwen3_5_moe_text", dict(SHAPE, **EXPERTS))}


def _damped(model) -> None:
    centred_norms_and_decisive_routers(model)
    for name, p in model.named_parameters():
        if any(s in name for s in ("o_proj", "out_proj", "down_proj")):
            p.mul_(DAMP)


def add_mtp(path, model, mtp_layers: int = 1, seed: int = 3) -> dict[str, torch.Tensor]:
    """Random mtp.* tensors in the saved checkpoint, and mtp_num_hidden_layers in its config: the
    head's layer a perturbed copy of the target's first full-attention layer (its names as the
    checkpoint's), fc's embedding half near the identity. -> the mtp.* tensors."""
    g = torch.Generator().manual_seed(seed)
    sd = load_file(path / "model.safetensors")
    full = model.config.layer_types.index("full_attention")
    src = f"model.layers.{full}."
    H = model.config.hidden_size
    mtp = {"mtp.layers.0." + k[len(src):]: v + 0.02 * torch.randn(v.shape, generator=g)
           for k, v in sd.items() if k.startswith(src)}
    mtp["mtp.fc.weight"] = torch.cat([torch.eye(H), torch.zeros(H, H)], 1) + 0.05 * torch.randn(H, 2 * H, generator=g)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"mtp.{name}.weight"] = 0.1 * torch.randn(H, generator=g)
    save_file({**sd, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": mtp_layers}))
    return mtp


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> (transformers model, its directory with the head, the mtp.* tensors, ridge's fp32 load)."""
    @functools.cache
    def get(name):
        model_type, fields = VARIANTS[name]
        model, path = build_hf(tmp_path_factory.mktemp(name), model_type, fields, seed=1, edit=_damped)
        mtp = add_mtp(path, model)
        return model, path, mtp, load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    return get


def prompts(count: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    return {f"p{i}": torch.randint(3, V, (int(n),), generator=g).tolist()
            for i, n in enumerate(torch.randint(5, 40, (count,), generator=g))}


@pytest.mark.parametrize("name", list(VARIANTS))
@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_with_head_equals_plain_greedy(built, name, batch):
    model, path, mtp, lm = built(name)
    ps = prompts(max(batch, 4))  # batch 1: four requests, one at a time
    # A ridge point that makes drafts worth their pass at batch 16 (the knee past 16 tokens).
    plain = run_named(make_engine(lm, speculative="off", max_num_seqs=batch, ridge_point=300.0), ps, 24)
    eng = make_engine(lm, max_num_seqs=batch, num_speculative_tokens=4, ridge_point=300.0)  # the default: the head
    assert eng.speculator is not None and eng.speculator.name == "mtp"
    check_lossless(eng, ps, plain)


def check_lossless(eng, ps: dict, plain: dict, n: int = 24) -> None:
    """eng's greedy tokens equal plain's, with drafts accepted and drafts rejected."""
    seen = []
    verified = eng.speculator.on_verified
    eng.speculator.on_verified = lambda req, d, a: (seen.append((d, a)), verified(req, d, a))
    assert run_named(eng, ps, n) == plain
    assert any(a > 0 for d, a in seen), f"no draft accepted: {seen}"
    assert any(a < d for d, a in seen), f"no draft rejected: {seen}"
    assert_no_leak(eng)


def test_greedy_with_head_in_prefill_chunks_and_under_preemption(built):
    """Chunks of 8 (the head fed a chunk at a time) and a pool too small for 16 requests at once
    (preempted requests restart): still plain greedy, nothing leaked."""
    model, path, mtp, lm = built("dense")
    ps = prompts(16)
    kw = dict(max_num_seqs=16, prefill_chunk=8, num_kv_blocks=20, ridge_point=300.0)
    plain = run_named(make_engine(lm, speculative="off", **kw), ps, 24)
    eng = make_engine(lm, num_speculative_tokens=4, **kw)
    assert run_named(eng, ps, 24) == plain
    assert eng.stats()["speculative"]["total"]["drafted"] > 0
    assert_no_leak(eng)


def test_seeded_sampling_unchanged_by_the_head(built):
    model, path, mtp, lm = built("dense")
    ps = prompts(4)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, seed=5, deterministic=True)
    plain = run_named(make_engine(lm, speculative="off", max_num_seqs=4, ridge_point=300.0), ps, 16, params)
    eng = make_engine(lm, max_num_seqs=4, num_speculative_tokens=3, ridge_point=300.0)
    assert run_named(eng, ps, 16, params) == plain
    assert eng.stats()["speculative"]["total"]["drafted"] > 0


def rms(x, w, eps):
    """Qwen3.5's RMSNorm: multiplies by 1 + w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def oracle_logits(mtp: dict, model, hidden, next_ids) -> torch.Tensor:
    """The head's logits at positions 0..n-1 of one sequence, in plain torch from the checkpoint's
    tensors: hidden [n, H] the target's final states there, next_ids the tokens at 1..n."""
    c = model.config
    t = {k[len("mtp."):]: v.float() for k, v in mtp.items()}
    L, eps, D = "layers.0.", c.rms_norm_eps, c.head_dim
    n, nh, nkv = len(next_ids), c.num_attention_heads, c.num_key_value_heads
    e = model.get_input_embeddings().weight[next_ids]
    x = torch.cat([rms(e, t["pre_fc_norm_embedding.weight"], eps), rms(hidden, t["pre_fc_norm_hidden.weight"], eps)], -1)
    x = x @ t["fc.weight"].T
    a = rms(x, t[L + "input_layernorm.weight"], eps)
    q, gate = (a @ t[L + "self_attn.q_proj.weight"].T).view(n, nh, 2 * D).chunk(2, -1)
    k = (a @ t[L + "self_attn.k_proj.weight"].T).view(n, nkv, D)
    v = (a @ t[L + "self_attn.v_proj.weight"].T).view(n, nkv, D)
    q, k = rms(q, t[L + "self_attn.q_norm.weight"], eps), rms(k, t[L + "self_attn.k_norm.weight"], eps)
    rot = int(D * c.rope_parameters.get("partial_rotary_factor", 0.25))  # transformers' default: a quarter
    theta = c.rope_parameters["rope_theta"]
    ang = torch.arange(n, dtype=torch.float64)[:, None] / theta ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot)
    cos, sin = torch.cat([ang, ang], -1).cos().float()[:, None], torch.cat([ang, ang], -1).sin().float()[:, None]

    def rope(x):
        r, rest = x[..., :rot], x[..., rot:]
        half = torch.cat([-r[..., rot // 2:], r[..., :rot // 2]], -1)
        return torch.cat([r * cos + half * sin, rest], -1)
    q, k = rope(q), rope(k)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * D ** -0.5
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(n, nh * D) * torch.sigmoid(gate.reshape(n, nh * D))
    x = x + o @ t[L + "self_attn.o_proj.weight"].T
    m = rms(x, t[L + "post_attention_layernorm.weight"], eps)
    x = x + (torch.nn.functional.silu(m @ t[L + "mlp.gate_proj.weight"].T) * (m @ t[L + "mlp.up_proj.weight"].T)) \
        @ t[L + "mlp.down_proj.weight"].T
    return rms(x, t["norm.weight"], eps) @ model.get_output_embeddings().weight.T


def test_head_logits_equal_the_definition(built):
    model, path, mtp, lm = built("dense")
    ids = torch.randint(3, V, (N + 1,), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        hidden = model.model(ids[None, :-1]).last_hidden_state[0]  # after the final norm
        ref = oracle_logits(mtp, model, hidden, ids[1:])
    head = load_mtp(lm.model, path, torch.device("cpu"), torch.float32)
    bs, blocks = 16, list(range(-(-N // 16)))
    cache = KVCache(head.cfg, len(blocks), bs, "fp32", torch.device("cpu"))
    out = []
    for a, b in ((0, 37), (37, 38), (38, N)):  # in chunks, as the engine feeds it: each reads the KV before it
        meta = AttentionMetadata.build([b - a], [b], [blocks], list(range(a, b)), "cpu")
        out.append(head.compute_logits(head(ids[a + 1:b + 1], hidden[a:b], torch.arange(a, b), meta, cache.layers[0])))
    assert_match(torch.cat(out), ref)


def test_moe_head_loads_its_experts(built):
    model, path, mtp, lm = built("moe")
    head = load_mtp(lm.model, path, torch.device("cpu"), torch.float32)
    assert head.cfg.num_experts == EXPERTS["num_experts"] and head.layer.experts is not None


def test_mtp_num_hidden_layers(built, tmp_path):
    model, path, mtp, lm = built("dense")
    cfg = json.loads((path / "config.json").read_text())
    try:
        (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 0}))
        assert make_engine(lm).speculator is None  # the tensors are there; the config says no head
        (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 2}))
        with pytest.raises(ModelLoadError, match="mtp_num_hidden_layers=2"):
            make_engine(lm)
        assert make_engine(lm, speculative="off").speculator is None  # off never reads the head
    finally:
        (path / "config.json").write_text(json.dumps(cfg))


def test_checkpoint_without_mtp_tensors_runs_without_a_head(tmp_path):
    model, path = build_hf(tmp_path, "qwen3_5_text", SHAPE, seed=1, edit=_damped)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "mtp_num_hidden_layers": 1}))  # as saved by transformers
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    assert make_engine(lm).speculator is None


def test_memory_plan_counts_the_head(built):
    model, path, mtp, lm = built("dense")
    plain = make_engine(lm, speculative="off")
    eng = make_engine(lm)
    head = eng.speculator.proposer.head
    assert eng.memory.weight_bytes == plain.memory.weight_bytes + head.weight_bytes()
    assert head.weight_bytes() == sum(t.numel() * 4 for k, t in mtp.items())  # fp32: the checkpoint's numbers
    per_token = kv_bytes_per_token(head_config(lm.config), "fp32")
    assert per_token == 2 * lm.config.num_kv_heads * lm.config.head_dim * 4
    assert eng.memory.group_bytes_per_token[0] == plain.memory.group_bytes_per_token[0] + per_token
