"""The engine in three parts (issue 40): the core's outputs carry token ids only, and the output
processor the daemon runs on its socket thread (a sample's TextState inside streams.InFlight)
turns them into the same text, stop strings included, as the in-process LLMEngine, even when
the core runs steps past a stop string before it hears of it."""
from __future__ import annotations

import pytest

from engine_utils import greedy, load_tiny, make_engine, prompts
from ridge.daemon.frontend.streams import InFlight
from ridge.engine.builder import build_engine
from ridge.engine.config import EngineConfig
from ridge.engine.core import EngineCore
from ridge.engine.output import TextState
from ridge.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_tiny(tmp_path_factory, "parts")


def core(loaded) -> EngineCore:
    return EngineCore(build_engine(EngineConfig(device="cpu", kv_dtype="fp32", num_kv_blocks=256, max_num_seqs=16,
                                                prefill_chunk=64, ridge_point=8.0, kv_disk=False), loaded))


def _stop_for(text: str) -> str | None:
    """Two printable characters that first occur past the start of text."""
    return next((text[k:k + 2] for k in range(3, len(text) - 2)
                 if "\ufffd" not in text[k:k + 2] and text.find(text[k:k + 2]) == k), None)


def test_core_outputs_carry_no_text(loaded):
    eng = core(loaded)
    eng.add_request("a", prompts(loaded.config.vocab_size, [9])[0], greedy(6))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert outs and all(o.new_text == "" for o in outs) and sum(len(o.new_token_ids) for o in outs) == 6
    assert outs[-1].finished and outs[-1].finish_reason == "length"


@pytest.mark.parametrize("lag", [0, 3])
def test_a_stop_string_read_on_the_daemon_side_equals_the_in_process_engine(loaded, lag):
    """lag: steps the core runs before the socket thread's finish reaches it; their tokens are dropped."""
    vocab = loaded.config.vocab_size
    for p in prompts(vocab, [5, 7, 11, 13, 17], seed=3):
        full = make_engine(loaded).generate([p], greedy(40))[0].new_text
        if (stop := _stop_for(full)) is not None:
            break
    assert stop is not None, full
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop], n=2)  # greedy: both meet the stop alike
    (want,) = make_engine(loaded).generate([p], params)
    assert want.finish_reason == "stop" and want.new_text == full[:full.index(stop)]

    eng = core(loaded)
    eng.add_request("e1", p, params)
    inf = InFlight(None, "c", "e1", stream=False, n=2, logprobs=False,
                   detok=lambda: TextState(loaded.tokenizer, p, params))
    told: list[tuple[int, int]] = []  # (step at which the stop was found, sample)
    step = 0
    while eng.has_unfinished():
        step += 1
        for o in eng.step():
            if inf.add(o):
                told.append((step, o.index))
        for at, index in [t for t in told if t[0] + lag == step]:
            assert eng.finish_sample("e1", index)
    assert sorted(i for _, i in told) == [0, 1] and inf.done
    final = inf.final()
    for c in final["choices"]:
        assert (c["text"], c["finish_reason"], c["completion_tokens"]) == \
            (want.new_text, "stop", want.num_output_tokens)
        assert c["token_ids"] == want.new_token_ids
    assert final["usage"]["completion_tokens"] == 2 * want.num_output_tokens
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.num_blocks


def test_an_embedding_step_samples_nothing(tmp_path_factory):
    """Pooling is the runner's task: no logits, no sample; the request ends once its prompt is computed."""
    loaded = load_tiny(tmp_path_factory, "parts-embed")
    eng = make_engine(loaded, pooling="mean")
    out = eng.embed([[5, 6, 7, 8], [9, 10]])
    assert out.finished and out.finish_reason == "stop" and len(out.embeddings) == 2
    assert eng.runner.last.sampled is None and eng.totals["decode_tokens"] == 0


def test_a_stop_string_in_outputs_merged_past_the_end_is_the_finish(loaded):
    """The socket thread held up (engine_loop.HeldOutputs merged every step into one output): the
    core ran the sample to max_tokens, never told of the stop string. The output processor still
    ends the text at the stop, keeps the tokens up to it, and says stop, as the in-process engine."""
    from ridge.daemon.frontend.engine_loop import HeldOutputs

    vocab = loaded.config.vocab_size
    for p in prompts(vocab, [5, 7, 11, 13, 17], seed=3):
        full = make_engine(loaded).generate([p], greedy(40))[0].new_text
        if (stop := _stop_for(full)) is not None:
            break
    params = SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop])
    (want,) = make_engine(loaded).generate([p], params)
    eng = core(loaded)
    eng.add_request("e1", p, params)
    held = HeldOutputs()
    while eng.has_unfinished():
        held.add(eng.step())
    (merged,) = held.take()
    assert merged.finished and merged.finish_reason == "length" and merged.num_output_tokens == 40
    inf = InFlight(None, "c", "e1", stream=False, n=1, logprobs=False,
                   detok=lambda: TextState(loaded.tokenizer, p, params))
    assert inf.add(merged) is False and inf.done  # nothing to tell the core: it has finished
    (c,) = inf.final()["choices"]
    assert (c["text"], c["finish_reason"], c["completion_tokens"], c["token_ids"]) == \
        (want.new_text, "stop", want.num_output_tokens, want.new_token_ids)
