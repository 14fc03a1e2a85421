"""Whole model steps through ops.use_triton() (the interpreter) against the reference
path, the dispatch rules and the config cache."""

import pytest
import torch
from tiny_models import make_tiny

from ridge.kernels import ops
from ridge.kernels.triton_utils import ConfigCache
from ridge.models.oneshot import prompt_logits
from ridge.models.loader import load_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path, cfg, _ = make_tiny(tmp_path_factory.mktemp("tiny"))
    return load_model(path, device="cpu", weights="fp8", use_cache=False, show_progress=False).model


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp32"])
def test_prompt_step_through_triton(tiny, kv_dtype):
    ids = list(range(3, 44))
    expected = prompt_logits(tiny, ids, kv_dtype=kv_dtype)
    with ops.use_triton():
        got = prompt_logits(tiny, ids, kv_dtype=kv_dtype)
    torch.testing.assert_close(got, expected, atol=2e-3, rtol=2e-3)


def test_dispatch_rules():
    x, w = torch.zeros(2, 8), torch.ones(8)
    # CPU default: by the call's shapes (tests/test_native.py checks where the C kernels run);
    # a dtype no CPU path takes goes to the reference.
    assert ops.backend("rms_norm", x, w, 1e-5, None) in (ops.rms_norm_native, ops.rms_norm_torch)
    assert ops.backend("rms_norm", x.bfloat16(), w, 1e-5, None) is ops.rms_norm_ref
    assert ops.backend("silu_and_mul", x.half()) is ops.silu_and_mul_ref
    with ops.use_triton():
        assert ops.backend("rms_norm", x, w, 1e-5, None).__name__ == "rms_norm_triton"
        with ops.use_triton(False):  # the oracle: references only
            assert ops.backend("rms_norm", x, w, 1e-5, None) is ops.rms_norm_ref
    assert ops._FORCE is None


def test_config_cache_round_trip(tmp_path):
    cache = ConfigCache(tmp_path / "cfg.json")
    cache.put("attn|H200|sm90|key", {"BLOCK_N": 64})
    assert ConfigCache(tmp_path / "cfg.json").get("attn|H200|sm90|key") == {"BLOCK_N": 64}
    assert ConfigCache(tmp_path / "missing.json").get("x") is None
