"""`ridge bench` step breakdown: exclusive times through the engine's timing hook."""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from engine_utils import greedy, make_engine, prompts
from ridge.bench.profile import Breakdown, step_breakdown
from ridge.kernels import decoder_native
from ridge.kernels.timing import section, set_timer
from ridge.models.loader import load_model
from tiny_models import make_tiny

ENGINE_SECTIONS = {"norm", "rope", "act", "linear", "kv_write", "attention", "embed", "lm_head",
                   "batch_build", "sample", "schedule", "sched_update", "outputs"}


def test_nested_sections_get_exclusive_time():
    """A parent's clock stops while its child runs: lm_head keeps only its own 5 s,
    the linear inside it gets its 10, and what no section covers is "other"."""
    now = [0.0]

    def advance(s):
        now[0] += s

    def step():
        advance(1)
        with section("lm_head"):
            advance(2)
            with section("linear"):
                advance(10)
            advance(3)
        advance(4)

    bd = Breakdown(torch.device("cpu"), clock=lambda: now[0])
    previous = set_timer(bd)
    try:
        bd.step(step)
        bd.step(step)
    finally:
        set_timer(previous)
    assert bd.per_step_ms() == {"linear": 10e3, "lm_head": 5e3, "other": 5e3, "total": 20e3}


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path, _, _ = make_tiny(tmp_path_factory.mktemp("profile"), "llama")
    return make_engine(load_model(path, device="cpu", use_cache=False))


@pytest.mark.parametrize("one_call", [False, True])
def test_breakdown_of_real_engine_steps_adds_up(engine, one_call):
    """Per op, each op's section; with the layers in one C call (kernels/decoder_native.py), theirs
    in `layers`."""
    for i, p in enumerate(prompts(engine.loaded.config.vocab_size, [9, 14, 5])):
        engine.add_request(f"p{i}", p, greedy(12))
    engine.step()  # the prefill; the rest are decode steps
    with step_breakdown(engine) as bd, (nullcontext() if one_call else decoder_native.off()):
        for _ in range(3):
            bd.step(engine.step)
    assert set_timer(None) is None  # the hook is off again once the block ends
    ms = bd.per_step_ms()
    inside = {"norm", "rope", "act", "linear", "kv_write", "attention"}
    want = (ENGINE_SECTIONS - inside) | {"layers", "linear"} if one_call else ENGINE_SECTIONS  # linear: the head's
    assert want <= set(ms), want - set(ms)
    assert one_call == engine.model.__dict__["_native_stack"].took(3)
    parts = {k: v for k, v in ms.items() if k != "total"}
    assert all(v > 0 for k, v in parts.items() if k != "other")
    assert sum(parts.values()) == pytest.approx(ms["total"])
    assert ms["other"] > -0.05 * ms["total"]  # exclusive times: nothing counted twice
    while engine.has_unfinished():
        engine.step()
