"""The daemon's subcommands: `ridge serve`, `ridge chat`, `ridge status`, `ridge models`,
`ridge pull` (daemon/pull.py), and
what `ridge generate` shares with them (daemon/cli/generate.py)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

NO_DAEMON_HINT = ("Start one with `ridge serve` (in another terminal, or as a service), "
                  "or run the model in this process with `ridge generate --local ...`.")


def add_client_args(p) -> None:
    p.add_argument("--endpoint", default=None,
                   help="daemon endpoint (default: $RIDGE_ENDPOINT, then the user socket, then the system socket)")


def _flagged():
    from ridge.request import specs

    return [s for s in specs().values() if s.rule.flag]


def add_sampling_args(p) -> None:
    """The request's sampling fields declared as flags (ridge/request.py): names, help and defaults."""
    for s in _flagged():
        flag = "--" + s.name.replace("_", "-")
        if s.kind is list:  # a list of strings: the flag repeats
            p.add_argument(flag, action="append", default=[], help=f"{s.rule.doc} (repeatable)")
            continue
        shown = "" if s.default_value is None else f" (default: {s.default_value})"
        p.add_argument(flag, type=s.kind, default=s.default_value, help=s.rule.doc + shown)


def sampling_fields(args) -> dict:
    """The sampling flags as a request's fields (the protocol's and SamplingParams' names): those
    that differ from the declared defaults, and max_tokens (a command's own default may differ)."""
    out = {}
    for s in _flagged():
        v = getattr(args, s.name)
        if s.name == "max_tokens" or v != s.default_value:
            out[s.name] = list(v) if s.kind is list else v
    return out


def add_daemon_parsers(sub) -> None:
    from ridge.options import add_options

    from .config import add_serve_args
    from ..gateway.settings import GATEWAY_OPTIONS

    s = sub.add_parser("serve", help="run the daemon: serve a model over ZeroMQ (docs/protocol.md)",
                       description="Options come from flags, then RIDGE_* variables, then "
                                   "$XDG_CONFIG_HOME/ridge/config.toml (see --print-config).")
    add_serve_args(s)
    s.set_defaults(func=_serve)

    c = sub.add_parser("chat", help="a multi-turn chat with the daemon's model, in the terminal")
    c.add_argument("--system", default=None, help="system message")
    add_client_args(c)
    add_sampling_args(c)
    c.set_defaults(func=run_chat, max_tokens=512)

    g = sub.add_parser("gateway", help="serve the OpenAI-compatible HTTP API for the running daemon",
                       description="An HTTP server (OpenAI's /v1/chat/completions, /v1/completions, /v1/models; "
                                   "/health, /metrics) that is a client of the daemon. Options come from flags, "
                                   "then RIDGE_* variables, then the daemon's config file.")
    add_options(g, GATEWAY_OPTIONS, given_only=True)
    add_client_args(g)
    g.add_argument("--config", default=None, help="config file (default: $XDG_CONFIG_HOME/ridge/config.toml)")
    g.set_defaults(func=run_gateway)

    st = sub.add_parser("status", help="the daemon's model, load, KV cache and memory")
    st.add_argument("--json", action="store_true", help="the whole stats reply as JSON")
    add_client_args(st)
    st.set_defaults(func=run_status)

    m = sub.add_parser("models", help="the models the daemon can serve: loaded or not, their memory, when "
                                      "each unloads (docs/protocol.md §3.10)")
    m.add_argument("--json", action="store_true", help="the models reply as JSON")
    m.add_argument("--config", default=None, help="config file, read when no daemon runs (default: "
                                                  "$XDG_CONFIG_HOME/ridge/config.toml)")
    add_client_args(m)
    m.set_defaults(func=run_models)

    pl = sub.add_parser("pull", help="download a model from the Hugging Face Hub into the models directory",
                        description="REPO:TAG picks a GGUF repository's file(s) of that quantization "
                                    "(unsloth/Qwen3-8B-GGUF:Q8_0); REPO alone, a safetensors repository (or a GGUF one "
                                    "with a single quantization). Files are checked against the Hub's sha256 before "
                                    "they are moved in; a running daemon serves the model at once. HF_TOKEN and "
                                    "HF_ENDPOINT are honoured.")
    pl.add_argument("name", metavar="REPO[:TAG]", help="a Hub repository, optionally with hf.co/ before it")
    pl.add_argument("--revision", default=None, help="a branch, tag or commit of the repository (default: main)")
    pl.add_argument("--models-dir", default=None, help="where to put it (default: the daemon's models_dir: "
                                                       "RIDGE_MODELS_DIR, config.toml, then $XDG_DATA_HOME/ridge/models)")
    pl.add_argument("--config", default=None, help="config file whose models_dir to use (default: "
                                                   "$XDG_CONFIG_HOME/ridge/config.toml)")
    pl.set_defaults(func=run_pull)


def _serve(args) -> int:
    from .serve import run_serve
    return run_serve(args)


def gateway_endpoint(values: dict, keyed: bool) -> str | None:
    """The daemon `ridge gateway` serves (None: found on each connect, as every client finds it).
    A gateway without a key is pinned at start to the daemon found then, or to the user socket, so
    that it never falls back to the system socket later: in front of that one it needs a key."""
    from ..transport.endpoint import find_daemon, system_endpoint, user_endpoint

    given = values["endpoint"] or (system_endpoint() if values["system"] else None)
    if given or keyed:
        return given
    return find_daemon()[0] or user_endpoint()


def run_gateway(args) -> int:
    from .config import resolve
    from ..transport.endpoint import EndpointError, system_endpoint
    from ..gateway.run import run_foreground
    from ..gateway.settings import gateway_settings, refuse_keyless_system
    from .serve import setup_logging

    values = resolve(args).values  # the daemon's config file too: the endpoint it serves, the gateway's keys
    setup_logging()
    try:
        settings = gateway_settings(values)
        endpoint = gateway_endpoint(values, settings.api_key is not None)
        if endpoint == system_endpoint():
            refuse_keyless_system(settings.url, settings.api_key)
        return run_foreground(settings, endpoint, gateway_settings(values, None, key="ollama"))
    except EndpointError as e:
        print(f"ridge: {e}", file=sys.stderr)
        return 1


def connect(endpoint: str | None):
    """-> (Client, hello reply), or None after saying plainly that no daemon runs."""
    from ..client import Client, DaemonUnavailable

    try:
        client = Client(endpoint, timeout=30.0)
        return client, client.hello()
    except DaemonUnavailable as e:
        print(f"ridge: {e.message}.\n{NO_DAEMON_HINT}", file=sys.stderr)
        return None


def stream_reply(client, **kw) -> tuple[str, object]:
    """Print a streamed reply; Ctrl-C aborts it. -> (text, final or None). A reasoning model's
    thinking (docs/protocol.md §3.2.3) is shown dimmed on a terminal, and left out of a pipe."""
    s = client.stream(**kw)
    tty = sys.stdout.isatty()
    try:
        for d in s:
            if d.index == 0:
                if d.reasoning and tty:
                    sys.stdout.write(f"\x1b[2m{d.reasoning}\x1b[0m")
                sys.stdout.write(d.text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        s.close()
        sys.stdout.write(" [stopped]")
    sys.stdout.write("\n")
    return s.text, s.final


CHAT_HELP = ("Commands: /image PATH attaches an image to your next message (repeatable), /reset forgets the "
             "conversation, /exit (or Ctrl-D) quits; Ctrl-C stops a reply.")


def run_chat(args) -> int:
    from ..client import RidgeError

    got = connect(args.endpoint)
    if got is None:
        return 1
    client, hello = got
    model = hello["model"]
    print(f"ridge chat: {model['name']} ({model['arch']}, context {model['max_model_len']}) "
          f"at {client.endpoint}\n{CHAT_HELP}")
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    images: list[bytes] = []  # the conversation's, each named by its index in a message's image part
    attached: list[bytes] = []  # /image's, for the next message
    try:
        while True:
            try:
                line = input("> ")
            except EOFError:
                print()
                return 0
            except KeyboardInterrupt:
                print()
                continue
            text = line.strip()
            if not text:
                continue
            if text in ("/exit", "/quit"):
                return 0
            if text == "/reset":
                history.clear(), images.clear(), attached.clear()
                print("(conversation cleared)")
                continue
            if text.startswith("/image "):
                attached += _attach(text.removeprefix("/image ").strip())
                continue
            history.append({"role": "user", "content": user_content(line, len(images), len(attached))})
            images += attached
            sent, attached = len(attached), []
            try:
                reply, final = stream_reply(client, messages=system + history, **sampling_fields(args),
                                            **({"images": images} if images else {}))
            except RidgeError as e:
                history.pop()
                del images[len(images) - sent:]
                hint = " Try /reset." if e.code == "invalid_request" else ""
                print(f"ridge: {e.message}.{hint}", file=sys.stderr)
                continue
            history.append({"role": "assistant", "content": reply})
            if final is not None and final.finish_reason == "length":
                print("(the reply hit max_tokens)", file=sys.stderr)
    finally:
        client.close()


def user_content(text: str, first: int, count: int) -> str | list[dict]:
    """A user message's content with `count` images first (the request's images from index `first`),
    as docs/protocol.md §3.2.5 writes image parts; without images, the text alone."""
    if not count:
        return text
    return [{"type": "image", "image": first + i} for i in range(count)] + [{"type": "text", "text": text}]


def _attach(path: str) -> list[bytes]:
    """/image PATH: the file's bytes for the next message (the daemon checks them), or nothing."""
    try:
        with open(os.path.expanduser(path), "rb") as f:
            data = f.read()
    except OSError as e:
        print(f"ridge: {path}: {e.strerror}", file=sys.stderr)
        return []
    print(f"(image {path} attached to your next message)")
    return [data]


def _gib(n) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def run_status(args) -> int:
    from ..client import RidgeError

    got = connect(args.endpoint)
    if got is None:
        return 1
    client, _ = got
    try:
        reply = client.stats()
    except RidgeError as e:
        print(f"ridge: {e.message}", file=sys.stderr)
        return 1
    finally:
        client.close()
    if args.json:
        print(json.dumps({k: reply[k] for k in ("model", "stats", "daemon", "time", "seq")}, indent=2))
        return 0
    print(format_status(client.endpoint, reply))
    return 0


def run_models(args) -> int:
    """The daemon's `models` reply; with no daemon running, what its configuration would serve."""
    from ..client import Client, DaemonUnavailable, RidgeError

    try:
        client = Client(args.endpoint, timeout=30.0)
        try:
            reply = client.models()
        finally:
            client.close()
    except DaemonUnavailable:
        reply = offline_models(args)
    except RidgeError as e:
        print(f"ridge: {e.message}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(reply, indent=2))
        return 0
    print(format_models(reply))
    return 0


def run_pull(args) -> int:
    """`ridge pull`: into the models directory `ridge serve` would scan with the same configuration
    (daemon/pull.py); the registry reads that directory on each listing, so nothing tells the daemon."""
    import argparse

    from ..frontend.registry import default_models_dir, served_name
    from ..pull import PullError, plan, pull
    from .config import resolve

    c = resolve(argparse.Namespace(config=args.config, models_dir=args.models_dir)).values
    models_dir = Path(c["models_dir"]) if c["models_dir"] else default_models_dir()
    try:
        p = plan(args.name, args.revision)
        print(f"pulling {p.repo} at {p.commit[:12]}: {len(p.files)} file(s), {_gib(p.total)} into {models_dir}",
              file=sys.stderr)
        path = pull(p, models_dir)
    except PullError as e:
        print(f"ridge: {e}", file=sys.stderr)
        return 1
    name = served_name({"path": str(path), "name": path.name})
    print(f"{path}\nserved as {name!r}: `ridge models` lists it, a request naming it loads it")
    return 0


def offline_models(args) -> dict:
    """The registry `ridge serve` would build from the same configuration, nothing loaded."""
    import argparse
    import time

    from ridge.durations import parse_duration, wire_duration
    from ridge.quant.source import resolve_model_path

    from ..frontend.registry import Entry, Registry, default_models_dir, served_name
    from .config import resolve

    res = resolve(argparse.Namespace(config=args.config))
    c = res.values
    path = str(resolve_model_path(c["model"]))
    name = c["served_model_name"] or served_name({"path": path, "name": Path(path).stem})
    reg = Registry(Entry(name, path, source="default"),
                   Path(c["models_dir"]) if c["models_dir"] else default_models_dir(), res.models, str(res.path))
    keep = parse_duration(c["keep_alive"])
    models = []
    for n, e in reg.entries().items():
        size, mtime, fmt = e.disk()
        models.append({"name": n, "path": e.path, "default": e is reg.default, "size": size, "modified_at": mtime,
                       "format": fmt, "state": "available", "loaded": False, "bytes": 0,
                       "keep_alive": wire_duration(keep if e.keep is None else e.keep), "expires_at": None})
    return {"type": "models", "default": name, "models": models, "running": False, "time": time.time()}


def _until(m: dict, now: float) -> str:
    if m["state"] != "ready":
        return "-"
    if m.get("expires_at") is None:
        return "kept" if m["keep_alive"] == -1 else "in use"
    left = max(m["expires_at"] - now, 0.0)
    return f"{left:.0f} s" if left < 120 else f"{left / 60:.0f} min"


def format_models(reply: dict) -> str:
    import time

    now = time.time()
    rows = [("NAME", "KIND", "STATE", "MEMORY", "UNLOADS IN", "ON DISK", "PATH")]
    for m in reply["models"]:
        rows.append((m["name"] + (" *" if m["default"] else ""), m.get("kind", "-"),
                     m["state"] + (" (parked)" if m.get("parked") else ""),
                     _gib(m["bytes"]) if m["bytes"] else "-", _until(m, now), _gib(m["size"]), m["path"] or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    head = "no daemon is running: what it would serve" if reply.get("running") is False else \
        f"{sum(m['loaded'] for m in reply['models'])} loaded of at most {reply['max_loaded_models']}"
    return head + " (* the default)\n" + "\n".join(lines)


def _tier_lines(t: dict | None) -> list[str]:
    if not t:
        return []
    out = []
    for name in ("host", "disk"):
        x = t[name]
        if not x["enabled"]:
            out.append(f"kv {name:<6} off" + (f" ({x['off_reason']})" if x.get("off_reason") else ""))
            continue
        where = f" in {x['path']}" if x.get("path") else ""
        out.append(f"kv {name:<6} {x['blocks']} blocks, {_gib(x['used_bytes'])} of {_gib(x['capacity_bytes'])}{where}; "
                   f"{x['hits']} hits, {x['misses']} misses; {_gib(x['bytes_in'])} in, {_gib(x['bytes_out'])} out"
                   + (f"; {x['corrupt']} corrupt files refused" if x.get("corrupt") else "")
                   + ("; writes paused: the disk is full" if x.get("paused") else ""))
    w = t["step_wait"]
    out.append(f"kv tiers  device {t['device']['hits']} hits, {t['device']['misses']} misses; "
               f"{t['loading']} loading; tier work {w['pct']:.2f}% of step time (at most {w['max_pct']:.1f}% of one)")
    return out


def weights_label(m: dict) -> str:
    """FP8 where the device holds FP8; else the dtype held, and the numbers in it where they are
    rounded ones (FP8 or bf16 values upcast on CPU)."""
    if m["fp8_weights"]:
        return "FP8"
    held, kind = m["weight_dtype"], m.get("weights") or ("fp8" if m["quantized"] else None)
    if kind == "fp8":
        return f"{held} (FP8-quantized)"
    if kind == "bf16" and held != "bfloat16":
        return f"{held} (bf16 values)"
    return held


def format_status(endpoint: str, reply: dict) -> str:
    m, s, d = reply["model"], reply["stats"], reply["daemon"]
    mem, tot = s["memory"], s["totals"]
    used = s["kv_blocks_used"] / max(1, s["kv_blocks_total"])
    weights = weights_label(m)
    lines = [
        f"ridge daemon at {endpoint}: {d['state']}, pid {d['pid']}, up {s['uptime']:.0f} s",
        f"model     {m['name']}  ({m['arch']}, {m['num_layers']} layers, context {m['max_model_len']}, "
        f"{weights} weights, on {m['device']})",
        f"requests  {s['running']} running, {s['waiting']} waiting, {s['preempted']} preempted; "
        f"{d['in_flight']} in flight from {d['clients']} client(s)",
        f"kv cache  {s['kv_blocks_used']}/{s['kv_blocks_total']} blocks used ({100 * used:.1f}%), "
        f"{s['kv_blocks_cached']} cached; {m['kv_dtype']}, {m['block_size']} tokens per block; "
        f"prefix hit rate {100 * s['prefix_hit_rate']:.1f}%",
        f"speed     prefill {s['prefill_tps']:.1f} tok/s, decode {s['decode_tps']:.1f} tok/s (last 10 s); "
        f"ridge point {m['ridge_point']:.1f} FLOP/B ({m['ridge_source']})",
        f"memory    {mem['device']}: total {_gib(mem['device_total'])}, weights {_gib(mem['weights'])}, "
        f"KV pool {_gib(mem['kv_pool'])}, activations {_gib(mem['activations'])}, "
        f"reserve {_gib(mem['reserve'])}, free {_gib(mem['device_free'])}",
        f"host      total {_gib(mem['host_total'])}, available {_gib(mem['host_available'])}, "
        f"daemon RSS {_gib(mem['host_rss'])}",
        *_tier_lines(s.get("kv_tiers")),
        f"totals    {tot['requests']} requests, {tot['prefill_tokens']} prefill and {tot['decode_tokens']} decode "
        f"tokens in {tot['steps']} steps; {tot['errors']} errors; aborts {d['aborts']}",
    ]
    return "\n".join(lines)
