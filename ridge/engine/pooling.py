"""Embedding models: which pooling a model's metadata names, the pooled state a
prompt's prefill leaves (its last token's, or the mean over all of them,
summed chunk by chunk), and the embedding made of it.

An embedding request is a prefill whose KV is dropped: it takes no prefix-cache
hits (the mean needs every token's state, and a hit skips them) and publishes
no blocks (scheduler.py), and its blocks return to the pool when it ends."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ridge.quant.errors import ModelLoadError

from .output import RequestOutput
from .request import FinishReason

POOLINGS = ("last", "mean", "rank")  # rank: a reranker, its last token's state judged by its head (rerank.py)
PRESERVE = ("Transformer", "Pooling", "Normalize")  # sentence-transformers modules whose math ridge runs
# llama.cpp's enum llama_pooling_type, as GGUF's {arch}.pooling_type holds it.
GGUF_POOLING = {0: None, 1: "mean", 2: "cls", 3: "last", 4: "rank"}
ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


def resolve_pooling(option: str, path) -> str | None:
    """The `--pooling` option (auto: the model's own metadata) -> last, mean, rank, or None (a
    model that generates)."""
    if option == "none":
        return None
    if option in POOLINGS:
        return option
    return model_pooling(path)


def model_pooling(path) -> str | None:
    """What the model's metadata says: sentence-transformers' modules.json and its Pooling
    module's config.json in an HF directory, {arch}.pooling_type in a GGUF file. None: no
    pooling named (a generative model)."""
    p = Path(path)
    if p.is_dir():
        return _sentence_transformers(p)
    if p.suffix == ".gguf":
        return _gguf(p)
    return None


def _sentence_transformers(d: Path) -> str | None:
    modules = d / "modules.json"
    if not modules.exists():
        return None
    mods = json.loads(modules.read_text())
    for m in mods:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind not in PRESERVE:  # a Dense projection, say: its weights would change the embedding
            raise ModelLoadError(d, f"modules.json: the {kind} module ({m.get('path')}) is not one ridge runs")
    pool = next((m for m in mods if str(m.get("type", "")).endswith("Pooling")), None)
    if pool is None:
        return None
    cfg_path = d / str(pool.get("path", "1_Pooling")) / "config.json"
    cfg = json.loads(cfg_path.read_text())
    on = [k for k, v in cfg.items() if k.startswith("pooling_mode_") and v]
    if len(on) != 1 or on[0] not in ST_MODES:
        raise ModelLoadError(d, f"{cfg_path.relative_to(d)}: pooling {', '.join(on) or 'none'}; ridge pools by "
                                f"{' or '.join(ST_MODES)}")
    if cfg.get("include_prompt", True) is False:
        raise ModelLoadError(d, f"{cfg_path.relative_to(d)}: include_prompt false is not one ridge runs")
    return ST_MODES[on[0]]


def _gguf(path: Path) -> str | None:
    from ridge.quant.gguf_loader import _field, open_gguf

    reader = open_gguf(path)
    arch = _field(reader, "general.architecture")
    value = _field(reader, f"{arch}.pooling_type")
    if value is None:
        return None
    kind = GGUF_POOLING.get(int(value), "unknown")
    if kind is not None and kind not in POOLINGS:
        raise ModelLoadError(path, f"{arch}.pooling_type = {int(value)} ({kind}); ridge pools by last or mean, "
                                   "or ranks")
    return kind


def pool_step(out, last_row: dict, hidden: torch.Tensor) -> None:
    """After a step's forward: each embedding request's share of the pooled state (runner.py).
    A chunk from position 0 starts the sum again: a request preempted is recomputed whole. Only
    prompt rows count: an overlapped step may feed the request its sample before it is read."""
    for s in out.scheduled:
        r = s.request
        if r.embed_pooling is None:
            continue
        first = last_row[id(s)] + 1 - s.num_scheduled_tokens  # the row of position s.start
        rows = min(s.start + s.num_scheduled_tokens, r.num_prompt_tokens) - s.start  # prompt rows this step
        if rows <= 0:
            continue
        if r.embed_pooling == "mean":
            part = hidden[first:first + rows].float().sum(0)
            r.pooled = part if s.start == 0 or r.pooled is None else r.pooled + part
        elif s.start + rows == r.num_prompt_tokens:  # a copy: a graph's output buffer is rewritten next step
            r.pooled = hidden[first + rows - 1].float().clone()


def embeddings(group: list, dimensions: int | None) -> list[list[float]]:
    """The requests' pooled states -> unit vectors, cut to `dimensions` first (Matryoshka)."""
    vecs = torch.stack([r.pooled / (r.num_prompt_tokens if r.embed_pooling == "mean" else 1) for r in group]).cpu()
    if dimensions is not None:
        vecs = vecs[:, :dimensions]
    return torch.nn.functional.normalize(vecs, dim=-1).tolist()


def kind_of(pooling: str | None) -> str:
    """What a model answers (docs/protocol.md §3.10's `kind`): generate, embed or rerank."""
    return "generate" if pooling is None else "rerank" if pooling == "rank" else "embed"


def pooled_output(request_id: str, group: list, dimensions: int | None, rank=None) -> RequestOutput:
    """One output for the inputs of an embedding request, once every one has finished: the
    embeddings (rank: a reranker's scores, rank(pooled states [N, H]) -> N floats), or the first
    failure (abort, error) among them."""
    prompt = sum(r.num_prompt_tokens for r in group)
    bad = next((r for r in group if r.finish_reason not in (FinishReason.LENGTH, FinishReason.STOP)), None)
    if bad is not None:
        return RequestOutput(request_id, 0, [], "", True, str(bad.finish_reason), bad.error, num_prompt_tokens=prompt)
    if rank is not None:
        return RequestOutput(request_id, 0, [], "", True, "stop", None, num_prompt_tokens=prompt,
                             scores=rank(torch.stack([r.pooled for r in group])))
    return RequestOutput(request_id, 0, [], "", True, "stop", None, num_prompt_tokens=prompt,
                         embeddings=embeddings(group, dimensions))
