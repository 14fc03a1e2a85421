"""The engine's KV tiers (ridge/cache/tiers.py) from its options: their sizes,
and the disk key that keeps every model's blocks apart."""
from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import psutil

from ridge.cache.block_hash import DIGEST_BYTES
from ridge.cache.block_io import BlockLayout
from ridge.cache.disk_tier import VERSION, DiskTier, kv_root
from ridge.cache.tiers import KVTiers
from ridge.kernels.ops import FP8_KV_FORMAT

log = logging.getLogger("ridge.engine")
GIB = 1 << 30
HOST_FRACTION, HOST_CAP_GIB = 0.25, 8.0  # of the free RAM at start
DISK_FRACTION, DISK_CAP_GIB = 0.10, 32.0  # of the free space where the tier lives
LAYOUT = 1  # the block row's layout (cache/block_io.py): bump when it changes


def host_bytes(config) -> int:
    if config.kv_host_gib is not None:
        return int(config.kv_host_gib * GIB)
    return int(min(HOST_FRACTION * psutil.virtual_memory().available, HOST_CAP_GIB * GIB))


def disk_bytes(config, root: Path) -> int:
    if config.kv_disk_gib is not None:
        return int(config.kv_disk_gib * GIB)
    where = next((p for p in [root, *root.parents] if p.exists()), Path("/"))
    return int(min(DISK_FRACTION * shutil.disk_usage(where).free, DISK_CAP_GIB * GIB))


def disk_key(loaded, draft, kv_dtype: str, block_size: int, block_bytes: int) -> tuple[str, dict]:
    """-> (directory name, what it names). Everything a block's bytes depend on: the weights
    (the converted model's store key: its file, the quantizer's version and options), the
    device type and compute dtype they run in, a draft model's, the KV dtype and block size,
    and the row layout; and how block hashes are made (their key is in the folder: disk_tier.py)."""
    describe = {
        "model": loaded.identity, "model_path": str(loaded.path),
        "weight_dtype": str(loaded.model.embed_tokens.weight.dtype), "device": loaded.device.type,
        "draft": draft.identity if draft is not None else None,
        "kv_dtype": kv_dtype, "block_size": block_size, "block_bytes": block_bytes,
        "layout": LAYOUT, "file_version": VERSION, "block_hash": f"keyed blake2b-{8 * DIGEST_BYTES}",
        **({"fp8_kv": FP8_KV_FORMAT} if kv_dtype == "fp8" else {}),  # what an FP8 block's bytes hold
    }
    key = hashlib.sha256(json.dumps(describe, sort_keys=True).encode()).hexdigest()[:24]
    return key, describe


def build_tiers(config, loaded, draft, caches: list, kv_dtype: str) -> KVTiers | None:
    """None when prefix caching is off, or both tiers are, or the model has sliding layers:
    a sliding group's blocks leave the device behind the window, long before the full
    group's, so a tier block of the full layers alone could never serve a hit; the prefix
    cache of such a model lives on the device (cache/manager.py)."""
    if not config.enable_prefix_caching:
        return None
    if loaded.config.linear_layers:  # a hit needs its state checkpoint too, which only the device holds (engine/hybrid.py)
        return None
    if any(g.window is not None for g in loaded.config.kv_groups()):
        log.info("KV tiers off: the model has sliding-window layers, whose prefix cache stays on the device")
        return None
    disk = None
    if config.kv_disk:
        root = Path(config.kv_disk_dir).expanduser() if config.kv_disk_dir else kv_root()
        cap = disk_bytes(config, root)
        if cap > 0:
            block_bytes = BlockLayout(caches).block_bytes
            key, describe = disk_key(loaded, draft, kv_dtype, config.block_size, block_bytes)
            disk = DiskTier(root, key, describe, cap, block_bytes)
    tiers = KVTiers(caches, host_bytes(config), disk)
    if not tiers.enabled:
        tiers.close()
        return None
    return tiers
