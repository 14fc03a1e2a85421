"""`ridge bench window`: a sliding-window model's decode step against its context.

A sliding layer attends to its last `window` keys whatever the context, so a model whose
layers all slide should decode at 4 windows of context in the time it takes at 1; Gemma 3's
full layers (1 in 6) still grow with the context. The model is random, Gemma-3-270M-shaped by
default, built from transformers' Gemma3TextConfig and written as safetensors with a byte-level
tokenizer; it loads through ridge's loader like any HF directory. Each context is a fixture of
`batch` requests sharing one long prompt (bench/host.py) on its own engine (one model, a pool
each), timed in pure decode with the contexts' steps interleaved; the attention section is the
engine's own (bench/profile.py). Each row also gives the KV blocks a request holds in each KV group
(cache/manager.py): a sliding group's stay at its window's, cdiv(window - 1, 16) + 1 blocks,
while the full group's grow with the context."""
from __future__ import annotations

import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# Gemma-3-270M (google/gemma-3-270m config.json), but its 262144-row vocabulary (--vocab).
GEMMA3_270M = dict(hidden_size=640, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=1,
                   head_dim=256, query_pre_attn_scalar=256, rope_theta=1_000_000.0, rope_local_base_freq=10000.0)
PATTERNS = ("sliding", "gemma3")  # every layer sliding; Gemma 3's 5 sliding : 1 full
_CHATML = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{'<|im_start|>assistant\n'}}{% endif %}")


def add_window_parser(sub, common) -> None:
    w = sub.add_parser("window", help="a sliding-window model's decode step at 1, 2 and 4 windows of context")
    common(w, workload=False)
    w.add_argument("--window", type=int, default=512, help="sliding window (Gemma-3-270M's: 512)")
    w.add_argument("--multiples", default="1,2,4", help="contexts, in windows")
    w.add_argument("--batch", type=int, default=16, help="requests in the step")
    w.add_argument("--steps", type=int, default=12, help="timed steps per context")
    w.add_argument("--layers", type=int, default=18, help="decoder layers (Gemma-3-270M: 18)")
    w.add_argument("--vocab", type=int, default=262144, help="vocabulary rows (Gemma 3: 262144)")
    w.add_argument("--patterns", default=",".join(PATTERNS),
                   help="layer patterns: sliding (every layer) and/or gemma3 (5 sliding : 1 full)")


def write_model(path: Path, pattern: str, window: int, layers: int, vocab: int, max_position: int) -> Path:
    """A random gemma3_text directory: transformers' config and initialisation, bf16 safetensors,
    a byte-level tokenizer with a ChatML template."""
    import torch
    import transformers

    if pattern not in PATTERNS:
        raise ValueError(f"--patterns {pattern!r}: choose from {', '.join(PATTERNS)}")
    types = ["sliding_attention" if pattern == "sliding" or (i + 1) % 6 else "full_attention" for i in range(layers)]
    cfg = transformers.AutoConfig.for_model("gemma3_text", vocab_size=vocab, num_hidden_layers=layers,
                                            sliding_window=window, layer_types=types,
                                            max_position_embeddings=max_position, **GEMMA3_270M)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(str(path))
    write_byte_tokenizer(path)
    return path


def write_byte_tokenizer(path: Path) -> None:
    """A byte-level tokenizer (the 256 bytes and ChatML's three specials, no merges) with a ChatML
    template, as tokenizer.json and tokenizer_config.json: enough for a random model's prompts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(specials + sorted(alphabet))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": _CHATML, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}))


def run_contexts(engines: dict, batch: int, steps: int, retries: int) -> list[dict]:
    """engines: context -> an engine (one model, a pool each). Per context: the median
    decode step and its attention section, in ms. The contexts' steps interleave, one step
    each in turn, so that drifting machine load hits all of them alike."""
    from .decode import _uncontended
    from .host import SharedPrefixDecode
    from .profile import step_breakdown

    fixtures = {ctx: SharedPrefixDecode(e, batch, ctx, steps * (2 + retries) + 16, f"win{ctx}")
                for ctx, e in engines.items()}
    try:
        for _ in range(3):  # warm: the first steps of a new context build its step state
            for fx in fixtures.values():
                fx.step()

        def timed():
            times = {ctx: [] for ctx in fixtures}
            for _ in range(steps):
                for ctx, fx in fixtures.items():
                    t = time.perf_counter()
                    fx.step()
                    times[ctx].append(time.perf_counter() - t)
            return times
        times, util, tries = _uncontended(timed, retries)
        attention = {ctx: [] for ctx in fixtures}
        for _ in range(3):
            for ctx, fx in fixtures.items():
                with step_breakdown(fx.engine) as bd:
                    bd.step(fx.step)
                attention[ctx].append(bd.per_step_ms().get("attention", 0.0))
        held = {ctx: dict(zip(_group_names(fx.engine), (statistics.mean(n) for n in zip(
            *(fx.engine.kv_cache_manager.num_held_blocks(i) for i in fx.ids))))) for ctx, fx in fixtures.items()}
    finally:
        for fx in fixtures.values():
            fx.close()
    rows = [{"context": ctx, "mean_context": fx.context, "batch": batch, "step_ms": 1e3 * statistics.median(times[ctx]),
             "attention_ms": statistics.median(attention[ctx]), "cpu_util": util, "tries": tries,
             "kv_blocks_held": held[ctx]} for ctx, fx in fixtures.items()]
    for r in rows:
        r["step_vs_first"] = r["step_ms"] / rows[0]["step_ms"]
        r["attention_vs_first"] = r["attention_ms"] / rows[0]["attention_ms"] if rows[0]["attention_ms"] else None
    return rows


def _group_names(engine) -> list[str]:
    return ["full" if g.window is None else f"sliding {g.window}" for g in engine.kv_cache_manager.groups]


def run_window(args, rep) -> None:
    from ridge.config import kv_bytes_per_token
    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.models.registry import read_config

    from .runs import warm_up

    multiples = [int(m) for m in args.multiples.split(",") if m.strip()]
    contexts = [m * args.window for m in multiples]
    for pattern in args.patterns.split(","):
        with tempfile.TemporaryDirectory(prefix="ridge-window-") as d:
            write_model(Path(d), pattern, args.window, args.layers, args.vocab, max(contexts) + 4 * args.steps + 256)
            # A pool per context, room for its fixture at full attention twice over (the prefix
            # once, each request's tail and decode); a throwaway model: no KV tier would see it.
            base = replace(engine_config(args), model=d, max_num_seqs=max(args.batch, 1), kv_disk=False,
                           kv_host_gib=0)
            per_token = kv_bytes_per_token(read_config(d), "fp32")
            engines, loaded = {}, None
            for ctx in contexts:
                tokens = ctx + args.batch * (6 * args.steps + 96)
                gib = max(0.25, 2 * tokens * per_token / 2 ** 30)
                engines[ctx] = loaded_engine = LLMEngine(replace(base, kv_memory_gib=gib), loaded=loaded)
                loaded = loaded_engine.loaded
                warm_up(loaded_engine)
            rep.set_env(engines[contexts[0]])
            rows = run_contexts(engines, args.batch, args.steps, args.retries)
            del engines, loaded, loaded_engine
        rep.add(f"window_{pattern}", {"pattern": pattern, "window": args.window, "layers": args.layers, "rows": rows})
        rep.table(f"decode step against context, window {args.window}, {pattern} layers, batch {args.batch} "
                  "(medians, ms)",
                  ["context", "windows", "step ms", "x 1 window", "attention ms", "x 1 window", "cpu util",
                   "KV blocks/request"],
                  [[r["context"], m, f"{r['step_ms']:.1f}", f"{r['step_vs_first']:.2f}",
                    f"{r['attention_ms']:.2f}" if r["attention_ms"] is not None else "-",
                    f"{r['attention_vs_first']:.2f}" if r["attention_vs_first"] is not None else "-",
                    f"{r['cpu_util']:.2f}",
                    ", ".join(f"{k} {v:.0f}" for k, v in r["kv_blocks_held"].items())] for m, r in zip(multiples, rows)],
                  note="x 1 window: against the first context; a sliding layer's attention and KV should stay flat")
