"""A model's image prompt rules: what its chat template writes for an image, what that marker
becomes in the prompt, and which runs of placeholder tokens each encoder input fills.

Read from the model's directory (config.json, preprocessor_config.json,
processor_config.json); torch-free, so the daemon's admission workers run it.
Two steps, as a processor does them: `expand` turns one decoded image into the
text that replaces its marker and the encoder inputs in that text's order;
after the whole prompt is tokenized, `place` gives each input the offset of
its run of image tokens. A run that is not where an input expects it (the
client's own text spelling the image token) is refused, never guessed at.

A raw prompt (no chat template) marks each image with RAW_MARKER, llama-server's
multimodal marker, in the order the images are given."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from ridge.errors import InvalidRequest

from . import processor_class
from .idefics3 import Idefics3Images
from .inputs import ImageInput, image_hash
from .gemma3 import Gemma3Images
from .gemma4 import Gemma4Images
from .pixels import PreprocessorConfigError
from .pixtral import PixtralImages
from .qwen_vl import QwenVLImages

RAW_MARKER = "<__media__>"  # llama-server's mtmd marker: where a raw prompt puts each image


@dataclass(frozen=True, slots=True)
class Pending:
    """An encoder input whose run of placeholders is not located yet."""
    content: str
    pixel_values: np.ndarray
    length: int
    meta: dict


@dataclass(frozen=True, slots=True)
class Expanded:
    """One image in a prompt: the text that replaces its marker, and its encoder inputs in order."""
    text: str
    inputs: tuple[Pending, ...]

    @property
    def num_image_tokens(self) -> int:
        return sum(p.length for p in self.inputs)


@dataclass(frozen=True, slots=True)
class Idefics3Prompt:
    """SmolVLM and Idefics3: each tile a run of image_seq_len `<image>` tokens after
    `<fake_token_around_image><row_r_col_c>`, a newline after each row of tiles, then the whole
    image as `<fake_token_around_image><global-img>` + its run + `<fake_token_around_image>`
    (Idefics3Processor.replace_image_token; SmolVLM's get_image_prompt_string is the same)."""
    images: Idefics3Images
    image_token_id: int
    marker: str = "<image>"  # what the chat template writes per image part, and the placeholder
    fake: str = "<fake_token_around_image>"
    global_tag: str = "<global-img>"
    how: str = ""  # the family and its settings: part of every input's content hash

    def expand(self, image: Image.Image) -> Expanded:
        pre = self.images.preprocess(image)
        n, tiles = self.images.image_seq_len, pre.pixel_values
        run = self.marker * n
        text, inputs = "", []
        for r in range(pre.rows):
            for c in range(pre.cols):
                text += f"{self.fake}<row_{r + 1}_col_{c + 1}>{run}"
                inputs.append(self._input(tiles[len(inputs)], {"tile": (r, c)}))
            text += "\n"
        text += ("\n" if pre.rows else "") + f"{self.fake}{self.global_tag}{run}{self.fake}"
        inputs.append(self._input(tiles[len(inputs)], {"tile": "global"}))
        return Expanded(text, tuple(inputs))

    def num_image_tokens(self, height: int, width: int) -> int:
        return self.images.num_image_tokens(height, width)

    def _input(self, pixels: np.ndarray, meta: dict) -> Pending:
        return Pending(image_hash(pixels, self.how), pixels, self.images.image_seq_len, meta)


@dataclass(frozen=True, slots=True)
class PixtralPrompt:
    """Pixtral and Mistral 3: an image of R x C cells is R rows of C `[IMG]` tokens, each row closed
    by `[IMG_BREAK]`, the last by `[IMG_END]` instead (PixtralProcessor.replace_image_token). The
    chat template writes one `[IMG]` per image part: the marker.

    An image's placeholders are R runs, so each row is one encoder input: its length C, its
    content a hash of the image's and the row's, its meta the image's hash (`image`), the row
    (`row`) and the grid (`grid`). The encoder runs the whole image once and gives each row its
    slice of the output (ridge/models/<family>/vision.py)."""
    images: PixtralImages
    image_token_id: int
    marker: str = "[IMG]"  # what the chat template writes per image part, and the placeholder
    row_break: str = "[IMG_BREAK]"
    end: str = "[IMG_END]"
    how: str = ""  # the family and its settings: part of every input's content hash

    def expand(self, image: Image.Image) -> Expanded:
        pre = self.images.preprocess(image)
        key = image_hash(pre.pixel_values, self.how)
        text = "".join(self.marker * pre.cols + (self.end if r == pre.rows - 1 else self.row_break)
                       for r in range(pre.rows))
        inputs = tuple(Pending(row_content(key, r), pre.pixel_values, pre.cols,
                               {"image": key, "row": r, "grid": (pre.rows, pre.cols)}) for r in range(pre.rows))
        return Expanded(text, inputs)

    def num_image_tokens(self, height: int, width: int) -> int:
        """Prompt tokens the image takes: its [IMG] tokens and one [IMG_BREAK] or [IMG_END] a row."""
        rows, cols = self.images.grid(height, width)
        return rows * (cols + 1)


@dataclass(frozen=True, slots=True)
class Gemma3Prompt:
    """Gemma 3: each picture (the image, then its pan-and-scan crops) is
    `\\n\\n<start_of_image>` + mm_tokens_per_image `<image_soft_token>` + `<end_of_image>\\n\\n`;
    with crops, the image's block and the crops' blocks sit in the processor's fixed sentence
    (Gemma3Processor.replace_image_token). The chat template writes `<start_of_image>` per image
    part: the marker, which the expansion writes again inside each block."""
    images: Gemma3Images
    image_token_id: int
    marker: str = "<start_of_image>"  # the processor's boi_token
    image_token: str = "<image_soft_token>"
    end: str = "<end_of_image>"
    how: str = ""  # the family and its settings: part of every input's content hash

    def expand(self, image: Image.Image) -> Expanded:
        pre = self.images.preprocess(image)
        n = self.images.image_seq_length
        block = f"\n\n{self.marker}{self.image_token * n}{self.end}\n\n"
        text = block if not pre.num_crops else (
            f"Here is the original image {block} and here are some crops to help you see better "
            + " ".join([block] * pre.num_crops))
        inputs = tuple(Pending(image_hash(px, self.how), px, n, {"crop": i})
                       for i, px in enumerate(pre.pixel_values))  # crop 0: the whole image
        return Expanded(text, inputs)

    def num_image_tokens(self, height: int, width: int) -> int:
        return self.images.num_image_tokens(height, width)

    @property
    def longest_run(self) -> int:
        """The most placeholders one picture takes in a row (the engine's step must hold them)."""
        return self.images.image_seq_length


@dataclass(frozen=True, slots=True)
class Gemma4Prompt:
    """Gemma 4: the chat template writes the image token once per image part (the marker), and the
    processor puts `<|image>` + one image token per pooled cell + `<image|>` in its place
    (Gemma4Processor.replace_image_token). One image is one encoder input: its own patches (the
    processor's padding to the patch budget left off: the encoder runs each image at its length)
    and its patch grid."""
    images: Gemma4Images
    image_token_id: int
    marker: str = "<|image|>"  # the processor's image_token
    boi: str = "<|image>"
    eoi: str = "<image|>"
    how: str = ""  # the family and its settings: part of every input's content hash

    def expand(self, image: Image.Image) -> Expanded:
        pre = self.images.preprocess(image)
        xy = pre.image_position_ids
        mine = xy[:, 0] >= 0
        grid = (int(xy[mine, 1].max()) + 1, int(xy[mine, 0].max()) + 1)  # rows, columns of patches
        pixels = np.ascontiguousarray(pre.pixel_values[mine])
        n = pre.num_image_tokens
        return Expanded(f"{self.boi}{self.marker * n}{self.eoi}",
                        (Pending(image_hash(pixels, f"{self.how}|{grid}"), pixels, n, {"grid": grid}),))

    def num_image_tokens(self, height: int, width: int) -> int:
        return self.images.num_image_tokens(height, width)

    @property
    def longest_run(self) -> int:
        return self.images.max_soft_tokens


@dataclass(frozen=True, slots=True)
class QwenVLPrompt:
    """Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the chat template writes
    `<|vision_start|><|image_pad|><|vision_end|>` per image part (the marker), and the processor
    repeats `<|image_pad|>` once per merged token (Qwen2_5_VLProcessor). One image is one encoder
    input, its meta the grid in patches (`grid`: the encoder's) and in merged tokens (`mrope_grid`:
    the text model's three positions, ridge/models/layers/mrope.py)."""
    images: QwenVLImages
    image_token_id: int
    start: str = "<|vision_start|>"
    image_token: str = "<|image_pad|>"
    end: str = "<|vision_end|>"
    how: str = ""  # the family and its settings: part of every input's content hash

    @property
    def marker(self) -> str:
        return self.start + self.image_token + self.end

    def expand(self, image: Image.Image) -> Expanded:
        pre = self.images.preprocess(image)
        t, h, w = pre.image_grid_thw
        m = self.images.merge_size
        meta = {"grid": (t, h, w), "mrope_grid": (t, h // m, w // m)}
        n = pre.num_image_tokens
        return Expanded(self.start + self.image_token * n + self.end,
                        (Pending(image_hash(pre.pixel_values, self.how), pre.pixel_values, n, meta),))

    def num_image_tokens(self, height: int, width: int) -> int:
        """Prompt tokens the image takes: its placeholders and the two markers around them."""
        return self.images.num_image_tokens(height, width) + 2


def _qwen_vl_rules(d: Path, pre: dict, config: dict) -> QwenVLPrompt:
    """Qwen2VLImageProcessor's settings, checked against config.json's vision tower (the patches and
    merge squares it takes), the three tokens' ids against the tokenizer's."""
    images = QwenVLImages.from_config(pre)
    vision = config.get("vision_config") or {}
    for key, value in (("patch_size", images.patch_size), ("temporal_patch_size", images.temporal_patch_size),
                       ("spatial_merge_size", images.merge_size)):
        model = vision.get(key)
        if model is not None and model != value:  # the placeholders must be the rows the merger gives
            raise PreprocessorConfigError("merge_size" if key == "spatial_merge_size" else key, value,
                                          f"config.json's vision tower is built for {model}")
    ids = _tokenizer_ids(d)
    tokens = {}
    for index, text, default_id in (("image_token_id", "<|image_pad|>", 151655),
                                    ("vision_start_token_id", "<|vision_start|>", 151652),
                                    ("vision_end_token_id", "<|vision_end|>", 151653)):
        want = config.get(index, default_id)
        if isinstance(want, bool) or not isinstance(want, int) or want < 0:
            raise PreprocessorConfigError(index, want, "config.json must give the token's id")
        if ids and ids.get(text) != want:  # the runs place() looks for must be this id
            raise PreprocessorConfigError(index, want, f"tokenizer.json gives {text} the id {ids.get(text)}")
        tokens[index] = want
    return QwenVLPrompt(images, tokens["image_token_id"], how=f"{config.get('model_type', '')}|{images!r}")


def row_content(image: str, row: int) -> str:
    """One row's content hash: hex (the prefix cache reads its first 16 digits) and distinct per row."""
    return hashlib.sha256(f"{image}|row {row}".encode()).hexdigest()


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise PreprocessorConfigError(path.name, None, f"cannot be read: {e}") from None


def _encoder_rows(config: dict) -> int | None:
    """Rows an Idefics3 encoder gives a tile: its patches, pixel-shuffled by scale_factor."""
    vision, scale = config.get("vision_config") or {}, config.get("scale_factor")
    size, patch = vision.get("image_size"), vision.get("patch_size")
    if not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in (size, patch, scale)):
        return None
    return (size // patch // scale) ** 2


def _positive(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _pixtral_rules(pre: dict, config: dict, proc: dict) -> PixtralPrompt:
    """PixtralProcessor's settings (processor_config.json: patch_size, spatial_merge_size and the
    three tokens), checked against the model's own config.json, which the encoder runs by."""
    patch, merge = proc.get("patch_size", 16), proc.get("spatial_merge_size", 1)
    vision = config.get("vision_config") or {}
    for key, value, model in (("patch_size", patch, vision.get("patch_size")),
                              ("spatial_merge_size", merge, config.get("spatial_merge_size"))):
        if not _positive(value):
            raise PreprocessorConfigError(key, value, "processor_config.json: expected a positive integer")
        if model is not None and model != value:
            # the placeholders must be the rows the encoder gives
            raise PreprocessorConfigError(key, value, f"config.json's model is built for {model}")
    tokens = {k: proc.get(k, d) for k, d in (("image_token", "[IMG]"), ("image_break_token", "[IMG_BREAK]"),
                                             ("image_end_token", "[IMG_END]"))}
    for k, v in tokens.items():
        if not isinstance(v, str) or not v:
            raise PreprocessorConfigError(k, v, "processor_config.json: expected the token's text")
    token_id = config.get("image_token_index", config.get("image_token_id"))
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise PreprocessorConfigError("image_token_index", token_id, "config.json must give the image token's id")
    # the processor resizes to whole cells of its own patch_size times the merge, whatever the
    # image processor's patch_size says (PixtralProcessor._process_images)
    images = PixtralImages.from_config({**pre, "patch_size": patch}, spatial_merge_size=merge)
    return PixtralPrompt(images, token_id, tokens["image_token"], tokens["image_break_token"],
                         tokens["image_end_token"], how=f"{config.get('model_type', '')}|{images!r}")


def _tokenizer_ids(d: Path) -> dict[str, int]:
    """The added tokens' ids in tokenizer.json ({} without one)."""
    return {t.get("content"): t.get("id") for t in _json(d / "tokenizer.json").get("added_tokens") or []
            if isinstance(t, dict)}


def _gemma3_rules(d: Path, pre: dict, config: dict, proc: dict) -> Gemma3Prompt:
    """Gemma3Processor's settings: image_seq_length (processor_config.json, and the image
    processor's), checked against config.json's mm_tokens_per_image, the rows the projector gives a
    picture; the three tokens' texts from the tokenizer, checked against config.json's ids."""
    mm = config.get("mm_tokens_per_image", 256)  # Gemma3Config's default
    if not _positive(mm):
        raise PreprocessorConfigError("mm_tokens_per_image", mm, "config.json: expected a positive integer")
    for source, fields in (("processor_config.json", proc), ("preprocessor_config.json", pre)):
        value = fields.get("image_seq_length")
        if value is not None and value != mm:  # the placeholders must be the rows the projector gives
            raise PreprocessorConfigError("image_seq_length", value,
                                          f"{source}: config.json's mm_tokens_per_image is {mm}")
    tok = _json(d / "tokenizer_config.json")
    extra = tok.get("extra_special_tokens") if isinstance(tok.get("extra_special_tokens"), dict) else {}
    ids = _tokenizer_ids(d)
    tokens = {}
    # each token's text (the processor's default where the tokenizer names none), its config.json
    # field and Gemma3Config's default id
    for key, index, default, default_id in (("boi_token", "boi_token_index", "<start_of_image>", 255999),
                                            ("image_token", "image_token_index", "<image_soft_token>", 262144),
                                            ("eoi_token", "eoi_token_index", "<end_of_image>", 256000)):
        text = extra.get(key, tok.get(key, default))
        if isinstance(text, dict):  # an AddedToken as older tokenizers save it
            text = text.get("content")
        if not isinstance(text, str) or not text:
            raise PreprocessorConfigError(key, text, "tokenizer_config.json: expected the token's text")
        want = config.get(index, default_id)
        if isinstance(want, bool) or not isinstance(want, int) or want < 0:
            raise PreprocessorConfigError(index, want, "config.json must give the token's id")
        if ids and ids.get(text) != want:  # the runs place() looks for must be this id
            raise PreprocessorConfigError(index, want, f"tokenizer.json gives {text} the id {ids.get(text)}")
        tokens[key], tokens[index] = text, want
    images = Gemma3Images.from_config({**pre, "image_seq_length": mm})
    side = (config.get("vision_config") or {}).get("image_size")
    if side is not None and (images.height, images.width) != (side, side):
        # the tower's position embeddings are for its own square
        raise PreprocessorConfigError("size", pre.get("size"), f"config.json's vision tower takes {side} x {side} "
                                      "pictures")
    return Gemma3Prompt(images, tokens["image_token_index"], tokens["boi_token"], tokens["image_token"],
                        tokens["eoi_token"], how=f"{config.get('model_type', '')}|{images!r}")


def _gemma4_rules(d: Path, pre: dict, config: dict) -> Gemma4Prompt:
    """Gemma4Processor's settings: the image processor's patch budget and pooling, checked against
    the tower's (config.json's vision_config); the three tokens' texts from the tokenizer, the image
    token's checked against config.json's image_token_id."""
    images = Gemma4Images.from_config(pre)
    vision = config.get("vision_config") or {}
    for key, default in (("patch_size", 16), ("pooling_kernel_size", 3)):
        if vision.get(key, default) != getattr(images, key):  # the encoder's grid must be the processor's
            raise PreprocessorConfigError(key, getattr(images, key), f"config.json's vision tower takes "
                                          f"{vision.get(key, default)}")
    tok = _json(d / "tokenizer_config.json")
    extra = tok.get("extra_special_tokens") if isinstance(tok.get("extra_special_tokens"), dict) else {}
    texts = {}
    for key, default in (("image_token", "<|image|>"), ("boi_token", "<|image>"), ("eoi_token", "<image|>")):
        text = extra.get(key, tok.get(key, default))
        if isinstance(text, dict):  # an AddedToken as older tokenizers save it
            text = text.get("content")
        if not isinstance(text, str) or not text:
            raise PreprocessorConfigError(key, text, "tokenizer_config.json: expected the token's text")
        texts[key] = text
    want = config.get("image_token_id", 258_880)  # Gemma4Config's default
    if isinstance(want, bool) or not isinstance(want, int) or want < 0:
        raise PreprocessorConfigError("image_token_id", want, "config.json must give the image token's id")
    ids = _tokenizer_ids(d)
    if ids and ids.get(texts["image_token"]) != want:  # the runs place() looks for must be this id
        raise PreprocessorConfigError("image_token_id", want,
                                      f"tokenizer.json gives {texts['image_token']} the id {ids.get(texts['image_token'])}")
    return Gemma4Prompt(images, want, texts["image_token"], texts["boi_token"], texts["eoi_token"],
                        how=f"{config.get('model_type', '')}|{images!r}")


def read_prompt_rules(model_dir) -> Idefics3Prompt | PixtralPrompt | Gemma3Prompt | Gemma4Prompt | QwenVLPrompt | None:
    """The image prompt rules of the model in `model_dir`; None when it has no image processor
    (a text model, a GGUF file): such a model takes no images. PreprocessorConfigError names a
    field ridge cannot honour."""
    d = Path(model_dir) if model_dir else None
    if d is None or not d.is_dir() or not (d / "preprocessor_config.json").is_file():
        return None
    pre, config = _json(d / "preprocessor_config.json"), _json(d / "config.json")
    proc = _json(d / "processor_config.json")
    family = processor_class(pre)
    if family is PixtralImages:
        return _pixtral_rules(pre, config, proc)
    if family is Gemma3Images:
        return _gemma3_rules(d, pre, config, proc)
    if family is Gemma4Images:
        return _gemma4_rules(d, pre, config)
    if family is QwenVLImages:
        return _qwen_vl_rules(d, pre, config)
    if family is not Idefics3Images:
        raise PreprocessorConfigError("image_processor_type", pre.get("image_processor_type"),
                                      "ridge writes image prompts for Gemma 3, Gemma 4, Pixtral, Mistral 3, Qwen-VL, "
                                      "SmolVLM and Idefics3 so far")
    seq_len, rows = proc.get("image_seq_len"), _encoder_rows(config)
    if seq_len is None:
        seq_len = rows
    elif rows is not None and seq_len != rows:  # the placeholders must be the rows the encoder gives
        raise PreprocessorConfigError("image_seq_len", seq_len, f"the vision config's encoder gives {rows} rows "
                                      "a tile (image_size / patch_size squared, over scale_factor squared)")
    if seq_len is None:
        raise PreprocessorConfigError("image_seq_len", None, "processor_config.json must give image_seq_len")
    token_id = config.get("image_token_id")
    if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
        raise PreprocessorConfigError("image_token_id", token_id, "config.json must give the image token's id")
    images = Idefics3Images.from_config({k: v for k, v in pre.items() if k != "image_seq_len"}, image_seq_len=seq_len)
    return Idefics3Prompt(images, token_id, how=f"{config.get('model_type', '')}|{images!r}")


def place(ids: list[int], expanded: list[Expanded], image_token_id: int) -> tuple[ImageInput, ...]:
    """Each encoder input's offset: the runs of image tokens in the tokenized prompt, in order,
    one per input and of its length. InvalidRequest when they are not (the prompt's own text spells
    the image token, or an image's text did not tokenize to one run per input)."""
    runs, i, n = [], 0, len(ids)
    while i < n:
        if ids[i] == image_token_id:
            j = i
            while j < n and ids[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    pending = [p for e in expanded for p in e.inputs]
    if [r[1] for r in runs] != [p.length for p in pending]:
        raise InvalidRequest(f"the prompt holds {len(runs)} runs of the model's image token where its "
                             f"{len(expanded)} image(s) make {len(pending)}: the text must not spell the image "
                             "token itself; mark each image with an image part (or, in a raw prompt, "
                             f"{RAW_MARKER})")
    return tuple(ImageInput(p.content, p.pixel_values, off, p.length, p.meta) for p, (off, _) in zip(pending, runs))
