"""From a SpeculativeConfig to what the engine runs, in the engine's build order:
the draft model first (its weights and KV count against memory), the policy
once the knee is known, the proposer once the KV cache exists."""
from __future__ import annotations

import logging

from .config import SpeculativeConfig
from .policy import SpecPolicy
from .proposers import AutoProposer, DraftModelProposer, NgramProposer, SelfDraftProposer

log = logging.getLogger("ridge.engine")


def check_same_tokenizer(target, draft, path) -> None:
    a, b = target.backend.get_vocab(), draft.backend.get_vocab()
    if a != b:
        raise ValueError(f"{path}: the draft model's vocabulary differs from the target's "
                         f"({len(b)} vs {len(a)} tokens); a draft must share the tokenizer")


def _linear_weights(model) -> int:
    """Weights a step multiplies by: what a pass costs, whatever format each copy is in."""
    from ridge.quant.linear import FP8Linear

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, FP8Linear))


def load_draft(cfg: SpeculativeConfig, device, weights: str, max_model_len: int, tokenizer):
    """-> the draft model's LoadedModel, or None unless cfg names one."""
    if cfg.method != "draft":
        return None
    from ridge.models.loader import load_model

    loaded = load_model(cfg.draft_path, device=device, weights=weights, max_model_len=max_model_len)
    check_same_tokenizer(tokenizer, loaded.tokenizer, cfg.draft_path)
    return loaded


def build_policy(cfg: SpeculativeConfig, knee_tokens: float, target_model, draft=None) -> SpecPolicy | None:
    """The policy prices a draft pass against a target pass; None: no speculation."""
    layers = len(target_model.layers)
    if cfg.method == "off":
        return None
    if cfg.method == "ngram":
        return SpecPolicy(knee_tokens, cfg.max_k, 0.0)
    if cfg.method == "self":
        if not 1 <= cfg.num_layers < layers:
            raise ValueError(f"--speculative {cfg}: L must be in [1, {layers - 1}]")
        return SpecPolicy(knee_tokens, cfg.max_k, cfg.num_layers / layers)
    if cfg.method == "auto":
        n = auto_layers(layers)
        return SpecPolicy(knee_tokens, cfg.max_k, n / layers, costed_source=f"self:{n}")
    cost = _linear_weights(draft.model) / max(_linear_weights(target_model), 1)
    policy = SpecPolicy(knee_tokens, cfg.max_k, cost)
    if not policy.can_pay():
        log.warning("--speculative %s: the draft multiplies %.2fx the target's weights per token, so "
                    "drafting can never pay; speculation is off", cfg, cost)
        return None
    return policy


def auto_layers(num_layers: int) -> int:
    return max(1, num_layers // 4)


def build_proposer(cfg: SpeculativeConfig, policy: SpecPolicy | None, model, kv_cache, sampler,
                   draft=None, draft_cache=None, step_buffers=None):
    """-> the proposer, given everything it reads: the target and its cache (self-draft),
    the sampler (sampled drafts), the draft model, its cache and its own step buffers."""
    if policy is None:
        return None
    if cfg.method == "ngram":
        return NgramProposer()
    if cfg.method == "self":
        return SelfDraftProposer(cfg.num_layers, model, kv_cache, sampler)
    if cfg.method == "auto":
        selfdraft = SelfDraftProposer(auto_layers(len(model.layers)), model, kv_cache, sampler)
        return AutoProposer(NgramProposer(), selfdraft, policy)
    return DraftModelProposer(draft, draft_cache, sampler, step_buffers)
