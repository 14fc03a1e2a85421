"""Admission shared fairly (issue 38, finding 4): one client's heavy admission work
(a rerank of a huge query over many tiny documents) no longer holds up another
client's small requests; a rerank tokenizes its query once, cut to the context;
one request's prompts have a token budget; one principal's outstanding admission
work is capped apart from the daemon's. A real daemon on test_rerank.py's tiny
reranker, real validators on its tokenizer, and daemon/admission.py's real workers."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from ridge.daemon.frontend.admission import Admission
from ridge.daemon.protocol import BUSY, Envelope, Limits, ProtocolError
from ridge.daemon.frontend.validate import MAX_REQUEST_TOKENS, Validator
from ridge.engine import rerank
from ridge.models.loader import load_model
from test_daemon_harness import Daemon, Raw
from test_families import V, build_hf
from test_rerank import JUDGED, write_judging_tokenizer

CONTEXT = 1024
HUGE_QUERY = "the query " * 43200  # 432 KB


@pytest.fixture(scope="module")
def ranker_dir(tmp_path_factory):
    _, path = build_hf(tmp_path_factory.mktemp("hostile-rank"), "qwen3",
                       {"vocab_size": V + len(JUDGED), "max_position_embeddings": CONTEXT})
    write_judging_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, ranker_dir):
    d = Daemon(tmp_path_factory.mktemp("hostile-admission"), str(ranker_dir), "--pooling", "rank", "--weights",
               "fp32", "--kv-dtype", "fp32", "--num-kv-blocks", "128")
    yield d
    assert d.stop() == 0, d.output()


def test_a_huge_rerank_does_not_hold_up_another_clients_tokenize(daemon):
    """Before: the rerank tokenized its 432 KB query once per document on the one admission worker,
    and every other client's tokenize waited for all of it (12-20 s on 2 cores)."""
    hog, other = Raw(daemon.endpoint), Raw(daemon.endpoint)
    try:
        assert other.call({"type": "tokenize", "id": "warm", "text": "hello"})["type"] == "tokenize"
        started = time.monotonic()
        hog.send({"type": "rerank", "id": "r", "query": HUGE_QUERY, "documents": ["x"] * 64}, v=4)
        times = []
        for i in range(20):
            t = time.monotonic()
            reply = other.call({"type": "tokenize", "id": f"t{i}", "text": "hello world"}, timeout=120)
            times.append(time.monotonic() - t)
            assert reply["type"] == "tokenize", reply
            time.sleep(0.01)
        while (reply := hog.recv(120))["type"] == "heartbeat":
            pass
        took = time.monotonic() - started
    finally:
        hog.close()
        other.close()
    assert reply["type"] == "rerank", reply
    # The query fills the context, so every document's prompt is the same: the same score for each.
    assert len(reply["results"]) == 64 and len({round(r["relevance_score"], 6) for r in reply["results"]}) == 1
    times.sort()
    print(f"tokenize during a 432 KB x 64 rerank: p50 {1e3 * times[10]:.1f} ms, "
          f"p95 {1e3 * times[18]:.1f} ms, max {1e3 * times[19]:.1f} ms; the rerank took {took:.2f} s")
    assert times[18] < 0.05, times  # one call in 20 may meet a loaded machine's hiccup


@pytest.fixture(scope="module")
def validator(ranker_dir):
    tok = load_model(ranker_dir, device="cpu", weights="fp32", use_cache=False, show_progress=False).tokenizer
    limits = Limits(max_frame_bytes=1 << 20, max_prompt_tokens=CONTEXT - 1, max_tokens=CONTEXT,
                    max_requests_per_client=256, max_queue=1024)
    return Validator(tok, V + len(JUDGED), CONTEXT, 16, 4096, limits, embedding_size=64, ranks=True)


def run(work):
    """A validator's stepped work run to its end, as an admission worker runs it."""
    steps, n = work, 0
    try:
        while True:
            next(steps)
            n += 1
    except StopIteration as e:
        return e.value, n


@pytest.mark.parametrize("query,docs", [
    ("what is the capital of France", ["Paris is the capital of France.", "the cat sat", "x", " spaced  \n"]),
    ("ends with spaces   ", ["\nstarts with a newline", "word " * 1500]),  # a document past the context
    (HUGE_QUERY, ["x", "y"]),  # a query past the context
    ("q" * 9000 + " tail", ["d"]),  # one long word: the query's cut lands inside it
], ids=["plain", "long-document", "huge-query", "long-word"])
def test_rerank_prompts_are_the_model_cards(validator, query, docs):
    """The query tokenized once and cut to the context gives each document the prompt
    engine/rerank.prompt_ids writes from the whole text (the model card's cut)."""
    env = Envelope("rerank", "r", {"query": query, "documents": docs}, 4)
    req, _ = run(validator.rerank_steps(env))
    limit = CONTEXT - 1
    assert req.inputs == [rerank.prompt_ids(validator.tokenizer, query, d, None, limit) for d in docs]


def test_a_requests_prompts_have_a_token_budget(validator):
    docs = ["some words of a document " * 8] * 2048  # about 250 tokens each with the judging prompt
    with pytest.raises(ProtocolError, match=f"{MAX_REQUEST_TOKENS} tokens") as e:
        run(validator.rerank_steps(Envelope("rerank", "r", {"query": "q", "documents": docs}, 4)))
    assert e.value.code == "invalid_request"


def peer(name: str, identity: str):
    return SimpleNamespace(key=("router", name.encode()), identity=identity, gone=False)


def test_principals_are_served_round_robin_and_each_has_a_cap():
    """Alice queues three, then Bob one: Bob's runs second, not fourth, and Alice's other connection
    comes before her first one's second. Alice's fourth is `busy` (her cap, 3) while Bob still gets in."""
    adm, release, order = Admission(workers=1, principal_pending=3), threading.Event(), []
    alice, alice2, bob = peer("a", "uid:1"), peer("a2", "uid:1"), peer("b", "uid:2")

    def work(env):
        order.append(env.id)
        return env.id

    try:
        adm.submit(alice, Envelope("tokenize", "a0", {}), lambda env: release.wait(10) and work(env), 10)
        time.sleep(0.2)  # a0 holds the one worker
        adm.submit(alice, Envelope("tokenize", "a1", {}), work, 10)
        adm.submit(alice2, Envelope("tokenize", "a2", {}), work, 10)  # another connection: the same principal
        with pytest.raises(ProtocolError) as e:
            adm.submit(alice2, Envelope("tokenize", "a3", {}), work, 10)
        assert e.value.code == BUSY and e.value.extra == {"retry_after": 0.1}
        adm.submit(bob, Envelope("tokenize", "b0", {}), work, 10)
        release.set()
        done, deadline = [], time.monotonic() + 10
        while len(done) < 4 and time.monotonic() < deadline:
            done += adm.ready()
            time.sleep(0.01)
        assert order == ["a0", "b0", "a2", "a1"]
        assert (adm.count, adm.bytes, adm.owed) == (0, 0, {})
    finally:
        release.set()
        adm.close()


def test_stepped_work_takes_turns_with_other_principals():
    """A generator's steps are interleaved with another principal's work: Bob's one message runs
    after Alice's first step, not after all ten."""
    adm, order = Admission(workers=1), []
    alice, bob = peer("a", "uid:1"), peer("b", "uid:2")
    gate = threading.Event()

    def stepped(env):
        for i in range(10):
            if i == 0:
                gate.wait(10)
            order.append(f"a{i}")
            yield
        return "a"

    try:
        adm.submit(alice, Envelope("rerank", "a", {}), stepped, 10)
        adm.submit(bob, Envelope("tokenize", "b", {}), lambda env: order.append("b") or "b", 10)
        gate.set()
        done, deadline = [], time.monotonic() + 10
        while len(done) < 2 and time.monotonic() < deadline:
            done += adm.ready()
            time.sleep(0.01)
        assert sorted(p.result for p in done) == ["a", "b"]
        assert order.index("b") <= 2, order
    finally:
        gate.set()
        adm.close()
