"""What a constraint may cost the compiler, bounded before llguidance sees it (issue 38).

llguidance compiles a grammar recursively, one native stack frame per step of the
longest chain of rules and schema references it follows, and a native stack
overflow ends the whole daemon (SIGSEGV), not the request. So:

- Every compile runs on a thread of ours with a known stack (STACK_BYTES), not on
  whichever thread asked (the admission workers' stack is whatever RLIMIT_STACK
  gives: 8 MiB usually, 2 MiB when it is unlimited).
- Before that, the grammar's chain weight (chain_weight) must be at most MAX_CHAIN.
  It is an upper bound on the depth of any chain the compiler can follow: every
  Lark rule of every grammar, plus the largest JSON schema's containers and $refs
  (a chain visits each of them at most once; one schema cannot nest in another).
- A GBNF grammar has at most MAX_GBNF_RULES rules: llguidance converts it to Lark in
  Python, in time quadratic in its rules, on the caller's thread when a chat grammar
  embeds it.
- A compile gets COMPILE_SECONDS. llguidance's LLParserLimits bound its lexer and
  grammar size, but not its JSON schema compiler: 3,000 optional properties in one
  object take about 3 s under any of those limits. Past the budget the request is
  refused; the compile cannot be interrupted and finishes in the background, at
  most MAX_COMPILING at a time, so a stream of slow schemas holds at most that many
  cores and never an admission worker for longer than the budget.

Measured (tests/test_hostile_schemas.py has the shapes) on x86_64, crash thresholds
scale with the stack: with 8 MiB, a $ref chain of 2,490 links (2 steps each), a
chain of defs each nesting 3 objects (8 steps a link) of 406 links, a Lark rule
chain of 2,670 rules; with 64 MiB, 20,000 $ref links (40,000 steps), 3,241
nested-object links (25,900 steps) and 21,400 Lark rules. The worst step costs
about 3.1 KB of stack: MAX_CHAIN is a quarter of the lowest threshold at STACK_BYTES."""
from __future__ import annotations

import json
import re
import threading
import time

from ridge.errors import InvalidRequest

STACK_BYTES = 64 << 20  # address space only: pages are committed as a deep compile touches them
MAX_CHAIN = 5000  # the lowest measured crash at STACK_BYTES is 21,400 (Lark rules): over 4x margin
COMPILE_SECONDS = 1.0  # typical schemas compile in about a millisecond, a large tools grammar in 0.1 s; the
# costliest shape under MAX_CHAIN (4,900 optional properties) in 2 s on a quiet 2-core machine: refused
PREPARE_SECONDS = 10.0  # a grammar's text and chain check: linear in the request's bytes (a 10,000-link
# chain in 20 ms), kept off the compile's clock so that a chain too deep is named as such on a busy machine
MAX_GBNF_RULES = 500  # llama.cpp's own grammars have tens; a GBNF grammar's conversion is quadratic
MAX_COMPILING = 2  # compiles running at once, a timed-out one included until it ends

_slots = threading.BoundedSemaphore(MAX_COMPILING)
_stack_lock = threading.Lock()  # threading.stack_size is process-wide: set, start, restore
# A Lark rule or terminal definition: `name:`, `?name:`, `name[lazy]:`, `NAME.2:` at a line's start.
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\[[^\]\n]*\])?(?:\.-?\d+)?[ \t]*:", re.M)
_JSON = re.compile(r"%json\s*(?=\{)")


def chain_weight(grammar: str) -> int:
    """llguidance's grammar text (its JSON form, or Lark) -> an upper bound on the longest chain of
    rules and schema steps a compile can recurse through. Raises ValueError when it nests beyond
    what Python's JSON reader takes (far beyond what llguidance's own reader takes)."""
    if not grammar.lstrip().startswith("{"):
        return _lark_weight(grammar)
    top = _loads(grammar)
    rules, largest = 0, 0
    for g in top.get("grammars", ()) if isinstance(top, dict) else ():
        if not isinstance(g, dict):
            continue
        if g.get("json_schema") is not None:
            largest = max(largest, _json_weight(g["json_schema"]))
        if isinstance(g.get("lark_grammar"), str):
            r, j = _lark_parts(g["lark_grammar"])
            rules, largest = rules + r, max(largest, j)
    return rules + largest


def _lark_weight(text: str) -> int:
    rules, largest = _lark_parts(text)
    return rules + largest


def _lark_parts(text: str) -> tuple[int, int]:
    """-> (its rules, its largest inline `%json {...}` schema's weight)."""
    largest, dec = 0, json.JSONDecoder()
    for m in _JSON.finditer(text):
        try:
            schema, _ = dec.raw_decode(text, m.end())
        except ValueError:
            continue  # not JSON: llguidance refuses it
        except RecursionError:
            raise ValueError("an inline %json schema nests too deeply") from None
        largest = max(largest, _json_weight(schema))
    return len(_RULE.findall(text)), largest


def _loads(text: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it nests too deeply") from None


def _json_weight(value) -> int:
    """Containers (each a schema, or a list or map of them) and $refs: a chain passes each at most once."""
    n, todo = 0, [value]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            n += 1 + ("$ref" in v)
            todo.extend(v.values())
        elif isinstance(v, list):
            n += 1
            todo.extend(v)
    return n


def check_chain(grammar: str, what: str) -> None:
    """Raises InvalidRequest when the grammar may hold a chain too long to compile safely."""
    try:
        n = chain_weight(grammar)
    except ValueError as e:
        raise InvalidRequest(f"response_format: {what} is too deep to compile: {e}") from None
    if n > MAX_CHAIN:
        raise InvalidRequest(f"response_format: {what} is too deep to compile: its chains of rules and "
                             f"$refs may pass through {n} rules and schemas, at most {MAX_CHAIN}")


def check_gbnf(text: str, what: str) -> None:
    """llguidance converts GBNF to Lark in Python, in time quadratic in the rules (a chain of 1,000
    alternatives takes 2.7 s, holding the GIL): a GBNF grammar is refused past MAX_GBNF_RULES."""
    n = text.count("::=")
    if n > MAX_GBNF_RULES:
        raise InvalidRequest(f"response_format: {what} has {n} GBNF rules, at most {MAX_GBNF_RULES} (a Lark "
                             f"grammar may have up to {MAX_CHAIN})")


def run_bounded(build, what: str, seconds: float = COMPILE_SECONDS):
    """-> build(), run on a compile thread of STACK_BYTES. Raises InvalidRequest when it does not
    finish within `seconds` (waiting for a free compile slot included)."""
    deadline = time.monotonic() + seconds
    if not _slots.acquire(timeout=seconds):
        raise InvalidRequest(f"response_format: {what} was not compiled: {MAX_COMPILING} slow compiles are "
                             "still running; retry later")
    out: dict = {}
    done = threading.Event()

    def target():
        try:
            out["value"] = build()
        except BaseException as e:  # handed to the caller
            out["error"] = e
        finally:
            done.set()
            _slots.release()

    try:
        with _stack_lock:
            before = threading.stack_size(STACK_BYTES)
            try:
                threading.Thread(target=target, name="ridge-grammar").start()
            finally:
                threading.stack_size(before)
    except BaseException:
        _slots.release()  # the thread never ran
        raise
    if not done.wait(max(0.0, deadline - time.monotonic())):
        raise InvalidRequest(f"response_format: {what} took longer than {seconds:g} s to compile")
    if "error" in out:
        raise out["error"]
    return out["value"]
