"""Split GGUF files (llama.cpp's gguf-split layout: NAME-00001-of-0000N.gguf, the metadata in the
first part, split.no / split.count / split.tensors.count in each), written by the gguf package's
own writer as convert_hf_to_gguf.py --split-max-tensors writes them: loaded from the first part
with the same logits as the same model in one file, refused with the first part named when a later
part is given or a part is missing, cached as one model, and served by the models directory as one."""
from __future__ import annotations

import shutil

import pytest
import torch

from ridge.daemon.frontend.model_files import read_facts
from ridge.daemon.frontend.registry import scan
from ridge.models.loader import load_model
from ridge.models.oneshot import prompt_logits
from ridge.quant.errors import ModelLoadError
from ridge.quant.gguf_header import read_header
from ridge.quant.store import cache_key
from tiny_models import random_state_dict, tiny_config, write_gguf

PROMPT = [1, 40, 71, 200, 33, 5, 90, 12, 140, 7, 260, 3, 88]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("split")
    cfg = tiny_config("llama")
    sd = random_state_dict(cfg, seed=3)
    (tmp / "whole").mkdir()
    (tmp / "split").mkdir()
    whole = write_gguf(tmp / "whole" / "tiny-Q8_0.gguf", cfg, sd, "Q8_0")
    first = write_gguf(tmp / "split" / "tiny-Q8_0.gguf", cfg, sd, "Q8_0", split_max_tensors=8)
    return whole, first


def test_the_parts_are_llama_cpps_layout(files):
    _, first = files
    parts = sorted(first.parent.iterdir())
    assert [p.name for p in parts] == [f"tiny-Q8_0-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    heads = [read_header(p) for p in parts]
    assert [(h.values["split.no"], h.values["split.count"]) for h in heads] == [(0, 3), (1, 3), (2, 3)]
    assert sum(h.tensor_count for h in heads) == heads[0].values["split.tensors.count"]
    assert "general.architecture" in heads[0].values and "general.architecture" not in heads[1].values


@pytest.mark.parametrize("weights", ["fp32", "fp8"])
def test_a_split_gguf_gives_the_logits_of_the_whole_file(files, weights):
    whole, first = files
    want = prompt_logits(load_model(whole, device="cpu", weights=weights, use_cache=False).model, PROMPT)
    got = prompt_logits(load_model(first, device="cpu", weights=weights, use_cache=False).model, PROMPT)
    assert torch.equal(got, want)


def test_a_later_part_or_a_missing_part_is_refused_by_name(files, tmp_path):
    _, first = files
    with pytest.raises(ModelLoadError, match="part 2 of a GGUF split in 3; give its first part, "
                                             "tiny-Q8_0-00001-of-00003.gguf"):
        load_model(first.with_name("tiny-Q8_0-00002-of-00003.gguf"), device="cpu", weights="fp32", use_cache=False)
    for p in first.parent.iterdir():
        if "-00003-of-" not in p.name:
            shutil.copy(p, tmp_path / p.name)
    with pytest.raises(ModelLoadError, match="tiny-Q8_0-00003-of-00003.gguf.*no such file: part 3 of 3"):
        load_model(tmp_path / first.name, device="cpu", weights="fp32", use_cache=False)
    # a part renamed out of the layout: its name and its count disagree
    (tmp_path / first.name).rename(tmp_path / "tiny.gguf")
    with pytest.raises(ModelLoadError, match="not named as llama.cpp names the parts"):
        load_model(tmp_path / "tiny.gguf", device="cpu", weights="fp32", use_cache=False)


def test_every_part_keys_the_converted_cache_and_the_directory_serves_one_model(files, tmp_path):
    _, first = files
    for p in first.parent.iterdir():
        shutil.copy(p, tmp_path / p.name)
    key = cache_key(tmp_path / first.name, {})
    last = tmp_path / "tiny-Q8_0-00003-of-00003.gguf"
    last.write_bytes(last.read_bytes())  # rewritten: a new mtime, the same name
    assert cache_key(tmp_path / first.name, {}) != key
    models = scan(tmp_path)
    assert list(models) == ["tiny"] and models["tiny"].path == str(tmp_path / first.name)
    size = sum(p.stat().st_size for p in tmp_path.iterdir())  # what `ridge models` and /api/tags show
    assert models["tiny"].disk()[0] == size and read_facts(str(tmp_path / first.name))[1].size == size


def test_ridge_pull_fetches_every_part_and_the_pulled_model_runs(files, tmp_path, monkeypatch):
    """A quantization tag that names a split GGUF pulls all its parts (from a local server in the Hub's
    layout, tests/test_pull.py's); the first part is the model, with the whole file's logits."""
    from ridge.daemon.pull import plan, pull
    from test_pull import Hub

    whole, first = files
    hub = Hub()
    hub.repos["acme/Tiny-GGUF"] = {**{p.name: p.read_bytes() for p in first.parent.iterdir()},
                                   "tiny-F16.gguf": whole.read_bytes()}
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    try:
        path = pull(plan("acme/Tiny-GGUF:Q8_0"), tmp_path / "models", lambda *_: None)
    finally:
        hub.shutdown()
    assert path == tmp_path / "models" / first.name
    assert sorted(p.name for p in path.parent.iterdir()) == sorted(p.name for p in first.parent.iterdir())
    assert list(scan(path.parent)) == ["tiny"]
    want = prompt_logits(load_model(whole, device="cpu", weights="fp32", use_cache=False).model, PROMPT)
    pulled = load_model(path, device="cpu", weights="fp32", use_cache=False)
    assert torch.equal(prompt_logits(pulled.model, PROMPT), want)
