"""Chat templates rendered within a time and an output budget (issue 38).

A chat template is the model's code, run on what clients send. jinja2's sandbox keeps it
from the daemon's objects, but not from its time or memory: `'x' * 50000000` is one
expression, and two nested `range(100000)` loops run for minutes. A render here gets
RENDER_SECONDS and RENDER_CHARS of output; past either it raises TemplateBudgetError,
which the daemon answers as a refused request (the chat template failed: ...).

The rules, each checked where the sandbox lets us see the template work:
- time: every call, filter, attribute or item access, intercepted operator, `range`
  item and output chunk checks the clock;
- output: the rendered text, chunk by chunk, is at most RENDER_CHARS;
- one operation may not build a value larger than OP_CHARS: `*` and `+` on strings
  and lists, `**` on integers, printf and str.format widths, and a call's arguments
  (a width, a separator) estimated before it runs.
Not covered: a loop over a client's long string or list whose body does none of the
above (a template that does nothing per item); its time is bounded by that input."""
from __future__ import annotations

import functools
import re
import threading
import time

from jinja2.exceptions import SecurityError
from jinja2.sandbox import MAX_RANGE, ImmutableSandboxedEnvironment

RENDER_SECONDS = 1.0  # a real template renders a long chat in milliseconds
RENDER_CHARS = 8 << 20  # the prompt it renders is at most a frame (1 MiB by default) and its tools
OP_CHARS = 4 * RENDER_CHARS  # one value an operation may build, estimated before it is built
_WIDTH = re.compile(r"\d{6,}")  # a printf or format width worth a look
_state = threading.local()  # the render this thread runs: (deadline, chars so far)


class TemplateBudgetError(SecurityError):
    """A chat template ran past its time or output budget."""


def _tick() -> None:
    # No deadline outside render(): jinja folds constant filters while it compiles a template.
    deadline = getattr(_state, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise TemplateBudgetError(f"the chat template ran longer than {RENDER_SECONDS:g} s")


def _too_big(what: str) -> TemplateBudgetError:
    return TemplateBudgetError(f"the chat template builds {what} larger than {OP_CHARS} characters")


_SIZED = (str, list, tuple, dict)


def _size(v) -> int:
    """Characters or items, a list's strings' characters included (what joining it writes)."""
    if isinstance(v, (list, tuple)):
        return len(v) + sum(len(x) for x in v if isinstance(x, str))
    return len(v) if isinstance(v, _SIZED) else 0


def _check_args(values) -> None:
    """A call's result is at most about its largest string or list, times the next largest (a join's
    separator, a replace's new part), times its largest integer (a width, a count)."""
    sized = sorted((_size(v) for v in values if isinstance(v, _SIZED)), reverse=True)
    if not sized:
        return  # numbers alone: the result is a number or its text
    ints = [abs(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]
    grow = ((sized[1] if len(sized) > 1 else 0) + 1) * (max(ints, default=0) + 1)
    if sized[0] > OP_CHARS or (grow > 1 and (sized[0] + 1) * grow > OP_CHARS):
        raise _too_big("a value")


def _finalize(value):
    """Each {{ value }} before it is written: a value past OP_CHARS is refused before its text is built."""
    if _size(value) > OP_CHARS:
        raise _too_big("an output")
    return value


def _check_widths(fmt: str) -> None:
    if any(int(w) > OP_CHARS for w in _WIDTH.findall(fmt)):
        raise _too_big("a formatted string")


def _budgeted_filter(name: str, f):
    @functools.wraps(f)  # keeps jinja's pass_context marks
    def filt(*args, **kwargs):
        _tick()
        _check_args([*args, *kwargs.values()])
        if name == "format" and args and isinstance(args[0], str):
            _check_widths(args[0])
        return f(*args, **kwargs)
    return filt


def _range(*args):
    """jinja's safe range (at most MAX_RANGE items), checking the clock at each item."""
    r = range(*args)
    if len(r) > MAX_RANGE:
        raise OverflowError(f"range too big: at most {MAX_RANGE} items")
    for i in r:
        _tick()
        yield i


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def __init__(self, *args, **kwargs):
        super().__init__(*args, finalize=_finalize, **kwargs)
        self.globals["range"] = _range

    def finish_filters(self) -> None:
        """Call once the filters are set: each one checks the budget."""
        self.filters = {k: _budgeted_filter(k, f) for k, f in self.filters.items()}

    def call_binop(self, context, operator, left, right):
        _tick()
        if operator == "*":
            n, seq = (right, left) if isinstance(right, int) else (left, right)
            if isinstance(n, int) and _size(seq) * n > OP_CHARS:
                raise _too_big("a repeated string or list")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    max(left.bit_length(), 1) * right > 8 * OP_CHARS:
                raise _too_big("a number")
        elif operator == "%" and isinstance(left, str):
            _check_widths(left)
            _check_args(list(right) if isinstance(right, tuple) else [right])
        elif operator == "+" and _size(left) + _size(right) > OP_CHARS:
            raise _too_big("a joined string or list")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja's signature)
        _tick()
        base = getattr(__obj, "__self__", None)  # a bound method's object: "sep".join(xs)
        _check_args([base, *args, *kwargs.values()])
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj, attribute):
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        _tick()
        return super().getitem(obj, argument)

    def wrap_str_format(self, value):
        fmt = super().wrap_str_format(value)
        if fmt is not None:
            _check_widths(value.__self__)
        return fmt


def render(template, **context) -> str:
    """template: a Template of a BudgetedSandbox. Raises TemplateBudgetError past the budget."""
    _state.deadline = time.monotonic() + RENDER_SECONDS
    try:
        out, n = [], 0
        for chunk in template.generate(**context):
            n += len(chunk)
            if n > RENDER_CHARS:
                raise TemplateBudgetError(f"the chat template wrote more than {RENDER_CHARS} characters")
            _tick()
            out.append(chunk)
        return "".join(out)
    finally:
        _state.deadline = None
