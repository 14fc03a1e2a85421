"""SmolVLM and Idefics3 (ridge/models/idefics3/): tiny random SmolVLMForConditionalGeneration and
Idefics3ForConditionalGeneration built by transformers 5.25 (tests/vlm_models.py), saved as HF
directories. The oracles are transformers' own: get_image_features for the vision tower and the
connector, the wrapper's logits for the text model (read by ridge's loader as llama) with and
without an image, Idefics3Processor for the prompt's placeholders.

The pixels are ridge's preprocessing (ridge/vision/idefics3.py) of PNG files decoded by ridge's
decoder: gradients plus noise, of sizes that split into several tiles."""
from __future__ import annotations

import copy
import dataclasses
import io
import json
import math
import shutil

import numpy as np
import pytest
import torch
import transformers
from PIL import Image

from engine_utils import make_engine
from ridge.cache.kv_cache import KVCache
from ridge.kernels.metadata import AttentionMetadata
from ridge.models.idefics3.config import (VISION_DEFAULTS, VISION_IGNORED, WRAPPER_DEFAULTS, WRAPPER_IGNORED,
                                          WRAPPER_READ)
from ridge.models.idefics3.vision import load_vision, pixel_shuffle
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.models.registry import read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.quant.hf_config import BASE_IGNORED
from ridge.quant.linear import FP8Linear
from ridge.vision import Idefics3Images, decode_image
from ridge.vision.inputs import ImageInput, image_hash
from test_engine_images import admitted, greedy_hf, params, prompt, run
from vlm_models import IMAGE, IMAGE_SEQ_LEN, vlm_vocab, write_tiny_smolvlm

KINDS = ("smolvlm", "idefics3")
PROMPT = [0, 5, 17, 200, 3, 99, 268, 1, 40, 41, 42, 150, 7, 7, 300, 12, 9, 260, 33, 8]  # text only, specials too


def png(w: int, h: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx * 3 + yy) % 256], axis=-1)
    px = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px, "RGB").save(buf, "PNG")
    return buf.getvalue()


# (width, height): 3 x 4 tiles and the whole; 4 x 2 and the whole; a small square scaled up to 4 x 4
IMAGES = [png(100, 70, 0), png(30, 61, 1), png(20, 20, 2)]


@pytest.fixture(scope="module", params=KINDS)
def vlm(request, tmp_path_factory):
    path = write_tiny_smolvlm(tmp_path_factory.mktemp(request.param), request.param, seed=KINDS.index(request.param))
    hf = transformers.AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32,
                                                                  attn_implementation="eager").eval()
    return request.param, path, hf


def assert_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-5, f"relative error {err:.2e}"


def assert_logits(got: torch.Tensor, ref: torch.Tensor) -> None:
    assert_close(got, ref)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() == 1.0


def preprocess(path, data: bytes):
    cfg = json.loads((path / "preprocessor_config.json").read_text())
    seq = json.loads((path / "processor_config.json").read_text())["image_seq_len"]
    return Idefics3Images.from_config(cfg, image_seq_len=seq).preprocess(decode_image(data))


def image_inputs(path, images: list[bytes], ids: list[int]) -> list[ImageInput]:
    """One ImageInput per tile, each at its run of <image> tokens in ids, in order."""
    image_id = vlm_vocab().index(IMAGE)
    starts = [i for i, t in enumerate(ids) if t == image_id and (i == 0 or ids[i - 1] != image_id)]
    tiles = [t for data in images for t in preprocess(path, data).pixel_values]
    assert len(starts) == len(tiles)
    return [ImageInput(image_hash(t, "idefics3"), t, s, IMAGE_SEQ_LEN) for s, t in zip(starts, tiles)]


def processor_inputs(path, images: list[bytes]):
    """transformers' processor on a chat with the images, the writer's template and tokens."""
    proc = transformers.AutoProcessor.from_pretrained(str(path))
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": "What is in the picture?"}]
    text = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return proc(text=text, images=[[Image.open(io.BytesIO(d)) for d in images]], return_tensors="pt")


def test_the_processor_loads_and_agrees_with_ridges_preprocessing(vlm):
    """The writer's directory as transformers' AutoProcessor reads it: the prompt holds one run
    of image_seq_len <image> tokens per tile, and ridge's tiles equal the processor's pixels."""
    _, path, _ = vlm
    batch = processor_inputs(path, IMAGES[:2])
    ids = batch["input_ids"][0].tolist()
    inputs = image_inputs(path, IMAGES[:2], ids)
    assert len(inputs) == 13 + 9
    assert sum(t == vlm_vocab().index(IMAGE) for t in ids) == IMAGE_SEQ_LEN * len(inputs)
    ref = batch["pixel_values"][0]  # one sample: its images' tiles, in order
    np.testing.assert_array_equal(ref.numpy(), np.stack([i.pixel_values for i in inputs]))


def test_encode_matches_get_image_features(vlm):
    """Every tile of three images (13 + 9 + 17 tiles; one forward) against transformers' tower
    and connector on the same pixels, in fp32."""
    _, path, hf = vlm
    vision = load_vision(path, "cpu", torch.float32)
    tiles = [preprocess(path, d).pixel_values for d in IMAGES]
    inputs = [ImageInput(image_hash(t, "t"), t, i * IMAGE_SEQ_LEN, IMAGE_SEQ_LEN)
              for i, t in enumerate(np.concatenate(tiles))]
    got = vision.encode(inputs)
    assert [tuple(g.shape) for g in got] == [(IMAGE_SEQ_LEN, hf.config.text_config.hidden_size)] * len(inputs)
    assert all(g.dtype == torch.float32 for g in got)
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.from_numpy(np.concatenate(tiles))[None]).pooler_output[0]
    assert_close(torch.cat(got), ref)
    # a tile alone gives the rows it gives in a batch
    assert_close(vision.encode(inputs[5:6])[0], got[5])
    with pytest.raises(ValueError, match="15 placeholder tokens for a tile worth 16"):
        vision.encode([dataclasses.replace(inputs[0], length=15)])


# ridge's fused decoder products -> transformers' pieces, stacked along the output rows in this order
UNFUSED = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
           "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}


def on_ridge_weights(hf, vision, lm=None):
    """A copy of transformers' model holding the weights ridge runs: each FP8Linear's e4m3 values
    times their scales (FP8Linear.dequantized) in the encoder, and with lm the decoder's too
    (unfused; the table and head as ridge holds them). ridge's encoder names are the checkpoint's
    without "model." (Gemma 3: without the tower's "vision_model." too)."""
    ref = copy.deepcopy(hf)
    theirs = dict(ref.model.named_parameters())
    with torch.no_grad():
        for name, m in vision.named_modules():
            if not isinstance(m, FP8Linear):
                continue
            if name == "multi_modal_projector.proj":  # Gemma 3's product: an [in, out] parameter
                theirs["multi_modal_projector.mm_input_projection_weight"].copy_(m.dequantized().T)
                continue
            alt = name.replace("vision_tower.", "vision_tower.vision_model.", 1)
            theirs[next(k for k in (f"{name}.weight", f"{alt}.weight") if k in theirs)].copy_(m.dequantized())
        if lm is not None:
            emb = lm.model.embed_tokens
            ref.get_input_embeddings().weight.copy_(emb.dequantized() if hasattr(emb, "dequantized") else emb.weight)
            if not lm.config.tie_word_embeddings:
                ref.get_output_embeddings().weight.copy_(lm.model.lm_head.dequantized())
            for ours, layer in zip(lm.model.layers, ref.get_decoder().layers):
                for fused, parts in UNFUSED.items():
                    targets = [layer.get_submodule(p).weight for p in parts]
                    for t, w in zip(targets, getattr(ours, fused).dequantized().split([t.shape[0] for t in targets])):
                        t.copy_(w)
    return ref


def assert_fp8_tower(vision, ours: FP8Linear, source: torch.Tensor) -> None:
    """Every Linear of the encoder an FP8Linear holding e4m3, the rest (conv, positions, norms)
    in fp32; ours differs from the checkpoint's source values: really quantized."""
    linears = [m for m in vision.modules() if isinstance(m, FP8Linear)]
    assert ours in linears and not any(type(m) is torch.nn.Linear for m in vision.modules())
    assert all(m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.dtype == torch.float32 for m in linears)
    assert all(p.dtype == torch.float32 for p in vision.parameters())
    assert ours.dequantized().shape == source.shape and not torch.equal(ours.dequantized(), source)


def test_encode_in_fp8_matches_get_image_features_on_ridges_weights(vlm):
    """weights "fp8": the tower's and connector's Linears are e4m3 (per-output-channel scales);
    the rows equal transformers' on a copy holding those dequantized weights."""
    _, path, hf = vlm
    vision = load_vision(path, "cpu", torch.float32, weights="fp8")
    assert_fp8_tower(vision, vision.vision_model.encoder.layers[0].self_attn.q_proj,
                     hf.model.vision_model.encoder.layers[0].self_attn.q_proj.weight)
    tiles = np.concatenate([preprocess(path, d).pixel_values for d in IMAGES[:2]])
    inputs = [ImageInput(image_hash(t, "t"), t, i * IMAGE_SEQ_LEN, IMAGE_SEQ_LEN) for i, t in enumerate(tiles)]
    got = vision.encode(inputs)
    assert all(g.dtype == torch.float32 for g in got)
    with torch.no_grad():
        ref = on_ridge_weights(hf, vision).model.get_image_features(torch.from_numpy(tiles)[None]).pooler_output[0]
        plain = hf.model.get_image_features(torch.from_numpy(tiles)[None]).pooler_output[0]
    assert_close(torch.cat(got), ref)
    assert not torch.allclose(torch.cat(got), plain, rtol=0, atol=1e-6)
    assert vision.weight_bytes() < load_vision(path, "cpu", torch.float32).weight_bytes()


def test_greedy_in_fp8_through_the_engine_equals_transformers_on_ridges_weights(vlm):
    """load_model(weights="fp8"): tower, connector and decoder in e4m3; two images (22 tiles) in
    one prefill, greedy against transformers' generate on a copy holding ridge's dequantized weights."""
    _, path, hf = vlm
    lm = load_model(path, device="cpu", weights="fp8", use_cache=False)
    proj = lm.vision.connector.modality_projection.proj
    assert_fp8_tower(lm.vision, proj, hf.model.connector.modality_projection.proj.weight)
    proc = transformers.AutoProcessor.from_pretrained(str(path))
    batch = prompt(proc, IMAGES[:2])
    ids = batch["input_ids"][0].tolist()
    eng = make_engine(lm, prefill_chunk=512, enable_prefix_caching=False)
    got, _ = run(eng, {"a": admitted(path, proc, IMAGES[:2], ids, params())})
    assert got["a"] == greedy_hf(on_ridge_weights(hf, lm.vision, lm), batch)


def test_a_smaller_tile_takes_bucketed_positions(vlm):
    """Tiles of 6 x 6 patches on the 8 x 8 position table (transformers spreads them over it),
    beside whole tiles in one call: two shapes, two forwards."""
    _, path, hf = vlm
    vision = load_vision(path, "cpu", torch.float32)
    small = np.random.default_rng(3).standard_normal((2, 3, 24, 24)).astype(np.float32)
    whole = preprocess(path, IMAGES[1]).pixel_values[:2]
    inputs = [ImageInput(str(i), t, 0, 9) for i, t in enumerate(small)]
    inputs.insert(1, ImageInput("w", whole[0], 0, IMAGE_SEQ_LEN))
    got = vision.encode(inputs)
    assert [g.shape[0] for g in got] == [9, IMAGE_SEQ_LEN, 9]
    with torch.no_grad():
        ref = hf.model.get_image_features(torch.from_numpy(small)[None]).pooler_output[0]
        ref_whole = hf.model.get_image_features(torch.from_numpy(whole[:1])[None]).pooler_output[0]
    assert_close(torch.cat([got[0], got[2]]), ref)
    assert_close(got[1], ref_whole)


def test_the_tower_in_bf16(vlm):
    """Loaded in bf16, the tower computes in bf16 and stays near fp32's (bf16 rounding)."""
    _, path, _ = vlm
    t = preprocess(path, IMAGES[1]).pixel_values
    inputs = [ImageInput(image_hash(x, "t"), x, 0, IMAGE_SEQ_LEN) for x in t]
    ref = torch.cat(load_vision(path, "cpu", torch.float32).encode(inputs))
    bf16 = load_vision(path, "cpu", torch.bfloat16)
    got = torch.cat(bf16.encode(inputs))
    assert got.dtype == torch.bfloat16
    assert ((got.float() - ref).abs().max() / ref.abs().max()).item() < 0.05
    assert bf16.weight_bytes() * 2 == load_vision(path, "cpu", torch.float32).weight_bytes()


def test_text_model_loads_as_llama_and_matches_transformers(vlm, caplog):
    kind, path, hf = vlm
    with caplog.at_level("INFO", logger="ridge.quant"):
        lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    names = list(hf.state_dict())
    vision = sum(n.startswith(("model.vision_model.", "model.connector.")) for n in names)
    assert any(f"its {vision} vision tower and connector tensors" in r.getMessage() for r in caplog.records)
    cfg, text = lm.config, hf.config.text_config
    assert cfg.arch == "idefics3_text"
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_kv_heads, cfg.rms_norm_eps) == (
        text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_key_value_heads, text.rms_norm_eps)
    assert cfg.tie_word_embeddings is hf.config.tie_word_embeddings is False
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0]
    assert_logits(prompt_logits(lm.model, PROMPT), ref)


def logits_with_images(model, ids: list[int], inputs: list[ImageInput], vision) -> torch.Tensor:
    """prompt_logits with the encoder's rows in place of the placeholders (CausalLM's embeds)."""
    n, bs = len(ids), 16
    nb = math.ceil(n / bs)
    cache = KVCache(model.cfg, nb, bs, "fp32", torch.device("cpu"))
    meta = AttentionMetadata.build([n], [n], [list(range(nb))], list(range(n)), torch.device("cpu"))
    rows = torch.cat([torch.arange(i.offset, i.end) for i in inputs])
    embeds = (rows, torch.cat(vision.encode(inputs)))
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(n), meta, cache.layers, embeds=embeds)
        return model.compute_logits(hidden)


def test_a_prompt_with_two_images_matches_transformers(vlm):
    """The whole model: ridge's text model with load_vision's rows at the processor's
    placeholders, against the wrapper's logits on the processor's input."""
    _, path, hf = vlm
    batch = processor_inputs(path, IMAGES[:2])
    ids = batch["input_ids"][0].tolist()
    lm = load_model(path, device="cpu", weights="fp32", use_cache=False)
    vision = load_vision(path, "cpu", torch.float32)
    got = logits_with_images(lm.model, ids, image_inputs(path, IMAGES[:2], ids), vision)
    with torch.no_grad():
        ref = hf(**batch).logits[0]
    assert_logits(got, ref)


@pytest.mark.parametrize("scale", [2, 4])  # 4: SmolVLM-256M's and 500M's 512-pixel tiles of 64 tokens
def test_pixel_shuffle_is_transformers(vlm, scale):
    """The block layout against transformers' connector's own pixel_shuffle (8 x 8 patches)."""
    _, _, hf = vlm
    x = torch.randn(3, 64, 5)
    assert torch.equal(pixel_shuffle(x, 8, scale), hf.model.connector.pixel_shuffle(x, scale))


def test_no_vision_tensors_no_encoder(vlm, tmp_path):
    """A copy holding only the text model's tensors (served as text) gives no encoder."""
    from safetensors.torch import load_file, save_file

    _, path, _ = vlm
    for f in path.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, tmp_path / f.name)
    sd = load_file(str(path / "model.safetensors"))
    save_file({k: v for k, v in sd.items() if not k.startswith(("model.vision_model.", "model.connector."))},
              str(tmp_path / "model.safetensors"))
    assert load_vision(tmp_path, "cpu", torch.float32) is None
    # a tensor the tower does not have is refused by name
    save_file({**sd, "model.vision_model.extra.weight": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.vision_model.extra.weight"):
        load_vision(tmp_path, "cpu", torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_config_fields_are_declared(kind):
    """Every field of the wrapper's config class and of its vision config class read (with
    transformers' default) or declared ignored."""
    outer = getattr(transformers, {"smolvlm": "SmolVLMConfig", "idefics3": "Idefics3Config"}[kind])
    inner = getattr(transformers, {"smolvlm": "SmolVLMVisionConfig", "idefics3": "Idefics3VisionConfig"}[kind])
    fields = {f.name: f.default for f in dataclasses.fields(outer)}
    assert not set(fields) - WRAPPER_READ - WRAPPER_IGNORED - BASE_IGNORED
    assert {k: fields[k] for k in WRAPPER_DEFAULTS} == WRAPPER_DEFAULTS
    vfields = {f.name: f.default for f in dataclasses.fields(inner)}
    assert not set(vfields) - set(VISION_DEFAULTS) - VISION_IGNORED - BASE_IGNORED
    assert {k: vfields[k] for k in VISION_DEFAULTS} == VISION_DEFAULTS


def _write_config(tmp_path, kind: str, text: dict | None = None, vision: dict | None = None, **top) -> dict:
    cls = {"smolvlm": transformers.SmolVLMConfig, "idefics3": transformers.Idefics3Config}[kind]
    c = cls(text_config={"model_type": "llama", "vocab_size": 400, "hidden_size": 64, "num_attention_heads": 4,
                         "intermediate_size": 96, "num_hidden_layers": 2},
            vision_config={"hidden_size": 32, "num_attention_heads": 2, "image_size": 32, "patch_size": 4},
            image_token_id=300).to_dict()
    c["text_config"].update(text or {})
    c["vision_config"].update(vision or {})
    c.update(top)
    (tmp_path / "config.json").write_text(json.dumps(c))
    return c


@pytest.mark.parametrize("text, vision, top, named", [
    ({}, {"hidden_act": "relu"}, {}, "vision_config.hidden_act='relu'"),
    ({}, {"image_size": [32, 32]}, {}, "vision_config.image_size=[32, 32]"),
    ({}, {"num_attention_heads": 3}, {}, "vision_config.num_attention_heads=3"),
    ({}, {"layer_norm_eps": "small"}, {}, "vision_config.layer_norm_eps='small'"),
    ({}, {}, {"scale_factor": 0}, "scale_factor=0"),
    ({}, {}, {"vision_config": [1]}, "vision_config=[1]"),
    ({}, {}, {"image_token_id": 400}, "image_token_id=400"),
    ({}, {}, {"tie_word_embeddings": "no"}, "tie_word_embeddings='no'"),
    ({"model_type": "mistral"}, {}, {}, "text_config.model_type='mistral'"),
    ({"hidden_act": "relu"}, {}, {}, "text_config.hidden_act='relu'"),
    ({}, {}, {"quantization_config": {"quant_method": "gptq"}}, "quantization_config.quant_method='gptq'"),
])
@pytest.mark.parametrize("kind", KINDS)
def test_refusals_name_the_field(tmp_path, kind, text, vision, top, named):
    _write_config(tmp_path, kind, text, vision, **top)
    with pytest.raises(ModelLoadError) as e:
        read_hf_config(tmp_path)
    assert named in str(e.value)


@pytest.mark.parametrize("kind", KINDS)
def test_config_without_text_config_is_transformers_default(tmp_path, kind):
    """A file without text_config: transformers builds LlamaConfig(rms_norm_eps=1e-5), not
    LlamaConfig's own 1e-6; the vision tower's defaults likewise."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": kind, "image_token_id": 5}))
    cfg = read_hf_config(tmp_path)
    ref = transformers.AutoConfig.from_pretrained(str(tmp_path)).text_config
    assert (cfg.rms_norm_eps, cfg.hidden_size, cfg.vocab_size, cfg.num_layers) == (
        ref.rms_norm_eps, ref.hidden_size, ref.vocab_size, ref.num_hidden_layers)
    assert cfg.rms_norm_eps == 1e-5
