"""`ridge bench vision`: time to first token for one image and a short question, against
transformers' `generate` on the same inputs; then the same request again (the encoder's output
from its cache, the prompt's blocks from the prefix cache) as a ratio of the first.

The model is random and Gemma-3-4B-shaped by default (google/gemma-3-4b-it's config: a 34-layer
text model 2560 wide, 8 query and 4 KV heads of 256, windows of 1024 on 5 layers in 6; SigLIP
so400m, 27 layers 1152 wide, 896-pixel pictures of 14-pixel patches pooled to 256 tokens),
built by transformers and written as bf16 safetensors with a byte-level tokenizer (the three
image tokens added) and Gemma3Processor's files, kept under $XDG_CACHE_HOME/ridge/bench-vision
keyed by shape. ridge runs it in-process as the daemon does (the prompt rule of
ridge/vision/prompt.py, the engine's encoder step); transformers runs
Gemma3ForConditionalGeneration in `--hf-dtype` on the processor's inputs for the same picture
and text, one new token. Each side is loaded, measured and freed before the other, rounds
alternating (ridge, transformers, ...); the tables give each round and the best."""
from __future__ import annotations

import gc
import hashlib
import io
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

# google/gemma-3-4b-it config.json (text_config and vision_config), with the vocabulary cut to --vocab
TEXT = dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
            num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
            sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
            rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131_072)
VISION = dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
              image_size=896, patch_size=14, vision_use_head=False)
TOKENS = 256
SPECIALS = ["<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<image_soft_token>",
            "<end_of_image>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' }}"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}{{ '<start_of_image>' }}{% else %}{{ p['text'] }}{% endif %}{% endfor %}"
            "{% endif %}{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
            "{{ '<start_of_turn>model\n' }}{% endif %}")


def add_vision_parser(sub, common) -> None:
    v = sub.add_parser("vision", help="time to first token with an image, against transformers' generate")
    common(v, workload=False)
    v.add_argument("--image", default="896x896", help="the picture's WxH (resized to the tower's square)")
    v.add_argument("--question", default="What is in this picture? Answer in one word.")
    v.add_argument("--rounds", type=int, default=1, help="rounds of ridge then transformers; the best of each")
    v.add_argument("--hf-dtype", default="bfloat16", choices=("bfloat16", "float32"), help="transformers' dtype")
    v.add_argument("--layers", type=int, default=TEXT["num_hidden_layers"], help="text layers (Gemma-3-4B: 34)")
    v.add_argument("--vision-layers", type=int, default=VISION["num_hidden_layers"], help="tower layers (27)")
    v.add_argument("--vocab", type=int, default=262_208, help="vocabulary rows (Gemma 3: 262208)")
    v.add_argument("--no-hf", action="store_true", help="ridge alone")


def _shape(args) -> dict:
    return {"text": dict(TEXT, num_hidden_layers=args.layers, vocab_size=args.vocab),
            "vision": dict(VISION, num_hidden_layers=args.vision_layers)}


def write_model(shape: dict, root: Path | None = None) -> Path:
    """The checkpoint directory for the shape, written once (reused after)."""
    import torch
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = root or Path(base) / "ridge" / "bench-vision"
    key = hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:12]
    d = root / f"gemma3-{key}"
    if (d / "config.json").is_file():
        return d
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {t: i for i, t in enumerate(alphabet)}
    ids = {t: len(alphabet) + i for i, t in enumerate(SPECIALS)}
    tok = Tokenizer(models.BPE(vocab={**vocab, **ids}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in SPECIALS])
    cfg = transformers.Gemma3Config(text_config=shape["text"], vision_config=shape["vision"],
                                    mm_tokens_per_image=TOKENS, image_token_index=ids["<image_soft_token>"],
                                    boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                                    bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=0)
    torch.manual_seed(0)
    tmp = d.with_name(d.name + ".tmp")
    model = transformers.Gemma3ForConditionalGeneration(cfg).to(torch.bfloat16)
    model.save_pretrained(str(tmp))
    del model
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "add_bos_token": False, "chat_template": TEMPLATE,
        "extra_special_tokens": {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                                 "eoi_token": "<end_of_image>"}}))
    side = shape["vision"]["image_size"]
    (tmp / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Gemma3ImageProcessor", "processor_class": "Gemma3Processor", "do_resize": True,
        "do_rescale": True, "do_normalize": True, "rescale_factor": 1 / 255, "resample": 2,
        "image_mean": [0.5] * 3, "image_std": [0.5] * 3, "size": {"height": side, "width": side},
        "image_seq_length": TOKENS, "do_pan_and_scan": False}))
    (tmp / "processor_config.json").write_text(json.dumps({"processor_class": "Gemma3Processor",
                                                           "image_seq_length": TOKENS}))
    tmp.rename(d)
    return d


def png(w: int, h: int, seed: int = 0) -> bytes:
    """A PNG of gradients plus noise, w x h: every crop and pooled cell differs."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    px = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) % 256], -1)
    px = np.clip(px + rng.integers(-40, 40, (h, w, 3)), 0, 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(px, "RGB").save(buf, "PNG")
    return buf.getvalue()


def picture(size: str) -> bytes:
    """png() of a WxH size."""
    w, h = (int(x) for x in size.lower().split("x"))
    return png(w, h)


def ridge_ttft(args, d: Path, png: bytes) -> dict:
    """The request twice on one engine: the first time to its first token, and the second's."""
    from ridge.engine.admit import Admitted
    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.engine.sampling_params import SamplingParams
    from ridge.vision import decode_image
    from ridge.vision.prompt import place, read_prompt_rules

    from .runs import warm_up

    t0 = time.perf_counter()
    engine = LLMEngine(replace(engine_config(args), model=str(d), max_num_seqs=1, kv_disk=False, kv_host_gib=0,
                               kv_memory_gib=1.0, max_model_len=4096))
    load_s = time.perf_counter() - t0
    warm_up(engine)  # the C kernels built and the CPU formats chosen: not the image's time
    rules = read_prompt_rules(d)
    expanded = rules.expand(decode_image(png))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": args.question}]}]
    text = engine.tokenizer.apply_chat_template(messages).replace(rules.marker, expanded.text, 1)
    ids = engine.tokenizer.encode_rendered(text)
    images = place(ids, [expanded], rules.image_token_id)
    out = {"load_s": load_s, "prompt_tokens": len(ids)}
    for name in ("first", "again"):
        t = time.perf_counter()
        engine.add_request(name, Admitted(ids, SamplingParams(max_tokens=1, ignore_eos=True), images))
        cached = 0
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    cached = o.num_cached_tokens
        out[f"{name}_s"], out[f"{name}_cached"] = time.perf_counter() - t, cached
    out["encoder_misses"] = engine.runner.encoder.cache.misses
    out["encoder_hits"] = engine.runner.encoder.cache.hits
    del engine
    gc.collect()
    return out


def hf_ttft(args, d: Path, png: bytes) -> dict:
    import torch
    import transformers
    from PIL import Image

    t0 = time.perf_counter()
    model = transformers.AutoModelForImageTextToText.from_pretrained(str(d), dtype=getattr(torch, args.hf_dtype)).eval()
    proc = transformers.AutoProcessor.from_pretrained(str(d))
    load_s = time.perf_counter() - t0
    text = ("<bos><start_of_turn>user\n<start_of_image>" + args.question + "<end_of_turn>\n<start_of_turn>model\n")
    batch = proc(text=text, images=[[Image.open(io.BytesIO(png)).convert("RGB")]], return_tensors="pt")
    batch["pixel_values"] = batch["pixel_values"].to(model.dtype)
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=1, do_sample=False)
    out = {"load_s": load_s, "first_s": time.perf_counter() - t, "prompt_tokens": int(batch["input_ids"].shape[1])}
    del model
    gc.collect()
    return out


def run_vision(args, rep) -> None:
    import torch

    shape = _shape(args)
    t0 = time.perf_counter()
    d = write_model(shape)
    write_s = time.perf_counter() - t0
    png = picture(args.image)
    rounds = []
    threads = torch.get_num_threads()
    for _ in range(max(1, args.rounds)):
        torch.set_num_threads(threads)
        r = {"ridge": ridge_ttft(args, d, png)}
        if not args.no_hf:
            torch.set_num_threads(threads)
            r["hf"] = hf_ttft(args, d, png)
        rounds.append(r)
    best = min(r["ridge"]["first_s"] for r in rounds)
    again = min(r["ridge"]["again_s"] for r in rounds)
    hf = min(r["hf"]["first_s"] for r in rounds) if not args.no_hf else None
    rep.add("vision", {"shape": shape, "image": args.image, "path": str(d), "write_s": write_s, "rounds": rounds,
                       "threads": threads, "hf_dtype": args.hf_dtype})
    rep.table(f"time to first token: one {args.image} image and a {rounds[0]['ridge']['prompt_tokens']}-token "
              f"prompt, Gemma-3-4B-shaped ({args.layers} text layers, {args.vision_layers} tower layers), "
              f"{args.weights} weights, {threads} threads",
              ["round", "ridge first s", "ridge again s", "again / first", "prefix hit tokens",
               f"transformers ({args.hf_dtype}) s", "ridge / transformers"],
              [[i + 1, f"{r['ridge']['first_s']:.2f}", f"{r['ridge']['again_s']:.3f}",
                f"{r['ridge']['again_s'] / r['ridge']['first_s']:.3f}", r["ridge"]["again_cached"],
                f"{r['hf']['first_s']:.2f}" if "hf" in r else "-",
                f"{r['ridge']['first_s'] / r['hf']['first_s']:.2f}" if "hf" in r else "-"]
               for i, r in enumerate(rounds)] +
              [["best", f"{best:.2f}", f"{again:.3f}", f"{again / best:.3f}", "", f"{hf:.2f}" if hf else "-",
                f"{best / hf:.2f}" if hf else "-"]],
              note="again: the same request on the same engine (the encoder's rows from its cache, the prompt's "
                   "blocks from the prefix cache); ridge's first includes the encoder, run once. "
                   f"Encoder runs: {statistics.mean(r['ridge']['encoder_misses'] for r in rounds):.0f} a round")
