"""Constraints compiled for one tokenizer, and each sample's matcher.

The library is llguidance, chosen by measurement (docs/benchmarks.md): it
compiles a typical schema in about a millisecond, reads JSON schemas, regexes
and Lark grammars (GBNF is converted to Lark), and has no dependencies.

A compiled constraint is a matcher that has consumed nothing; every sample
gets a deep copy of it, which shares the compiled grammar and lexer. They are
cached per (constraint, tokenizer): one GrammarCompiler per tokenizer, one
entry per constraint. The daemon's validator and the engine share the
compiler, so a schema compiled at admission on the socket thread is a cache
hit on the engine's thread."""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future

from ridge.errors import InvalidRequest
from .bounds import PREPARE_SECONDS, check_chain, check_gbnf, run_bounded
from .format import Constraint

log = logging.getLogger("ridge.engine")
CACHE_SIZE = 256  # compiled constraints kept, least recently used out first
# JSON whitespace between tokens: none, up to two spaces, or a newline and its indentation.
# llguidance's default, any run of whitespace, lets a model under a constraint loop on
# newlines until max_tokens (a tiny random model did at once). A schema's own
# "x-guidance": {"whitespace_pattern": ...} overrides it.
JSON_WHITESPACE = r"(\r?\n[ \t]{0,32}|[ \t]{0,2})?"


class Matcher:
    """One sample's position in its constraint. Invariant: it has consumed exactly
    the first num_tokens of the request's output; sync() catches it up."""

    __slots__ = ("ll", "num_tokens")

    def __init__(self, ll):
        self.ll = ll  # llguidance.LLMatcher
        self.num_tokens = 0

    def sync(self, output_token_ids: list[int]) -> None:
        new = output_token_ids[self.num_tokens:]
        # A finished constraint allows only EOS, which ends the request without being consumed.
        if new and not self.ll.is_stopped() and not self.ll.consume_tokens(new):
            log.error("a constrained request produced a token its grammar refuses: %s", self.ll.get_error())
        self.num_tokens = len(output_token_ids)

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of tokens (drafts, after the synced output) the constraint allows."""
        return self.ll.validate_tokens(tokens) if tokens else 0

    @property
    def is_error(self) -> bool:
        return self.ll.is_error()


class CompiledConstraint:
    def __init__(self, template):
        self._template = template  # never advanced: only copied

    def matcher(self) -> Matcher:
        return Matcher(self._template.deep_copy())


class GrammarCompiler:
    """Compiles response formats for one tokenizer. vocab_size: the model's logits width,
    which may exceed the tokenizer's (tokens past the tokenizer are never allowed)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._ll_tokenizer = None
        self._cache: OrderedDict[tuple[str, str], CompiledConstraint] = OrderedDict()
        self._lock = threading.Lock()
        # A constraint being compiled -> its result: a second thread that asks for it meanwhile
        # waits for the first instead of compiling it again.
        self._compiling: dict[tuple[str, str], Future] = {}
        self.hits = self.misses = 0

    @property
    def ll_tokenizer(self):
        """Built on first use (about 0.4 s for a 49K vocabulary), from the tokenizer's own JSON."""
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance

                self._ll_tokenizer = llguidance.LLTokenizer(self.tokenizer.backend.to_str(), n_vocab=self.vocab_size,
                                                            eos_token=list(self.tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, c: Constraint) -> CompiledConstraint:
        """Raises InvalidRequest, with the library's reason, for a constraint that does not compile."""
        with self._lock:
            hit = self._cache.get(c.key)
            if hit is not None:
                self._cache.move_to_end(c.key)
                self.hits += 1
                return hit
            pending = self._compiling.get(c.key)
            if pending is None:
                self._compiling[c.key] = mine = Future()
                self.misses += 1
        if pending is not None:
            return pending.result()
        try:
            compiled = CompiledConstraint(self._build(c))
        except BaseException as e:
            with self._lock:
                del self._compiling[c.key]
            mine.set_exception(e)
            raise
        with self._lock:
            del self._compiling[c.key]
            self._cache[c.key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        mine.set_result(compiled)
        return compiled

    def _build(self, c: Constraint):
        import llguidance

        what = {"json_schema": "the JSON schema", "regex": "the regex", "grammar": "the grammar",
                "llguidance": "the chat grammar (the tools' schemas, the response_format)"}[c.kind]
        if c.kind == "grammar":
            check_gbnf(c.text, what)
        ll_tokenizer = self.ll_tokenizer

        def text() -> str:
            try:
                grammar = grammar_text(c)
            except (ValueError, RecursionError) as e:
                raise InvalidRequest(f"response_format: {what} does not compile: {e}") from None
            # A chain too long for the compiler's stack would end the daemon, not the request.
            check_chain(grammar, what)
            return grammar

        # The text and its chain check are linear in the request's bytes, and run first on a compile
        # thread (its stack) with a budget of their own; a GBNF grammar's conversion, quadratic in
        # its rules, stays on the compile's clock.
        ready = None if c.kind == "grammar" else run_bounded(text, what, PREPARE_SECONDS)

        def build():  # on a compile thread (bounds.py)
            grammar = ready if ready is not None else text()
            m = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
            if not m.is_error():
                # The first mask builds lexer states that every copy shares: here, at admission,
                # rather than in the first step.
                m.compute_bitmask()
            return m

        m = run_bounded(build, what)
        if m.is_error():
            raise InvalidRequest(f"response_format: {what} does not compile: {m.get_error()}"[:2000])
        return m


def grammar_text(c: Constraint) -> str:
    """-> llguidance's grammar for the constraint. Raises ValueError when it cannot be read."""
    from llguidance import LLMatcher, grammar_from

    if c.kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(c.text, defaults={"whitespace_pattern": JSON_WHITESPACE})
    if c.kind == "regex":
        return LLMatcher.grammar_from_regex(c.text)
    if c.kind == "llguidance":  # composed by the daemon for a chat turn, already in the library's form
        return c.text
    return grammar_from("grammar", c.text)


def named_grammars(c: Constraint, name: str) -> list[dict]:
    """The constraint as llguidance's grammars, the first named `name`, for a grammar that embeds
    it (`@name`): the daemon's chat grammar puts a response_format after the thinking."""
    import json

    if c.kind == "grammar":  # converted here, on the caller's thread: bounded as _build bounds it
        check_gbnf(c.text, "the grammar")
    text = grammar_text(c)
    try:
        entries = json.loads(text)["grammars"]
    except ValueError:  # a Lark grammar comes back as its text
        entries = [{"lark_grammar": text}]
    return [{**entries[0], "name": name}] + entries[1:]
