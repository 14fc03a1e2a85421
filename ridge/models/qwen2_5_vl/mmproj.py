"""Qwen2.5-VL's image encoder from llama.cpp's projector file (`--mmproj`, as llama-server takes it
beside a qwen2vl GGUF): what convert_hf_to_gguf.py's Qwen2VLVisionModel writes for a
Qwen2_5_VLForConditionalGeneration, read back into vision.py's VisionTransformer, run as
llama.cpp's clip graph runs it (tools/mtmd/models/qwen2vl.cpp).

The file's keys: clip.projector_type "qwen2.5vl_merger", clip.use_silu (the MLP's activation: the
converter always writes true), clip.vision.{patch_size, embedding_length, feed_forward_length,
block_count, attention.head_count, attention.layer_norm_epsilon, projection_dim (the text model's
width), image_mean, image_std, image_size (only llama.cpp's warm-up reads it)} and
clip.vision.n_wa_pattern: fullatt_block_indexes as a period (block i attends over the whole
image where (i + 1) % n is 0; 0: every block does). clip.vision.spatial_merge_size, which
llama.cpp reads for its preprocessing, may be written by hand; its graph merges 2 x 2 whatever it
says. What the file cannot say, llama.cpp fixes and ridge takes from it: windows of 112 pixels a
side, a temporal patch of 2 (the converter refuses others), the axial rotation's base 10000.

Its tensors: the patch conv's two frames as v.patch_embd.weight and v.patch_embd.weight.1 (the
Conv3d split along time: stacked back), each block's q, k and v apart (v.blk.N.attn_{q,k,v}: the
fused qkv rows concatenated back), its RMSNorms ln1 and ln2, the gated MLP ffn_{gate,up,down},
the merger's RMSNorm as v.post_ln and its two Linears as mm.0 and mm.2.

The prompt rule is Qwen2VLImageProcessor's at llama-server's limits for this projector: between 8
and 4096 merged tokens an image (clip.cpp set_limit_image_tokens), resized bicubically, normalized
by the file's mean and std; <|vision_start|>, <|image_pad|> and <|vision_end|> from the text
model's vocabulary."""
from __future__ import annotations

import torch

from ridge.quant.errors import ModelLoadError

from ..layers.siglip import place_encoder
from ..mmproj import vocabulary_ids
from .config import AXIAL_THETA, VisionConfig
from .vision import EPS, QwenVLEncoder, VisionTransformer

# the keys ridge reads (and the converter writes for this projector); any other clip.vision key is refused
KEYS = {"clip.vision.image_size", "clip.vision.patch_size", "clip.vision.embedding_length",
        "clip.vision.feed_forward_length", "clip.vision.block_count", "clip.vision.attention.head_count",
        "clip.vision.attention.layer_norm_epsilon", "clip.vision.projection_dim", "clip.vision.image_mean",
        "clip.vision.image_std", "clip.vision.n_wa_pattern", "clip.vision.spatial_merge_size",
        "clip.vision.projector_type"}
# clip.* keys beside clip.vision.*: what models/mmproj.py checks, and the activation
TOP_KEYS = {"clip.projector_type", "clip.has_vision_encoder", "clip.use_silu", "clip.use_gelu"}
MERGE = 2  # llama.cpp's graph merges 2 x 2 patches into a token
TEMPORAL = 2  # the converter splits the Conv3d into exactly two frames
WINDOW = 112  # pixels a side of an attention window: clip.cpp's default, which it reads from no key here
MIN_TOKENS, MAX_TOKENS = 8, 4096  # llama-server's limits on an image's merged tokens for this projector
BLOCK = {"ln1": "norm1", "ln2": "norm2", "attn_out": "attn.proj", "ffn_gate": "mlp.gate_proj",
         "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
QKV = ("attn_q", "attn_k", "attn_v")  # the converter's split of attn.qkv, in its row order
GLOBAL = {"v.post_ln": "visual.merger.ln_q", "mm.0": "visual.merger.mlp.0", "mm.2": "visual.merger.mlp.2"}


def _int(meta: dict, key: str, path, minimum: int = 1) -> int:
    v = meta.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ModelLoadError(path, f"{key}={v!r}: expected an integer >= {minimum}")
    return v


def _check_keys(meta: dict, path) -> None:
    unknown = sorted(k for k in meta if k.startswith("clip.") and k not in KEYS | TOP_KEYS)
    if unknown:
        raise ModelLoadError(path, f"{unknown[0]}={meta[unknown[0]]!r}: a setting of Qwen2.5-VL's projector ridge "
                                   "does not know")
    if meta.get("clip.use_silu") is not True or meta.get("clip.use_gelu", False) is not False:
        raise ModelLoadError(path, f"clip.use_silu={meta.get('clip.use_silu')!r}, clip.use_gelu="
                                   f"{meta.get('clip.use_gelu')!r}: Qwen2.5-VL's MLP runs SiLU")
    merge = meta.get("clip.vision.spatial_merge_size", MERGE)
    if merge != MERGE or isinstance(merge, bool):
        raise ModelLoadError(path, f"clip.vision.spatial_merge_size={merge!r}: llama.cpp's graph merges "
                                   f"{MERGE} x {MERGE} patches")
    eps = meta.get("clip.vision.attention.layer_norm_epsilon", EPS)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or abs(eps - EPS) > EPS * 1e-6:
        # the tower's RMSNorms (vision.py) run transformers' fixed epsilon
        raise ModelLoadError(path, f"clip.vision.attention.layer_norm_epsilon={eps!r}: ridge's tower runs {EPS}")


def read_config(meta: dict, path) -> VisionConfig:
    """The tower's config the file implies, checked key by key."""
    _check_keys(meta, path)
    patch = _int(meta, "clip.vision.patch_size", path)
    hidden = _int(meta, "clip.vision.embedding_length", path)
    heads = _int(meta, "clip.vision.attention.head_count", path)
    if hidden % heads or (hidden // heads) % 4:
        # a quarter of a head turns by row, a quarter by column
        raise ModelLoadError(path, f"clip.vision.attention.head_count={heads}: embedding_length={hidden} must split "
                                   "into heads of a multiple of 4")
    if WINDOW // MERGE // patch < 1:
        raise ModelLoadError(path, f"clip.vision.patch_size={patch}: llama.cpp's {WINDOW}-pixel windows hold no "
                                   "merged token")
    depth = _int(meta, "clip.vision.block_count", path)
    period = _int(meta, "clip.vision.n_wa_pattern", path, minimum=0)
    full = range(depth) if period == 0 else [i for i in range(depth) if (i + 1) % period == 0]
    return VisionConfig(depth=depth, hidden_size=hidden, num_heads=heads, in_channels=3, patch_size=patch,
                        intermediate_size=_int(meta, "clip.vision.feed_forward_length", path),
                        temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, hidden_act="silu",
                        rope_theta=AXIAL_THETA, out_hidden_size=_int(meta, "clip.vision.projection_dim", path),
                        window_size=WINDOW, full_blocks=frozenset(full))


def module_name(name: str) -> str | None:
    """A tensor of the file -> the encoder's name; None: not one of the encoder's (the patch
    conv's frames and q, k and v are joined by encoder_tensors)."""
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL:
        return f"{GLOBAL[stem]}.{kind}"
    parts = stem.split(".")
    if len(parts) == 4 and parts[:2] == ["v", "blk"] and parts[2].isdigit() and parts[3] in BLOCK:
        return f"visual.blocks.{parts[2]}.{BLOCK[parts[3]]}.{kind}"
    return None


def encoder_tensors(tensors: dict[str, torch.Tensor], path) -> tuple[dict, dict]:
    """The file's tensors under the encoder's names, the converter's splits undone (the conv's
    frames stacked along time, each block's q, k and v rows concatenated) -> (them, each one's
    name in the file, for refusals)."""
    rest, sd, source = dict(tensors), {}, {}
    frames = ("v.patch_embd.weight", "v.patch_embd.weight.1")
    if any(n in rest for n in frames):
        w = [rest.pop(n, None) for n in frames]
        if None in w or w[0].shape != w[1].shape or w[0].dim() != 4:
            raise ModelLoadError(path, f"tensor {frames[0]} / {frames[1]}: expected both frames of the patch conv, "
                                       "[hidden, channels, patch, patch] each")
        sd["visual.patch_embed.proj.weight"], source["visual.patch_embed.proj.weight"] = torch.stack(w, 2), frames[0]
    blocks = {parts[2] for parts in (n.split(".") for n in tensors) if parts[:2] == ["v", "blk"] and len(parts) == 5
              and parts[3] in QKV}
    for b, kind in ((b, kind) for b in sorted(blocks) for kind in ("weight", "bias")):
        names = [f"v.blk.{b}.{p}.{kind}" for p in QKV]
        missing = [n for n in names if n not in rest]
        if missing:
            raise ModelLoadError(path, f"tensor {missing[0]} missing: the converter splits attn.qkv in three")
        mine = f"visual.blocks.{b}.attn.qkv.{kind}"
        sd[mine], source[mine] = torch.cat([rest.pop(n) for n in names]), names[0]
    for name, t in rest.items():
        mine = module_name(name)
        if mine is None:
            raise ModelLoadError(path, f"tensor {name}: not part of Qwen2.5-VL's encoder")
        sd[mine], source[mine] = t, name
    return sd, source


def load(tensors: dict[str, torch.Tensor], meta: dict, path, device, dtype: torch.dtype, weights: str,
         text_hidden_size: int) -> QwenVLEncoder:
    """tensors: the file's, by its names, in fp32. The encoder for a text model text_hidden_size wide
    (models/mmproj.py checked the file's projection_dim against it)."""
    cfg = read_config(meta, path)
    sd, source = encoder_tensors(tensors, path)
    if weights != "fp8":  # FP8: place_encoder quantizes the fp32 values itself
        sd = {k: t.to(device=device, dtype=dtype) for k, t in sd.items()}
    return place_encoder(sd, source, path, lambda: QwenVLEncoder(cfg, VisionTransformer), device, dtype, weights)


def _three(meta: dict, key: str, path) -> list:
    v = meta.get(key)
    if not isinstance(v, list) or len(v) != 3 or not all(isinstance(x, (int, float)) for x in v):
        raise ModelLoadError(path, f"{key}={v!r}: expected three numbers (RGB)")
    return v


def preprocessor(meta: dict, path) -> dict:
    """Qwen2VLImageProcessor's settings the file implies (ridge/vision/qwen_vl.py reads them)."""
    cfg = read_config(meta, path)
    mean, std = _three(meta, "clip.vision.image_mean", path), _three(meta, "clip.vision.image_std", path)
    cell = (cfg.patch_size * MERGE) ** 2  # the pixels of one merged token
    return {"do_resize": True, "resample": 3, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
            "image_mean": mean, "image_std": std, "min_pixels": MIN_TOKENS * cell, "max_pixels": MAX_TOKENS * cell,
            "patch_size": cfg.patch_size, "temporal_patch_size": TEMPORAL, "merge_size": MERGE}


TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # the markers and the placeholder


def prompt_rules(meta: dict, path, token_id):
    """Qwen2_5_VLProcessor's prompt at the file's settings; token_id(text) -> the text model's id."""
    from ridge.vision.prompt import QwenVLPrompt
    from ridge.vision.qwen_vl import QwenVLImages

    image = vocabulary_ids(TOKENS, token_id, path, "Qwen2.5-VL")[1]
    images = QwenVLImages.from_config(preprocessor(meta, path))
    return QwenVLPrompt(images, image, *TOKENS, how=f"{meta.get('clip.projector_type')}-mmproj|{images!r}")
