"""What an engine turns off for a hybrid model (recurrent layers beside attention: Qwen3.5's Gated
DeltaNet, LFM2's short convolutions).

ridge never runs a feature approximately. Two do not hold yet for a recurrent state:
- the KV tiers (host RAM, disk) hold prefix blocks, but not the state checkpoints a hybrid's
  prefix hit also needs (cache/state_cache.py StateCheckpoints): the prefix cache of a hybrid
  lives on the device;
- self-drafting (self:L, and auto, which drafts with the target's first layers) would run the
  target's linear layers on drafts, advancing the states the verification then reads.
Each is refused by name at start (logged) and the engine runs with it off, rather than failing.
Prefix caching on the device holds (a hit is cut back to its last checkpointed block), and so
does speculation by n-grams or a draft model: a verified span keeps the state after each token,
and a rejection rolls the request's state back to its last accepted token
(ModelRunner.restore_states)."""
from __future__ import annotations

import dataclasses
import logging

from ridge.config import ModelConfig

log = logging.getLogger("ridge.engine")

TIERS_REFUSAL = "KV tiers: hybrid models' state checkpoints (recurrent layers) are not held in host RAM or on disk"
SPECULATIVE_REFUSAL = ("speculative decoding by self-drafting: hybrid models (recurrent state) would advance "
                       "their states on drafts")
SELF_DRAFTING = ("self", "auto")


def hybrid_config(config, cfg: ModelConfig):
    """-> (the EngineConfig to run cfg with, the refusals logged): config itself for a model without
    linear-attention layers; else a copy with the KV tiers and self-drafting off where they were on."""
    if not cfg.linear_layers:
        return config, []
    off, refused = {}, []
    if config.enable_prefix_caching and (config.kv_disk or config.kv_host_gib != 0):
        off.update(kv_disk=False, kv_host_gib=0)
        refused.append(TIERS_REFUSAL)
    if config.speculative_config.method in SELF_DRAFTING:
        off["speculative"] = "off"
        refused.append(f"{SPECULATIVE_REFUSAL} (--speculative {config.speculative})")
    for why in refused:
        log.warning("%s: %s; running without it", cfg.name or cfg.arch, why)
    return (dataclasses.replace(config, **off) if off else config), refused
