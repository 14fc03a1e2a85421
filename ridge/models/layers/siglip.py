"""What the image families' SigLIP-style encoders share in reading a checkpoint: the tower's
fields of vision_config (each honoured or refused by name) and the encoder's tensors (read one
at a time from the files' memory maps, checked name by name and shape by shape against the
module the config builds). The tower itself is ridge/models/idefics3/vision.py's.

With FP8 weights (--weights fp8) every nn.Linear of an encoder (tower and projector) is quantized
at load to e4m3 with one scale per output channel and held as an FP8Linear, run by the products
the decoder's FP8 layers use; convolutions, position tables and norms stay in the compute dtype.
Nothing is cached on disk, so every load pays the scales' search (the decoder's "mse" rule): about
15 M weights/s on a 2-core CPU, some 6 s for SmolVLM-256M's 93M-parameter tower and 28 s for a
SigLIP-so400m one, against a decoder whose conversion is cached once."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from ridge.quant.errors import ModelLoadError
from ridge.quant.fp8 import quantize_fp8
from ridge.quant.hf_config import ACTIVATIONS, HFConfig
from ridge.quant.linear import FP8Linear

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


class VisionView(HFConfig):
    """vision_config's values: a refusal names the field as vision_config.<key>."""

    def refuse(self, key: str, value, why: str):
        super().refuse(f"vision_config.{key}", value, why)


def positive(c: HFConfig, key: str) -> int:
    v = c.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        # transformers' tower takes image_size // patch_size and a square conv: a list breaks both
        c.refuse(key, v, "expected a positive integer")
    return v


def read_tower(c: HFConfig, defaults: dict) -> tuple[VisionView, dict]:
    """The wrapper's vision_config -> (its view, the tower's fields as the encoder's VisionConfig
    names them); the family checks image_size and patch_size against its own use."""
    values = c.get("vision_config")
    if values is None:
        values = {}
    if not isinstance(values, dict):
        c.refuse("vision_config", values, "expected the vision tower's config (a JSON object)")
    v = VisionView(values, c.path, defaults)
    hidden, heads = positive(v, "hidden_size"), positive(v, "num_attention_heads")
    if hidden % heads:
        v.refuse("num_attention_heads", heads, f"does not divide hidden_size={hidden}")
    act = v.get("hidden_act")
    if act not in ACTIVATIONS:
        v.refuse("hidden_act", act, f"ridge runs {', '.join(ACTIVATIONS)}")
    return v, dict(hidden_size=hidden, intermediate_size=positive(v, "intermediate_size"),
                   num_layers=positive(v, "num_hidden_layers"), num_heads=heads,
                   num_channels=positive(v, "num_channels"), image_size=positive(v, "image_size"),
                   patch_size=positive(v, "patch_size"), hidden_act=ACTIVATIONS[act],
                   layer_norm_eps=v.number("layer_norm_eps"))


def read_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    try:
        values = json.loads(cfg_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(cfg_file, f"not a readable config ({e})") from None
    if not isinstance(values, dict):
        raise ModelLoadError(cfg_file, "not a JSON object")
    return values


def load_encoder(path: Path, rename: Callable[[str], str | None], build: Callable[[], nn.Module], device,
                 dtype: torch.dtype, weights: str = "fp32") -> nn.Module | None:
    """The encoder build() makes, its weights in dtype on device: each tensor of the directory's
    safetensors that rename() maps to one of its names (None: not the encoder's). None where no
    tensor is the encoder's (a text-only copy); a missing, extra or misshapen one is refused,
    named as the checkpoint names it. weights "fp8": each nn.Linear quantized (see above), from
    the checkpoint's values rather than their cast to dtype."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors weights in this directory")
    sd: dict[str, torch.Tensor] = {}
    source: dict[str, str] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                mine = rename(name)
                if mine is None:
                    continue
                t = st.get_tensor(name)
                if t.dtype not in FLOATS:
                    raise ModelLoadError(f, f"tensor {name}: {t.dtype}; ridge reads the vision tower in "
                                            "fp32, fp16 or bf16")
                sd[mine], source[mine] = (t if weights == "fp8" else t.to(device=device, dtype=dtype)), name
    if not sd:
        return None
    return place_encoder(sd, source, path, build, device, dtype, weights)


def place_encoder(sd: dict[str, torch.Tensor], source: dict[str, str], path, build: Callable[[], nn.Module], device,
                  dtype: torch.dtype, weights: str) -> nn.Module:
    """The encoder build() makes holding sd's tensors (its names; source: each one's name in the
    file, for refusals), checked name by name and shape by shape, in dtype on device; weights
    "fp8": each nn.Linear quantized. sd's tensors are in dtype on device already unless "fp8"."""
    with torch.device("meta"):
        model = build()
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    for name in sorted(set(expected) | set(sd)):
        if name not in sd:
            raise ModelLoadError(path, f"tensor {name} missing: the vision config declares it")
        if name not in expected:
            raise ModelLoadError(path, f"tensor {source[name]}: not part of the encoder ridge runs")
        if tuple(sd[name].shape) != expected[name]:
            raise ModelLoadError(path, f"tensor {source[name]}: shape {tuple(sd[name].shape)}, the config gives "
                                       f"{expected[name]}")
    if weights == "fp8":
        quantize_linears(model, sd, device, dtype)
        sd = {k: t.to(device=device, dtype=dtype) for k, t in sd.items()}
    model.load_state_dict(sd, assign=True, strict=weights != "fp8")  # fp8: the Linears hold theirs
    return model.eval()


class TowerLinear(FP8Linear):
    """An FP8Linear over [..., in] activations: the decoder's products take rows, [tokens, in]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, sd: dict[str, torch.Tensor], device, dtype: torch.dtype) -> None:
    """Each nn.Linear of model (on meta) -> a TowerLinear (an FP8Linear) holding its weight from sd
    as e4m3 with per-output-channel scales (quant/fp8.py's "channel" grouping, its default rule),
    its bias in dtype; their tensors are taken out of sd."""
    device = torch.device(device)
    for prefix, child in list(model.named_modules()):
        if type(child) is not nn.Linear:
            continue
        owner, _, name = prefix.rpartition(".")
        w, b = sd.pop(f"{prefix}.weight"), sd.pop(f"{prefix}.bias", None)
        q = TowerLinear(child.in_features, child.out_features, bias=b is not None)
        q.load(*quantize_fp8(w.float(), grouping="channel"), b, device, dtype)
        setattr(model.get_submodule(owner), name, q)


def tower_bytes(model: nn.Module) -> int:
    """An encoder's weight bytes: its parameters and the FP8Linears' buffers (e4m3, scales, biases)."""
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
