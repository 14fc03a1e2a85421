"""Gemma 3's image encoder from llama.cpp's projector file (`--mmproj`, as llama-server takes it
beside a gemma3 GGUF): what convert_hf_to_gguf.py's Gemma3VisionModel writes, read back into
vision.py's Gemma3Vision.

The file's keys: clip.projector_type "gemma3", clip.vision.{image_size, patch_size,
embedding_length, feed_forward_length, block_count, attention.head_count,
attention.layer_norm_epsilon, projection_dim (the text model's width), image_mean, image_std,
use_gelu} and, when the pool is not 4 patches a side, projector.scale_factor. Its tensors: SigLIP's
under v.* (the gguf package's tensor map for the clip arch) and the projector's
mm.input_projection ([vision width, text width], as the checkpoint's parameter) and
mm.soft_emb_norm, which the converter stores as 1 + w (Gemma's RMSNorm multiplier): read back as w.
The prompt rule is Gemma3Processor's at those settings: a picture of image_size squared, resized
bilinearly, normalized by the file's mean and std, pan-and-scan off (llama.cpp never crops)."""
from __future__ import annotations

import torch

from ridge.quant.errors import ModelLoadError

from ..layers.siglip import place_encoder
from .vision import Gemma3Vision, VisionConfig

PROJECTOR = "gemma3"
BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_out": "self_attn.out_proj", "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1",
         "ffn_down": "mlp.fc2"}
GLOBAL = {"v.patch_embd": "vision_tower.embeddings.patch_embedding",
          "v.position_embd": "vision_tower.embeddings.position_embedding",
          "v.post_ln": "vision_tower.post_layernorm"}
# the keys ridge reads (and the converter writes for this projector); any other clip.vision key is refused
KEYS = {"clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
        "clip.vision.feed_forward_length", "clip.vision.block_count", "clip.vision.attention.head_count",
        "clip.vision.attention.layer_norm_epsilon", "clip.vision.projection_dim", "clip.vision.image_mean",
        "clip.vision.image_std", "clip.vision.use_gelu", "clip.vision.projector.scale_factor",
        "clip.vision.projector_type"}
POOL = 4  # the projector's default pooling, patches a side per token (Gemma3VisionModel's)


def _int(meta: dict, key: str, path) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ModelLoadError(path, f"{key}={v!r}: expected a positive integer")
    return v


def read_config(meta: dict, path) -> VisionConfig:
    unknown = sorted(k for k in meta if k.startswith("clip.vision.") and k not in KEYS)
    if unknown:
        raise ModelLoadError(path, f"{unknown[0]}={meta[unknown[0]]!r}: a setting of Gemma 3's projector ridge "
                                   "does not know")
    if meta.get("clip.vision.use_gelu") is not True:
        raise ModelLoadError(path, f"clip.vision.use_gelu={meta.get('clip.vision.use_gelu')!r}: Gemma 3's tower "
                                   "runs GELU (tanh)")
    image, patch = _int(meta, "clip.vision.image_size", path), _int(meta, "clip.vision.patch_size", path)
    hidden, heads = _int(meta, "clip.vision.embedding_length", path), _int(meta, "clip.vision.attention.head_count", path)
    if image % patch or hidden % heads:
        raise ModelLoadError(path, f"clip.vision.patch_size={patch} / attention.head_count={heads}: expected "
                                   f"divisors of image_size={image} and embedding_length={hidden}")
    scale = meta.get("clip.vision.projector.scale_factor", POOL)
    side = image // patch
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1 or side % scale:
        raise ModelLoadError(path, f"clip.vision.projector.scale_factor={scale!r}: expected a divisor of the "
                                   f"{side} patches a side")
    eps = meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0:
        raise ModelLoadError(path, f"clip.vision.attention.layer_norm_epsilon={eps!r}: expected a positive number")
    return VisionConfig(hidden_size=hidden, intermediate_size=_int(meta, "clip.vision.feed_forward_length", path),
                        num_layers=_int(meta, "clip.vision.block_count", path), num_heads=heads, num_channels=3,
                        image_size=image, patch_size=patch, hidden_act="gelu_pytorch_tanh", layer_norm_eps=float(eps),
                        mm_tokens_per_image=(side // scale) ** 2,
                        text_hidden_size=_int(meta, "clip.vision.projection_dim", path))


def module_name(name: str) -> str | None:
    """A tensor of the file -> Gemma3Vision's name; None: not one of the encoder's."""
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL:
        return f"{GLOBAL[stem]}.{kind}"
    if name == "mm.input_projection.weight":
        return "multi_modal_projector.mm_input_projection_weight"
    if name == "mm.soft_emb_norm.weight":
        return "multi_modal_projector.mm_soft_emb_norm.weight"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in BLOCK:
        return f"vision_tower.encoder.layers.{parts[2]}.{BLOCK[parts[3]]}.{kind}"
    return None


def load(tensors: dict[str, torch.Tensor], meta: dict, path, device, dtype: torch.dtype, weights: str,
         text_hidden_size: int) -> Gemma3Vision:
    """tensors: the file's, by its names, in fp32. The encoder for a text model text_hidden_size wide
    (models/mmproj.py checked the file's projection_dim against it)."""
    cfg = read_config(meta, path)
    sd, source = {}, {}
    for name, t in tensors.items():
        mine = module_name(name)
        if mine is None:
            raise ModelLoadError(path, f"tensor {name}: not part of Gemma 3's encoder")
        if name == "mm.soft_emb_norm.weight":
            t = t - 1.0  # the converter stores Gemma's multiplier, 1 + w
        sd[mine], source[mine] = (t if weights == "fp8" else t.to(device=device, dtype=dtype)), name
    model = place_encoder(sd, source, path, lambda: Gemma3Vision(cfg), device, dtype, weights)
    if weights == "fp8":
        model.multi_modal_projector.quantize(device, dtype)
    return model


def preprocessor(meta: dict, path) -> dict:
    """Gemma3ImageProcessor's settings the file implies (ridge/vision/gemma3.py reads them)."""
    cfg = read_config(meta, path)
    mean, std = meta.get("clip.vision.image_mean"), meta.get("clip.vision.image_std")
    for key, v in (("clip.vision.image_mean", mean), ("clip.vision.image_std", std)):
        if not isinstance(v, list) or len(v) != 3 or not all(isinstance(x, (int, float)) for x in v):
            raise ModelLoadError(path, f"{key}={v!r}: expected three numbers")
    return {"image_processor_type": "Gemma3ImageProcessor", "do_resize": True, "resample": 2, "do_rescale": True,
            "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": mean, "image_std": std,
            "size": {"height": cfg.image_size, "width": cfg.image_size}, "image_seq_length": cfg.mm_tokens_per_image,
            "do_pan_and_scan": False}


TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")  # Gemma 3's boi, image and eoi tokens


def prompt_rules(meta: dict, path, token_id):
    """Gemma3Processor's prompt at the file's settings; token_id(text) -> the text model's id."""
    from ridge.vision.gemma3 import Gemma3Images
    from ridge.vision.prompt import Gemma3Prompt

    from ..mmproj import vocabulary_ids

    image = vocabulary_ids(TOKENS, token_id, path, "Gemma 3")[1]
    images = Gemma3Images.from_config(preprocessor(meta, path), pan_and_scan=False)
    return Gemma3Prompt(images, image, TOKENS[0], TOKENS[1], TOKENS[2], how=f"{PROJECTOR}-mmproj|{images!r}")
