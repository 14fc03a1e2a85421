"""A GGUF model with llama.cpp's projector file (`--mmproj`, models/mmproj.py): a tiny random
Gemma 3 with images built by transformers 5.25, its text model written as llama.cpp's converter
writes a gemma3 GGUF and its tower and projector as the converter's --mmproj writes them
(Gemma3VisionModel: the clip arch, clip.vision.* keys, SigLIP under v.* by the gguf package's
tensor map, mm.input_projection in F16 as the converter forces it, the embeddings in F32,
mm.soft_emb_norm stored as 1 + w). The oracles are transformers' on the same checkpoint with the
projection rounded to F16: the encoder's rows, and greedy tokens through the engine with two
images in the prompt; the prompt rule the file implies equals the HF directory's."""
from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from engine_utils import make_engine
from test_engine_images import greedy_hf, params, run
from test_idefics3 import on_ridge_weights
from test_gemma3_images import (PREPROCESSOR, SIDE, SQUARE, TEXT, WIDE, image_inputs, processor_inputs, vocab,
                                write_tiny_gemma3)
from tiny_models import write_gguf
from ridge.engine.admit import Admitted
from ridge.models.loader import load_model
from ridge.models.mmproj import load_mmproj, mmproj_prompt_rules
from ridge.models.registry import read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.vision import decode_image
from ridge.vision.prompt import read_prompt_rules

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

# A text model llama.cpp's gemma3 GGUF can hold: its period of 6 (5 sliding : 1 full), its sliding
# layers' RoPE base of 10000, query_pre_attn_scalar equal to head_dim.
GGUF_TEXT = dict(TEXT, num_hidden_layers=6, sliding_window_pattern=6, rope_local_base_freq=10_000.0)


def build(path):
    write_tiny_gemma3(path, seed=6, text=GGUF_TEXT)
    return transformers.Gemma3ForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)


def write_text_gguf(path, hf_dir, model) -> None:
    """The text model, as the converter's Gemma3Model writes a Gemma3ForConditionalGeneration's."""
    cfg = read_hf_config(hf_dir)
    sd = {k.replace("model.language_model.", "model."): t for k, t in model.state_dict().items()
          if k.startswith(("model.language_model.", "lm_head."))}
    v = vocab()
    extra = tuple(v[len(v) - 3:]) + tuple(f"<unused{i}>" for i in range(5))
    write_gguf(path, cfg, sd, extra_tokens=extra)


def write_mmproj(path, model, overrides: dict | None = None, drop: str | None = None) -> None:
    """What `convert_hf_to_gguf.py --mmproj` writes for Gemma 3 (Gemma3VisionModel)."""
    vc = model.config.vision_config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    keys = {"clip.has_vision_encoder": True, "clip.projector_type": gguf.VisionProjectorType.GEMMA3,
            "clip.vision.projection_dim": model.config.text_config.hidden_size,
            "clip.vision.image_size": vc.image_size, "clip.vision.patch_size": vc.patch_size,
            "clip.vision.embedding_length": vc.hidden_size, "clip.vision.feed_forward_length": vc.intermediate_size,
            "clip.vision.block_count": vc.num_hidden_layers, "clip.vision.attention.head_count": vc.num_attention_heads,
            "clip.vision.image_mean": PREPROCESSOR["image_mean"], "clip.vision.image_std": PREPROCESSOR["image_std"],
            "clip.vision.attention.layer_norm_epsilon": vc.layer_norm_eps, "clip.vision.use_gelu": True,
            # 8 patches a side pooled to 4: not the default of 4 a side per token, so written
            "clip.vision.projector.scale_factor": (SIDE // vc.patch_size) // 4}
    keys.update(overrides or {})
    for k, value in keys.items():
        if isinstance(value, bool):
            w.add_bool(k, value)
        elif isinstance(value, int):
            w.add_uint32(k, value)
        elif isinstance(value, float):
            w.add_float32(k, value)
        elif isinstance(value, str):
            w.add_string(k, value)
        else:
            w.add_array(k, value)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vc.num_hidden_layers)
    for name, t in model.state_dict().items():
        if not name.startswith(("model.vision_tower.", "model.multi_modal_projector.")) or ".head." in name:
            continue
        hub = name.removeprefix("model.").replace("vision_tower.", "vision_tower.vision_model.", 1)
        hub = hub.replace("mm_input_projection_weight", "mm_input_projection.weight")
        stem, _, kind = hub.rpartition(".")
        gname = f"{names.get_name(stem)}.{kind}"
        if gname == drop:
            continue
        arr = t.float()
        if "soft_emb_norm" in hub:
            arr = arr + 1.0  # Gemma3RMSNorm's multiplier
        if "input_projection" in hub:
            w.add_tensor(gname, arr.half().numpy())  # forced F16
        else:
            w.add_tensor(gname, arr.numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mmproj")
    hf_dir = d / "hf"
    model = build(hf_dir)
    write_text_gguf(d / "text.gguf", hf_dir, model)
    write_mmproj(d / "mmproj.gguf", model)
    # the oracle: the checkpoint with its projection as the projector file holds it (F16)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    with torch.no_grad():
        p = ref.model.multi_modal_projector.mm_input_projection_weight
        p.copy_(p.half().float())
    proc = transformers.AutoProcessor.from_pretrained(str(hf_dir))
    return d, hf_dir, ref, proc


def test_the_projector_files_encoder_matches_transformers(files):
    d, hf_dir, ref, proc = files
    batch = processor_inputs(proc, [WIDE, SQUARE], False)
    inputs = image_inputs([WIDE, SQUARE], batch["input_ids"][0].tolist(), False)
    vision = load_mmproj(d / "mmproj.gguf", "cpu", torch.float32, "fp32", GGUF_TEXT["hidden_size"])
    got = torch.stack(vision.encode(inputs))
    with torch.no_grad():
        want = ref.model.get_image_features(torch.from_numpy(np.stack([i.pixel_values for i in inputs]))).pooler_output
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"relative error {err:.2e}"


def test_the_prompt_rule_from_the_file_equals_the_directorys(files):
    d, hf_dir, _, _ = files
    lm = load_model(d / "text.gguf", device="cpu", weights="fp32", use_cache=False, mmproj=d / "mmproj.gguf")
    ours = mmproj_prompt_rules(d / "mmproj.gguf", lm.tokenizer.backend.token_to_id)
    theirs = read_prompt_rules(hf_dir)
    assert (ours.image_token_id, ours.marker, ours.image_token, ours.end) == \
        (theirs.image_token_id, theirs.marker, theirs.image_token, theirs.end)
    for data in (WIDE, SQUARE):
        a, b = ours.expand(decode_image(data)), theirs.expand(decode_image(data))
        assert a.text == b.text
        np.testing.assert_array_equal(a.inputs[0].pixel_values, b.inputs[0].pixel_values)


@pytest.mark.parametrize("weights", ["fp32", "fp8"])
def test_greedy_with_images_from_the_gguf_equals_transformers(files, weights):
    """load_model(text.gguf, mmproj=...): two images in one prefill, greedy against transformers;
    with FP8 weights against transformers holding ridge's dequantized e4m3 weights (encoder and
    decoder, test_idefics3.on_ridge_weights)."""
    d, hf_dir, ref, proc = files
    lm = load_model(d / "text.gguf", device="cpu", weights=weights, use_cache=False, mmproj=d / "mmproj.gguf")
    assert lm.config.image_attention_bidirectional and lm.mmproj == d / "mmproj.gguf"
    batch = processor_inputs(proc, [WIDE, SQUARE], False)
    ids = batch["input_ids"][0].tolist()
    admitted = {"a": Admitted(ids, params(), tuple(image_inputs([WIDE, SQUARE], ids, False)))}
    got, _ = run(make_engine(lm, prefill_chunk=512, enable_prefix_caching=False), admitted)
    if weights == "fp8":
        assert lm.vision.multi_modal_projector.proj.is_fp8
        ref = on_ridge_weights(ref, lm.vision, lm)
    assert got["a"] == greedy_hf(ref, batch)


@pytest.mark.parametrize("overrides, drop, named", [
    ({"clip.projector_type": "llava"}, None, "clip.projector_type='llava'"),
    ({"clip.vision.use_gelu": False}, None, "clip.vision.use_gelu=False"),
    ({"clip.vision.projection_dim": 32}, None, "clip.vision.projection_dim=32"),
    ({"clip.vision.window_size": 4}, None, "clip.vision.window_size=4"),
    ({}, "v.post_ln.weight", "tensor vision_tower.post_layernorm.weight missing"),
])
def test_projector_files_ridge_cannot_run_are_refused_by_name(files, tmp_path, overrides, drop, named):
    d, hf_dir, ref, _ = files
    write_mmproj(tmp_path / "bad.gguf", ref, overrides, drop)
    with pytest.raises(ModelLoadError, match=named):
        load_model(d / "text.gguf", device="cpu", weights="fp32", use_cache=False, mmproj=tmp_path / "bad.gguf")


def test_a_projector_file_beside_a_directory_or_as_the_model_is_refused(files, tmp_path):
    d, hf_dir, _, _ = files
    with pytest.raises(ModelLoadError, match="an HF directory carries its own image encoder"):
        load_model(hf_dir, device="cpu", weights="fp32", use_cache=False, mmproj=d / "mmproj.gguf")
    with pytest.raises(ModelLoadError, match="--mmproj takes a projector file"):
        load_model(d / "text.gguf", device="cpu", weights="fp32", use_cache=False, mmproj=d / "text.gguf")
    shutil.copy(d / "mmproj.gguf", tmp_path / "m.gguf")
    with pytest.raises(ModelLoadError):
        load_model(tmp_path / "m.gguf", device="cpu", weights="fp32", use_cache=False)
