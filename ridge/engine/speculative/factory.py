"""From a SpeculativeConfig to the Speculator the engine runs, in the engine's build order:
plan_speculation before the KV cache is sized (the draft model's weights and KV count against
memory; the policy once the knee is known), build_speculator once the KV cache exists (the
proposer, the draft model's cache and step buffers)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from ridge.cache.kv_cache import KVCache
from ridge.config import kv_bytes_per_token

from ..step_batch import StepBuffers
from .config import SpeculativeConfig
from .policy import SpecPolicy
from .proposers import AutoProposer, DraftModelProposer, NgramProposer, SelfDraftProposer
from .speculator import Speculator

log = logging.getLogger("ridge.engine")


def check_same_tokenizer(target, draft, path) -> None:
    a, b = target.backend.get_vocab(), draft.backend.get_vocab()
    if a != b:
        raise ValueError(f"{path}: the draft model's vocabulary differs from the target's "
                         f"({len(b)} vs {len(a)} tokens); a draft must share the tokenizer")


def _linear_weights(model) -> int:
    """Weights a token's pass multiplies by: what a pass costs, whatever format each copy is in;
    of a mixture of experts' stacked experts, the k of E a token is routed to."""
    from ridge.quant.experts import FP8Experts
    from ridge.quant.linear import FP8Linear

    dense = sum(m.weight.numel() for m in model.modules() if isinstance(m, FP8Linear))
    experts = sum(m.w_gate_up.numel() + m.w_down.numel() for m in model.modules() if isinstance(m, FP8Experts))
    return dense + experts * model.cfg.num_experts_per_tok // max(model.cfg.num_experts, 1)


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


@dataclass
class SpeculationPlan:
    """What speculation settles before the KV cache is sized: its policy, and the draft model
    whose weights and KV count against memory (None unless --speculative names one)."""
    config: SpeculativeConfig
    policy: SpecPolicy
    draft: object = None  # the draft model's LoadedModel

    @property
    def weight_bytes(self) -> int:
        return self.draft.weight_bytes if self.draft is not None else 0

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """The draft's KV per token: it lives in the target's blocks, so one pool accounts for both."""
        return kv_bytes_per_token(self.draft.config, kv_dtype) if self.draft is not None else 0


def plan_speculation(cfg: SpeculativeConfig, device, weights, max_model_len: int, tokenizer, knee_tokens: float,
                     target_model) -> SpeculationPlan | None:
    """None: no speculation (off, or a draft model that can never pay)."""
    draft = load_draft(cfg, device, weights, max_model_len, tokenizer)
    policy = build_policy(cfg, knee_tokens, target_model, draft)
    return None if policy is None else SpeculationPlan(cfg, policy, draft)


def build_speculator(plan: SpeculationPlan, model, kv_cache: KVCache, sampler, max_tokens: int, max_seqs: int,
                     max_blocks_per_seq: int) -> Speculator:
    """Once the target's KV cache exists: a draft model's own cache, indexed by the target's block
    ids, and its own step buffers (it plans every step's known tokens); then the proposer, which
    shares the runner's sampler (a seeded request draws from one generator)."""
    device = model.cos_sin.device
    draft_cache = bufs = None
    if plan.draft is not None:
        draft_cache = KVCache(plan.draft.config, kv_cache.num_blocks, kv_cache.block_size, kv_cache.dtype_name,
                              device)
        bufs = StepBuffers(max_tokens, max_seqs, max_blocks_per_seq, device)
    proposer = build_proposer(plan.config, plan.policy, model, kv_cache, sampler, plan.draft, draft_cache, bufs)
    return Speculator(plan.policy, proposer, [draft_cache] if draft_cache is not None else [])
