"""From a SpeculativeConfig to the Speculator the engine runs, in the engine's build order:
plan_speculation before the KV cache is sized (a draft model's or the checkpoint's own draft
head's weights and KV count against memory; the policy once the knee is known),
build_speculator once the KV cache exists (the proposer, the drafter's cache and step buffers)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ridge.cache.kv_cache import KVCache
from ridge.config import kv_bytes_per_token

from ..step_batch import StepBuffers
from .assistant import AssistantProposer
from .config import SpeculativeConfig
from .mtp import MTPProposer
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
    """-> the draft model's LoadedModel, or None unless cfg names one (an assistant checkpoint is a
    head: load_head)."""
    from ridge.models.gemma4.assistant import is_assistant

    if cfg.method != "draft" or is_assistant(cfg.draft_path):
        return None
    from ridge.models.loader import load_model

    loaded = load_model(cfg.draft_path, device=device, weights=weights, max_model_len=max_model_len)
    check_same_tokenizer(tokenizer, loaded.tokenizer, cfg.draft_path)
    return loaded


def load_head(cfg: SpeculativeConfig, target_model, source, device, weights: str, max_model_len: int):
    """-> a draft head that reads the target's states: the checkpoint's own (Qwen3.5's MTP, under
    `head`, where the checkpoint at `source` has one), or Gemma 4's assistant named by draft:PATH;
    None otherwise. Its weights stay unquantized, in the compute dtype."""
    from ridge.kernels import ops
    from ridge.models.gemma4.assistant import is_assistant, load_assistant

    device = torch.device(device)
    dtype = torch.float32 if weights == "fp32" else ops.compute_dtype(device)
    if cfg.method == "draft" and is_assistant(cfg.draft_path):
        head = load_assistant(cfg.draft_path, target_model, device, dtype, max_model_len)
        if head.cfg.vocab_size != target_model.cfg.vocab_size:
            raise ValueError(f"{cfg.draft_path}: the assistant's vocabulary differs from the target's "
                             f"({head.cfg.vocab_size} vs {target_model.cfg.vocab_size} tokens)")
        return head
    if cfg.method != "head" or source is None:
        return None
    from ridge.models.qwen3_5.mtp import load_mtp

    return load_mtp(target_model, source, device, dtype)


def build_policy(cfg: SpeculativeConfig, knee_tokens: float, target_model, draft=None,
                 head=None) -> SpecPolicy | None:
    """The policy prices a draft pass against a target pass; None: no speculation."""
    layers = len(target_model.layers)
    if cfg.method == "off" or (cfg.method == "head" and head is None):
        return None
    if head is not None:  # a pass of the head's layers and of the logits' product per draft
        cost = (_linear_weights(head) + head.head_weights()) / max(_linear_weights(target_model), 1)
        return _paying(SpecPolicy(knee_tokens, cfg.max_k, cost), cfg, f"the draft head ({head.name})")
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
    return _paying(SpecPolicy(knee_tokens, cfg.max_k, cost), cfg, "the draft")


def _paying(policy: SpecPolicy, cfg: SpeculativeConfig, what: str) -> SpecPolicy | None:
    if not policy.can_pay():
        log.warning("--speculative %s: %s multiplies %.2fx the target's weights per token, so "
                    "drafting can never pay; speculation is off", cfg, what, policy.draft_cost)
        return None
    return policy


def auto_layers(num_layers: int) -> int:
    return max(1, num_layers // 4)


def build_proposer(cfg: SpeculativeConfig, policy: SpecPolicy | None, model, kv_cache, sampler,
                   draft=None, draft_cache=None, step_buffers=None, head=None):
    """-> the proposer, given everything it reads: the target and its cache (self-draft),
    the sampler (sampled drafts), the draft model or head, its cache and its own step buffers."""
    if policy is None:
        return None
    if cfg.method == "head":
        return MTPProposer(head, draft_cache, sampler)
    if head is not None:
        return AssistantProposer(head, kv_cache, sampler)
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
    """What speculation settles before the KV cache is sized: its policy, and the draft model or
    the checkpoint's draft head whose weights and KV count against memory (None: neither)."""
    config: SpeculativeConfig
    policy: SpecPolicy
    draft: object = None  # the draft model's LoadedModel
    head: object = None  # a draft head on the target's states (Qwen3.5's MTP, Gemma 4's assistant)

    @property
    def weight_bytes(self) -> int:
        if self.head is not None:
            return self.head.weight_bytes()
        return self.draft.weight_bytes if self.draft is not None else 0

    @property
    def drafter_config(self):
        """The ModelConfig of the drafter's own KV cache, or None where it has none."""
        return self.head.kv_config if self.head is not None else self.draft.config if self.draft is not None else None

    def kv_bytes_per_token(self, kv_dtype: str) -> int:
        """The drafter's KV per token: it lives in the target's blocks, so one pool accounts for both."""
        cfg = self.drafter_config
        return kv_bytes_per_token(cfg, kv_dtype) if cfg is not None else 0


def plan_speculation(cfg: SpeculativeConfig, device, weights, max_model_len: int, tokenizer, knee_tokens: float,
                     target_model, source=None) -> SpeculationPlan | None:
    """None: no speculation (off, no draft head in the checkpoint at `source`, or a drafter that
    can never pay)."""
    draft = load_draft(cfg, device, weights, max_model_len, tokenizer)
    head = load_head(cfg, target_model, source, device, weights, max_model_len)
    policy = build_policy(cfg, knee_tokens, target_model, draft, head)
    return None if policy is None else SpeculationPlan(cfg, policy, draft, head)


def build_speculator(plan: SpeculationPlan, model, kv_cache: KVCache, sampler, max_tokens: int, max_seqs: int,
                     max_blocks_per_seq: int) -> Speculator:
    """Once the target's KV cache exists: a draft model's own cache, indexed by the target's block
    ids, and its own step buffers (it plans every step's known tokens); then the proposer, which
    shares the runner's sampler (a seeded request draws from one generator)."""
    device = model.cos_sin.device
    draft_cache = bufs = None
    if plan.drafter_config is not None:
        draft_cache = KVCache(plan.drafter_config, kv_cache.num_blocks, kv_cache.block_size, kv_cache.dtype_name,
                              device)
    if plan.draft is not None:
        bufs = StepBuffers(max_tokens, max_seqs, max_blocks_per_seq, device)
    proposer = build_proposer(plan.config, plan.policy, model, kv_cache, sampler, plan.draft, draft_cache, bufs,
                              plan.head)
    return Speculator(plan.policy, proposer, [draft_cache] if draft_cache is not None else [])
