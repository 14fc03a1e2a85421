"""The pure-Python byte count `ridge plan` and the memory planner use against the
tensors the cache really allocates."""
import pytest

from ridge.cache.kv_cache import KV_DTYPES, KVCache
from ridge.config import KV_DTYPE_BYTES, kv_bytes_per_token
from tiny_models import tiny_config


def test_every_cache_dtype_is_counted():
    assert set(KV_DTYPES) == set(KV_DTYPE_BYTES)


@pytest.mark.parametrize("name", list(KV_DTYPES))
def test_bytes_per_token_is_what_the_cache_allocates(name):
    cfg = tiny_config(num_layers=3, num_kv_heads=2, head_dim=16)
    cache = KVCache(cfg, num_blocks=5, block_size=4, dtype_name=name)
    tensors = [t for layer in cache.layers for t in (layer.k, layer.v, layer.k_scale, layer.v_scale) if t is not None]
    allocated = sum(t.numel() * t.element_size() for t in tensors)
    assert cache.total_bytes == allocated == kv_bytes_per_token(cfg, name) * 5 * 4


def test_unknown_kv_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown KV dtype"):
        kv_bytes_per_token(tiny_config(), "int4")
