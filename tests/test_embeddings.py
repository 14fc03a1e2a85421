"""Embeddings (engine/pooling.py, the daemon's embed, /v1/embeddings): a tiny random
qwen3 model built by transformers, loaded through ridge with fp32 weights, pooled by
its last token and by the mean, against transformers' final hidden states; chunked
prefill, a batch of 64, Matryoshka truncation; then a live daemon and gateway
through the real `openai` package."""
from __future__ import annotations

import base64
import json

import numpy as np
import pytest
import torch

from engine_utils import assert_no_leak, greedy, make_engine, prompts
from ridge.errors import InvalidRequest
from ridge.models.loader import load_model
from ridge.quant.errors import ModelLoadError
from test_families import build_hf

transformers = pytest.importorskip("transformers")


def write_pooling(path, mode: str) -> None:
    """sentence-transformers' files for a Transformer, then a Pooling module, then Normalize."""
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": mode == "mean",
             "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": mode == "last"}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(transformers model, its directory with last-token pooling metadata, ridge's fp32 load)."""
    model, path = build_hf(tmp_path_factory.mktemp("embed"), "qwen3", {})
    write_pooling(path, "last")
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    return model, path, lm


def reference(model, ids: list[int], pooling: str, dimensions: int | None = None) -> torch.Tensor:
    with torch.no_grad():
        h = model.model(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if pooling == "last" else h.mean(0)
    v = v[:dimensions] if dimensions else v
    return torch.nn.functional.normalize(v, dim=-1)


def cosines(got: list, ref: list) -> list[float]:
    return [float(torch.nn.functional.cosine_similarity(torch.tensor(g), r, dim=0)) for g, r in zip(got, ref)]


def vocab_prompts(lm, lengths, seed=0):
    return prompts(lm.config.vocab_size, lengths, seed)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("chunk", [256, 16])
def test_pooling_matches_transformers(qwen3, pooling, chunk):
    """Prompts of 5-90 tokens, prefilled whole or in 16-token chunks (the mean summed over them)."""
    model, _, lm = qwen3
    eng = make_engine(lm, prefill_chunk=chunk, pooling=pooling)
    inputs = vocab_prompts(lm, [5, 17, 40, 90])
    out = eng.embed(inputs)
    assert out.finish_reason == "stop" and out.num_prompt_tokens == sum(map(len, inputs))
    ref = [reference(model, ids, pooling) for ids in inputs]
    assert min(cosines(out.embeddings, ref)) >= 0.9999
    assert all(abs(np.linalg.norm(e) - 1) < 1e-5 for e in out.embeddings)
    assert_no_leak(eng)


def test_the_model_metadata_names_its_pooling(qwen3, tmp_path):
    _, path, lm = qwen3
    assert make_engine(lm).pooling == "last"  # auto: 1_Pooling/config.json says lasttoken
    write_pooling(path, "mean")
    try:
        assert make_engine(lm).pooling == "mean"
    finally:
        write_pooling(path, "last")
    assert make_engine(lm, pooling="none").pooling is None
    from ridge.engine.pooling import model_pooling
    bad = tmp_path / "cls"
    bad.mkdir()
    write_pooling(bad, "last")
    cfg = json.loads((bad / "1_Pooling" / "config.json").read_text())
    (bad / "1_Pooling" / "config.json").write_text(json.dumps({**cfg, "pooling_mode_lasttoken": False,
                                                                "pooling_mode_cls_token": True}))
    with pytest.raises(ModelLoadError, match="pooling_mode_cls_token"):
        model_pooling(bad)
    mods = json.loads((bad / "modules.json").read_text())
    (bad / "modules.json").write_text(json.dumps(mods + [{"idx": 3, "name": "3", "path": "3_Dense",
                                                          "type": "sentence_transformers.models.Dense"}]))
    with pytest.raises(ModelLoadError, match="Dense"):
        model_pooling(bad)


def test_gguf_pooling_type_is_read(tmp_path):
    """llama.cpp's enum: 3 last, 1 mean, 0 none; 2 (CLS) is refused by name."""
    from ridge.engine.pooling import model_pooling

    for value, want in ((3, "last"), (1, "mean"), (0, None)):
        assert model_pooling(_gguf_with_pooling(tmp_path / f"p{value}.gguf", value)) == want
    with pytest.raises(ModelLoadError, match="pooling_type = 2"):
        model_pooling(_gguf_with_pooling(tmp_path / "cls.gguf", 2))


def _gguf_with_pooling(path, value: int):
    import gguf
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_uint32("qwen3.pooling_type", value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_dimensions_truncate_then_renormalise(qwen3):
    model, _, lm = qwen3
    eng = make_engine(lm)
    inputs = vocab_prompts(lm, [12, 33], seed=3)
    full = eng.embed(inputs).embeddings
    cut = eng.embed(inputs, dimensions=16).embeddings
    assert all(len(e) == 16 and abs(np.linalg.norm(e) - 1) < 1e-5 for e in cut)
    for f, c in zip(full, cut):
        expect = np.array(f[:16]) / np.linalg.norm(f[:16])
        assert np.allclose(c, expect, atol=1e-5)
    assert min(cosines(cut, [reference(model, ids, "last", 16) for ids in inputs])) >= 0.9999
    with pytest.raises(InvalidRequest, match="dimensions"):
        eng.add_embedding(None, inputs, dimensions=65)


def test_a_batch_of_64_through_the_engine(qwen3):
    """64 inputs in several requests at once, stepped together (max_num_seqs 16); every block
    returns to the pool and none is published to the prefix cache."""
    model, _, lm = qwen3
    eng = make_engine(lm, max_num_seqs=16, prefill_chunk=1024)
    widths = []
    eng.step_observers.append(lambda out, seconds: widths.append(len(out.scheduled)))
    inputs = vocab_prompts(lm, [3 + (i * 7) % 50 for i in range(64)], seed=5)
    rids = [eng.add_embedding(f"e{k}", inputs[k * 16:(k + 1) * 16]) for k in range(4)]
    outs = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs[o.request_id] = o
    assert max(widths) == 16 and sum(widths) == 64 and sorted(outs) == sorted(rids)
    got = [e for rid in rids for e in outs[rid].embeddings]
    assert min(cosines(got, [reference(model, ids, "last") for ids in inputs])) >= 0.9999
    assert_no_leak(eng)
    assert eng.kv_cache_manager.get_computed_blocks("probe", inputs[0] * 4)[1] == 0  # no KV kept


def test_an_embedding_step_takes_whole_prefills(qwen3):
    """With no --prefill-chunk an embedding engine's step is sized for whole prefills of every
    sequence it holds, not a generating engine's latency chunk (max_num_seqs + 2 T*): 16 inputs
    of 20-60 tokens run in one step, embedded as transformers embeds them."""
    model, _, lm = qwen3
    eng = make_engine(lm, prefill_chunk=None, num_kv_blocks=128)
    chunk = eng.budget_info["budget"]  # a generating engine's chunk at this ridge point
    assert eng.sched_config.max_num_batched_tokens == eng.sched_config.long_prefill_token_threshold == 16 * chunk
    steps = []
    eng.step_observers.append(lambda out, seconds: steps.append(out.num_scheduled_tokens))
    inputs = vocab_prompts(lm, [20 + (i * 13) % 41 for i in range(16)], seed=3)
    assert sum(map(len, inputs)) > 16 + chunk  # more than a generating engine's step holds
    out = eng.embed(inputs)
    assert steps == [sum(map(len, inputs))]
    assert min(cosines(out.embeddings, [reference(model, ids, "last") for ids in inputs])) >= 0.9999
    assert_no_leak(eng)


def test_kinds_refuse_each_others_requests(qwen3):
    _, _, lm = qwen3
    with pytest.raises(InvalidRequest, match="embedding model"):
        make_engine(lm).add_request(None, [5, 6, 7], greedy(2))
    with pytest.raises(InvalidRequest, match="no embeddings"):
        make_engine(lm, pooling="none").add_embedding(None, [[5, 6, 7]])
    with pytest.raises(InvalidRequest, match="empty"):
        make_engine(lm).add_embedding(None, [[]])


# -- a live daemon and gateway, through the real openai package ----------------------------------
@pytest.fixture(scope="module")
def served(qwen3, tmp_path_factory):
    from test_gateway import http_daemon

    from test_gateway import free_port

    _, path, _ = qwen3
    port = free_port()  # Ollama's listener beside the gateway: test_ollama_embed
    d = http_daemon(tmp_path_factory.mktemp("embed-daemon"), str(path), "--weights", "fp32", "--kv-dtype", "fp32",
                    "--num-kv-blocks", 256, "--served-model-name", "tiny-embed", "--ollama", f"127.0.0.1:{port}")
    d.ollama_url = f"http://127.0.0.1:{port}"
    yield d
    d.stop()


@pytest.fixture(scope="module")
def oai(served):
    import openai
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_embeddings_through_the_daemon(qwen3, served, oai):
    model, _, lm = qwen3
    texts = ["hello world", "a longer sentence about embeddings", "x"]
    got = oai.embeddings.create(model="tiny-embed", input=texts)  # the package asks for base64 and decodes it
    floats = oai.embeddings.create(model="tiny-embed", input=texts, encoding_format="float")
    assert [e.index for e in got.data] == [0, 1, 2] and got.model == "tiny-embed"
    assert np.allclose([e.embedding for e in got.data], [e.embedding for e in floats.data], atol=0, rtol=0)
    ids = [lm.tokenizer.encode(t) for t in texts]
    assert got.usage.prompt_tokens == got.usage.total_tokens == sum(map(len, ids))
    ref = [reference(model, x, "last") for x in ids]
    assert min(cosines([e.embedding for e in got.data], ref)) >= 0.9999
    one = oai.embeddings.create(model="tiny-embed", input=ids[1], dimensions=16, encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == 16
    assert min(cosines([one.data[0].embedding], [reference(model, ids[1], "last", 16)])) >= 0.9999
    raw = base64.b64decode(served_post(served, {"input": "hello world", "encoding_format": "base64"})[1]
                           ["data"][0]["embedding"])
    assert np.frombuffer(raw, "<f4").tolist() == pytest.approx(floats.data[0].embedding, abs=0)


def served_post(served, body: dict) -> tuple[int, dict]:
    from test_gateway import ask
    return ask(served.url, "POST", "/v1/embeddings", {"Content-Type": "application/json"}, body)


@pytest.mark.parametrize("body, param", [({"input": ""}, "input"), ({"input": []}, "input"),
                                         ({"input": [[]]}, "input"), ({"input": "hi", "dimensions": 65}, None),
                                         ({"input": "hi", "dimensions": 0}, None), ({"input": 5}, "input"),
                                         ({"input": "hi", "encoding_format": "int8"}, "encoding_format")])
def test_bad_input_is_400_in_openai_shape(served, body, param):
    status, reply = served_post(served, body)
    assert status == 400 and set(reply["error"]) == {"message", "type", "param", "code"}
    assert reply["error"]["type"] == "invalid_request_error"
    if param:
        assert reply["error"]["param"] == param
    if "dimensions" in body:
        assert "dimensions" in reply["error"]["message"]


def test_generate_on_an_embedding_model_is_refused(oai):
    import openai
    with pytest.raises(openai.BadRequestError, match="embedding model"):
        oai.completions.create(model="tiny-embed", prompt="hello", max_tokens=2)


def test_a_base_models_checkpoint_loads(tmp_path):
    """transformers' Qwen3Model saved alone (no "model." prefix, no head, tied), as embedding
    checkpoints ship: pooled through ridge as transformers' AutoModel computes it."""
    from test_families import BASE
    from tiny_models import write_tokenizer_files

    cfg = transformers.AutoConfig.for_model("qwen3", **{**BASE, "tie_word_embeddings": True})
    torch.manual_seed(1)
    base = transformers.AutoModel.from_config(cfg, dtype=torch.float32).eval()
    base.save_pretrained(tmp_path)
    write_tokenizer_files(tmp_path)
    write_pooling(tmp_path, "last")
    lm = load_model(tmp_path, device="cpu", weights="fp32", use_cache=False, show_progress=False)
    inputs = vocab_prompts(lm, [9, 30], seed=11)
    got = make_engine(lm).embed(inputs).embeddings
    with torch.no_grad():
        ref = [torch.nn.functional.normalize(base(torch.tensor([ids])).last_hidden_state[0, -1], dim=-1)
               for ids in inputs]
    assert min(cosines(got, ref)) >= 0.9999


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_overlapped_steps_pool_only_the_prompt(qwen3, pooling):
    """With overlap a step is planned before the previous one's sample is read, so an embedding
    may be fed its sample once more: that row is not the prompt's and must not be pooled."""
    model, _, lm = qwen3
    eng = make_engine(lm, pooling=pooling, async_scheduling=True, prefill_chunk=16)
    inputs = vocab_prompts(lm, [7, 23, 40], seed=13)
    out = eng.embed(inputs)
    assert min(cosines(out.embeddings, [reference(model, ids, pooling) for ids in inputs])) >= 0.9999
    assert_no_leak(eng)


def test_the_python_client_embeds(served, oai):
    from ridge.daemon.client import Client

    c = Client(served.endpoint)
    try:
        reply = c.embed(["hello world", [5, 6, 7]], dimensions=8)
        assert c.hello()["model"]["pooling"] == "last"
    finally:
        c.close()
    assert reply["finish_reason"] == "stop" and [len(v) for v in reply["data"]] == [8, 8]
    want = oai.embeddings.create(model="tiny-embed", input="hello world", dimensions=8, encoding_format="float")
    assert reply["data"][0] == pytest.approx(want.data[0].embedding, abs=0)


def test_ollama_embed(qwen3, served):
    """/api/embed and /api/embeddings through the `ollama` package; an input past the context is cut
    to its first max_prompt_tokens tokens (Ollama's truncate, on by default)."""
    import ollama

    model, _, lm = qwen3
    c = ollama.Client(host=served.ollama_url, timeout=60)
    texts = ["hello world", "a longer sentence about embeddings"]
    got = c.embed(model="tiny-embed", input=texts)
    ids = [lm.tokenizer.encode(t) for t in texts]
    assert min(cosines(got.embeddings, [reference(model, x, "last") for x in ids])) >= 0.9999
    assert got.prompt_eval_count == sum(map(len, ids)) and got.model == "tiny-embed"
    assert len(c.embed(model="tiny-embed", input="x", dimensions=16).embeddings[0]) == 16
    limit = lm.config.max_position - 1
    long = " ".join(["word"] * (limit + 20))
    cut = lm.tokenizer.encode(long)[:limit]
    assert cosines(c.embed(model="tiny-embed", input=long).embeddings, [reference(model, cut, "last")])[0] >= 0.9999
    with pytest.raises(ollama.ResponseError) as e:
        c.embed(model="tiny-embed", input=long, truncate=False)
    assert e.value.status_code == 400
    assert c.show("tiny-embed").capabilities == ["embedding"]
    legacy = c.embeddings(model="tiny-embed", prompt="hello world")
    assert cosines([legacy.embedding], [reference(model, ids[0], "last")])[0] >= 0.9999
    with pytest.raises(ollama.ResponseError) as e:
        c.chat(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 400


def test_bench_embeddings_end_to_end(tmp_path):
    """`ridge bench embeddings` on a tiny shape: both sides run, alternate and embed alike. The
    model is cached under the suite's XDG_CACHE_HOME (conftest.py) beside the CPU kernels: a
    cache of its own would build those kernels again (half a minute)."""
    from ridge.cli import main

    out = tmp_path / "embed.json"
    rc = main(["bench", "embeddings", "--device", "cpu", "--threads", "1", "--weights", "fp32", "--batches", "1,4",
               "--ridge-point", "8", "--cpu-weight-format", "fp32", "--num-kv-blocks", "64", "--prefill-chunk", "64",
               "--inputs", "4", "--rounds", "2", "--lengths", "4-12", "--hidden", "64", "--layers", "1", "--heads", "4",
               "--kv-heads", "2", "--head-dim", "16", "--inter", "96", "--vocab", "300", "--json", str(out)])
    rows = json.loads(out.read_text())["results"]["embeddings"]["rows"]
    assert rc == 0 and [r["batch"] for r in rows] == [1, 4]
    assert all(r["min_cosine"] >= 0.9999 and len(r["rounds"]) == 2 and r["ratio"] > 0 for r in rows)
