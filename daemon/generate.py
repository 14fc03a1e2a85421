"""`ridge generate`: one reply to one prompt, streamed to the terminal, from the
daemon or (--local) from an engine in this process."""
from __future__ import annotations

import sys

from .commands import add_client_args, add_sampling_args, connect, sampling_fields, stream_reply


def add_generate_parser(sub) -> None:
    from ridge.engine.config import add_engine_args

    p = sub.add_parser("generate", help="generate a reply to one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as text")
    p.add_argument("--local", action="store_true", help="run the engine in this process")
    add_engine_args(p)
    add_sampling_args(p)
    add_client_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    return run_local(args) if args.local else run_through_daemon(args)


def _messages(args) -> list[dict]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]


def run_local(args) -> int:
    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.engine.sampling_params import SamplingParams

    engine = LLMEngine(engine_config(args))
    ids = engine.tokenizer.encode(args.prompt) if args.raw else engine.tokenizer.encode_chat(_messages(args))
    rid = engine.add_request(None, ids, SamplingParams(**sampling_fields(args)))
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


def run_through_daemon(args) -> int:
    from .client import RidgeError

    got = connect(args.endpoint)
    if got is None:
        return 1
    client, hello = got
    model = hello["model"]
    if args.model is not None:
        print(f"ridge: note: --model applies to --local only; the daemon serves {model['name']}", file=sys.stderr)
    print(f"[ridge daemon at {client.endpoint}, serving {model['name']}]", file=sys.stderr)
    kw = {"prompt": args.prompt} if args.raw else {"messages": _messages(args)}
    try:
        _, final = stream_reply(client, **kw, **sampling_fields(args))
    except RidgeError as e:
        print(f"ridge: {e.message} ({e.code})", file=sys.stderr)
        return 1
    finally:
        client.close()
    if final is None:
        return 130
    if final.error:
        print(f"error: {final.error}", file=sys.stderr)
        return 1
    return 0
