"""The three candidate libraries behind one small interface, for `ridge bench
structured libraries`: compile a case, make a matcher, fill bitmask rows
(bit j of word w allows token 32w + j), consume a token. Only llguidance is a
dependency of ridge; the others are measured when installed
(pip install xgrammar outlines-core)."""
from __future__ import annotations

import json
import time

import torch

from ridge.engine.structured.grammar import JSON_WHITESPACE


def _vocab(tok) -> list[str]:
    out = [""] * tok.vocab_size
    for s, i in tok.backend.get_vocab(with_added_tokens=True).items():
        out[i] = s
    return out


def _alloc(n: int, vocab_size: int) -> torch.Tensor:
    return torch.full((n, (vocab_size + 31) // 32), -1, dtype=torch.int32)


class Llguidance:
    name = "llguidance"

    def __init__(self, tok, vocab_size: int):
        import llguidance

        self.llg, self.V = llguidance, vocab_size
        t = time.perf_counter()
        self.tk = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=list(tok.eos_token_ids))
        self.tokenizer_s = time.perf_counter() - t
        self.executor = llguidance.LLExecutor()
        self.version = llguidance.__version__

    def compile(self, kind: str, spec):
        M = self.llg.LLMatcher
        g = M.grammar_from_json_schema(json.dumps(spec), defaults={"whitespace_pattern": JSON_WHITESPACE}) \
            if kind == "json" else M.grammar_from_regex(spec)
        m = M(self.tk, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def alloc(self, n: int) -> torch.Tensor:
        return _alloc(n, self.V)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].unsafe_compute_mask_ptr(bitmask.data_ptr(), bitmask.shape[1] * 4)
        else:
            self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(),
                                                  bitmask.shape[1] * 4, bitmask.shape[0])

    def consume(self, m, token: int) -> bool:
        return m.is_stopped() or m.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab_size: int):
        import xgrammar

        self.xgr, self.V = xgrammar, vocab_size
        t = time.perf_counter()
        info = xgrammar.TokenizerInfo(_vocab(tok), xgrammar.VocabType.BYTE_LEVEL, vocab_size=vocab_size,
                                      stop_token_ids=list(tok.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)  # compile times, not cache hits
        self.tokenizer_s = time.perf_counter() - t
        self.batch = xgrammar.BatchGrammarMatcher()
        from importlib.metadata import version
        self.version = version("xgrammar")

    def compile(self, kind: str, spec):
        return self.compiler.compile_json_schema(json.dumps(spec)) if kind == "json" else \
            self.compiler.compile_regex(spec)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def alloc(self, n: int) -> torch.Tensor:
        return _alloc(n, self.V)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, bitmask)

    def consume(self, m, token: int) -> bool:
        return m.accept_token(token)


class OutlinesCore:
    """A regex index over the vocabulary's bytes; JSON schemas become regexes first."""
    name = "outlines-core"

    def __init__(self, tok, vocab_size: int):
        import llguidance
        import outlines_core

        self.oc, self.V = outlines_core, vocab_size
        t = time.perf_counter()
        ll = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size)  # each token's bytes
        by_bytes: dict[bytes, list[int]] = {}
        for i in range(tok.vocab_size):
            if not ll.is_special_token(i):
                by_bytes.setdefault(ll.decode_bytes([i]), []).append(i)
        self.vocab = outlines_core.Vocabulary(tok.eos_token_ids[0], by_bytes)
        self.tokenizer_s = time.perf_counter() - t
        from importlib.metadata import version
        self.version = version("outlines-core")

    def compile(self, kind: str, spec):
        rx = self.oc.json_schema.build_regex_from_schema(json.dumps(spec)) if kind == "json" else spec
        return self.oc.Index(rx, self.vocab)

    def matcher(self, compiled):
        return self.oc.Guide(compiled)

    def alloc(self, n: int) -> torch.Tensor:
        return _alloc(n, self.V)

    def fill(self, matchers: list, bitmask: torch.Tensor) -> None:
        for i, g in enumerate(matchers):
            row = bitmask[i]
            g.write_mask_into(row.data_ptr(), row.numel(), 4)

    def consume(self, g, token: int) -> bool:
        try:
            g.advance(token, False)
            return True
        except Exception:
            return False


LIBRARIES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}
