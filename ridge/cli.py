"""`ridge` command line: one entry point, one subcommand per job."""
from __future__ import annotations

import argparse
import logging
import os
import sys


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF directory (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    p.add_argument("--kv-dtype", default=None, choices=["fp8", "bf16", "fp16", "fp32"],
                   help="KV cache dtype (default: fp8 on CUDA, fp32 on CPU, by measurement)")
    p.add_argument("--max-model-len", type=int, default=None, help="cap the context below the model's own")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in flight per step")
    p.add_argument("--prefill-chunk", type=int, default=None, help="largest prefill chunk per step (default: from the ridge point)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="fixed KV pool size instead of sizing from memory")
    p.add_argument("--kv-memory-gib", type=float, default=None, help="cap on the KV pool")
    p.add_argument("--gpu-reserve-gib", type=float, default=1.0, help="GPU memory left for the desktop and others")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    p.add_argument("--ridge-point", type=float, default=None,
                   help="device FLOPs per byte (default: the plan table on GPU, measured on CPU)")
    p.add_argument("--speculative", default="off", metavar="ngram|draft:PATH|self:L|auto|off",
                   help="speculative decoding proposer (default: off)")
    p.add_argument("--num-speculative-tokens", type=int, default=8, help="most drafts per request per step")
    p.add_argument("--cpu-weight-format", default="auto", metavar="auto|fp32|bf16:N",
                   help="CPU: bf16 weights for steps of <= N tokens (auto: measured at start-up)")


def engine_config(args):
    from ridge.engine.engine import EngineConfig

    return EngineConfig(model=args.model, device=args.device, kv_dtype=args.kv_dtype, block_size=args.block_size,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        prefill_chunk=args.prefill_chunk, num_kv_blocks=args.num_kv_blocks,
                        kv_memory_gib=args.kv_memory_gib, gpu_reserve_gib=args.gpu_reserve_gib,
                        enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
                        ridge_point=args.ridge_point, speculative=args.speculative,
                        num_speculative_tokens=args.num_speculative_tokens,
                        cpu_weight_format=getattr(args, "cpu_weight_format", "auto"))


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_params(args):
    from ridge.engine.sampling import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                          seed=args.seed, stop=args.stop)


def run_generate_local(args) -> int:
    from ridge.engine.engine import LLMEngine

    engine = LLMEngine(engine_config(args))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    ids = engine.tokenizer.encode(args.prompt) if args.raw else engine.tokenizer.encode_chat(messages)
    rid = engine.add_request(None, ids, sampling_params(args))
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id == rid:
                sys.stdout.write(o.new_text)
                sys.stdout.flush()
                if o.finished:
                    final = o
    sys.stdout.write("\n")
    if final is not None and final.error:
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    return 0


def _add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a reply to one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as text")
    p.add_argument("--local", action="store_true", help="run the engine in this process")
    add_engine_args(p)
    add_sampling_args(p)
    from ridge.daemon.commands import add_client_args
    add_client_args(p)
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    if args.local:
        return run_generate_local(args)
    from ridge.daemon.commands import run_generate
    return run_generate(args)


def build_parser() -> argparse.ArgumentParser:
    from ridge.plan import add_plan_parser

    parser = argparse.ArgumentParser(prog="ridge", description="A local LLM inference daemon for one GPU.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_generate(sub)
    add_plan_parser(sub)
    from ridge.daemon.commands import add_daemon_parsers
    add_daemon_parsers(sub)
    from ridge.bench.command import add_bench_parser
    add_bench_parser(sub)
    from ridge.bench.daemon import add_bench_daemon_parser
    add_bench_daemon_parser(sub)
    from ridge.tui.command import add_top_parser  # textual is imported only when `ridge top` runs
    add_top_parser(sub)
    from ridge.daemon.service import add_service_parser
    add_service_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else os.environ.get("RIDGE_LOG_LEVEL", "INFO").upper(),
                        stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, MemoryError, OSError) as e:  # user-facing errors: a line, not a traceback
        if args.verbose:
            raise
        print(f"ridge: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
