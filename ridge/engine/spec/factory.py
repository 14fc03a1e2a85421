"""`--speculative ngram|draft:PATH|self:L|auto|off` -> a proposer and its policy."""
from __future__ import annotations

import logging

from .policy import SpecPolicy
from .proposers import AutoProposer, DraftModelProposer, NgramProposer, SelfDraftProposer

log = logging.getLogger("ridge.engine")


def _self_layers(spec: str, num_layers: int) -> int:
    try:
        n = int(spec.split(":", 1)[1])
    except (IndexError, ValueError):
        raise ValueError(f"--speculative {spec!r}: expected self:L with L a number of layers") from None
    if not 1 <= n < num_layers:
        raise ValueError(f"--speculative {spec!r}: L must be in [1, {num_layers - 1}]")
    return n


def check_same_tokenizer(target, draft, path) -> None:
    a, b = target.backend.get_vocab(), draft.backend.get_vocab()
    if a != b:
        raise ValueError(f"{path}: the draft model's vocabulary differs from the target's "
                         f"({len(b)} vs {len(a)} tokens); a draft must share the tokenizer")


def _linear_weights(model) -> int:
    """Weights a step multiplies by: what a pass costs, whatever format each copy is in."""
    from ridge.quant.linear import FP8Linear

    return sum(m.weight.numel() for m in model.modules() if isinstance(m, FP8Linear))


def load_draft(path: str, engine):
    from ridge.models.loader import load_model

    loaded = load_model(path, device=engine.device, quantize=engine.config.quantize,
                        max_model_len=engine.max_model_len)
    check_same_tokenizer(engine.tokenizer, loaded.tokenizer, path)
    return loaded


def build_speculation(spec: str, engine, knee_tokens: float, max_k: int):
    """-> (proposer | None, policy | None, draft LoadedModel | None)."""
    spec = (spec or "off").strip()
    layers = engine.loaded.config.num_layers
    if spec == "off":
        return None, None, None
    if spec == "ngram":
        return NgramProposer(), SpecPolicy(knee_tokens, max_k, 0.0), None
    if spec.startswith("self:"):
        n = _self_layers(spec, layers)
        return SelfDraftProposer(n), SpecPolicy(knee_tokens, max_k, n / layers), None
    if spec == "auto":
        n = max(1, layers // 4)
        selfdraft = SelfDraftProposer(n)
        policy = SpecPolicy(knee_tokens, max_k, n / layers, costed_source=selfdraft.name)
        return AutoProposer(NgramProposer(), selfdraft, policy), policy, None
    if spec.startswith("draft:"):
        draft = load_draft(spec.split(":", 1)[1], engine)
        cost = _linear_weights(draft.model) / max(_linear_weights(engine.model), 1)
        policy = SpecPolicy(knee_tokens, max_k, cost)
        if not policy.can_pay():
            log.warning("--speculative %s: the draft multiplies %.2fx the target's weights per token, so "
                        "drafting can never pay; speculation is off", spec, cost)
            return None, None, None
        return None, policy, draft  # the proposer needs the pool: see engine
    raise ValueError(f"unknown --speculative {spec!r}; choose ngram, draft:PATH, self:L, auto or off")


__all__ = ["build_speculation", "DraftModelProposer"]
