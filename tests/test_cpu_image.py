"""A CPU start from the converted cache maps the weights in the products' layout (issue 39,
ridge/models/cpu_image.py): the first CPU load of an entry writes its image, later ones take
every packed weight from the image's mapping, compute the same logits bit for bit, and copy
nothing; an image that does not fit the model is refused by name, a missing or unreadable one
means packing again."""
from __future__ import annotations

import pytest
import torch

from ridge.kernels.cpu_linear import tiles_offered
from ridge.models.cpu_image import image_key
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.quant import store
from ridge.quant.linear import FP8Linear
from tiny_models import make_tiny

pytestmark = pytest.mark.skipif(not tiles_offered(), reason="ridge's e4m3 products are not built here")
IDS = [1, 40, 71, 200, 33, 5, 90, 12]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path


def _image_dir(lm):
    return store.cache_root() / image_key(lm.identity.split(":")[0])


@pytest.mark.parametrize("arch, fmt, tied", [("llama", "gguf", True), ("qwen2", "hf", False)])
def test_a_cached_start_maps_the_image_and_computes_the_same(cache, arch, fmt, tied):
    path, cfg, _ = make_tiny(cache, arch, fmt=fmt, tie_word_embeddings=tied)
    first = load_model(path, device="cpu", recipe="g16", show_progress=False)
    assert _image_dir(first).is_dir()  # written by the first CPU load of the entry
    want = prompt_logits(first.model, IDS)
    again = load_model(path, device="cpu", recipe="g16", show_progress=False)
    assert again.from_cache
    image = store.load(image_key(again.identity.split(":")[0]))[1]
    for name, m in again.model.named_modules():
        if isinstance(m, FP8Linear) and name != "lm_head":
            mapped = image[f"{name}.cpu_e4m3"]
            # The layer reads the image's own bytes: the same file, the same offset, no copy.
            assert m.cpu.packed.untyped_storage().nbytes() >= mapped.nbytes
            assert torch.equal(m.cpu.packed, mapped) and m.cpu.packed.data_ptr() != 0
    head = again.model.lm_head.cpu
    assert head.code == "i8" and torch.equal(head.packed, image["lm_head.cpu_i8"])
    assert (again.model.embed_tokens.cpu is head) == tied
    torch.testing.assert_close(prompt_logits(again.model, IDS), want, rtol=0, atol=0)
    assert again.weight_bytes == first.weight_bytes


def test_the_image_is_a_mapping_not_a_copy(cache):
    """Two loads of the same image share the page cache's pages: their packed weights are views
    of a file mapping (safetensors maps it), so a load's anonymous memory does not grow with the
    weights (tensors under store.MAPPED_MIN_BYTES are copied out, as the converted cache's are)."""
    path, _, _ = make_tiny(cache, "llama", hidden_size=512, intermediate_size=1536)
    load_model(path, device="cpu", recipe="g16", show_progress=False)
    lm = load_model(path, device="cpu", recipe="g16", show_progress=False)
    qkv = lm.model.layers[0].gate_up_proj.cpu.packed  # 1.5 MiB: mapped (store.MAPPED_MIN_BYTES)
    maps = open("/proc/self/maps").read().splitlines()
    addr = qkv.untyped_storage().data_ptr()
    owner = [ln for ln in maps if int(ln.split("-")[0], 16) <= addr < int(ln.split()[0].split("-")[1], 16)]
    assert owner and image_key(lm.identity.split(":")[0]) in owner[0], owner


def test_an_image_that_does_not_fit_is_refused_by_name_and_a_broken_one_repacked(cache):
    path, _, _ = make_tiny(cache, "llama")
    first = load_model(path, device="cpu", recipe="g16", show_progress=False)
    d = _image_dir(first)
    # A layer's shard replaced by one of another shape: the load names the layer.
    from safetensors.torch import load_file, save_file

    shard = d / store.SHARD.format(1)
    t = load_file(str(shard))
    name = next(n for n in t if n.endswith(".cpu_e4m3"))
    t[name] = torch.zeros((1, 2, 16, 2), dtype=torch.uint8)
    save_file(t, str(shard))
    with pytest.raises(ValueError, match=name.rsplit(".cpu_", 1)[0]):
        load_model(path, device="cpu", recipe="g16", show_progress=False)
    # An unreadable image is no image: the start packs from the converted cache, as the first did.
    shard.write_bytes(b"not a safetensors file")
    lm = load_model(path, device="cpu", recipe="g16", show_progress=False)
    torch.testing.assert_close(prompt_logits(lm.model, IDS), prompt_logits(first.model, IDS), rtol=0, atol=0)


def test_no_image_without_the_cache_or_for_unquantized_weights(cache):
    path, _, _ = make_tiny(cache, "llama")
    load_model(path, device="cpu", recipe="g16", use_cache=False, show_progress=False)
    load_model(path, device="cpu", weights="bf16", show_progress=False)
    assert not list(store.cache_root().glob("*-cpu*"))
    load_model(path, device="cpu", recipe="g16", show_progress=False)
    assert len(list(store.cache_root().glob("*-cpu*"))) == 1
