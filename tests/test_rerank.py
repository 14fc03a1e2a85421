"""Reranking (engine/rerank.py, the daemon's rerank, /v1/rerank): a tiny random
qwen3 model built by transformers with "yes" and "no" in its vocabulary, judged
through ridge with fp32 weights, against transformers' own computation of
Qwen3-Reranker's score (softmax over the two logits at the prompt's last
position, the prompt tokenized as its model card's code does it). The daemon's
rerank and /v1/rerank are tested in test_ollama.py, on its daemon of many
models."""
from __future__ import annotations

import json

import pytest
import torch

from engine_utils import make_engine
from ridge.engine import rerank
from ridge.errors import InvalidRequest
from ridge.models.loader import load_model
from ridge.quant.errors import ModelLoadError
from test_families import V, build_hf
from tiny_models import MERGES, SPECIALS, tiny_vocab

transformers = pytest.importorskip("transformers")

JUDGED = ["ye", "yes", "no"]  # appended to the tiny vocabulary, with the merges that make them
QUERY = "what is the capital of France"
DOCS = ["Paris is the capital of France.", "the cat sat on the mat", "France borders Spain", "x"]


def write_judging_tokenizer(path) -> dict:
    """The tiny vocabulary with "yes" and "no" as tokens of their own -> its token -> id map."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tokens = tiny_vocab()[0] + JUDGED
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = [tuple(m.split()) for m in MERGES] + [("y", "e"), ("ye", "s"), ("n", "o")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.save(str(path / "tokenizer.json"))
    return vocab


@pytest.fixture(scope="module")
def ranker(tmp_path_factory):
    """(transformers model, its directory, its vocabulary, ridge's fp32 load)."""
    model, path = build_hf(tmp_path_factory.mktemp("rerank"), "qwen3", {"vocab_size": V + len(JUDGED),
                                                                       "max_position_embeddings": 1024})
    vocab = write_judging_tokenizer(path)
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    return model, path, vocab, lm


def reference(model, path, vocab, query: str, docs: list[str]) -> list[float]:
    """Qwen3-Reranker's model card, step by step, on the tokenizer's own files."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    head = tok.encode(rerank.PREFIX, add_special_tokens=False).ids
    tail = tok.encode(rerank.SUFFIX, add_special_tokens=False).ids
    out = []
    for d in docs:
        pair = f"<Instruct>: {rerank.INSTRUCTION}\n<Query>: {query}\n<Document>: {d}"
        ids = head + tok.encode(pair, add_special_tokens=False).ids + tail
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        pair_logits = torch.stack([logits[vocab["no"]], logits[vocab["yes"]]])
        out.append(float(torch.log_softmax(pair_logits, dim=0)[1].exp()))
    return out


def judge(engine, inputs) -> list[float]:
    rid = engine.add_embedding(None, inputs)
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                got = o
    return got.scores


@pytest.mark.parametrize("chunk", [16, 256])
def test_scores_match_transformers(ranker, chunk):
    model, path, vocab, lm = ranker
    eng = make_engine(lm, pooling="rank", prefill_chunk=chunk)
    got = judge(eng, eng.rerank_inputs(QUERY, DOCS))
    want = reference(model, path, vocab, QUERY, DOCS)
    assert max(abs(g - w) for g, w in zip(got, want)) < 1e-5
    assert len(set(round(g, 6) for g in got)) == len(DOCS)  # a random head still tells them apart


def test_long_documents_are_cut_to_the_context(ranker):
    _, _, _, lm = ranker
    eng = make_engine(lm, pooling="rank")
    (ids,) = eng.rerank_inputs(QUERY, ["word " * 1200])
    assert len(ids) == eng.max_model_len - 1
    assert ids[-len(lm.tokenizer.encode(rerank.SUFFIX, False)):] == lm.tokenizer.encode(rerank.SUFFIX, False)
    assert 0 < judge(eng, [ids])[0] < 1


def test_a_vocabulary_without_yes_is_refused(tmp_path):
    _, path = build_hf(tmp_path, "qwen3", {})
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    with pytest.raises(ModelLoadError, match="no token 'no'"):
        make_engine(lm, pooling="rank")


def test_a_ranker_generates_nothing(ranker):
    with pytest.raises(InvalidRequest, match="rank"):
        make_engine(ranker[3], pooling="rank").add_request(None, [5, 6, 7])
