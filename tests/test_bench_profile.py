"""`ridge bench` step breakdown: exclusive times through the engine's timing hook."""
from __future__ import annotations

import pytest
import torch

from engine_utils import greedy, make_engine, prompts
from ridge.bench.profile import Breakdown, step_breakdown
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


def test_breakdown_of_real_engine_steps_adds_up(engine):
    for i, p in enumerate(prompts(engine.loaded.config.vocab_size, [9, 14, 5])):
        engine.add_request(f"p{i}", p, greedy(12))
    engine.step()  # the prefill; the rest are decode steps
    with step_breakdown(engine) as bd:
        for _ in range(3):
            bd.step(engine.step)
    assert set_timer(None) is None  # the hook is off again once the block ends
    ms = bd.per_step_ms()
    assert ENGINE_SECTIONS <= set(ms), ENGINE_SECTIONS - set(ms)
    parts = {k: v for k, v in ms.items() if k != "total"}
    assert all(v > 0 for k, v in parts.items() if k != "other")
    assert sum(parts.values()) == pytest.approx(ms["total"])
    assert ms["other"] > -0.05 * ms["total"]  # exclusive times: nothing counted twice
    while engine.has_unfinished():
        engine.step()
