"""Gemma 4's assistant drafter (model_type gemma4_assistant: a checkpoint of its own, named with
`--speculative draft:PATH`), as transformers' Gemma4AssistantForCausalLM computes it and its
generation utilities drive it (Gemma4AssistantCandidateGenerator):

  x = pre_projection([target.embed(t) ; h])   2B -> H; t the last token, h the target's final
                                              hidden state before it (after the final norm), B wide
  x = the assistant's Gemma 4 layers, every one KV-shared: a full layer attends over the target's
      last full layer's K and V that computes its own, a sliding layer over its last sliding
      one's (the last sliding_window + 1 keys: transformers' bidirectional window counts both ends);
      keys before the last token, the query at its position
  x = norm(x); logits = lm_head(x) (tied to its embed_tokens; with use_ordered_embeddings only the
      tokens of the top centroid_intermediate_top_k centroids, the rest the minimum - 1)
  h = post_projection(x)                      the next draft's h, with the drafted token as t
Every draft of a round keeps the position and the keys; it writes no KV of its own. No soft-cap:
transformers' assistant reads its lm_head's logits as they are."""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ridge.config import ModelConfig
from ridge.quant.errors import ModelLoadError
from ridge.quant.fuse import fuse_layer
from ridge.quant.hf_config import HFConfig

from ..layers.decoder import RMSNorm
from ..layers.rope import rope_cos_sin
from .config import GEMMA4_DEFAULTS, WEIGHTS
from .model import Gemma4CausalLM

MODEL_TYPE = "gemma4_assistant"
DEFAULTS = dict(backbone_hidden_size=1536, use_ordered_embeddings=False, num_centroids=2048,
                centroid_intermediate_top_k=32, tie_word_embeddings=True)
# Gemma4AssistantConfig.validate_architecture: a text model with none of these
REQUIRED_OFF = ("hidden_size_per_layer_input", "enable_moe_block", "use_double_wide_mlp", "vocab_size_per_layer_input")


def is_assistant(path) -> bool:
    f = Path(path) / "config.json"
    return f.is_file() and json.loads(f.read_text()).get("model_type") == MODEL_TYPE


def read_config(path: Path) -> tuple[ModelConfig, dict]:
    """-> (its text model's ModelConfig, every layer KV-shared; the assistant's own fields)."""
    from . import SPEC

    f = Path(path) / "config.json"
    raw = json.loads(f.read_text())
    outer = HFConfig(raw, f, DEFAULTS)
    own = {k: outer.get(k) for k in DEFAULTS}
    text = raw.get("text_config")
    if not isinstance(text, dict):
        outer.refuse("text_config", text, "expected the assistant's gemma4_text config")
    for key in REQUIRED_OFF:
        if text.get(key) not in (None, 0, False):
            outer.refuse(f"text_config.{key}", text[key], "an assistant's text model has none")
    n = text.get("num_hidden_layers")
    if text.get("num_kv_shared_layers", n) != n:
        outer.refuse("text_config.num_kv_shared_layers", text.get("num_kv_shared_layers"),
                     f"every one of the assistant's {n} layers reads the target's K and V")
    view = HFConfig({**text, "num_kv_shared_layers": 0, "hidden_size_per_layer_input": 0,
                     "tie_word_embeddings": own["tie_word_embeddings"]}, f, GEMMA4_DEFAULTS)
    kw = SPEC.hf.model_config_kwargs(view, "gemma4_text")
    kw["extra"] = {**kw["extra"], "kv_source": [-1] * kw["num_layers"]}  # shared: the target's, at run time
    kw["name"] = Path(path).name
    return ModelConfig(**kw), own


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


class Gemma4Assistant(nn.Module):
    def __init__(self, cfg: ModelConfig, own: dict, layers: nn.ModuleList, path: Path):
        super().__init__()
        self.cfg, self.own, self.layers, self.path = cfg, own, layers, path
        self.name = f"draft:{path.name}"
        self.target_layers: dict[str, int] = {}  # layer type -> the target's layer whose K and V it reads
        self.target = []  # [the target CausalLM]: not a submodule, its weights are counted apart

    def attach(self, target) -> None:
        """Reads the target's last full and last sliding layer that compute their own K and V."""
        tc = target.cfg
        if tc.arch != "gemma4_text":
            raise ValueError(f"{self.name}: a Gemma 4 assistant drafts for a Gemma 4 target, not {tc.arch}")
        if self.own["backbone_hidden_size"] != tc.hidden_size:
            raise ValueError(f"{self.name}: backbone_hidden_size={self.own['backbone_hidden_size']}, the target's "
                             f"hidden_size is {tc.hidden_size}")
        own_kv = [i for i in range(tc.num_layers) if tc.extra["kv_source"][i] is None]
        for i in range(self.cfg.num_layers):
            kind = "full" if self.cfg.layer_window(i) is None else "sliding"
            src = [j for j in own_kv if (tc.layer_window(j) is None) == (kind == "full")]
            if not src:
                raise ValueError(f"{self.name}: its {kind} layers read the target's last {kind} layer; it has none")
            if tc.layer_window(src[-1]) != self.cfg.layer_window(i) or tc.layer_kv_shape(src[-1]) != \
                    self.cfg.layer_kv_shape(i):
                raise ValueError(f"{self.name}: layer {i} attends over the target's layer {src[-1]}, whose window "
                                 "or KV shape differs")
            self.target_layers[kind] = src[-1]
        self.target = [target]

    def load(self, sd: dict, device: torch.device, dtype: torch.dtype, max_model_len: int) -> None:
        cfg, p = self.cfg, self.path
        for name in ("pre_projection.weight", "post_projection.weight", "model.norm.weight"):
            if name not in sd:
                raise ModelLoadError(p, f"missing tensor {name}")
        head = sd.get("lm_head.weight", sd.get("model.embed_tokens.weight"))
        if head is None or not self.own["tie_word_embeddings"] and "lm_head.weight" not in sd:
            raise ModelLoadError(p, "missing tensor lm_head.weight" if not self.own["tie_word_embeddings"]
                                 else "missing tensor model.embed_tokens.weight")
        self.head_weight = head.to(device=device, dtype=dtype)  # [V, H]
        self.pre_projection = sd["pre_projection.weight"].to(device=device, dtype=dtype)  # [H, 2B]
        self.post_projection = sd["post_projection.weight"].to(device=device, dtype=dtype)  # [B, H]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.norm.weight = sd["model.norm.weight"].float().to(device)  # Gemma 4's norms multiply by w itself
        if self.own["use_ordered_embeddings"]:
            for name in ("masked_embedding.centroids.weight", "masked_embedding.token_ordering"):
                if name not in sd:
                    raise ModelLoadError(p, f"missing tensor {name}")
            C = self.own["num_centroids"]
            if cfg.vocab_size % C:
                raise ModelLoadError(p, f"num_centroids={C}: must divide vocab_size={cfg.vocab_size}")
            self.centroids = sd["masked_embedding.centroids.weight"].to(device=device, dtype=dtype)  # [C, H]
            self.token_ordering = sd["masked_embedding.token_ordering"].long().to(device).view(C, -1)
        fused = {}
        for i in range(cfg.num_layers):
            fuse_layer(sd, cfg, i, fused, p, WEIGHTS)
        with torch.device("meta"):
            stack = Gemma4CausalLM(cfg, max_model_len)
        for i in range(cfg.num_layers):
            stack.load_layer(i, fused, device, dtype)
        for layer in stack.layers:
            if layer.window is not None:  # transformers' bidirectional window is inclusive: W + 1 keys before
                layer.window += 1
        self.layers = stack.layers
        self.cos_sin = rope_cos_sin(cfg.global_head_dim or cfg.head_dim, max_model_len, cfg.rope_theta,
                                    cfg.rope_scaling).to(device)
        self.cos_sin_local = None if cfg.rope_local_theta is None else rope_cos_sin(
            cfg.head_dim, max_model_len, cfg.rope_local_theta, cfg.rope_local_scaling).to(device)

    @torch.inference_mode()
    def forward(self, token_ids, hidden, positions, meta, target_kv: list) -> tuple[torch.Tensor, torch.Tensor]:
        """token_ids [T], hidden [T, B], positions [T] (the last token's), meta: one query a request
        over the keys before it, target_kv: the target's KV cache layers -> (logits [T, V] fp32,
        the next draft's hidden [T, B])."""
        target = self.target[0]
        e = target.embed(token_ids)
        x = F.linear(torch.cat([e, hidden.to(e.dtype)], dim=-1), self.pre_projection)
        for i, layer in enumerate(self.layers):
            kind = "full" if layer.window is None else "sliding"
            rope = self.cos_sin_local if layer.local_rope else self.cos_sin
            x, _ = layer.forward(x, None, positions, rope, meta, target_kv[self.target_layers[kind]], None,
                                 from_model=True)
        x = self.norm.forward(x)[0]
        return self.logits(x), F.linear(x, self.post_projection)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        if not self.own["use_ordered_embeddings"]:
            return F.linear(x, self.head_weight).float()
        top = torch.topk(F.linear(x, self.centroids), self.own["centroid_intermediate_top_k"], dim=-1).indices
        chosen = self.token_ordering[top].reshape(x.shape[0], -1)  # [T, k * V / C] token ids
        picked = torch.einsum("th,tnh->tn", x, self.head_weight[chosen])
        out = torch.full((x.shape[0], self.cfg.vocab_size), picked.min().item() - 1.0, dtype=x.dtype, device=x.device)
        return out.scatter_(1, chosen, picked).float()

    kv_config = None  # no KV of its own: it reads the target's

    def head_weights(self) -> int:
        """Weights a draft multiplies besides its layers' linear ones: the projections and the
        logits' rows (only the chosen centroids' tokens with ordered embeddings)."""
        rows = self.cfg.vocab_size
        if self.own["use_ordered_embeddings"]:
            C = self.own["num_centroids"]
            rows = C + self.own["centroid_intermediate_top_k"] * (self.cfg.vocab_size // C)
        return self.pre_projection.numel() + self.post_projection.numel() + rows * self.cfg.hidden_size

    def weight_bytes(self) -> int:
        tensors = [self.head_weight, self.pre_projection, self.post_projection, self.norm.weight]
        tensors += list(self.layers.parameters()) + list(self.layers.buffers())
        if self.own["use_ordered_embeddings"]:
            tensors += [self.centroids, self.token_ordering]
        return sum(t.numel() * t.element_size() for t in tensors)


def load_assistant(path, target, device: torch.device, dtype: torch.dtype, max_model_len: int) -> Gemma4Assistant:
    path = Path(path)
    cfg, own = read_config(path)
    a = Gemma4Assistant(cfg, own, nn.ModuleList(), path)
    a.attach(target)
    a.load(_tensors(path), device, dtype, max_model_len)
    return a.eval()
