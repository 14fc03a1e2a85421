"""Client messages -> checked, tokenized requests, on the admission workers (admission.py).

The fields' types and ranges are the request's declaration (ridge/request.py);
whether the engine can serve the request is its admission rules
(engine/admit.py), asked here with the daemon's limits so that a request is
refused with an error frame before it is queued. What they admit (max_tokens
fitted to the context, the constraint compiled) the engine takes as it is."""
from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ridge.engine import rerank as judging
from ridge.engine.admit import Admitted, Rules, Unconstrainable
from ridge.engine.sampler_chain import breaker_sequences
from ridge.engine.sampling_params import SamplingParams
from ridge.engine.structured.grammar import GrammarCompiler
from ridge.errors import InvalidRequest
from ridge.request import (GENERATE, MAX_BIAS_ENTRIES, FieldError, body_problem, from_wire, refusal, specs,
                           wire_specs)

from ridge.vision.decode import ImageLimits
from ridge.vision.prompt import RAW_MARKER

from ..protocol import (INVALID_FIELD, INVALID_REQUEST, MISSING_FIELD, SUPPORTED, UNSUPPORTED_VERSION, Envelope,
                        MAX_EMBED_INPUTS, Limits, ProtocolError, check_keys, fail, is_int, is_num, speaks,
                        token_list, too_old)
from . import harmony, images
from .chat_format import HARMONY, chat_format, render_chat, ridge_tool_messages
from .chat_grammar import closed, turn_grammar
from .chat_calls import text_params
from .chat_output import OutputSpec
from .tools import V2_FIELDS, ChatTurn, check_messages, check_turn, template_messages, version_fields

_BOOL = "a boolean"
PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
PRINCIPAL_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # hello's sub-principal (Server._subdivide)
DEFAULT_MAX_TOKENS = specs()["max_tokens"].default
MAX_CALLS = 128  # calls in one sample, parallel_tool_calls true
# The prompts of one embed or rerank together: what one request may ask of the tokenizer and the
# engine's prefill (256 prompts of a 1K context; a rerank's query is cut to the context first).
MAX_REQUEST_TOKENS = 1 << 18
# Tokens read past a cut, so that the cut's last word, tokenized apart, is not among those kept.
CUT_MARGIN = 16


def _driven(steps):
    """A stepped validation run to its end at once."""
    try:
        while True:
            next(steps)
    except StopIteration as e:
        return e.value


@dataclass(slots=True)
class GenerateRequest:
    id: str
    admitted: Admitted  # its prompt and params, as the engine runs them
    stream: bool
    cache_salt: str | None = None  # the client's; the server joins it to the peer's identity (sharing.py)
    output: OutputSpec | harmony.HarmonySpec | None = None  # how its samples are read (chat_output.py)
    version: int = 2  # the protocol version it was sent in: its frames are in it

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.admitted.prompt_token_ids

    @property
    def params(self) -> SamplingParams:
        return self.admitted.params


@dataclass(slots=True)
class EmbedRequest:
    id: str
    admitted: list[Admitted]  # each input's prompt, as the engine runs it
    dimensions: int | None
    version: int
    top_n: int | None = None  # a rerank's: the best this many documents are answered; None: an embed

    @property
    def inputs(self) -> list[list[int]]:
        return [a.prompt_token_ids for a in self.admitted]


class Validator:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, block_size: int, num_blocks: int,
                 limits: Limits, grammars: GrammarCompiler | None = None, embedding_size: int | None = None,
                 ranks: bool = False, image_rules=None, image_limits: ImageLimits = ImageLimits()):
        """embedding_size: an embedding model's (engine/pooling.py); None: the model generates.
        ranks: the model is a reranker (engine/rerank.py), answering rerank, not embed.
        image_rules: the model's image prompt rules (ridge/vision/prompt.py); None: it takes no
        images; a string: why its images cannot be served (a preprocessor field ridge cannot honour)."""
        self.image_rules, self.image_limits = image_rules, image_limits
        self.embedding_size, self.ranks = embedding_size, ranks
        self.tokenizer, self.vocab, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.block_size, self.num_blocks, self.limits = block_size, num_blocks, limits
        # The engine's compiler, so that what compiles here is a cache hit on the engine's thread.
        self.grammars = grammars or GrammarCompiler(tokenizer, vocab_size)
        self.rules = Rules(vocab_size, max_model_len, block_size, num_blocks, limits.max_prompt_tokens,
                           limits.max_tokens, limits.max_n, self.grammars)
        self.chat = chat_format(tokenizer)  # what the chat template says about tools and reasoning
        self._grammar_tokens: frozenset[str] | None = None
        self._breakers: dict[tuple[str, ...], frozenset[int]] = {}  # dry_sequence_breakers -> token ids

    # -- generate ---------------------------------------------------------------
    def generate(self, env: Envelope) -> GenerateRequest:
        rid, body = env.id, env.body
        if self.embedding_size is not None:
            raise ProtocolError(INVALID_REQUEST, "this daemon serves an embedding model: it answers embed, not "
                                "generate", rid)
        version_fields(body, env.v, rid)
        check_keys(body, {*PROMPT_KEYS, "params", *(k for k, f in GENERATE.items() if f.since != "models")}, rid)
        if (bad := body_problem(body)) is not None:
            raise fail(*bad, rid)
        if (why := refusal(body, self.served)) is not None:
            raise ProtocolError(INVALID_REQUEST, why, rid)
        stream, salt = body.get("stream", True), body.get("cache_salt")
        d, budget = self.param_fields(body.get("params", {}), env.v, rid)
        pictures = self.pictures(env)
        output, order = None, []
        if "messages" in body and speaks(env.v, "tools"):
            ids, text, turn, order = self.chat_prompt(body, rid, pictures, env.v)
            d, output = self.chat_output(turn, text, d, budget, rid)
        else:
            if given := [k for k in V2_FIELDS if k in body]:
                raise fail(given[0], "given only with messages", rid)
            ids = self.prompt(body, rid, pictures)
            order = list(range(len(pictures)))
        admitted = self.admit(ids, self.sampling(d, rid), rid)
        if pictures:
            placed = [pictures[i] for i in order]
            admitted = replace(admitted, images=images.located(ids, placed, self.image_rules.image_token_id, rid))
        return GenerateRequest(rid, admitted, stream, salt, output, env.v)

    @property
    def served(self) -> frozenset:
        """The declared fields served only by some models (ridge/request.refusal) that this one honours."""
        return frozenset({"images"}) if self.image_rules is not None else frozenset()

    def pictures(self, env: Envelope) -> list:
        """A generate's image frames, decoded, preprocessed and expanded (images.py): on the
        admission worker that runs this validation."""
        n, rid = env.body.get("images", 0), env.id
        if n != len(env.frames):
            raise ProtocolError(INVALID_REQUEST, f"images says {n} image frame(s) follow the message and "
                                f"{len(env.frames)} came", rid)
        if not n:
            return []
        if isinstance(self.image_rules, str):
            raise ProtocolError(INVALID_REQUEST, f"images: this model takes no image input: {self.image_rules}", rid)
        if "prompt_token_ids" in env.body:
            raise fail("images", "given with prompt or messages (whose markers place them), not prompt_token_ids",
                       rid)
        return images.expand_all(self.image_rules, images.decode_all(env.frames, self.image_limits, rid), rid)

    def chat_output(self, turn: ChatTurn, text: str, d: dict, budget: int | None,
                    rid: str | None) -> tuple[dict, OutputSpec | None]:
        """The params' grammar (chat_grammar.py) and how the output is read (chat_output.py)."""
        fmt = self.chat
        if fmt.tool_format == HARMONY:
            return self.harmony_output(turn, d, budget, rid)
        start = fmt.reasoning_start(text)
        reads = bool(turn.calls) and fmt.tool_format is not None
        if not reads and start == "content":
            return d, None
        thinks = start != "content"
        rf = self.sampling(d, rid).constraint()
        d = dict(d)
        if grammar := turn_grammar(fmt, turn, start, budget, rf, self.grammar_tokens()):
            d["chat_grammar"] = grammar
        if budget is not None and thinks:
            d["speculative"] = False  # llguidance's token budgets cannot roll back a rejected draft
        markers = {r: m for r, m in fmt.markers.items() if (thinks if r.startswith("think") else reads)}
        d["keep_special_ids"] = tuple(sorted(m.token_id for m in markers.values() if m.special))
        spec = OutputSpec(start, fmt.tool_format if reads else None, MAX_CALLS if turn.parallel else 1,
                          {r: m.text for r, m in markers.items()}, text_params(turn.calls))
        return d, spec

    def harmony_output(self, turn: ChatTurn, d: dict, budget: int | None,
                       rid: str | None) -> tuple[dict, harmony.HarmonySpec]:
        """gpt-oss: every answer is framed in channels, so a grammar always holds it to them."""
        ids = {k: m.token_id for k, m in ((r.removeprefix("h_"), m) for r, m in self.chat.markers.items())}
        if any(i is None for i in ids.values()):
            raise ProtocolError(INVALID_REQUEST, "this model's tokenizer lacks harmony's special tokens", rid)
        think = harmony.thinks(turn.template_kwargs)
        d = dict(d, chat_grammar=harmony.grammar(ids, turn, think, budget, self.sampling(d, rid).constraint(), closed),
                 keep_special_ids=tuple(sorted(ids.values())))
        if budget is not None and think:
            d["speculative"] = False  # llguidance's token budgets cannot roll back a rejected draft
        return d, harmony.HarmonySpec(bool(turn.calls))

    def admit(self, ids: list[int], params: SamplingParams, rid: str | None) -> Admitted:
        """The engine's admission rules (engine/admit.py) with this daemon's limits; a response_format
        that does not compile is refused here, never at step time."""
        try:
            return self.rules.admit(ids, params)
        except FieldError as e:
            raise ProtocolError(INVALID_FIELD, f"params.{e}", rid) from None
        except Unconstrainable as e:
            if params.chat_grammar is not None:  # the tools' schemas, with the response_format
                raise ProtocolError(INVALID_FIELD, f"tools: {str(e).removeprefix('response_format: ')}", rid) from None
            raise ProtocolError(INVALID_FIELD, f"params.{e}", rid) from None
        except InvalidRequest as e:
            raise ProtocolError(INVALID_REQUEST, str(e), rid) from None

    def grammar_tokens(self) -> frozenset[str]:
        """The marker roles whose one token the grammar engine holds as special (it names them by
        id; text cannot spell them): every added token, for llguidance, not only the tokenizer's
        special ones. Asked once the first grammar is built, when the engine's view exists anyway."""
        if self._grammar_tokens is None:
            ll = self.grammars.ll_tokenizer
            self._grammar_tokens = frozenset(r for r, m in self.chat.markers.items()
                                             if m.token_id is not None and ll.is_special_token(m.token_id))
        return self._grammar_tokens

    def param_fields(self, raw, version: int, rid: str | None) -> tuple[dict, int | None]:
        """-> (the SamplingParams fields, the reasoning budget)."""
        if not isinstance(raw, dict):
            raise fail("params", "a map", rid)
        if speaks(version, "tools") and "max_reasoning_tokens" in raw:
            raw = dict(raw)
            budget = raw.pop("max_reasoning_tokens")
            if not (is_int(budget) and 0 <= budget <= self.limits.max_tokens):
                raise fail("params.max_reasoning_tokens", f"an integer in [0, {self.limits.max_tokens}]", rid)
        else:
            budget = None
        wire = wire_specs()
        check_keys(raw, set(wire), rid, "params.")
        for k, v in raw.items():
            if not wire[k].wire_ok(v):
                raise fail(f"params.{k}", wire[k].wire_words, rid)
        d = from_wire(raw)
        d.setdefault("max_tokens", min(DEFAULT_MAX_TOKENS, self.limits.max_tokens))
        if "logit_bias" in d:
            d["logit_bias"] = self.logit_bias(d["logit_bias"], rid)
        if d.get("dry_multiplier"):
            breakers = d.get("dry_sequence_breakers")
            if breakers is None:
                breakers = specs()["dry_sequence_breakers"].default_value
            if isinstance(breakers, list) and 0 < len(breakers) <= 16 and all(b for b in breakers):
                d["dry_breaker_ids"] = self.breaker_ids(tuple(breakers))
        return d, budget

    def logit_bias(self, raw, rid: str | None) -> dict[int, float]:
        """params.logit_bias -> token id -> bias. A map of token ids (OpenAI's, with integer keys), or
        llama-server's [[token id or string, bias], ...]: a string's tokens each get its bias. A bias
        of false bans the token (-inf), as llama-server reads it."""
        what = ("a map of token id to a finite number or false, or an array of [token id or string, bias] "
                f"pairs; token ids in [0, {self.vocab}), at most {MAX_BIAS_ENTRIES} tokens")
        pairs = list(raw.items()) if isinstance(raw, dict) else raw
        out: dict[int, float] = {}
        for pair in pairs:
            if isinstance(pair, (list, tuple)) and len(pair) == 2:
                key, bias = pair
            else:
                raise fail("params.logit_bias", what, rid)
            if bias is False:
                bias = float("-inf")
            elif is_num(bias):
                bias = float(bias)
            else:
                raise fail("params.logit_bias", what, rid)
            if isinstance(raw, dict) and isinstance(key, str) and key.isascii() and key.isdigit():
                key = int(key)  # OpenAI's JSON map: token ids as strings
            if isinstance(key, str) and not isinstance(raw, dict):
                ids = self.tokenizer.encode(key, add_special_tokens=False)
            elif is_int(key) and 0 <= key < self.vocab:
                ids = [key]
            else:
                raise fail("params.logit_bias", what, rid)
            for t in ids:
                out[t] = bias
            if len(out) > MAX_BIAS_ENTRIES:
                raise fail("params.logit_bias", what, rid)
        return out

    def breaker_ids(self, breakers: tuple[str, ...]) -> frozenset[tuple[int, ...]]:
        """DRY's sequence breakers as token sequences, as llama.cpp finds them (a breaker may span
        tokens: sampler_chain.breaker_sequences). The vocabulary is decoded once per set of breakers
        (the default set is all most clients send); kept for the daemon's life, bounded."""
        if (ids := self._breakers.get(breakers)) is None:
            texts = self.tokenizer.backend.decode_batch([[i] for i in range(min(self.vocab, self.tokenizer.vocab_size))], skip_special_tokens=False)
            ids = breaker_sequences(texts, breakers, lambda t: self.tokenizer.encode(t, add_special_tokens=False))
            if len(self._breakers) >= 16:
                self._breakers.pop(next(iter(self._breakers)))
            self._breakers[breakers] = ids
        return ids

    @staticmethod
    def sampling(d: dict, rid: str | None) -> SamplingParams:
        try:
            return SamplingParams.from_dict(d)
        except FieldError as e:  # a field outside its declared rule: named as the wire names it
            raise ProtocolError(INVALID_FIELD, f"params.{e}", rid) from None
        except InvalidRequest as e:
            raise ProtocolError(INVALID_FIELD, f"params: {e}", rid) from None

    def prompt(self, body: dict, rid: str | None, pictures: list = ()) -> list[int]:
        given = [k for k in PROMPT_KEYS if k in body]
        if not given:
            raise ProtocolError(MISSING_FIELD, "one of prompt, messages or prompt_token_ids is required", rid)
        if len(given) > 1:
            raise ProtocolError(INVALID_FIELD, f"give exactly one of prompt, messages, prompt_token_ids "
                                f"(got {', '.join(given)})", rid)
        key = given[0]
        if key == "prompt_token_ids":
            return list(token_list(body[key], key, self.vocab, rid, self.limits.max_frame_bytes))
        if key == "prompt":
            if not isinstance(body[key], str):
                raise fail("prompt", "a string", rid)
            text = body[key]
            if pictures:  # llama-server's way: the marker where each image goes, in order
                text = images.expand_markers(text, RAW_MARKER, pictures, True, rid)
            return self.encode_text(text, True, rid)
        return self.encode_chat(check_messages(body[key], rid, self.limits.max_messages, tools=False), rid)

    def chat_prompt(self, body: dict, rid: str | None, pictures: list = (),
                    version: int = 2) -> tuple[list[int], str, ChatTurn, list[int]]:
        """A version-2 chat: -> (its ids, its rendered text, the turn, the image each image part
        names, in the prompt's order). From version 5 a user message's content may be an array
        of text and image parts (§3.2.5), rendered through the chat template as such."""
        if given := [k for k in PROMPT_KEYS if k in body and k != "messages"]:
            raise ProtocolError(INVALID_FIELD, f"give exactly one of prompt, messages, prompt_token_ids "
                                f"(got messages, {', '.join(given)})", rid)
        refs = images.split_parts(body["messages"], len(pictures), rid) if speaks(version, "images") else None
        messages = body["messages"] if refs is None else refs.checked
        turn = check_turn(body, check_messages(messages, rid, self.limits.max_messages, tools=True), rid)
        if turn.calls and self.chat.tool_format is None:
            raise ProtocolError(INVALID_REQUEST, "this model's chat template writes tool calls in a format ridge "
                                "does not read (docs/protocol.md §3.2.3)", rid)
        order = refs.order if refs is not None else []
        if order:
            turn.messages = refs.rendered
        text = self.render(turn, rid)
        if order:
            text = images.expand_markers(text, self.image_rules.marker, [pictures[i] for i in order], False, rid)
        return self.tokenizer.encode_rendered(text), text, turn, order

    def render(self, turn: ChatTurn, rid: str | None) -> str:
        messages = self.chat.messages(template_messages(turn.messages))
        kw = dict(turn.template_kwargs)
        if self.chat.tool_format == HARMONY:
            harmony.check_kwargs(kw, rid)
            try:
                return harmony.render(messages, turn.shown_tools, kw)
            except ValueError as e:
                raise ProtocolError(INVALID_REQUEST, f"messages: {e}", rid) from None
        if self.chat.tools_in_template:
            kw["tools"] = turn.shown_tools
        else:
            messages = ridge_tool_messages(messages, turn.shown_tools)
        try:
            return render_chat(self.tokenizer.apply_chat_template, messages, **kw)
        except Exception as e:  # a template's raise_exception(), or a template bug
            raise ProtocolError(INVALID_REQUEST, f"the chat template failed: {type(e).__name__}: {e}"[:500],
                                rid) from None

    def encode_text(self, text: str, special: bool, rid: str | None) -> list[int]:
        if len(text) > 64 * self.limits.max_prompt_tokens + 64:  # cheap bound before tokenizing
            raise ProtocolError(INVALID_REQUEST, "the prompt is far longer than the context", rid)
        return self.tokenizer.encode(text, add_special_tokens=special)

    def encode_chat(self, messages: list[dict], rid: str | None) -> list[int]:
        try:
            return self.tokenizer.encode_rendered(render_chat(self.tokenizer.apply_chat_template, messages))
        except Exception as e:  # a template's raise_exception(), or a template bug
            raise ProtocolError(INVALID_REQUEST, f"the chat template failed: {type(e).__name__}: {e}"[:500],
                                rid) from None

    # -- embed --------------------------------------------------------------------
    def embed(self, env: Envelope) -> EmbedRequest:
        return _driven(self.embed_steps(env))

    def embed_steps(self, env: Envelope):
        """embed, its fields checked at once and its inputs then tokenized one per step of the
        generator it returns (admission.py runs them in turns with other clients' work)."""
        rid, body = env.id, env.body
        if not speaks(env.v, "embed"):
            raise too_old("embed", env.v, rid)
        if self.embedding_size is None:
            raise ProtocolError(INVALID_REQUEST, "this daemon serves a model that generates text and has no "
                                "embeddings (serve an embedding model, or one with --pooling last|mean)", rid)
        if self.ranks:
            raise ProtocolError(INVALID_REQUEST, "this model is a reranker: it answers rerank, not embed", rid)
        check_keys(body, {"input", "dimensions"}, rid)
        if "input" not in body:
            raise ProtocolError(MISSING_FIELD, "input is required", rid)
        items = body["input"]
        if not isinstance(items, list) or not 0 < len(items) <= MAX_EMBED_INPUTS:
            raise fail("input", f"an array of 1-{MAX_EMBED_INPUTS} strings or token id arrays", rid)
        dims = body.get("dimensions")
        if dims is not None and not (is_int(dims) and 1 <= dims <= self.embedding_size):
            raise fail("dimensions", f"an integer in [1, {self.embedding_size}] (the model's size), or nil", rid)
        return self._embed_steps(rid, items, dims, env.v)

    def _embed_steps(self, rid, items: list, dims: int | None, version: int):
        """Run by the admission workers one input per step (admission.py), within the request's budget."""
        one = SamplingParams(max_tokens=1)  # the prefill's one sample, as the engine runs it
        inputs: list[Admitted] = []
        total = 0
        for i, x in enumerate(items):
            ids = self.encode_text(x, True, rid) if isinstance(x, str) else \
                token_list(x, f"input[{i}]", self.vocab, rid, self.limits.max_prompt_tokens)
            if not ids:
                raise ProtocolError(INVALID_REQUEST, f"input[{i}] is empty", rid)
            inputs.append(self.admit(ids, one, rid))
            total = self._budget(total + len(ids), "embed", rid)
            yield
        return EmbedRequest(rid, inputs, dims, version)

    @staticmethod
    def _budget(total: int, what: str, rid: str | None) -> int:
        if total > MAX_REQUEST_TOKENS:
            raise ProtocolError(INVALID_REQUEST, f"the {what}'s prompts come to more than {MAX_REQUEST_TOKENS} tokens, "
                                "the limit for one request; send fewer or shorter inputs", rid)
        return total

    # -- rerank -------------------------------------------------------------------
    def rerank(self, env: Envelope) -> EmbedRequest:
        return _driven(self.rerank_steps(env))

    def rerank_steps(self, env: Envelope):
        """Each document's judging prompt (engine/rerank.py), admitted as an embed's inputs are, in
        steps as embed_steps."""
        rid, body = env.id, env.body
        if not speaks(env.v, "rerank"):
            raise too_old("rerank", env.v, rid)
        if not self.ranks:
            raise ProtocolError(INVALID_REQUEST, "this model is not a reranker (serve one whose metadata says so, "
                                "or with --pooling rank)", rid)
        check_keys(body, {"query", "documents", "instruction", "top_n"}, rid)
        for key in ("query", "documents"):
            if key not in body:
                raise ProtocolError(MISSING_FIELD, f"{key} is required", rid)
        query, docs, instruction = body["query"], body["documents"], body.get("instruction")
        if not isinstance(query, str) or not query:
            raise fail("query", "a non-empty string", rid)
        if not isinstance(docs, list) or not 0 < len(docs) <= MAX_EMBED_INPUTS or \
                not all(isinstance(d, str) for d in docs):
            raise fail("documents", f"an array of 1-{MAX_EMBED_INPUTS} strings", rid)
        if instruction is not None and not isinstance(instruction, str):
            raise fail("instruction", "a string, or nil", rid)
        top_n = body.get("top_n")
        if top_n is not None and not (is_int(top_n) and top_n >= 1):
            raise fail("top_n", "an integer >= 1, or nil", rid)
        return self._rerank_steps(rid, query, docs, instruction, min(top_n or len(docs), len(docs)), env.v)

    def _rerank_steps(self, rid, query: str, docs: list[str], instruction: str | None, top_n: int, version: int):
        """Each document's judging prompt as engine/rerank.prompt_ids writes it (the pair's text cut
        from its end to the context), with the query tokenized once, not once per document, and only
        as far as the context reaches: a huge query over many tiny documents costs one context's worth
        of tokenizing, not one per document. Runs one piece per admission step (admission.py)."""
        limit = min(self.limits.max_prompt_tokens, self.max_model_len - 1)
        head = self.tokenizer.encode(judging.PREFIX, add_special_tokens=False)
        tail = self.tokenizer.encode(judging.SUFFIX, add_special_tokens=False)
        room = max(0, limit - len(head) - len(tail))
        asked = f"<Instruct>: {instruction or judging.INSTRUCTION}\n<Query>: {query}"
        text, q = yield from self._leading(asked, room)
        one = SamplingParams(max_tokens=1)
        inputs: list[Admitted] = []
        total = 0
        if len(q) >= room:  # the query fills the context: no document is seen, as in the model card's cut
            ids = head + q[:room] + tail
            admitted = self.admit(ids, one, rid)
            self._budget(len(ids) * len(docs), "rerank", rid)
            return EmbedRequest(rid, [admitted] * len(docs), None, version, top_n)
        # Tokenized apart, the pair's two halves must meet as they do tokenized whole; a tokenizer
        # whose words can span "\n" (or that marks a text's start) is given each pair whole.
        probe_doc = "\n<Document>: " + docs[0][:64]
        apart = self.tokenizer.encode(asked[-64:], add_special_tokens=False) + \
            self.tokenizer.encode(probe_doc, add_special_tokens=False)
        whole = apart == self.tokenizer.encode(asked[-64:] + probe_doc, add_special_tokens=False)
        for d in docs:
            yield
            if whole:
                _, rest = yield from self._leading("\n<Document>: " + d, room - len(q))
                pair = q + rest
            else:
                _, pair = yield from self._leading(f"{text}\n<Document>: {d}", room)
            ids = head + pair[:room] + tail
            inputs.append(self.admit(ids, one, rid))
            total = self._budget(total + len(ids), "rerank", rid)
        return EmbedRequest(rid, inputs, None, version, top_n)

    def _leading(self, text: str, n: int):
        """-> (the start of text tokenized, its tokens): at least the first n tokens of the whole
        text's (all of them when it has fewer), from a prefix that grows fourfold per step."""
        cut = max(4096, 8 * (n + CUT_MARGIN))
        while True:
            piece = text[:cut]
            ids = self.tokenizer.encode(piece, add_special_tokens=False)
            if len(piece) == len(text):
                return piece, ids
            if len(ids) > n + CUT_MARGIN:
                return piece, ids[:n + CUT_MARGIN]
            cut *= 4
            yield

    # -- the small operations ------------------------------------------------------
    def tokenize(self, env: Envelope) -> list[int]:
        rid, body = env.id, env.body
        version_fields(body, env.v, rid)
        check_keys(body, {"text", "messages", "add_special_tokens", "tools", "chat_template_kwargs"}, rid)
        if "text" not in body and "messages" not in body:
            raise ProtocolError(MISSING_FIELD, "one of text or messages is required", rid)
        if "text" in body and "messages" in body:
            raise ProtocolError(INVALID_FIELD, "give exactly one of text or messages", rid)
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise fail("add_special_tokens", _BOOL, rid)
        if "messages" in body and speaks(env.v, "tools"):
            turn = check_turn(body, check_messages(body["messages"], rid, self.limits.max_messages, tools=True), rid)
            return self.tokenizer.encode_rendered(self.render(turn, rid))
        if "messages" in body:
            return self.encode_chat(check_messages(body["messages"], rid, self.limits.max_messages, tools=False), rid)
        if "tools" in body or "chat_template_kwargs" in body:
            raise fail("tools" if "tools" in body else "chat_template_kwargs", "given only with messages", rid)
        if not isinstance(body["text"], str):
            raise fail("text", "a string", rid)
        return self.encode_text(body["text"], special, rid)

    def detokenize(self, env: Envelope) -> str:
        rid, body = env.id, env.body
        check_keys(body, {"token_ids", "skip_special_tokens"}, rid)
        if "token_ids" not in body:
            raise ProtocolError(MISSING_FIELD, "token_ids is required", rid)
        ids = token_list(body["token_ids"], "token_ids", self.vocab, rid, self.limits.max_frame_bytes)
        skip = body.get("skip_special_tokens", True)
        if not isinstance(skip, bool):
            raise fail("skip_special_tokens", _BOOL, rid)
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    @staticmethod
    def hello(env: Envelope) -> int:
        rid, body = env.id, env.body
        check_keys(body, {"versions", "client", "principal"}, rid)
        p = body.get("principal")
        if p is not None and not (isinstance(p, str) and PRINCIPAL_RE.fullmatch(p)):
            raise fail("principal", "a string of 1-64 letters, digits and . _ : -", rid)
        versions = body.get("versions", list(SUPPORTED))
        if not isinstance(versions, list) or not all(is_int(v) for v in versions) or len(versions) > 64:
            raise fail("versions", "an array of integers", rid)
        if "client" in body and not (isinstance(body["client"], str) and len(body["client"].encode()) <= 128):
            raise fail("client", "a string of at most 128 bytes", rid)
        common = set(versions) & set(SUPPORTED)
        if not common:
            raise ProtocolError(UNSUPPORTED_VERSION, f"no common protocol version: the client speaks {versions}, "
                                f"this daemon {list(SUPPORTED)}", rid, supported=list(SUPPORTED))
        return max(common)

    @staticmethod
    def no_fields(env: Envelope) -> None:
        check_keys(env.body, set(), env.id)
