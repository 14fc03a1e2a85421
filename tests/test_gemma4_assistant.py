"""Gemma 4's assistant drafter (gemma4_assistant, issue 41 "Their own draft heads"), against
transformers 5.25's Gemma4AssistantForCausalLM as the oracle: a tiny random Gemma 4 target and a
tiny random assistant built by transformers and saved, each loaded through ridge's loaders.

- the assistant's forward (logits and the projected state it feeds back), given the same inputs
  (the target's last hidden state, the last token, the target's stored K and V of its last full
  and last sliding layer), equals transformers' in fp32 (relative error <= 1e-5), for the first
  draft and the next one, with a window shorter than the context, tied and ordered embeddings;
- as a proposer (`--speculative draft:PATH`), greedy output equals plain greedy, batch 1 and 16,
  with drafts made and some accepted;
- what it cannot run is refused by name."""
from __future__ import annotations

import functools
import json

import pytest
import torch

from engine_utils import make_engine, run_named
from ridge.cache.kv_cache import KVCache
from ridge.kernels.metadata import AttentionMetadata
from ridge.models.gemma4.assistant import load_assistant
from ridge.models.loader import load_model
from ridge.quant.errors import ModelLoadError
from test_families import BASE, V, assert_match, build_hf
from test_gemma4 import _draw, _fields
from test_mtp import check_lossless

transformers = pytest.importorskip("transformers")
from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM  # noqa: E402
from transformers.models.gemma4.configuration_gemma4 import Gemma4TextConfig  # noqa: E402

TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
TARGET = _fields(dict(num_hidden_layers=4, sliding_window=16, hidden_size_per_layer_input=0, layer_types=TYPES))
N_PROMPT = 40  # past the window: the sliding layers read its last 17 keys


def assistant_config(ordered: bool = False) -> Gemma4AssistantConfig:
    text = {k: v for k, v in {**BASE, **TARGET}.items() if k not in ("bos_token_id", "eos_token_id", "pad_token_id")}
    text.update(num_hidden_layers=2, hidden_size=32, intermediate_size=48, num_kv_shared_layers=2,
                layer_types=TYPES[:2], vocab_size_per_layer_input=0)
    return Gemma4AssistantConfig(text_config=Gemma4TextConfig(**text), backbone_hidden_size=BASE["hidden_size"],
                                 use_ordered_embeddings=ordered, num_centroids=V // 2 if V % 2 == 0 else 1,
                                 centroid_intermediate_top_k=1 if V % 2 else 3)


def build_assistant(tmp, ordered: bool = False, seed: int = 2):
    torch.manual_seed(seed)
    a = Gemma4AssistantForCausalLM(assistant_config(ordered)).eval()
    with torch.no_grad():
        for name, p in a.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
        for layer in a.model.layers:  # as tests/test_gemma4.py's _draw: scores spread as a usual model's
            layer.layer_scalar.copy_(0.5 + torch.rand(1))
            layer.self_attn.q_norm.weight.mul_(layer.self_attn.head_dim ** -0.25)
        if ordered:
            a.masked_embedding.token_ordering.copy_(torch.randperm(V))
    path = tmp / "assistant"
    a.save_pretrained(path)
    return a, path


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    @functools.cache
    def get(ordered: bool):
        tmp = tmp_path_factory.mktemp("g4a")
        target, tpath = build_hf(tmp, "gemma4_text", TARGET, seed=1, edit=_draw)
        a, apath = build_assistant(tmp, ordered)
        lm = load_model(tpath, device="cpu", weights="fp32", use_cache=False, show_progress=False)
        return target, a, apath, lm
    return get


def ridge_target_kv(lm, ids):
    """The target's paged K and V after a forward over ids, and its final hidden states."""
    n, bs = len(ids), 16
    blocks = list(range(-(-n // bs)))
    cache = KVCache(lm.config, len(blocks), bs, "fp32", torch.device("cpu"))
    meta = AttentionMetadata.build([n], [n], [blocks], list(range(n)), "cpu")
    groups = lm.config.kv_groups()
    if len(groups) > 1:
        meta.groups = tuple(AttentionMetadata.build([n], [n], [blocks], list(range(n)), "cpu") for _ in groups[1:])
    hidden = lm.model(torch.tensor(ids), torch.arange(n), meta, cache.layers)
    return cache, blocks, hidden


def query_meta(head, blocks, n: int) -> AttentionMetadata:
    """One query at position n over the keys 0..n-1 (the draft round's), in every group."""
    meta = AttentionMetadata.build([1], [n], [blocks], [n - 1], "cpu")
    meta.groups = tuple(AttentionMetadata.build([1], [n], [blocks], [n - 1], "cpu") for _ in head.cfg.kv_groups()[1:])
    return meta


@pytest.mark.parametrize("ordered", [False, True], ids=["tied", "ordered-embeddings"])
def test_forward_matches_transformers(built, ordered):
    target, a, apath, lm = built(ordered)
    ids = torch.randint(3, V, (N_PROMPT + 1,), generator=torch.Generator().manual_seed(7)).tolist()
    prompt, last = ids[:N_PROMPT], ids[N_PROMPT]
    head = load_assistant(apath, lm.model, torch.device("cpu"), torch.float32, 256)
    cache, blocks, hidden = ridge_target_kv(lm, prompt)
    with torch.no_grad():
        out = target(torch.tensor([prompt]), output_hidden_states=True, return_shared_kv_states=True)
        h_ref, kv = out.hidden_states[-1][:, -1:], out.shared_kv_states
        assert_match(hidden[-1:], h_ref[0])
        tok, h, toks = torch.tensor([[last]]), h_ref, []
        for _ in range(2):  # the first draft, then one fed back its own state and token
            ref = a(inputs_embeds=torch.cat([target.get_input_embeddings()(tok), h], -1),
                    position_ids=torch.tensor([[N_PROMPT]]), shared_kv_states=kv)
            toks.append((tok[0], ref.logits[0], ref.last_hidden_state[0]))
            tok, h = ref.logits.argmax(-1), ref.last_hidden_state
    h = hidden[-1:]
    for t, ref_logits, ref_state in toks:
        logits, h = head(t, h, torch.tensor([N_PROMPT]), query_meta(head, blocks, N_PROMPT), cache.layers)
        assert_match(logits, ref_logits)
        assert_match(h, ref_state)


# -- as a proposer ---------------------------------------------------------------------------------
DAMP = 0.4  # the post-norms' scale on both: how often the target repeats the token it reads


def _damped_target(model) -> None:
    _draw(model)
    for layer in model.model.layers:
        for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
            norm.weight.mul_(DAMP)


def agreeing_assistant(tmp, target, seed: int = 4):
    """An assistant that drafts the token it reads, as the damped target tends to emit it: its
    pre_projection takes a random projection of the token's embedding (the hidden half near zero),
    its layers damped, its logits' rows the same projection of the target's embeddings."""
    a, _ = build_assistant(tmp, seed=seed)
    g = torch.Generator().manual_seed(seed)
    H, B = a.config.text_config.hidden_size, BASE["hidden_size"]
    proj = torch.randn(H, B, generator=g) / B ** 0.5
    with torch.no_grad():
        a.pre_projection.weight.copy_(torch.cat([proj, 0.05 * torch.randn(H, B, generator=g)], 1))
        a.model.embed_tokens.weight.copy_(target.get_input_embeddings().weight @ proj.T)
        for layer in a.model.layers:
            for norm in (layer.post_attention_layernorm, layer.post_feedforward_layernorm):
                norm.weight.mul_(DAMP)
    path = tmp / "agreeing"
    a.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("g4a-engine")
    target, tpath = build_hf(tmp, "gemma4_text", TARGET, seed=1, edit=_damped_target)
    lm = load_model(tpath, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    return lm, agreeing_assistant(tmp, target)


def prompts(count: int) -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    return {f"p{i}": torch.randint(3, V, (int(n),), generator=g).tolist()
            for i, n in enumerate(torch.randint(5, 40, (count,), generator=g))}


@pytest.mark.parametrize("batch", [1, 16])
def test_greedy_with_assistant_equals_plain_greedy(pair, batch):
    lm, apath = pair
    ps = prompts(max(batch, 4))  # batch 1: four requests, one at a time
    kw = dict(max_num_seqs=batch, ridge_point=300.0)  # the knee past 16 tokens: drafts pay at batch 16
    plain = run_named(make_engine(lm, speculative="off", **kw), ps, 24)
    eng = make_engine(lm, speculative=f"draft:{apath}", num_speculative_tokens=4, **kw)
    assert eng.speculator.name == f"draft:{apath.name}" and eng.speculator.caches == []
    check_lossless(eng, ps, plain)


def test_refusals_name_the_field(pair, tmp_path):
    lm, apath = pair
    cfg = json.loads((apath / "config.json").read_text())
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in apath.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    for edit, named in ((dict(backbone_hidden_size=48), "backbone_hidden_size=48"),
                        (dict(text_config={**cfg["text_config"], "num_kv_shared_layers": 1}),
                         "text_config.num_kv_shared_layers=1"),
                        (dict(text_config={**cfg["text_config"], "hidden_size_per_layer_input": 4}),
                         "text_config.hidden_size_per_layer_input=4")):
        (bad / "config.json").write_text(json.dumps({**cfg, **edit}))
        with pytest.raises((ModelLoadError, ValueError), match=named):
            make_engine(lm, speculative=f"draft:{bad}")
