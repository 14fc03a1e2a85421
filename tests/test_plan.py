import sys

import pytest

from ridge import plan as P
from ridge.config import ModelShape, kv_bytes_per_token
from ridge.plan import (GIB, GPUS, concurrent_requests, get_gpu, kv_tokens_that_fit, make_plan,
                        match_device_name, token_budget_knee)
from tiny_models import make_tiny

SEED = dict(num_layers=80, num_kv_heads=8, head_dim=128)  # the seed's 70B-class model
SEED_SHAPE = ModelShape("70b", **SEED)
SEED_BPT = 327_680


def _run(argv):
    """Through the real CLI, which hands `ridge plan` the real model readers."""
    from ridge.cli import main

    return main(argv)


# --- the seed's worked example -------------------------------------------------------------

def test_seed_fp16_kv_bytes_per_token():
    bpt = kv_bytes_per_token(SEED_SHAPE, "bf16")
    assert bpt == SEED_BPT
    assert bpt / 1024 == 320  # KiB


@pytest.mark.parametrize("ten_gb", [10e9, 10 * GIB])
def test_seed_10gb_holds_about_32k_tokens(ten_gb):
    tokens = kv_tokens_that_fit(ten_gb, SEED_BPT)
    assert 30_500 <= tokens <= 32_800
    # "Eight users at 4K context and you are full" (7 with decimal GB, 8 with GiB).
    assert concurrent_requests(tokens, 4096) in (7, 8)


def test_seed_8000_token_request_is_about_2_5_gib():
    assert 8000 * SEED_BPT / GIB == pytest.approx(2.44, abs=0.01)


def test_fp8_scale_overhead_is_counted_and_still_nearly_doubles_capacity():
    # Without the scales FP8 would be exactly half; each (token, KV head) adds a float16 for K and for V.
    assert kv_bytes_per_token(SEED_SHAPE, "fp8") == 2 * 80 * 8 * (128 + 2)
    fp16 = kv_bytes_per_token(ModelShape("8b", 32, 8, 64), "fp16")
    fp8 = kv_bytes_per_token(ModelShape("8b", 32, 8, 64), "fp8")
    ratio = kv_tokens_that_fit(10 * GIB, fp8) / kv_tokens_that_fit(10 * GIB, fp16)
    assert 1.9 <= ratio < 2.0


def test_make_plan_reproduces_the_seed_80gb_fp8_weights_case():
    shape = ModelShape("70b", **SEED, num_params=70_000_000_000)
    plan = make_plan(shape, memory_gib=80e9 / GIB, weights="fp8", block_size=16)  # 80 GB minus 70 GB of FP8 weights = 10 GB
    fp16, fp8 = plan.rows
    assert plan.kv_memory_bytes == pytest.approx(10e9)
    assert (fp16.bytes_per_token, fp16.tokens, fp16.requests) == (SEED_BPT, 30_517, 7)
    assert fp8.bytes_per_token == 166_400
    assert fp8.tokens >= 1.9 * fp16.tokens and fp8.requests >= 14
    assert plan.ridge == {} and plan.knees == {}


# --- hardware table ------------------------------------------------------------------------

def test_h100_ridge_point():
    assert get_gpu("h100").ridge_point("bf16") == pytest.approx(989e12 / 3.35e12, rel=0.01)
    assert get_gpu("h100").ridge_point("bf16") == pytest.approx(295, abs=1)


def test_table_is_dense_and_ampere_has_no_fp8():
    assert set(GPUS) == {"rtx-3090", "rtx-4090", "rtx-5090", "rtx-a6000", "rtx-6000-ada",
                         "l4", "l40s", "a100-80gb", "h100-sxm", "h200"}
    for key in ("rtx-3090", "rtx-a6000", "a100-80gb"):
        assert GPUS[key].fp8_tflops is None
        with pytest.raises(ValueError, match="FP8"):
            GPUS[key].ridge_point("fp8")
    for spec in GPUS.values():
        assert 50 < spec.ridge_point("bf16") < 450  # a sparse figure would push H100 to ~590
    assert GPUS["rtx-4090"].bf16_tflops == 165.2  # FP32-accumulate, not the 330 FP16-acc figure


@pytest.mark.parametrize("name,key", [
    ("4090", "rtx-4090"), ("rtx-4090", "rtx-4090"), ("RTX 4090", "rtx-4090"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"), ("h100", "h100-sxm"), ("H100 SXM", "h100-sxm"),
    ("a100", "a100-80gb"), ("l4", "l4"), ("L40S", "l40s"), ("rtx 6000 ada", "rtx-6000-ada"),
    ("A6000", "rtx-a6000"), ("H200", "h200"), ("5090", "rtx-5090"), ("3090", "rtx-3090"),
])
def test_forgiving_lookup(name, key):
    assert get_gpu(name) is GPUS[key]


def test_unknown_gpu_lists_known_ones():
    with pytest.raises(ValueError) as e:
        get_gpu("voodoo2")
    assert "rtx-4090" in str(e.value) and "h100-sxm" in str(e.value)


@pytest.mark.parametrize("device,key", [
    ("NVIDIA H100 80GB HBM3", "h100-sxm"), ("NVIDIA H100 PCIe", None), ("NVIDIA H100 NVL", None),
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"), ("NVIDIA A100-SXM4-40GB", None),
    ("NVIDIA A100 80GB PCIe", None), ("NVIDIA H200", "h200"), ("NVIDIA L4", "l4"),
    ("NVIDIA L40S", "l40s"), ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("NVIDIA GeForce RTX 4090 D", None), ("NVIDIA GeForce RTX 3090 Ti", None),
    ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"), ("NVIDIA RTX A6000", "rtx-a6000"),
    ("NVIDIA GeForce RTX 5090", "rtx-5090"),
])
def test_local_device_names_match_only_the_right_row(device, key):
    assert match_device_name(device) is (GPUS[key] if key else None)


def test_local_device_spec_uses_measured_memory(monkeypatch):
    monkeypatch.setattr(P, "_local_cuda", lambda: ("NVIDIA H100 80GB HBM3", 79.1))
    spec = P.local_device_spec()
    assert spec.name == "H100 SXM" and spec.memory_gib == 79.1
    monkeypatch.setattr(P, "_local_cuda", lambda: None)
    assert P.local_device_spec() is None


def test_local_device_spec_on_this_machine_does_not_crash():
    spec = P.local_device_spec()
    assert spec is None or spec.name in {g.name for g in GPUS.values()}


# --- the knee ------------------------------------------------------------------------------

def test_token_budget_knee():
    assert token_budget_knee(295.3, 2) == pytest.approx(295.3)
    assert token_budget_knee(295.3, 1) == pytest.approx(147.65)
    # At T* a step's intensity 2*T/b equals the ridge point.
    t = token_budget_knee(200, 2)
    assert 2 * t / 2 == pytest.approx(200)


def test_make_plan_with_gpu_defaults_memory_and_reports_ridge():
    shape = ModelShape("8b", 32, 8, 128, num_params=8_000_000_000)
    plan = make_plan(shape, gpu="h100", weights="fp8", block_size=16)
    assert plan.memory_bytes == 80 * GIB
    assert plan.ridge["bf16"] == pytest.approx(295.3, abs=0.1)
    assert plan.ridge["fp8"] == pytest.approx(590.7, abs=0.1)
    # FP8 halves the bytes and doubles the FLOP/s: the knee lands at the same T*.
    knees = plan.knees
    assert knees["fp8 weights, fp8 math"] == pytest.approx(knees["bf16 weights, bf16 math"], rel=1e-3)


def test_ampere_knee_is_weight_only_fp8():
    plan = make_plan(ModelShape("8b", **SEED), gpu="3090", weights="fp8", block_size=16)
    assert "fp8 weights, bf16 math" in plan.knees and "fp8" not in plan.ridge


def test_weights_that_do_not_fit_give_zero_tokens():
    plan = make_plan(ModelShape("70b", **SEED, num_params=70_000_000_000), gpu="4090", weights="fp8", block_size=16)
    assert all(r.tokens == 0 and r.requests == 0 for r in plan.rows)
    assert any("do not fit" in n for n in plan.notes)


def test_explicit_weight_bytes_override_params():
    shape = ModelShape("x", **SEED, num_params=70_000_000_000)
    plan = make_plan(shape, memory_gib=100, weight_bytes=140e9 / 2, weights="fp8", block_size=16)  # e.g. 8-bit + overhead
    assert plan.weight_bytes == 70e9
    assert plan.kv_memory_bytes == pytest.approx(100 * GIB - 70e9)


# --- CLI -----------------------------------------------------------------------------------

def test_cli_explicit_numbers_print_the_seed_figure(capsys):
    rc = _run(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "327,680" in out and "320.0" in out


def test_cli_with_gpu_and_params(capsys):
    rc = _run(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128",
               "--params", "70B", "--gpu", "h100-sxm", "--context", "8192"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "H100 SXM" in out and "ridge point" in out and "reqs @8192" in out


@pytest.mark.parametrize("weights, gib", [("fp8", 65.2), ("bf16", 130.4), ("fp32", 260.8)])
def test_cli_weights_size_the_weights_as_the_engine_holds_them(capsys, weights, gib):
    """`ridge plan --weights` is the engine's option: 70B parameters at 1, 2 or 4 bytes each."""
    rc = _run(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--params", "70B",
               "--memory-gib", "300", "--weights", weights])
    assert rc == 0 and f"- {weights} weights {gib} GiB" in capsys.readouterr().out


def test_cli_unknown_weights_are_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        _run(["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "1", "--weights", "int4"])
    assert "--weights" in capsys.readouterr().err


def test_cli_unknown_gpu_is_an_error(capsys):
    rc = _run(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--gpu", "tpu"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown GPU" in err and "h100-sxm" in err


def test_cli_missing_shape_is_an_error(capsys):
    assert _run(["plan", "--layers", "80"]) == 2
    assert "MODEL_PATH" in capsys.readouterr().err


def test_cli_list_gpus(capsys):
    assert _run(["plan", "--list-gpus"]) == 0
    out = capsys.readouterr().out
    assert all(g.name in out for g in GPUS.values())
    assert " 295 " in out  # H100 bf16 ridge


@pytest.mark.parametrize("fmt", ["gguf", "hf"])
def test_cli_model_path_reads_the_shape_from_the_file(capsys, tmp_path, fmt):
    path, cfg, sd = make_tiny(tmp_path, "qwen2", fmt)  # untied head, attention biases
    assert _run(["plan", str(path), "--memory-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert f"{cfg.name if fmt == 'gguf' else path.name}: 2 layers, 2 KV heads, head_dim 16" in out
    assert f"{2 * 2 * 2 * 16 * 2:>12,}" in out  # bf16 bytes per token
    # The count leaves out norms and biases: every tensor with more than one row.
    assert cfg.shape().num_params == sum(t.numel() for t in sd.values() if t.dim() == 2)


def test_cli_flags_override_the_model_files_shape(capsys, tmp_path):
    path, _, _ = make_tiny(tmp_path)
    assert _run(["plan", str(path), "--layers", "80", "--kv-heads", "8", "--head-dim", "128"]) == 0
    assert "327,680" in capsys.readouterr().out


def test_cli_unreadable_model_path_is_an_error(capsys, tmp_path):
    assert _run(["plan", str(tmp_path / "nope.gguf")]) == 2
    assert "nope.gguf: no such file or directory" in capsys.readouterr().err
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    assert _run(["plan", str(tmp_path / "junk.gguf")]) == 2
    assert "not a readable GGUF file" in capsys.readouterr().err


def test_cli_local_without_a_known_cuda_device_is_an_error(capsys, monkeypatch):
    for local in (None, ("NVIDIA Mystery 9000", 10.0)):
        monkeypatch.setattr(P, "_local_cuda", lambda: local)
        argv = ["plan", "--layers", "1", "--kv-heads", "1", "--head-dim", "1", "--gpu", "local"]
        assert _run(argv) == 2
        assert "--memory-gib" in capsys.readouterr().err


def test_cli_local_known_device_uses_measured_memory(capsys, monkeypatch):
    monkeypatch.setattr(P, "_local_cuda", lambda: ("NVIDIA GeForce RTX 4090", 23.5))
    rc = _run(["plan", "--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--gpu", "local"])
    out = capsys.readouterr().out
    assert rc == 0 and "RTX 4090: 23.5 GiB" in out
    assert "77,004" in out  # 23.5 GiB / 320 KiB, no weights given


def test_module_does_not_import_torch_at_import_time():
    import subprocess
    from pathlib import Path
    code = "import sys, ridge.plan; print('torch' in sys.modules)"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_plan_counts_an_images_tokens_as_the_models_processor_does(tmp_path, capsys):
    """ridge plan DIR --image WxH: each image's prompt tokens by the model's own rules, equal to
    the count transformers' processor writes into the prompt for an image of that size."""
    import io

    import transformers
    from PIL import Image

    from vlm_models import IMAGE, vlm_vocab, write_tiny_smolvlm

    path = write_tiny_smolvlm(tmp_path / "vlm", "smolvlm")
    proc = transformers.AutoProcessor.from_pretrained(str(path))
    image_id = vlm_vocab().index(IMAGE)

    def processor_count(w: int, h: int) -> int:
        buf = io.BytesIO()
        Image.new("RGB", (w, h), (10, 200, 30)).save(buf, "PNG")
        text = proc.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}])
        ids = proc(text=text, images=[[Image.open(buf)]])["input_ids"][0]
        return sum(t == image_id for t in ids)

    assert _run(["plan", str(path), "--image", "100x70", "--image", "20x20"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    a, b = processor_count(100, 70), processor_count(20, 20)
    assert line == f"images: {a + b} prompt tokens (100x70: {a}, 20x20: {b})" and a > 0 and b > 0
    assert _run(["plan", "--layers", "2", "--kv-heads", "1", "--head-dim", "8", "--image", "10x10"]) == 2
    assert "takes no image input" in capsys.readouterr().err


def test_plan_counts_a_gemma3_images_tokens_with_pan_and_scan(tmp_path, capsys):
    """Gemma 3 with do_pan_and_scan on: a wide image is itself and 2 crops, a near-square one
    itself; each count is the image tokens Gemma3Processor writes for an image of that size."""
    import json

    import transformers
    from PIL import Image

    from test_gemma3_images import BOI, IMAGE, PREPROCESSOR, vocab, write_tiny_gemma3

    path = write_tiny_gemma3(tmp_path / "gemma3")
    (path / "preprocessor_config.json").write_text(json.dumps({**PREPROCESSOR, "do_pan_and_scan": True}))
    proc = transformers.AutoProcessor.from_pretrained(str(path))
    image_id = vocab().index(IMAGE)

    def processor_count(w: int, h: int) -> int:
        ids = proc(text=f"see {BOI}", images=[[Image.new("RGB", (w, h), (10, 200, 30))]],
                   do_pan_and_scan=True)["input_ids"][0]
        return sum(t == image_id for t in ids)

    assert _run(["plan", str(path), "--image", "700x300", "--image", "300x280"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    a, b = processor_count(700, 300), processor_count(300, 280)
    assert a == 3 * b > 0
    assert line == f"images: {a + b} prompt tokens (700x300: {a}, 300x280: {b})"
