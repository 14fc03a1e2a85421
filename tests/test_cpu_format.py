"""The CPU product is chosen per matrix shape and step size, by measurement, at every size the
scheduler makes, and the timings are cached per machine; the choice is kernels'
(kernels/cpu_linear_plan.py), the engine only starts it (ridge/engine/cpu_format.py). An e4m3
weight chooses between ridge's two e4m3 products only; a weight never quantized among fp32 and
bf16 copies."""
from __future__ import annotations

import json

import pytest
import torch

from ridge.engine import cpu_format
from ridge.kernels import cpu_linear_plan as plans
from ridge.kernels import native
from ridge.kernels.cpu_linear import ShapeFormat, gemv_bf16, gemv_offered, tiles_offered
from ridge.quant.fp8 import quantize_fp8
from ridge.quant.linear import FP8Linear


def _linear(out_f=48, in_f=32):
    q, s = quantize_fp8(torch.randn(out_f, in_f))
    lin = FP8Linear(in_f, out_f)
    lin.load(q, s, None, torch.device("cpu"), torch.float32)
    return lin


def _plain(out_f, in_f):
    lin = FP8Linear(in_f, out_f)
    lin.load(torch.randn(out_f, in_f), None, None, torch.device("cpu"), torch.float32)
    return lin


def test_sizes_cover_the_step_budget():
    assert plans.step_sizes(1) == [1]
    assert plans.step_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_each_size_takes_the_faster_format_and_a_loss_does_not_end_the_search():
    # bf16 slower at one row (as measured on an AMX machine) but faster at 16 and 64 rows.
    times = {1: (5.1e-3, 5.3e-3), 2: (5.2e-3, 5.0e-3), 16: (26e-3, 12e-3), 64: (60e-3, 12e-3), 128: (1.0, 2.0)}
    plan = plans.plan_from_times(times)
    assert plan == [(1, False), (2, False), (16, True), (64, True), (128, False)]
    assert plans.describe(plan) == "fp32 1-2, bf16 3-64, fp32 65-128"


needs_e4m3 = pytest.mark.skipif(not tiles_offered(), reason="ridge's e4m3 products are not built here")


def test_a_weight_never_quantized_takes_the_gemv_only_where_it_beats_both():
    known = {1: (10.0, 6.0), 4: (12.0, 6.5)}
    assert plans._format([1, 4], known, gemv_s=4.0).gemv == gemv_offered()
    assert not plans._format([1, 4], known, gemv_s=5.9).gemv  # not by the margin


def test_one_row_steps_take_the_gemv_where_it_is_kept():
    """A one-row step through ATen's bf16 GEMV on a plain bf16 copy, every other step
    size as before; the result is the bf16 product's, and oneDNN is switched back on after."""
    lin = _plain(48, 32)
    lin.cpu_weights().use(ShapeFormat([(1, True), (8, True)], gemv=True))
    assert [lin.cpu.kind(n) for n in (1, 3)] == ["gemv", "bf16"]
    plain = lin.cpu.copies["gemv"]
    assert plain.dtype == torch.bfloat16 and not plain.is_mkldnn
    for rows in (1, 3):
        x = torch.randn(rows, 32)
        ref = torch.nn.functional.linear(x, lin.weight)
        torch.testing.assert_close(lin(x), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)
    x = torch.randn(1, 32)
    assert torch.equal(lin(x), gemv_bf16(x.to(torch.bfloat16), plain).float())
    assert torch._C._get_mkldnn_enabled()  # switched back on
    lin.cpu.use(ShapeFormat([(1, True), (8, True)]))
    assert lin.cpu.kind(1) == "bf16" and set(lin.cpu.copies) == {"bf16"}


def test_a_layer_follows_its_plan_by_step_size():
    lin = _plain(48, 32)
    lin.cpu_weights().use(ShapeFormat([(1, False), (4, True), (8, False)]))
    assert [lin.cpu.kind(n) for n in (1, 2, 4, 5, 8, 100)] == ["fp32", "bf16", "bf16", "fp32", "fp32", "fp32"]
    x = torch.randn(3, 32)
    ref = torch.nn.functional.linear(x, lin.weight)
    torch.testing.assert_close(lin(x), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)
    lin.cpu.use(ShapeFormat.bf16_up_to(0))
    assert lin.cpu.copies == {} and lin.cpu.kind(1) == "fp32"
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))


@needs_e4m3
def test_an_e4m3_layer_follows_its_plan_and_makes_no_copy():
    """The streaming kernel at the sizes the plan marks, the blocked product at the others; both
    read the one packed copy, and each answers as the torch reference does."""
    lin = _linear()
    isa = native.fp8_linear_isa()
    lin.cpu.use(ShapeFormat([], fp8=[(1, True), (4, True), (8, False)]), isa)
    assert [lin.cpu.kind(n) for n in (1, 4, 5, 100)] == ["fp8", "fp8", "tiles", "tiles"]
    assert lin.cpu.copies == {} and lin.cpu.weight is None
    for rows in (1, 3, 5, 33):
        x = torch.randn(rows, 32)
        ref = lin.cpu.reference(x)
        torch.testing.assert_close(lin(x), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-5)


@needs_e4m3
def test_timings_are_measured_once_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(plans, "_had_the_cores", lambda wall, cpu: True)  # the suite's workers share the cores

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.lm_head = _linear(48, 32), _linear(48, 32), _linear(96, 32)
            self.c = _plain(48, 32)  # a recipe's bf16 exception: the formats of old

    m = Model()
    made = {}
    layers = [lin.cpu_weights() for lin in (m.a, m.b, m.lm_head, m.c)]
    found = plans.measure_plans(layers, (96, 32), max_tokens=20, max_head_rows=4, made=made)
    e4m3 = plans.shape_class(layers[0])[1]
    assert set(found) == {((48, 32), e4m3), ((96, 32), e4m3), ((48, 32), None)}
    # Only the weight never quantized has bf16 copies made to time it, handed back to keep.
    assert set(made) == {(id(m.c.weight), "packed"), (id(m.c.weight), "plain")}
    assert [n for n, _ in found[((48, 32), e4m3)].fp8] == [1, 2, 4, 8, 16, 20]
    assert [n for n, _ in found[((96, 32), e4m3)].fp8] == [1, 2, 4]  # the head only sees sampled rows
    assert [n for n, _ in found[((48, 32), None)].plan] == [1, 2, 4, 8, 16, 20]
    timings = json.loads((tmp_path / "ridge" / "cpu-format.json").read_text())
    assert all(t["48x32"]["gemv"] > 0 for t in timings.values())  # the one-row GEMV timed too
    assert native.source_digest() in e4m3  # the e4m3 products' timings are of this build of them
    assert all(sorted(map(int, t["48x32"][e4m3])) == [1, 2, 4, 8, 16, 20] for t in timings.values())
    assert all(len(v) == 2 and min(v) > 0 for t in timings.values() for v in t["48x32"][e4m3].values())
    cached = (tmp_path / "ridge" / "cpu-format.json").read_text()
    again_made = {}
    again = plans.measure_plans(layers, (96, 32), max_tokens=20, max_head_rows=4, made=again_made)  # cached
    assert again == found and (tmp_path / "ridge" / "cpu-format.json").read_text() == cached
    assert again_made == {}  # nothing timed, nothing copied


def test_an_unquantized_model_keeps_its_own_weights(tmp_path, monkeypatch):
    """--weights fp32: no bf16 copy (it would round the weights the user asked for), however
    large the model; a quantized one gets its copy where it measures faster."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(plans, "_had_the_cores", lambda wall, cpu: True)  # the suite's workers share the cores

    class Model(torch.nn.Module):
        def __init__(self, quantized: bool):
            super().__init__()
            self.a = _linear(48, 32) if quantized else _plain(48, 32)
            self.lm_head = _plain(96, 32)  # the head stays in the compute dtype (quant/fp8.py)
            self.cos_sin = torch.zeros(1)

    timings = tmp_path / "ridge" / "cpu-format.json"
    plain = Model(quantized=False)
    assert cpu_format.choose_cpu_format(plain, weight_bytes=1 << 40, max_tokens=8, max_head_rows=4) == 0
    assert all(m.cpu is None or not m.cpu.copies for m in plain.modules() if isinstance(m, FP8Linear))
    assert not timings.exists()  # nothing measured
    quantized = Model(quantized=True)
    cpu_format.choose_cpu_format(quantized, weight_bytes=1 << 40, max_tokens=8, max_head_rows=4)
    assert "48x32" in timings.read_text() and "96x32" in timings.read_text()
    # The e4m3 layer keeps its bytes alone; the head in the compute dtype may take a bf16 copy.
    assert quantized.a.cpu.copies == {} and quantized.a.cpu.weight is None


def test_shapes_are_timed_cold_over_enough_weights(monkeypatch):
    """A real step streams every weight through the cache, so each shape is timed over enough of
    the model's weights of that shape to overflow the last-level cache twice (in fp32)."""
    assert plans.llc_bytes() > 0
    monkeypatch.setattr(plans, "llc_bytes", lambda: 10_000)
    ws = [torch.zeros(48, 32) for _ in range(30)]  # 6,144 bytes each
    assert len(plans.cold_set(ws)) == 4  # ceil(20,000 / 6,144)
    assert len(plans.cold_set(ws[:2])) == 2  # all there are
    assert len(plans.cold_set([torch.zeros(100, 100)])) == 1  # larger than the cache alone
    times = plans.measure_shape(plans.cold_set(ws), [1, 3])
    assert set(times) == {1, 3} and all(t32 > 0 and t16 > 0 for t32, t16 in times.values())


def test_timings_are_kept_per_instruction_set(tmp_path, monkeypatch):
    """The same CPU capped to AVX2 (ONEDNN_MAX_CPU_ISA) is another machine to the timings."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    full = plans._cpu_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert plans._cpu_key() != full and torch.backends.cpu.get_cpu_capability() in full


@needs_e4m3
def test_e4m3_weights_are_timed_in_their_two_products_only():
    lins = [_linear(48, 32).cpu for _ in range(3)]
    times = plans.measure_e4m3(lins, [1, 2, 8], native.fp8_linear_isa())
    assert set(times) == {1, 2, 8} and all(0 < a < 1 and 0 < b < 1 for a, b in times.values())


def test_timings_taken_beside_other_work_are_not_cached():
    n = torch.get_num_threads()
    assert plans._had_the_cores(1.0, 0.9 * n) and plans._had_the_cores(0.0, 0.0)
    assert not plans._had_the_cores(1.0, 0.5 * n)  # half the cores: another process had the rest
