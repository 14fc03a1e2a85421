"""The decoder's layers in one C call (kernels/decoder_native.py, issue 45): a step's bits are the
per-op path's (the same kernels, in the same order), at decode and prefill sizes, on fp32 and
bf16 caches, with biases (qwen2; smollm3's MLP too), a sliding window, NoPE layers (smollm3),
per-head norms (qwen3) and mixtures of experts between calls (qwen3_moe with a dense layer,
mixtral); and the layers it cannot take run one op at a time (an FP8 cache, sink logits, a sliding
layer with blocks of its own, a product in a format not ridge's)."""
from __future__ import annotations

import pytest

from engine_utils import make_engine, prompts
from ridge.engine.sampling_params import SamplingParams
from ridge.kernels import decoder_native, native

pytestmark = pytest.mark.skipif(native.fp8_linear_isa() == 0, reason="no e4m3 kernel on this CPU")


def _load(tmp_path_factory, model_type: str, **fields):
    """A tiny random transformers model of the family, saved and loaded through ridge's loader."""
    from ridge.models.loader import load_model
    from test_families import build_hf

    _, path = build_hf(tmp_path_factory.mktemp(model_type), model_type, fields)
    return load_model(path, device="cpu", use_cache=False)


def _outputs(loaded, kv_dtype: str, **kw) -> list:
    """Five requests of odd lengths together (decode steps of 1-5 rows, prefill chunks of up to
    64): each one's tokens and top-5 logprobs."""
    eng = make_engine(loaded, kv_dtype=kv_dtype, **kw)
    ps = prompts(loaded.config.vocab_size, [1, 9, 40, 70, 23], seed=3)
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, SamplingParams(max_tokens=12 - i, ignore_eos=True, logprobs=5))
    got: dict[str, list] = {f"r{i}": [] for i in range(len(ps))}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += [(t, lp[0], tuple(lp[1])) for t, lp in zip(o.new_token_ids, o.logprobs or [])]
    return [got[k] for k in sorted(got)]


def _stack(loaded):
    return loaded.model.__dict__.get("_native_stack")


@pytest.mark.parametrize("arch, kw", [
    ("llama", {}), ("qwen2", {}), ("mistral", {"sliding_window": 16}),
    ("smollm3", {"no_rope_layers": [1, 0, 1, 0], "num_hidden_layers": 4, "attention_bias": True, "mlp_bias": True}),
    ("qwen3", {}),
    ("qwen3_moe", {"num_experts": 6, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [1],
                   "num_hidden_layers": 3}),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2})],
    ids=["llama", "qwen2-biases", "window16", "smollm3-nope-biases", "qwen3-head-norms", "qwen3_moe-dense-layer",
         "mixtral"])
@pytest.mark.parametrize("kv_dtype", ["fp32", "bf16"])
def test_one_call_equals_per_op(tmp_path_factory, arch, kw, kv_dtype):
    loaded = _load(tmp_path_factory, arch, **kw)
    fused = _outputs(loaded, kv_dtype)
    stack = _stack(loaded)
    assert stack is not None and stack.took(1), "the one-call path did not take a decode step"
    if arch in ("qwen3_moe", "mixtral"):  # the experts run in the call too (the dense layer's MLP as ever)
        assert any(stack.c_moe) and all(c or s.mlp is None for c, s in zip(stack.c_moe, stack.specs))
    with decoder_native.off():
        per_op = _outputs(loaded, kv_dtype)
    assert fused == per_op
    assert all(len(r) for r in fused)


@pytest.mark.skipif(not native.tiles_bf16(), reason="the CPU has no AMX")
def test_one_call_runs_the_amx_decode_steps_as_per_op(tmp_path_factory):
    """--cpu-amx decode on a measured plan (here set: the streaming kernel at one row, the blocked
    product above): the decode steps of 2-5 rows run AMX's bf16 tiles in the C call too, a
    prompt's fp32 tiles, and the bits are the per-op path's."""
    loaded = _load(tmp_path_factory, "llama")
    fused = _outputs(loaded, "bf16", cpu_weight_format="bf16:1")
    stack = _stack(loaded)
    decode = [built for (rows, dec), built in stack._rows.items() if dec and rows > 1 and built is not None]
    assert decode and all(lay.qkv.bf16 == lay.down.bf16 == 1 for built in decode for lay in built[0])
    assert all(lay.qkv.bf16 == 0 for (_, dec), built in stack._rows.items() if not dec and built is not None
               for lay in built[0])
    with decoder_native.off():
        per_op = _outputs(loaded, "bf16", cpu_weight_format="bf16:1")
    assert fused == per_op


def test_a_routers_tie_in_the_call_runs_the_step_per_op(tmp_path_factory):
    """Experts whose router rows are equal tie for every token (tests/test_moe.py's _tie): torch
    breaks such ties its own way, so a step whose router meets one in the C call runs per op
    again, and the tokens are the per-op path's (which breaks them as transformers does)."""
    from ridge.models.loader import load_model
    from test_families import build_hf
    from test_moe import VARIANTS, _tie

    _, path = build_hf(tmp_path_factory.mktemp("tie"), "qwen3_moe", VARIANTS["qwen3_moe"][1], edit=_tie)
    loaded = load_model(path, device="cpu", use_cache=False)
    fused = _outputs(loaded, "fp32")
    stack = _stack(loaded)
    assert stack.took(1) and all(stack.c_moe)
    with decoder_native.off():
        assert fused == _outputs(loaded, "fp32")


def test_fp8_cache_runs_per_op(tmp_path_factory):
    """An FP8 cache rotates q, k and v first (ops.kv_rotation): not the C path's; the step runs
    per op and the stack says so."""
    loaded = _load(tmp_path_factory, "llama")
    _outputs(loaded, "fp8")
    assert _stack(loaded)._built[1] is None


def test_family_attention_runs_per_op(tmp_path_factory):
    """gpt-oss's sink logits are not the C attention's: the model offers no specs."""
    loaded = _load(tmp_path_factory, "gpt_oss", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32,
                   sliding_window=16, layer_types=["full_attention"] * 2)
    _outputs(loaded, "fp32")
    assert loaded.model.plain_layer_specs() is None


def test_rows_past_the_streaming_formats_run_per_op(tmp_path_factory):
    """A product whose format at a row count is neither ridge kernel (a plain fp32 weight) takes
    the step out of the C path at that count only."""
    loaded = _load(tmp_path_factory, "llama")
    _outputs(loaded, "fp32")
    stack = _stack(loaded)
    assert stack.took(1)
    lin = stack.specs[0].products[1]
    runs, kinds, bounds = lin.runs, lin.kinds, lin.bounds
    try:
        lin.runs, lin.kinds, lin.bounds = [None, None], ["fp8", "fp32"], [1, 2]  # fp32 isn't ridge's: not taken
        stack._rows.clear()
        assert stack._layers(1) is not None and stack._layers(2) is None
    finally:
        lin.runs, lin.kinds, lin.bounds = runs, kinds, bounds
        stack._rows.clear()


def test_kv_groups_run_per_op(tmp_path_factory):
    """Sliding layers with blocks of their own (a second KV group, smollm3 with mixed windows):
    the model offers no specs, and the tokens are the per-op path's."""
    loaded = _load(tmp_path_factory, "smollm3", use_sliding_window=True, sliding_window=16,
                   layer_types=["full_attention", "sliding_attention"] * 2, num_hidden_layers=4)
    _outputs(loaded, "fp32")
    assert loaded.model.plain_layer_specs() is None


def test_a_step_without_prompt_rows_is_a_decode_step(tmp_path_factory):
    """The runner marks a step whose rows all lie past their prompts (cpu_linear.decode_step: where
    --cpu-amx decode rounds the products' activations to bf16), and never one with a prompt's rows:
    a one-token prompt's, or a new prompt's step beside running decodes."""
    from ridge.kernels.cpu_linear import in_decode_step

    loaded = _load(tmp_path_factory, "llama")
    eng = make_engine(loaded)
    seen: list[tuple[int, bool]] = []
    hook = loaded.model.register_forward_pre_hook(lambda mod, args: seen.append((args[0].shape[0], in_decode_step())))
    try:
        a, b, c = prompts(loaded.config.vocab_size, [9, 1, 5], seed=4)
        eng.add_request("a", a, SamplingParams(max_tokens=4, ignore_eos=True))
        eng.add_request("b", b, SamplingParams(max_tokens=4, ignore_eos=True))
        eng.step()
        eng.step()
        eng.add_request("c", c, SamplingParams(max_tokens=4, ignore_eos=True))
        eng.step()
        eng.step()
    finally:
        hook.remove()
    assert seen == [(10, False), (2, True), (7, False), (3, True)]
    assert not in_decode_step()
