"""The engine's live figures, as plain data (the daemon's `stats` reply)."""
from __future__ import annotations

import logging
import time

import psutil
import torch

from ridge.cache.tiers import tier_stats
from ridge.quant.linear import FP8Linear

from .request import RequestStatus

log = logging.getLogger("ridge.engine")
WINDOW_S = 10.0


def _rates(history, now: float) -> tuple[float, float]:
    recent = [(t, p, d) for t, p, d in history if now - t <= WINDOW_S]
    if not recent:
        return 0.0, 0.0
    span = max(now - recent[0][0], 1e-3) if len(recent) > 1 else WINDOW_S
    return sum(p for _, p, _ in recent) / span, sum(d for _, _, d in recent) / span


_host: dict = {"host_total": 0, "host_available": 0, "host_rss": 0}  # the last figures read


def host_memory() -> dict:
    """The host's memory and this process's RSS, read from /proc. A read that fails (EMFILE, when
    clients hold every descriptor) keeps the last figures: a statistic is never worth a failed step."""
    try:
        vm = psutil.virtual_memory()
        _host.update(host_total=vm.total, host_available=vm.available, host_rss=psutil.Process().memory_info().rss)
    except OSError as e:
        if not _host.get("failed"):
            log.warning("reading the host's memory failed (%s); the last figures stand until a read works", e)
        _host["failed"] = True
    else:
        _host.pop("failed", None)
    return {k: _host[k] for k in ("host_total", "host_available", "host_rss")}


def memory_stats(engine) -> dict:
    m = engine.memory
    host = host_memory()
    out = {"device": m.device, "device_total": m.total_bytes, "weights": m.weight_bytes,
           "kv_pool": m.kv_pool_bytes, "activations": m.activation_bytes, "reserve": m.reserve_bytes, **host}
    if engine.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(engine.device)
        out["device_free"] = free
    else:
        out["device_free"] = host["host_available"]
    return out


def kv_tier_stats(engine) -> dict:
    """Per tier: device (the pool's prefix cache), host, disk; and the engine thread's
    time in tier work as a share of step time."""
    kv, w = engine.kv_cache_manager, engine.tier_wait
    out = tier_stats(engine.tiers)
    out["device"] = {"hits": kv.device_hits, "misses": kv.device_misses, "blocks": kv.pool.num_cached_blocks}
    out["step_wait"] = {"steps": w["steps"], "pct": 100 * w["busy_s"] / w["step_s"] if w["step_s"] else 0.0,
                        "max_pct": 100 * w["max_frac"]}
    return out


def engine_stats(engine) -> dict:
    now = time.monotonic()
    sched, kv = engine.scheduler, engine.kv_cache_manager
    prefill_tps, decode_tps = _rates(engine.history, now)
    reserved, filled = engine.kv_waste()
    return {
        "uptime": now - engine.started,
        "running": len(sched.running),
        "waiting": len(sched.waiting) - sched.num_preempted_waiting,
        "preempted": sched.num_preempted_waiting,
        "loading": len(sched.loading),
        "num_preemptions": sched.num_preemptions,
        "kv_blocks_total": kv.num_blocks,
        "kv_blocks_used": kv.num_used_blocks,
        "kv_blocks_free": kv.num_free_blocks,
        "kv_blocks_cached": kv.pool.num_cached_blocks,
        "kv_groups": [{"window": g.window, "blocks": g.pool.num_blocks,
                       "used": g.pool.num_blocks - g.pool.num_free_blocks, "cached": g.pool.num_cached_blocks}
                      for g in kv.groups],
        "kv_block_size": engine.config.block_size,
        "kv_dtype": engine.kv_dtype,
        "kv_bytes_per_token": engine.memory.kv_bytes_per_token,
        "kv_slots_reserved": reserved,
        "kv_slots_filled": filled,
        "prefix_hit_rate": kv.prefix_hit_rate,
        "prefix_cache": {"queries": kv.prefix_queries, "hits": kv.prefix_hits},
        "kv_tiers": kv_tier_stats(engine),
        "prefill_tps": prefill_tps,
        "decode_tps": decode_tps,
        "totals": dict(engine.totals),
        **engine.metrics.as_dict(),
        "budget": dict(engine.budget_info),
        "speculative": {"proposer": engine.proposer_name,
                        **(engine.speculator.stats() if engine.speculator is not None else {})},
        "memory": memory_stats(engine),
        "requests": [
            {"id": r.client_id, "index": r.index, "state": RequestStatus(r.status).name.lower(),
             "age": now - r.timings.arrival, "prompt_tokens": r.num_prompt_tokens,
             "output_tokens": len(r.output_token_ids), "ttft": r.timings.ttft, "tps": r.timings.decode_tps}
            for r in list(sched.running) + sched.loading + list(sched.waiting)[:64]
        ],
    }


def model_info(engine) -> dict:
    """docs/protocol.md §7.1."""
    cfg, tok = engine.loaded.config, engine.tokenizer
    linears = [m for m in engine.model.modules() if isinstance(m, FP8Linear)]
    budget = engine.budget_info
    return {
        "name": cfg.name or engine.loaded.path.stem, "path": str(engine.loaded.path), "arch": cfg.arch,
        "mmproj": None if engine.loaded.mmproj is None else str(engine.loaded.mmproj),
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "num_heads": cfg.num_heads,
        "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "vocab_size": cfg.vocab_size,
        "max_model_len": engine.max_model_len,
        "fp8_weights": bool(linears) and all(m.is_fp8 for m in linears),
        "quantized": engine.loaded.weights == "fp8", "weights": engine.loaded.weights,
        "weight_dtype": str(engine.model.dtype).removeprefix("torch."),
        "kv_dtype": engine.kv_dtype, "block_size": engine.config.block_size, "num_kv_blocks": engine.kv_cache_manager.num_blocks,
        "ridge_point": float(budget.get("ridge_point", 0.0)), "ridge_source": str(budget.get("ridge_source", "")),
        "device": str(engine.device), "chat_template": tok.chat_template is not None,
        "eos_token_ids": list(tok.eos_token_ids), "bos_token_id": tok.bos_token_id,
        # what runs: the setting "head" on a checkpoint without a draft head speculates not at all
        "speculative": str(getattr(engine.config, "speculative", None) or "off") if engine.proposer_name != "off"
        else "off",
        "pooling": engine.pooling,  # last | mean: an embedding model (engine/pooling.py); None: it generates
    }
