"""Qwen2.5-VL from a GGUF with llama.cpp's projector file (`--mmproj`: models/qwen2_5_vl/gguf.py and
mmproj.py): a tiny random Qwen2_5_VLForConditionalGeneration built by transformers 5.25, its text
model written as the converter's Qwen2VLModel writes it (architecture qwen2vl, mrope_section
padded to four as rope.dimension_sections, the vocabulary padded with [PADn] tokens to the
embedding's rows) and its tower as Qwen2VLVisionModel writes it with --mmproj (projector type
qwen2.5vl_merger, fullatt_block_indexes as n_wa_pattern, clip.use_silu, the Conv3d split into two
frames, qkv split into q, k and v, the gguf package's tensor map), all in F32 (--outtype f32).

What llama.cpp fixes is built into the checkpoint: windows of 112 pixels (14 merged tokens of 8
pixels: the wide image spans two columns of windows, the tall one two rows) and a preprocessor at
llama-server's limits of 8 to 4096 merged tokens, with a mean and std of its own. The oracles are
transformers' on the same checkpoint: the encoder's rows, greedy tokens through the engine with two
images in one prompt (FP8: transformers holding ridge's dequantized weights), and the prompt rule
the file implies equals the HF directory's."""
from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from engine_utils import make_engine
from test_engine_images import greedy_hf, params, run
from test_idefics3 import assert_close, on_ridge_weights, png
from test_qwen_vl import END, MERGE, PAD, PATCH, PREPROCESSOR, SPECIALS, START, build, vocab
from tiny_models import _gguf_name, tiny_vocab
from vlm_models import write_vlm_tokenizer
from ridge.engine.admit import Admitted
from ridge.models.loader import load_model
from ridge.models.mmproj import load_mmproj, mmproj_prompt_rules
from ridge.models.registry import read_hf_config
from ridge.quant.errors import ModelLoadError
from ridge.vision import decode_image
from ridge.vision.prompt import place, read_prompt_rules

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

CELL = (PATCH * MERGE) ** 2  # pixels of one merged token
# llama-server's limits for this projector, and a normalization unlike the CLIP default
HF_PRE = dict(PREPROCESSOR, size={"shortest_edge": 8 * CELL, "longest_edge": 4096 * CELL},
              image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.25, 0.3])
VISION = {"window_size": 112, "fullatt_block_indexes": [1]}  # 3 blocks: n_wa_pattern 2
# (width, height): 19 x 5 merged tokens (two columns of windows); 4 x 16 (two rows); scaled up to 3 x 4
IMAGES = [png(150, 40, 0), png(30, 130, 1), png(5, 6, 2)]
CHAT = "<|im_start|>user\n" + START + PAD + END + "and then" + START + PAD + END + "what is it?<|im_end|>\n" \
       "<|im_start|>assistant\n"


def write_hf(path):
    model = build(7, vision=VISION)
    model.save_pretrained(str(path))
    write_vlm_tokenizer(path, SPECIALS, "<|im_start|>", "<|im_end|>")
    (path / "preprocessor_config.json").write_text(json.dumps(HF_PRE))
    return model


def _keys(w, keys: dict) -> None:
    """Each key in the type the converter's add_* writes it (integers as uint32)."""
    v = gguf.GGUFValueType
    kinds = {bool: v.BOOL, int: v.UINT32, float: v.FLOAT32, str: v.STRING}
    for k, value in keys.items():
        w.add_key_value(k, value, kinds.get(type(value), v.ARRAY))


def _close(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_text_gguf(path, model, sections=None) -> None:
    """The text model, as the converter's Qwen2VLModel writes a Qwen2_5_VLForConditionalGeneration's."""
    tc = model.config.text_config
    arch = gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2VL]
    w = gguf.GGUFWriter(str(path), arch)
    section = list(tc.rope_parameters["mrope_section"])
    _keys(w, {"general.file_type": 0, f"{arch}.block_count": tc.num_hidden_layers,
              f"{arch}.context_length": tc.max_position_embeddings, f"{arch}.embedding_length": tc.hidden_size,
              f"{arch}.feed_forward_length": tc.intermediate_size,
              f"{arch}.attention.head_count": tc.num_attention_heads,
              f"{arch}.attention.head_count_kv": tc.num_key_value_heads,
              f"{arch}.rope.dimension_sections": sections or section + [0] * (4 - len(section)),
              f"{arch}.rope.freq_base": float(tc.rope_parameters["rope_theta"]),
              f"{arch}.attention.layer_norm_rms_epsilon": float(tc.rms_norm_eps)})
    tokens, types, merges = tiny_vocab()
    tokens, types = tokens + SPECIALS, types + [3] * len(SPECIALS)  # the added tokens: CONTROL
    pad = tc.vocab_size - len(tokens)  # _set_vocab_gpt2 fills the embedding's rows with [PADn], UNUSED
    tokens, types = tokens + [f"[PAD{len(tokens) + i}]" for i in range(pad)], types + [5] * pad
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(vocab().index("<|im_end|>"))
    for name, t in model.state_dict().items():
        if name.startswith("model.language_model."):
            name = name.replace("model.language_model.", "model.")
        elif name != "lm_head.weight":
            continue
        w.add_tensor(_gguf_name(name, "qwen2"), t.float().contiguous().numpy())
    _close(w)


def write_mmproj(path, model, overrides: dict | None = None, drop: str | None = None, f16: bool = False) -> None:
    """What `convert_hf_to_gguf.py --mmproj --outtype f32` writes for Qwen2.5-VL (Qwen2VLVisionModel);
    f16: `--outtype f16`, its default: every matrix and the conv's frames in F16, norms and biases F32."""
    vc, tc = model.config.vision_config, model.config.text_config
    w = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    full = vc.fullatt_block_indexes
    keys = {"general.file_type": int(f16), "clip.has_vision_encoder": True,
            "clip.vision.projection_dim": tc.hidden_size,
            "clip.vision.image_size": 560,  # the converter's default: Qwen2.5-VL's config has none
            "clip.vision.patch_size": vc.patch_size, "clip.vision.embedding_length": vc.hidden_size,
            "clip.vision.feed_forward_length": vc.intermediate_size, "clip.vision.block_count": vc.depth,
            "clip.vision.attention.head_count": vc.num_heads, "clip.vision.image_mean": HF_PRE["image_mean"],
            "clip.vision.image_std": HF_PRE["image_std"], "clip.projector_type": gguf.VisionProjectorType.QWEN25VL,
            "clip.use_silu": True, "clip.vision.n_wa_pattern": full[0] + 1,
            # the converter reads the wrapper's own rms_norm_eps (transformers 5 nests it: the default)
            "clip.vision.attention.layer_norm_epsilon": 1e-6}
    keys.update(overrides or {})
    _keys(w, keys)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vc.depth)
    out = {}
    for name, t in model.state_dict().items():
        if not name.startswith("model.visual."):
            continue
        hub, t = name.removeprefix("model."), t.float()
        stem, _, kind = hub.rpartition(".")
        if stem.endswith(".attn.qkv"):  # split in three, as modify_tensors does
            for part, rows in zip("qkv", t.chunk(3)):
                out[f"{names.get_name(stem[:-3] + part)}.{kind}"] = rows
        elif hub == "visual.patch_embed.proj.weight":  # the Conv3d as two Conv2d, one per frame
            base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
            out[base], out[base + ".1"] = t[:, :, 0], t[:, :, 1]
        else:
            out[f"{names.get_name(stem)}.{kind}"] = t
    for gname, t in out.items():
        if gname != drop:
            w.add_tensor(gname, (t.half() if f16 and t.dim() > 1 else t).contiguous().numpy())
    _close(w)


def hf_pixels(images: list[bytes]):
    ip = transformers.Qwen2VLImageProcessorPil(**{k: v for k, v in HF_PRE.items()
                                                  if k not in ("image_processor_type", "processor_class")})
    out = ip([Image.open(io.BytesIO(x)).convert("RGB") for x in images], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def hf_batch(hf_dir, images: list[bytes]) -> dict:
    """transformers' input for CHAT (two images): Qwen2VLImageProcessorPil's pixels and grids, each
    <|image_pad|> repeated once per merged token, tokenized by the directory's tokenizer."""
    pixels, grids = hf_pixels(images)
    pieces = CHAT.split(PAD)
    text = pieces[0] + "".join(PAD * (int(g.prod()) // MERGE ** 2) + p for g, p in zip(grids, pieces[1:]))
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": grids,
            "mm_token_type_ids": (ids == vocab().index(PAD)).int()}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mmproj_qwen")
    hf_dir = d / "hf"
    model = write_hf(hf_dir)
    write_text_gguf(d / "text.gguf", model)
    write_mmproj(d / "mmproj.gguf", model)
    ref = transformers.AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                                   attn_implementation="eager").eval()
    return d, hf_dir, ref


def ridge_inputs(d, lm, images, ids):
    rules = mmproj_prompt_rules(d / "mmproj.gguf", lm.tokenizer.backend.token_to_id)
    return place(ids, [rules.expand(decode_image(x)) for x in images], rules.image_token_id)


def test_the_text_gguf_reads_as_the_directorys_text_model(files):
    """qwen2vl's config: the HF directory's, mrope included (its name and the file's bookkeeping
    aside; a float as GGUF's float32 holds it)."""
    d, hf_dir, _ = files
    lm = load_model(d / "text.gguf", device="cpu", weights="fp32", use_cache=False, mmproj=d / "mmproj.gguf")
    ours, theirs = lm.config, read_hf_config(hf_dir)
    assert ours.extra == theirs.extra == {"mrope_section": [2, 3, 3], "mrope_interleaved": False}
    skip = {"name", "max_position"}
    for f in type(ours).__dataclass_fields__:
        if f not in skip:
            want = getattr(theirs, f)
            assert getattr(ours, f) == (pytest.approx(want, rel=1e-7) if isinstance(want, float) else want), f


def test_the_projector_files_encoder_matches_transformers(files):
    """Three images (windows cut by the edges, one image over two columns and one over two rows of
    windows) against transformers' tower and merger, fp32."""
    d, hf_dir, ref = files
    lm = load_model(d / "text.gguf", device="cpu", weights="fp32", use_cache=False)
    vision = load_mmproj(d / "mmproj.gguf", "cpu", torch.float32, "fp32", ref.config.text_config.hidden_size)
    rules = mmproj_prompt_rules(d / "mmproj.gguf", lm.tokenizer.backend.token_to_id)
    inputs = [i for x in IMAGES for i in rules.expand(decode_image(x)).inputs]
    assert [i.meta["mrope_grid"] for i in inputs] == [(1, 5, 19), (1, 16, 4), (1, 4, 3)]
    got = torch.cat(vision.encode(inputs))
    with torch.no_grad():
        want = torch.cat(ref.model.get_image_features(*hf_pixels(IMAGES)).pooler_output)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"relative error {err:.2e}"


def test_an_f16_projector_file_matches_transformers_on_its_rounded_weights(files, tmp_path):
    """The converter's default output type: the tower's matrices and conv in F16, read back exactly."""
    d, _, ref = files
    write_mmproj(tmp_path / "f16.gguf", ref, f16=True)
    vision = load_mmproj(tmp_path / "f16.gguf", "cpu", torch.float32, "fp32", ref.config.text_config.hidden_size)
    rounded = copy.deepcopy(ref)
    with torch.no_grad():
        for p in rounded.model.visual.parameters():
            if p.dim() > 1:
                p.copy_(p.half().float())
    rules = mmproj_prompt_rules(tmp_path / "f16.gguf", lambda t: vocab().index(t))
    got = torch.cat(vision.encode([i for x in IMAGES[:2] for i in rules.expand(decode_image(x)).inputs]))
    with torch.no_grad():
        want = torch.cat(rounded.model.get_image_features(*hf_pixels(IMAGES[:2])).pooler_output)
        plain = torch.cat(ref.model.get_image_features(*hf_pixels(IMAGES[:2])).pooler_output)
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-5, f"relative error {err:.2e}"
    assert not torch.allclose(got, plain, rtol=0, atol=1e-6)  # really rounded


def test_the_prompt_rule_from_the_file_equals_the_directorys(files):
    d, hf_dir, _ = files
    lm = load_model(d / "text.gguf", device="cpu", weights="fp32", use_cache=False)
    ours = mmproj_prompt_rules(d / "mmproj.gguf", lm.tokenizer.backend.token_to_id)
    theirs = read_prompt_rules(hf_dir)
    want = (vocab().index(PAD), START + PAD + END, PAD, END)
    assert (ours.image_token_id, ours.marker, ours.image_token, ours.end) == want
    assert (theirs.image_token_id, theirs.marker, theirs.image_token, theirs.end) == want
    for data in IMAGES + [png(700, 600, 3)]:  # the last one past 4096 merged tokens: scaled down
        a, b = ours.expand(decode_image(data)), theirs.expand(decode_image(data))
        assert a.text == b.text
        np.testing.assert_array_equal(a.inputs[0].pixel_values, b.inputs[0].pixel_values)
        assert a.inputs[0].meta == b.inputs[0].meta


@pytest.mark.parametrize("weights", ["fp32", "fp8"])
def test_greedy_with_images_from_the_gguf_equals_transformers(files, weights):
    """load_model(text.gguf, mmproj=...): two images in one prefill, greedy against transformers;
    with FP8 weights against transformers holding ridge's dequantized e4m3 weights (encoder and
    decoder, test_idefics3.on_ridge_weights)."""
    d, hf_dir, ref = files
    lm = load_model(d / "text.gguf", device="cpu", weights=weights, use_cache=False, mmproj=d / "mmproj.gguf")
    assert lm.mmproj == d / "mmproj.gguf" and not lm.config.image_attention_bidirectional
    batch = hf_batch(hf_dir, IMAGES[:2])
    ids = batch["input_ids"][0].tolist()
    admitted = {"a": Admitted(ids, params(), ridge_inputs(d, lm, IMAGES[:2], ids))}
    got, _ = run(make_engine(lm, prefill_chunk=512, enable_prefix_caching=False), admitted)
    if weights == "fp8":
        assert lm.vision.visual.blocks[0].attn.qkv.is_fp8 and lm.vision.visual.merger.mlp[2].is_fp8
        ref = on_ridge_weights(ref, lm.vision, lm)
    assert got["a"] == greedy_hf(ref, batch)


def test_the_fp8_encoder_matches_transformers_on_ridges_weights(files):
    d, hf_dir, ref = files
    lm = load_model(d / "text.gguf", device="cpu", weights="fp32", use_cache=False)
    vision = load_mmproj(d / "mmproj.gguf", "cpu", torch.float32, "fp8", ref.config.text_config.hidden_size)
    batch = hf_batch(hf_dir, IMAGES[:2])
    inputs = ridge_inputs(d, lm, IMAGES[:2], batch["input_ids"][0].tolist())
    got = torch.cat(vision.encode(list(inputs)))
    with torch.no_grad():
        want = torch.cat(on_ridge_weights(ref, vision).model.get_image_features(
            batch["pixel_values"], batch["image_grid_thw"]).pooler_output)
    assert_close(got, want)


@pytest.mark.parametrize("overrides, drop, named", [
    ({"clip.projector_type": "qwen2vl_merger"}, None, "clip.projector_type='qwen2vl_merger'"),
    ({"clip.use_silu": False}, None, "clip.use_silu=False"),
    ({"clip.vision.projection_dim": 32}, None, "clip.vision.projection_dim=32"),
    ({"clip.vision.window_size": 64}, None, "clip.vision.window_size=64"),
    ({"clip.vision.spatial_merge_size": 4}, None, "clip.vision.spatial_merge_size=4"),
    ({"clip.vision.attention.layer_norm_epsilon": 1e-5}, None, "clip.vision.attention.layer_norm_epsilon="),
    ({"clip.vision.attention.head_count": 3}, None, "clip.vision.attention.head_count=3"),
    ({}, "v.blk.1.attn_k.bias", "tensor v.blk.1.attn_k.bias missing"),
    ({}, "v.patch_embd.weight.1", "tensor v.patch_embd.weight / v.patch_embd.weight.1"),
    ({}, "mm.2.bias", "tensor visual.merger.mlp.2.bias missing"),
])
def test_projector_files_ridge_cannot_run_are_refused_by_name(files, tmp_path, overrides, drop, named):
    d, _, ref = files
    write_mmproj(tmp_path / "bad.gguf", ref, overrides, drop)
    with pytest.raises(ModelLoadError, match=named.replace(".", r"\.").replace("(", r"\(")):
        load_model(d / "text.gguf", device="cpu", weights="fp32", use_cache=False, mmproj=tmp_path / "bad.gguf")


@pytest.mark.parametrize("sections, named", [([2, 3, 3], "expected four counts"), ([2, 3, 2, 1], "a fourth axis"),
                                             ([2, 3, 4, 0], "must sum to head_dim / 2 = 8")])
def test_text_ggufs_ridge_cannot_run_are_refused_by_name(files, tmp_path, sections, named):
    _, _, ref = files
    write_text_gguf(tmp_path / "bad.gguf", ref, sections)
    with pytest.raises(ModelLoadError, match=rf"qwen2vl\.rope\.dimension_sections=.*{named}"):
        load_model(tmp_path / "bad.gguf", device="cpu", weights="fp32", use_cache=False)
