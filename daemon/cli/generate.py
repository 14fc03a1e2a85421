"""`ridge generate`: one reply to one prompt, streamed to the terminal, from the
daemon or (--local) from an engine in this process."""
from __future__ import annotations

import json
import sys

from .commands import add_client_args, add_sampling_args, connect, sampling_fields, stream_reply, user_content


def add_generate_parser(sub) -> None:
    from ridge.engine.config import add_engine_args

    p = sub.add_parser("generate", help="generate a reply to one prompt, streamed to the terminal")
    p.add_argument("prompt")
    p.add_argument("--system", default=None, help="system message")
    p.add_argument("--raw", action="store_true", help="no chat template: continue the prompt as text")
    p.add_argument("--local", action="store_true", help="run the engine in this process")
    p.add_argument("--image", metavar="FILE", action="append", default=[],
                   help="an image for a model that takes them (repeatable): placed before the prompt in its user "
                        "message; with --raw, the prompt marks each image's place with <__media__>, in order")
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE", default=None,
                     help="the reply is JSON valid against the JSON schema in FILE ('-': standard input)")
    fmt.add_argument("--json", action="store_true", help="the reply is a JSON object (any)")
    fmt.add_argument("--regex", default=None, help="the whole reply matches this regular expression")
    fmt.add_argument("--grammar", metavar="FILE", default=None,
                     help="the reply follows the grammar in FILE (Lark, as llguidance reads it; GBNF is converted)")
    add_engine_args(p)
    add_sampling_args(p)
    add_client_args(p)
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    try:
        fmt = response_format(args)
        args.images = read_images(args.image)
    except (OSError, ValueError) as e:
        print(f"ridge: {e}", file=sys.stderr)
        return 2
    if args.images and args.local:
        print("ridge: --image goes through the daemon (its admission decodes and checks images); drop --local",
              file=sys.stderr)
        return 2
    if fmt is not None:
        args.response_format = fmt
    return run_local(args) if args.local else run_through_daemon(args)


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else open(path, encoding="utf-8").read()


def response_format(args) -> dict | None:
    """The output constraint the flags ask for, as params.response_format (docs/protocol.md)."""
    if args.json_schema is not None:
        try:
            schema = json.loads(_read(args.json_schema))
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema}: not JSON ({e})") from None
        return {"type": "json_schema", "json_schema": {"name": "cli", "schema": schema}}
    if args.json:
        return {"type": "json_object"}
    if args.regex is not None:
        return {"type": "regex", "regex": args.regex}
    if args.grammar is not None:
        return {"type": "grammar", "grammar": _read(args.grammar)}
    return None


def _fields(args) -> dict:
    fmt = getattr(args, "response_format", None)
    return {**sampling_fields(args), **({"response_format": fmt} if fmt is not None else {})}


def _messages(args) -> list[dict]:
    return ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": user_content(args.prompt, 0, len(args.image))}]


def read_images(paths: list[str]) -> list[bytes]:
    """The files' bytes (the daemon decodes and checks them); OSError names the file."""
    out = []
    for path in paths:
        with open(path, "rb") as f:
            out.append(f.read())
    return out


def run_local(args) -> int:
    from ridge.engine.config import engine_config
    from ridge.engine.engine import LLMEngine
    from ridge.engine.sampling_params import SamplingParams
    from ridge.errors import InvalidRequest

    engine = LLMEngine(engine_config(args))
    ids = engine.tokenizer.encode(args.prompt) if args.raw else engine.tokenizer.encode_chat(_messages(args))
    try:
        rid = engine.add_request(None, ids, SamplingParams(**_fields(args)))
    except InvalidRequest as e:
        print(f"ridge: {e}", file=sys.stderr)
        return 1
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
    from ..client import RidgeError

    got = connect(args.endpoint)
    if got is None:
        return 1
    client, hello = got
    model = hello["model"]
    if args.model is not None:
        print(f"ridge: note: --model applies to --local only; the daemon serves {model['name']}", file=sys.stderr)
    print(f"[ridge daemon at {client.endpoint}, serving {model['name']}]", file=sys.stderr)
    kw = {"prompt": args.prompt} if args.raw else {"messages": _messages(args)}
    if args.images:
        kw["images"] = args.images
    try:
        _, final = stream_reply(client, **kw, **_fields(args))
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
