"""Tokenizers for GGUF files and Hugging Face directories, built on the `tokenizers` library.

A GGUF carries no tokenizer.json, only llama.cpp's metadata keys; we rebuild an equivalent
`tokenizers.Tokenizer` from them so that both sources share one encode/decode/chat path.
"""
from __future__ import annotations

import json
import logging
import os
from datetime import datetime
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

log = logging.getLogger(__name__)

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Same regex lists, applied in order, as llama.cpp's llm_tokenizer_bpe for each `tokenizer.ggml.pre`.
# "default" deliberately maps to the GPT-2 regex (what transformers does), not llama.cpp's odd
# four-regex LLAMA_VOCAB_PRE_TYPE_DEFAULT, which no real vocabulary was trained with.
PRE_SPLITS: dict[str, list[str]] = {
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"],
                    [r"\p{N}", _GPT2]),
    **dict.fromkeys(["llama-bpe", "llama3", "llama-v3", "dbrx", "smaug-bpe", "falcon3"], [_LLAMA3]),
    **dict.fromkeys(["qwen2", "stablelm2", "deepseek-r1-qwen"], [_QWEN2]),
    **dict.fromkeys(["default", "gpt-2", "gpt2", "mpt", "olmo", "jais"], [_GPT2]),
}
_IGNORE_MERGES = {pre for pre, splits in PRE_SPLITS.items() if splits == [_LLAMA3]}  # as llama.cpp
_CONTROL, _USER_DEFINED, _UNKNOWN, _NORMAL = 3, 4, 2, 1
_CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
           " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
           "{{ '<|im_start|>assistant\n' }}{% endif %}")


class TokenizerError(ValueError):
    pass


def gguf_metadata_to_dict(reader) -> dict[str, object]:
    """All key/values of a `gguf.GGUFReader` as plain Python values.

    `field.contents()` touches one numpy view per array element; reading each array's byte range
    in one go from the file's memmap is faster (the 49k-string vocabulary in ~30 ms)."""
    from gguf import GGUFValueType as VT

    out: dict[str, object] = {}
    for key, f in reader.fields.items():
        if f.types[0] != VT.ARRAY or len(f.types) != 2 or not len(f.data):
            out[key] = f.contents()
        elif f.types[1] == VT.STRING:
            out[key] = _string_array(reader.data, f)
        else:
            first = f.parts[f.data[0]]
            off = first.ctypes.data - reader.data.ctypes.data
            out[key] = np.frombuffer(reader.data, first.dtype, len(f.data), off).tolist()
    return out


def _string_array(buf: np.ndarray, f) -> list[str]:
    # Each element is a u64 length followed by its bytes, laid out contiguously in the file.
    len_part, last = f.parts[f.data[0] - 1], f.parts[f.data[-1]]
    start = len_part.ctypes.data - buf.ctypes.data
    raw = buf[start:last.ctypes.data - buf.ctypes.data + last.nbytes].tobytes()
    order = "big" if len_part.dtype.byteorder == ">" else "little"
    res, pos, from_bytes = [], 0, int.from_bytes
    for _ in range(len(f.data)):
        n = from_bytes(raw[pos:pos + 8], order)
        pos += 8
        res.append(raw[pos:pos + n].decode("utf-8", "replace"))
        pos += n
    return res


def _added_tokens(tokens: list[str], types: list[int]) -> list[AddedToken]:
    # normalized=False: they must be matched in the raw text, before any `▁` rewriting.
    return [AddedToken(t, special=ty != _USER_DEFINED, normalized=False)
            for t, ty in zip(tokens, types) if ty in (_CONTROL, _USER_DEFINED, _UNKNOWN)]


def _byte_level_bpe(meta: dict) -> tokenizers.Tokenizer:
    tokens, pre = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_SPLITS:
        log.warning("unknown tokenizer.ggml.pre %r; falling back to the GPT-2 split regex", pre)
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(r), "isolated") for r in PRE_SPLITS.get(pre, [_GPT2])]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_merges(tokens: list[str], scores: list[float], types: list[int]):
    """GGUF 'llama' vocabularies usually carry scores, not merges.  SentencePiece BPE merges the
    pair whose result scores highest, so every split of a normal token into two known pieces is a
    merge ranked by that token's score."""
    ids = {t: i for i, t in enumerate(tokens)}
    found = []
    for t, score, ty in zip(tokens, scores, types):
        if ty != _NORMAL:
            continue
        for k in range(1, len(t)):
            left, right = t[:k], t[k:]
            if left in ids and right in ids:
                found.append((-score, ids[left], ids[right], left, right))
    found.sort()
    return [(left, right) for *_, left, right in found]


def _sentencepiece_bpe(meta: dict) -> tokenizers.Tokenizer:
    tokens = meta["tokenizer.ggml.tokens"]
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * n
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:
        merges = _sentencepiece_merges(tokens, meta.get("tokenizer.ggml.scores") or [0.0] * n, types)
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None else None
    tok = tokenizers.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, unk_token=unk,
                                          fuse_unk=True, byte_fallback=True))
    # Llama 2 / llama.cpp put a `▁` before every raw-text run, including after special tokens,
    # which a normalizer does (added tokens are cut out before normalizing).
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    norms = [normalizers.Prepend("▁")] if prefix else []
    tok.normalizer = normalizers.Sequence([*norms, normalizers.Replace(" ", "▁")])
    decs = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence([*decs, decoders.Strip(" ", 1, 0)] if prefix else decs)
    return tok


_BUILDERS = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON (as HF renders them).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


# Characters past which encode() goes through tokenizers' batch call: the same ids (it only skips
# the offsets), and it releases the GIL, which encode() holds (512 KiB of text: 0.37 s), so the
# daemon's socket thread keeps running while an admission worker tokenizes (daemon/frontend/admission.py).
LONG_TEXT = 4096


class Tokenizer:
    def __init__(self, tok: tokenizers.Tokenizer, *, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool, chat_template: str | None, name: str = "",
                 pad_token_id: int | None = None):
        self._tok = tok
        self.bos_token_id = bos_token_id
        self.eos_token_ids = list(dict.fromkeys(eos_token_ids))
        self.add_bos = bool(add_bos)
        self.chat_template = chat_template
        self.name = name
        self.pad_token_id = pad_token_id
        self._template = None
        # A tokenizer.json post-processor may already insert BOS; never add it twice.
        empty = tok.encode("", add_special_tokens=True).ids
        self._backend_adds_bos = bos_token_id is not None and empty[:1] == [bos_token_id]

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, object], name: str = "") -> "Tokenizer":
        kind = meta.get("tokenizer.ggml.model")
        if kind not in _BUILDERS:
            raise TokenizerError(f"{name or 'GGUF'}: unsupported tokenizer.ggml.model {kind!r}")
        needed = ["tokenizer.ggml.tokens"] + (["tokenizer.ggml.merges"] if kind == "gpt2" else [])
        if missing := [k for k in needed if k not in meta]:
            raise TokenizerError(f"{name or 'GGUF'}: metadata lacks {', '.join(missing)}")
        tok = _BUILDERS[kind](meta)
        types = meta.get("tokenizer.ggml.token_type") or []
        tok.add_special_tokens(_added_tokens(meta["tokenizer.ggml.tokens"], types))  # ids exist: no growth
        ggml = {k[len("tokenizer.ggml."):]: v for k, v in meta.items() if k.startswith("tokenizer.ggml.")}
        # EOT/EOM end a turn just like EOS (Llama 3's <|eot_id|>), so generation must stop on them.
        eos = [ggml[k] for k in ("eos_token_id", "eot_token_id", "eom_token_id") if ggml.get(k) is not None]
        return cls(tok, bos_token_id=ggml.get("bos_token_id"), eos_token_ids=eos,
                   add_bos=ggml.get("add_bos_token", kind == "llama"),
                   chat_template=meta.get("tokenizer.chat_template"), name=name,
                   pad_token_id=ggml.get("padding_token_id"))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        d = Path(path)
        if not (d / "tokenizer.json").is_file():
            raise TokenizerError(f"{d}: no tokenizer.json (only fast-tokenizer directories are supported)")
        tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = _read_json(d / "tokenizer_config.json")
        bos, eos, pad = (_token_id(tok, cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token"))
        gen_eos = _read_json(d / "generation_config.json").get("eos_token_id")
        eos_ids = [eos] + (gen_eos if isinstance(gen_eos, list) else [gen_eos])
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: prefer "default"
            named = {t["name"]: t["template"] for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text()
        return cls(tok, bos_token_id=bos, eos_token_ids=[i for i in eos_ids if i is not None],
                   add_bos=cfg.get("add_bos_token", False), chat_template=template, name=d.name,
                   pad_token_id=pad)

    def to_dict(self) -> dict:
        return {"version": 1, "tokenizer_json": self._tok.to_str(), "bos_token_id": self.bos_token_id,
                "eos_token_ids": self.eos_token_ids, "add_bos": self.add_bos,
                "chat_template": self.chat_template, "name": self.name, "pad_token_id": self.pad_token_id}

    @classmethod
    def from_dict(cls, d: dict) -> "Tokenizer":
        if d.get("version") != 1:  # a stale cache: the caller rebuilds from the source
            raise TokenizerError(f"unsupported tokenizer cache version {d.get('version')!r}")
        return cls(tokenizers.Tokenizer.from_str(d["tokenizer_json"]), bos_token_id=d["bos_token_id"],
                   eos_token_ids=d["eos_token_ids"], add_bos=d["add_bos"], chat_template=d["chat_template"],
                   name=d.get("name", ""), pad_token_id=d.get("pad_token_id"))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self._tok.id_to_token(token_id) or "")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > LONG_TEXT:  # the batch call releases the GIL while it runs; encode() holds it
            ids = self._tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        wants_bos = self.add_bos and self.bos_token_id is not None and not self._backend_adds_bos
        if add_special_tokens and wants_bos:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        source = self.chat_template or _CHATML
        from .template_sandbox import BudgetedSandbox, render
        if self._template is None or self._template[0] != source:  # compile once per template
            # Sandboxed, and within a time and an output budget: the template is the model's code,
            # run on what clients send (template_sandbox.py).
            env = BudgetedSandbox(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = _tojson
            env.finish_filters()
            env.globals.update(raise_exception=_raise_exception,
                               strftime_now=lambda fmt: datetime.now().strftime(fmt))
            self._template = (source, env.from_string(source))
        eos = self.eos_token_ids[0] if self.eos_token_ids else None
        return render(self._template[1], messages=messages, add_generation_prompt=add_generation_prompt,
                      bos_token=self.token_text(self.bos_token_id), eos_token=self.token_text(eos), **kwargs)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        return self.encode_rendered(self.apply_chat_template(messages, add_generation_prompt, **kwargs))

    def encode_rendered(self, text: str) -> list[int]:
        """A rendered chat. Templates usually write BOS themselves (HF encodes without special
        tokens); it is added only when the model wants one and the template did not emit it."""
        ids = self.encode(text, False)
        if self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids


def _read_json(p: Path) -> dict:
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else {}


def _token_id(tok: tokenizers.Tokenizer, token) -> int | None:
    # tokenizer_config.json spells special tokens as strings or as AddedToken dicts.
    content = token.get("content") if isinstance(token, dict) else token
    return tok.token_to_id(content) if content else None


class IncrementalDetokenizer:
    """Streams text token by token, the way vLLM does: decode a short window of earlier tokens
    with and without the new ones and emit the difference.  The window keeps SentencePiece's
    leading space (which decode strips at the start of a text) and byte-level merges right, and
    text ending in U+FFFD is an incomplete UTF-8 sequence, held back until more bytes arrive."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True, keep: tuple[int, ...] = ()):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.keep = frozenset(keep)  # special tokens whose text is kept though the others are skipped
        self.ids = list(prompt_ids or [])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - 5, 0)  # enough context for a leading space

    def _pending(self) -> tuple[str, str]:
        dec = self.tokenizer.decode
        return (dec(self.ids[self.prefix_offset:self.read_offset], self.skip),
                dec(self.ids[self.prefix_offset:], self.skip))

    def add(self, token_id: int) -> str:
        if token_id in self.keep:  # its text, after what was pending; decoding restarts past it
            text = self.flush() + self.tokenizer.token_text(token_id)
            self.ids.append(token_id)
            self.prefix_offset = self.read_offset = len(self.ids)
            return text
        self.ids.append(token_id)
        prefix, full = self._pending()
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        prefix, full = self._pending()
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return full[len(prefix):]
