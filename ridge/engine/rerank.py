"""Rerankers that judge with their language-model head (Qwen3-Reranker): a query
and a document are written into the model's judging prompt, the prompt is one
prefill (pooled by its last token, as an embedding's: pooling.py, no KV kept),
and the score is the probability of "yes" against "no" as the next token:
softmax over those two logits at the prompt's last position.

The prompt and the tokens are Qwen3-Reranker's own (its model card's code): the
system line, `<Instruct>: … <Query>: … <Document>: …` as the user's turn, and
an assistant's turn opened with an empty thinking block. A model is a reranker
by its metadata (GGUF's `{arch}.pooling_type` = 4, llama.cpp's RANK) or by its
entry (`pooling = "rank"`)."""
from __future__ import annotations

import torch

from ridge.quant.errors import ModelLoadError

INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
PREFIX = ("<|im_start|>system\nJudge whether the Document meets the requirements based on the Query and the Instruct "
          "provided. Note that the answer can only be \"yes\" or \"no\".<|im_end|>\n<|im_start|>user\n")
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
YES, NO = "yes", "no"


def judged_tokens(tokenizer, path) -> tuple[int, int]:
    """-> (no id, yes id): the two tokens the score compares, each one token of the vocabulary
    (transformers' convert_tokens_to_ids). A vocabulary without them cannot be judged this way."""
    ids = [tokenizer.backend.token_to_id(t) for t in (NO, YES)]
    missing = [t for t, i in zip((NO, YES), ids) if i is None]
    if missing:
        raise ModelLoadError(path, f"pooling rank: the vocabulary has no token {missing[0]!r}, which a reranker's "
                                   "score reads (Qwen3-Reranker's yes/no)")
    return ids[0], ids[1]


def prompt_ids(tokenizer, query: str, document: str, instruction: str | None, limit: int) -> list[int]:
    """The judging prompt's tokens. As the model card's code does, the pair's text is cut from its end
    to leave room for the fixed prefix and suffix within `limit` tokens."""
    head = tokenizer.encode(PREFIX, add_special_tokens=False)
    tail = tokenizer.encode(SUFFIX, add_special_tokens=False)
    pair = tokenizer.encode(f"<Instruct>: {instruction or INSTRUCTION}\n<Query>: {query}\n<Document>: {document}",
                            add_special_tokens=False)
    return head + pair[:max(0, limit - len(head) - len(tail))] + tail


def scores(model, pooled: torch.Tensor, judged: tuple[int, int]) -> list[float]:
    """pooled [N, H]: each prompt's last final hidden state -> P(yes) of each, through the model's
    own head (its logits at that position, as a next-token step computes them)."""
    logits = model.compute_logits(pooled.to(model.dtype))[:, list(judged)]  # [N, 2]: no, yes
    return torch.softmax(logits.float(), dim=-1)[:, 1].tolist()
