"""Each family's preprocessing (ridge/vision/) against transformers' image processors, the PIL
backend (`*ImageProcessorPil`, the slow path: Pillow + numpy), built from the same config dict.

Tolerance: none. The same Pillow resample on the same uint8 pixels and the same float64-then-
float32 arithmetic give equal float32 values, so pixel values are compared exactly.

Token counts: the oracle is the processor's own placeholder expansion. Gemma 3's and Idefics3's
processors run whole, with a tiny word-level tokenizer, and the image tokens are counted in their
input_ids; the others' processors need torchvision (their video processors) to be built, so their
`replace_image_token` runs on the image processor's output, with the attributes it reads, except
Pixtral's, whose module imports torchvision: its expansion is restated in pixtral_placeholder."""
from __future__ import annotations

import io
from types import SimpleNamespace

import numpy as np
import pytest
import transformers as T
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers

from ridge.errors import InvalidRequest
from ridge.vision import (Gemma3Images, Gemma4Images, Idefics3Images, PixtralImages, PreprocessorConfigError,
                          QwenVLImages, decode_image, probe_image, processor_class)

CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
# (width, height, mode): odd sides, portrait and landscape, tiny, large, strips, exact squares, RGBA
SHAPES = [(33, 47, "RGB"), (641, 479, "RGB"), (300, 1200, "RGB"), (1500, 400, "RGB"), (6, 9, "RGB"),
          (2048, 1536, "RGB"), (250, 170, "RGBA"), (896, 896, "RGB"), (1000, 40, "RGB")]


def png(w: int, h: int, mode: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    # smooth gradients plus noise: resamplers see both edges and flat regions
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255 // max(w - 1, 1), yy * 255 // max(h - 1, 1), (xx + yy) % 256], axis=-1)
    px = np.clip(base + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    if mode == "RGBA":
        px = np.concatenate([px, rng.integers(0, 256, (h, w, 1), dtype=np.uint8)], axis=-1)
    buf = io.BytesIO()
    Image.fromarray(px, mode).save(buf, "PNG")
    return buf.getvalue()


IMAGES = [(f"{w}x{h}{'-rgba' if m == 'RGBA' else ''}", png(w, h, m, i)) for i, (w, h, m) in enumerate(SHAPES)]


def pair(data: bytes) -> tuple[Image.Image, Image.Image]:
    """(what ridge preprocesses: its decoder's RGB, what transformers gets: the file as opened)."""
    return decode_image(data), Image.open(io.BytesIO(data))


def header_size(data: bytes) -> tuple[int, int]:
    """(height, width) from the header alone: what `ridge plan` and admission count tokens from."""
    h = probe_image(data)
    return h.height, h.width


def reference(cls, cfg: dict, drop=()):
    return cls(**{k: v for k, v in cfg.items() if k not in drop + ("image_processor_type", "processor_class")})


SPECIAL = (["<|image_pad|>", "<start_of_image>", "<image_soft_token>", "<end_of_image>", "<image>",
            "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"]
           + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)])


def tiny_tokenizer(**named) -> T.PreTrainedTokenizerFast:
    """A word-level tokenizer holding the processors' special tokens: enough to count them."""
    vocab = {t: i for i, t in enumerate(["<unk>", "look", "\n", "\n\n"] + SPECIAL)}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = T.PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", extra_special_tokens=named)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    return tok


# Gemma 3 ---------------------------------------------------------------------------------------

GEMMA3 = {  # google/gemma-3-4b-it's preprocessor_config.json
    "do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None, "do_rescale": True, "do_resize": True,
    "image_mean": [0.5, 0.5, 0.5], "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": 256,
    "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None, "pan_and_scan_min_crop_size": None,
    "pan_and_scan_min_ratio_to_activate": None, "processor_class": "Gemma3Processor", "resample": 2,
    "rescale_factor": 0.00392156862745098, "size": {"height": 896, "width": 896}}


@pytest.fixture(scope="module")
def gemma3_processor():
    tok = tiny_tokenizer(image_token="<image_soft_token>", boi_token="<start_of_image>", eoi_token="<end_of_image>")
    ip = reference(T.Gemma3ImageProcessorPil, GEMMA3, ("image_seq_length",))
    return T.Gemma3Processor(image_processor=ip, tokenizer=tok, image_seq_length=256), tok


@pytest.mark.parametrize("pan_and_scan", [False, True])
def test_gemma3(gemma3_processor, pan_and_scan):
    processor, tok = gemma3_processor
    ours_cfg = Gemma3Images.from_config(GEMMA3, pan_and_scan=pan_and_scan)
    crops_seen = set()
    for name, data in IMAGES:
        ours, theirs = pair(data)
        got = ours_cfg.preprocess(ours)
        ref = processor(text="look <start_of_image>", images=[theirs], do_pan_and_scan=pan_and_scan,
                        return_tensors="np")
        np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"], err_msg=name)
        assert got.pixel_values.shape[1:] == (3, 896, 896) and got.pixel_values.dtype == np.float32
        n_ref = int((ref["input_ids"][0] == tok.convert_tokens_to_ids("<image_soft_token>")).sum())
        assert got.num_image_tokens == n_ref == ours_cfg.num_image_tokens(*header_size(data)), name
        crops_seen.add(got.num_crops)
    assert crops_seen == ({0, 2, 4} if pan_and_scan else {0})  # the cases reach 0, 2 and the maximum 4 crops


# Qwen2-VL, Qwen2.5-VL, Qwen3-VL ------------------------------------------------------------------

QWEN = {
    "qwen2.5-vl": {"min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
                   "merge_size": 2, "image_mean": CLIP_MEAN, "image_std": CLIP_STD,
                   "image_processor_type": "Qwen2VLImageProcessor", "processor_class": "Qwen2_5_VLProcessor"},
    "qwen3-vl": {"size": {"longest_edge": 16777216, "shortest_edge": 65536}, "patch_size": 16,
                 "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                 "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast",
                 "processor_class": "Qwen3VLProcessor"},
    # a small pixel budget: large images are scaled down, small ones up
    "qwen2-vl-small-budget": {"min_pixels": 100_000, "max_pixels": 200_000, "resample": 3,
                              "image_processor_type": "Qwen2VLImageProcessor"},
}


@pytest.mark.parametrize("name", sorted(QWEN))
def test_qwen_vl_dynamic_resolution(name):
    cfg = QWEN[name]
    ours_cfg, ref_proc = QwenVLImages.from_config(cfg), reference(T.Qwen2VLImageProcessorPil, cfg)
    expand = SimpleNamespace(image_processor=ref_proc, image_token="<|image_pad|>")
    grids = set()
    for img_name, data in IMAGES:
        ours, theirs = pair(data)
        got, ref = ours_cfg.preprocess(ours), ref_proc(theirs)
        np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"], err_msg=img_name)
        assert list(got.image_grid_thw) == ref["image_grid_thw"][0].tolist()
        n_ref = T.Qwen2VLProcessor.replace_image_token(expand, ref, 0).count("<|image_pad|>")
        assert got.num_image_tokens == n_ref == ours_cfg.num_image_tokens(*header_size(data)), img_name
        grids.add(got.image_grid_thw)
        if name == "qwen2-vl-small-budget":  # patch 14 by default
            assert 100_000 <= got.image_grid_thw[1] * got.image_grid_thw[2] * 14**2 <= 200_000, img_name
    assert len(grids) >= 7  # a size per image, not one fixed size


def test_qwen_vl_refuses_extreme_aspect_ratios():
    strip = decode_image(png(1000, 4, "RGB", 0))
    ours = QwenVLImages.from_config(QWEN["qwen2.5-vl"])
    with pytest.raises(ValueError, match="aspect ratio must be smaller than 200"):
        reference(T.Qwen2VLImageProcessorPil, QWEN["qwen2.5-vl"])(strip)
    for call in (lambda: ours.preprocess(strip), lambda: ours.num_image_tokens(4, 1000)):
        with pytest.raises(InvalidRequest, match="aspect ratios up to 200"):
            call()


# Pixtral and Mistral 3 ---------------------------------------------------------------------------

PIXTRAL = {
    # mistralai/Mistral-Small-3.1-24B-Instruct-2503: patch 14, merged 2x2 (processor_config.json)
    "mistral3": ({"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
                  "image_mean": CLIP_MEAN, "image_std": CLIP_STD, "image_processor_type": "PixtralImageProcessor",
                  "patch_size": {"height": 14, "width": 14}, "processor_class": "PixtralProcessor", "resample": 3,
                  "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 1540}}, 14, 2),
    "pixtral-12b": ({"patch_size": {"height": 16, "width": 16}, "size": {"longest_edge": 1024},
                     "image_processor_type": "PixtralImageProcessor"}, 16, 1),
}


def pixtral_placeholder(height: int, width: int, cell: int) -> str:
    """PixtralProcessor.replace_image_token's expansion, restated: its module imports torchvision.
    A row of [IMG] per cell across, each row closed by [IMG_BREAK], the last by [IMG_END]."""
    tokens = (["[IMG]"] * (width // cell) + ["[IMG_BREAK]"]) * (height // cell)
    return "".join(tokens[:-1] + ["[IMG_END]"])


@pytest.mark.parametrize("name", sorted(PIXTRAL))
def test_pixtral(name):
    cfg, patch, merge = PIXTRAL[name]
    ours_cfg = PixtralImages.from_config(cfg, spatial_merge_size=merge)
    ref_proc = reference(T.PixtralImageProcessorPil, cfg)
    for img_name, data in IMAGES:
        ours, theirs = pair(data)
        got = ours_cfg.preprocess(ours)
        ref = ref_proc(theirs, patch_size=patch * merge)  # as PixtralProcessor passes it
        np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"][0], err_msg=img_name)
        assert tuple(got.image_size) == tuple(ref["image_sizes"][0])
        text = pixtral_placeholder(*ref["image_sizes"][0], patch * merge)
        assert got.num_image_tokens == text.count("[IMG]") == ours_cfg.num_image_tokens(*header_size(data))
        assert got.num_placeholder_tokens == text.count("[IMG]") + text.count("[IMG_BREAK]") + text.count("[IMG_END]")
        assert text.count("[IMG_BREAK]") == got.rows - 1 and text.endswith("[IMG_END]")


# SmolVLM and Idefics3 ----------------------------------------------------------------------------

IDEFICS = {
    # HuggingFaceTB/SmolVLM-256M-Instruct: 512-pixel tiles of 64 tokens
    "smolvlm": ({"do_convert_rgb": True, "do_image_splitting": True, "do_normalize": True, "do_pad": True,
                 "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                 "image_processor_type": "SmolVLMImageProcessor", "image_std": [0.5, 0.5, 0.5],
                 "max_image_size": {"longest_edge": 512}, "processor_class": "SmolVLMProcessor", "resample": 1,
                 "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 2048}}, 64,
                T.SmolVLMImageProcessorPil),
    "idefics3": ({"image_processor_type": "Idefics3ImageProcessor"}, 169, T.Idefics3ImageProcessorPil),
    "idefics3-no-splitting": ({"do_image_splitting": False, "image_processor_type": "Idefics3ImageProcessor"},
                              169, T.Idefics3ImageProcessorPil),
}


@pytest.mark.parametrize("name", sorted(IDEFICS))
def test_smolvlm_and_idefics3_tiles(name):
    cfg, seq_len, cls = IDEFICS[name]
    ours_cfg, ref_proc = Idefics3Images.from_config(cfg, image_seq_len=seq_len), reference(cls, cfg)
    tok = tiny_tokenizer()
    whole = T.Idefics3Processor(image_processor=ref_proc, tokenizer=tok, image_seq_len=seq_len)
    expand = SimpleNamespace(image_seq_len=seq_len, fake_image_token="<fake_token_around_image>",
                             image_token="<image>", global_image_token="<global-img>")
    grids = set()
    for img_name, data in IMAGES:
        ours, theirs = pair(data)
        got = ours_cfg.preprocess(ours)
        ref = ref_proc(theirs, return_row_col_info=True)
        np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"][0], err_msg=img_name)
        assert (got.rows, got.cols) == (ref["rows"][0][0], ref["cols"][0][0])
        if name.startswith("idefics3"):
            ids = whole(text="look <image>", images=[[theirs]])["input_ids"][0]
            n_ref = ids.count(tok.convert_tokens_to_ids("<image>"))
        else:
            n_ref = T.SmolVLMProcessor.replace_image_token(expand, ref, 0).count("<image>")
        assert got.num_image_tokens == n_ref == ours_cfg.num_image_tokens(*header_size(data)), img_name
        grids.add((got.rows, got.cols))
    assert len(grids) > (1 if "splitting" not in name else 0)


# Gemma 4 -----------------------------------------------------------------------------------------

GEMMA4 = {"do_convert_rgb": True, "do_normalize": False, "do_rescale": True, "do_resize": True,
          "image_mean": [0.0, 0.0, 0.0], "image_std": [1.0, 1.0, 1.0], "image_processor_type": "Gemma4ImageProcessor",
          "max_soft_tokens": 280, "patch_size": 16, "pooling_kernel_size": 3, "resample": 3,
          "rescale_factor": 0.00392156862745098}


@pytest.mark.parametrize("max_soft_tokens", [70, 280, 1120])
def test_gemma4(max_soft_tokens):
    cfg = dict(GEMMA4, max_soft_tokens=max_soft_tokens)
    ours_cfg, ref_proc = Gemma4Images.from_config(cfg), reference(T.Gemma4ImageProcessorPil, cfg)
    expand = SimpleNamespace(boi_token="<|image>", eoi_token="<image|>", image_token="<|image|>")
    for img_name, data in IMAGES:
        ours, theirs = pair(data)
        got, ref = ours_cfg.preprocess(ours), ref_proc(theirs)
        np.testing.assert_array_equal(got.pixel_values, ref["pixel_values"][0], err_msg=img_name)
        np.testing.assert_array_equal(got.image_position_ids, ref["image_position_ids"][0])
        n_ref = T.Gemma4Processor.replace_image_token(expand, ref, 0).count("<|image|>")
        assert got.num_image_tokens == n_ref == ours_cfg.num_image_tokens(*header_size(data)), img_name
        assert got.num_image_tokens <= max_soft_tokens


# Configs -----------------------------------------------------------------------------------------

def test_the_config_names_the_family():
    assert processor_class(GEMMA3) is Gemma3Images
    assert processor_class(QWEN["qwen3-vl"]) is QwenVLImages  # the Fast class name, as Qwen3-VL ships it
    assert processor_class({"image_processor_type": "SmolVLMImageProcessorPil"}) is Idefics3Images
    with pytest.raises(PreprocessorConfigError, match="image_processor_type='CLIPImageProcessor'"):
        processor_class({"image_processor_type": "CLIPImageProcessor"})


def test_fields_ridge_cannot_honour_are_refused_by_name():
    with pytest.raises(PreprocessorConfigError, match="crop_to_patches=True: not a field ridge reads for Gemma 3"):
        Gemma3Images.from_config(dict(GEMMA3, crop_to_patches=True))
    with pytest.raises(PreprocessorConfigError, match="max_soft_tokens=100: Gemma 4 takes one of"):
        Gemma4Images.from_config(dict(GEMMA4, max_soft_tokens=100))
    with pytest.raises(PreprocessorConfigError, match="do_center_crop=True"):
        PixtralImages.from_config({"do_center_crop": True, "crop_size": {"height": 224, "width": 224}})
    with pytest.raises(PreprocessorConfigError, match="resample=9"):
        QwenVLImages.from_config({"resample": 9})
    with pytest.raises(PreprocessorConfigError, match="size=.*shortest_edge and longest_edge"):
        QwenVLImages.from_config({"size": {"height": 448, "width": 448}})
    with pytest.raises(PreprocessorConfigError, match="size=.*min_pixels"):  # transformers cannot resize by it either
        QwenVLImages.from_config({"size": {"min_pixels": 3136, "max_pixels": 12845056}})
    older = {"size": {"min_pixels": 3136, "max_pixels": 12845056}, "min_pixels": 3136, "max_pixels": 1_000_000}
    ours, ref = QwenVLImages.from_config(older), reference(T.Qwen2VLImageProcessorPil, older)
    assert (ours.min_pixels, ours.max_pixels) == (ref.size.shortest_edge, ref.size.longest_edge) == (3136, 1_000_000)
    with pytest.raises(PreprocessorConfigError, match="image_mean=.*expected 3 values"):
        Idefics3Images.from_config({"image_mean": [0.5, 0.5]}, image_seq_len=64)
