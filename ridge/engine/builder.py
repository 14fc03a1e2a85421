"""The engine's first part: everything an EngineCore steps with, built once from an EngineConfig
(and a model already loaded, when the daemon parks and restores one).

The order is the dependencies': the model, the step budget its ridge point gives, the CPU
formats that budget picks, the speculation plan, a forward at the largest step (the activation
peak), the memory plan that sizes the KV pool (and a hybrid model's state slots) from what is
left, the caches, then the runner with its hooks (sampler, speculator, constraints, pooling,
state slots) handed in, the scheduler and the KV tiers. Nothing here runs a request."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ridge.cache.kv_cache import KVCache
from ridge.cache.manager import KVCacheManager
from ridge.cache.state_cache import StateCheckpoints, StateSlots
from ridge.config import draft_table_mismatch
from ridge.kernels import native, ops
from ridge.models.loader import LoadedModel, load_model

from .budget import default_token_budget, pooled_token_budget
from .config import EngineConfig
from .cpu_format import CpuFormats, choose_cpu_format, fp8_max_tokens, invariant_unavailable, keep_freed_memory
from .encoder import EncoderStep
from .hybrid import hybrid_config
from .kv_tiers import build_tiers
from .pooling import resolve_pooling
from .rerank import judged_tokens
from .runner import ModelRunner
from .sampler import Sampler
from .scheduler import Scheduler, SchedulerConfig
from .sizing import cache_budget, measure_activation_peak, plan_memory
from .speculative import build_speculator, plan_speculation
from .structured import Constraints
from .threads import ThreadGovernor

log = logging.getLogger("ridge.engine")
CUDA_HOST_THREADS = 4  # torch CPU threads of a GPU engine unless --threads says otherwise
# A hybrid model's prefix cache: state checkpoints at block boundaries, this many per request in
# flight (each a whole recurrent state: cache/state_cache.py), least recently used evicted.
STATE_CHECKPOINTS_PER_SEQ = 4


@dataclass(eq=False)
class EngineParts:
    """What build_engine made: the EngineCore's attributes, each built once."""
    config: EngineConfig  # as the model resolved it (a hybrid's refusals applied)
    loaded: LoadedModel
    model: torch.nn.Module
    tokenizer: object
    device: torch.device
    max_model_len: int
    kv_dtype: str
    hybrid_refusals: list
    thread_governor: ThreadGovernor | None
    pooling: str | None  # last, mean or rank for an embedding model; None if it generates
    sched_config: SchedulerConfig
    budget_info: dict  # the ridge point, T* and the chunk: how the step budget was chosen
    deterministic: bool
    invariant_reason: str | None  # why batch-invariant steps are unavailable here (None: they are)
    lowp_max_tokens: int
    cpu_formats: CpuFormats
    fp8_max_tokens: int
    memory: object  # sizing.MemoryPlan
    kv_cache: KVCache
    kv_cache_manager: KVCacheManager
    state_slots: StateSlots | None
    state_checkpoints: StateCheckpoints | None
    runner: ModelRunner
    speculator: object  # speculative.Speculator, or None
    constraints: Constraints
    judged: object  # a reranker's judged tokens (rerank.py), or None
    scheduler: Scheduler
    tiers: object  # kv_tiers' host and disk tiers, or None
    async_scheduling: bool


def build_engine(config: EngineConfig | None = None, loaded: LoadedModel | None = None) -> EngineParts:
    config = config or EngineConfig()
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    device = loaded.device.type if loaded else config.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        native.start_build()  # ridge's CPU kernels compile (first start) while the model loads
    if loaded is None:
        loaded = load_model(config.model, device=config.device, max_model_len=config.max_model_len,
                            weights=config.weights, recipe=config.fp8_recipe, mmproj=config.mmproj)
        # ridge bench loading --model reads this line: the load apart from the process's start
        log.info("weights loaded in %.2f s (%s)", loaded.load_seconds,
                 "from the converted cache" if loaded.from_cache else "converted from the source")
    model, device = loaded.model, loaded.device
    # A hybrid model runs without what its recurrent state does not support yet (hybrid.py).
    config, refusals = hybrid_config(config, loaded.config)
    if device.type == "cuda" and not config.num_threads:
        # The host only plans steps and samples small tensors: torch's default of
        # one intra-op thread per core kept 10-15 cores busy for nothing.
        torch.set_num_threads(min(CUDA_HOST_THREADS, os.cpu_count() or 1))
    max_model_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
    kv_dtype = config.resolved_kv_dtype(device)
    if device.type == "cpu":
        keep_freed_memory()
    governor = ThreadGovernor(torch.get_num_threads()) if device.type == "cpu" and config.adaptive_threads else None
    pooling = resolve_pooling(config.pooling, loaded.path)
    sched_config, budget_info = plan_budget(config, loaded, max_model_len, pooling)
    budget = sched_config.max_num_batched_tokens
    invariant_reason = invariant_unavailable(device)
    if config.deterministic and invariant_reason:
        raise ValueError(f"--deterministic: {invariant_reason}")
    spec = plan_speculation(config.speculative_config, device, config.weights, max_model_len,
                            loaded.tokenizer, budget_info["knee_tokens"], model, loaded.path)
    head_rows = min(budget, config.max_num_seqs * (1 + (config.num_speculative_tokens if spec is not None else 0)))
    # A deterministic engine runs every step batch-invariant: the fastest formats by step size are never used.
    lowp_max_tokens = 0 if config.deterministic else choose_cpu_format(
        model, loaded.weight_bytes, config.cpu_weight_format, budget, head_rows, config.cpu_amx)
    cpu_formats = CpuFormats(model, budget, head_rows, config.deterministic)
    draft = spec.draft if spec is not None else None
    if draft is not None and (why := draft_table_mismatch(loaded.config, draft.config)):
        raise ValueError(f"the draft model {draft.path.name}: {why}")
    if draft is not None and draft.config.linear_layers:  # its states would need slots and rollback of their own
        raise ValueError(f"the draft model {draft.path.name}: a hybrid model (recurrent state) cannot draft yet")
    if draft is not None:  # the draft steps as often as the target: it gets the same CPU format
        choose_cpu_format(draft.model, draft.weight_bytes, config.cpu_weight_format, budget, head_rows,
                          config.cpu_amx)
    act = measure_activation_peak(lambda: profile_forward(loaded, sched_config, kv_dtype, config.max_num_seqs,
                                                          max_model_len), device)
    room = cache_budget(device, act, gpu_reserve_gib=config.gpu_reserve_gib, cpu_kv_cap_gib=config.cpu_kv_cap_gib,
                        kv_memory_gib=config.kv_memory_gib)
    state_slots, state_checkpoints = state_pools(config, loaded, spec is not None, room)
    # (the pools define __len__: an empty one is falsy, so `is not None`)
    state_pool = (state_slots.pool_size if state_slots is not None else 0) + \
        (state_checkpoints.count if state_checkpoints is not None else 0)
    memory = plan_memory(loaded.config, kv_dtype, config.block_size, device,
                         loaded.weight_bytes + (spec.weight_bytes if spec else 0), act,
                         gpu_reserve_gib=config.gpu_reserve_gib, cpu_kv_cap_gib=config.cpu_kv_cap_gib,
                         kv_memory_gib=config.kv_memory_gib, num_blocks=config.num_kv_blocks,
                         max_model_len=max_model_len, max_num_seqs=config.max_num_seqs,
                         max_num_batched_tokens=budget,
                         extra_bytes_per_token=spec.kv_bytes_per_token(kv_dtype) if spec else 0,
                         state_bytes=state_pool * loaded.config.state_bytes_per_request())
    blocks = memory.group_blocks  # one pool per KV group (cache/manager.py)
    kv_cache = KVCache(loaded.config, blocks, config.block_size, kv_dtype, device, num_state_slots=state_pool)
    kv_cache_manager = KVCacheManager(None, config.block_size, config.enable_prefix_caching, groups=[
        (g.window, n) for g, n in zip(loaded.config.kv_groups(), blocks)])
    # The runner's hooks (runner.py): the speculator's proposer shares its sampler (a seeded
    # request draws from one generator), so the sampler comes first.
    sampler = Sampler()
    speculator = build_speculator(spec, model, kv_cache, sampler, budget, config.max_num_seqs,
                                  -(-max_model_len // config.block_size)) if spec is not None else None
    constraints = Constraints(loaded.tokenizer, loaded.config.vocab_size)
    runner = ModelRunner(model, kv_cache, config.max_num_seqs, max_model_len, config.cuda_graph, budget,
                         sampler=sampler, speculator=speculator, constraints=constraints,
                         pooling=pooling is not None, state_slots=state_slots, state_checkpoints=state_checkpoints,
                         encoder=EncoderStep(loaded.vision) if loaded.vision is not None else None)
    scheduler = Scheduler(sched_config, kv_cache_manager, speculator, state_slots, state_checkpoints)
    caches = [kv_cache] + (speculator.caches if speculator else [])  # what the block ids index
    tiers = build_tiers(config, loaded, draft, caches, kv_dtype)
    if tiers is not None:
        kv_cache_manager.attach_tiers(tiers)
    # Overlap needs the device to run apart from the host: on CPU both are the same
    # cores, so a step would only finish later. Drafting reads the last token on the host.
    overlap = config.async_scheduling if config.async_scheduling is not None else device.type == "cuda"
    return EngineParts(
        config=config, loaded=loaded, model=model, tokenizer=loaded.tokenizer, device=device,
        max_model_len=max_model_len, kv_dtype=kv_dtype, hybrid_refusals=refusals, thread_governor=governor,
        pooling=pooling, sched_config=sched_config, budget_info=budget_info, deterministic=config.deterministic,
        invariant_reason=invariant_reason, lowp_max_tokens=lowp_max_tokens, cpu_formats=cpu_formats,
        fp8_max_tokens=fp8_max_tokens(model), memory=memory, kv_cache=kv_cache, kv_cache_manager=kv_cache_manager,
        state_slots=state_slots, state_checkpoints=state_checkpoints, runner=runner, speculator=speculator,
        constraints=constraints, judged=judged_tokens(loaded.tokenizer, loaded.path) if pooling == "rank" else None,
        scheduler=scheduler, tiers=tiers, async_scheduling=overlap and speculator is None)


def plan_budget(c: EngineConfig, loaded: LoadedModel, max_model_len: int,
                pooling: str | None) -> tuple[SchedulerConfig, dict]:
    """The step budget from the device's ridge point (budget.py) -> (scheduler config, how it was chosen)."""
    fp8 = ops.keeps_fp8(loaded.device) and loaded.weights == "fp8"
    b = 1 if fp8 else loaded.model.dtype.itemsize
    mc = loaded.config  # a mixture of experts' chunk grows by E / k (engine/budget.py)
    experts = (mc.num_experts, mc.num_experts_per_tok) if mc.num_experts else None
    chunk, info = default_token_budget(loaded.device, b, fp8, c.ridge_point, experts)
    chunk = c.prefill_chunk or chunk
    # An embedding engine's step is sized for whole prefills, a generating one's for its decodes' latency.
    step = c.max_num_seqs + chunk
    if pooling is not None:
        chunk = step = c.prefill_chunk or pooled_token_budget(chunk, c.max_num_seqs)
    if mc.image_attention_bidirectional and loaded.vision is not None:
        # an image whose tokens see each other both ways goes into one step whole: the step holds
        # the longest (Gemma 3's 256 tokens a picture, Gemma 4's patch budget), as vLLM sizes its
        # batch for the largest multimodal item
        longest = longest_image_run(loaded)
        if longest > step:
            log.info("step budget raised from %d to %d tokens: an image's run goes into one step", step, longest)
            step = longest
    sched = SchedulerConfig(max_num_seqs=c.max_num_seqs, max_num_batched_tokens=step,
                            long_prefill_token_threshold=chunk, block_size=c.block_size, max_model_len=max_model_len,
                            whole_image_runs=mc.image_attention_bidirectional)
    info["prefill_chunk"] = chunk
    log.info("step budget: ridge point %.1f FLOP/B (%s), T* = %.1f tokens, prefill chunk %d, %d tokens per step",
             info["ridge_point"], info["ridge_source"], info["knee_tokens"], chunk, step)
    return sched, info


def longest_image_run(loaded: LoadedModel) -> int:
    """The most placeholder tokens one image takes in a row, by the model's prompt rule (its
    directory's processor files, or its projector file); 0 where it has none."""
    from ridge.models.mmproj import mmproj_prompt_rules
    from ridge.vision.prompt import read_prompt_rules

    if loaded.mmproj is not None:
        rules = mmproj_prompt_rules(loaded.mmproj, loaded.tokenizer.backend.token_to_id)
    else:
        rules = read_prompt_rules(loaded.path)
    return getattr(rules, "longest_run", 0) if rules is not None else 0


def state_pools(config: EngineConfig, loaded: LoadedModel, speculating: bool, room: int) \
        -> tuple[StateSlots | None, StateCheckpoints | None]:
    """A hybrid model's state slots (cache/state_cache.py): one per request in flight, with
    speculation one per draft each to roll back to, and with prefix caching the checkpoints
    (STATE_CHECKPOINTS_PER_SEQ per request in flight, fewer where they would take more than half
    of the caches' room: checkpoints only save prefill, the KV pool holds what runs); none for a
    model without linear layers."""
    if not loaded.config.linear_layers:
        return None, None
    slots = StateSlots(config.max_num_seqs, config.num_speculative_tokens if speculating else 0)
    if not config.enable_prefix_caching:
        return slots, None
    want = STATE_CHECKPOINTS_PER_SEQ * config.max_num_seqs
    fit = room // 2 // loaded.config.state_bytes_per_request() - slots.pool_size
    count = max(1, min(want, fit))
    if count < want:
        log.info("state checkpoints: %d, not %d: %d requests' states (%.1f MiB each) and their checkpoints take at "
                 "most half of the %.2f GiB for the caches", count, want, config.max_num_seqs,
                 loaded.config.state_bytes_per_request() / 2**20, room / 2**30)
    return slots, StateCheckpoints(slots.pool_size, count)


def profile_forward(loaded: LoadedModel, sched: SchedulerConfig, kv_dtype: str, max_num_seqs: int,
                    max_model_len: int) -> None:
    """One forward pass at the largest step, into a scratch cache."""
    from ridge.kernels.metadata import AttentionMetadata
    n, bs, device = sched.max_num_batched_tokens, sched.block_size, loaded.device
    scratch = KVCache(loaded.config, -(-n // bs), bs, kv_dtype, device)
    meta = AttentionMetadata.build([n], [n], [list(range(-(-n // bs)))], list(range(n)), device)
    ids = torch.zeros(n, dtype=torch.long, device=device)
    hidden = loaded.model(ids, torch.arange(n, device=device) % max_model_len, meta, scratch.layers)
    loaded.model.compute_logits(hidden[:max_num_seqs])
    del scratch
