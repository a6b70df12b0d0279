"""Chat templates under a budget: Jinja's immutable sandbox keeps a template from touching anything but its
variables, and this module keeps it from running forever or filling memory, whatever it is written to do.

A render gets a `Budget` sized from the chat it renders (`budget_for`): a number of steps, a size, and a margin
of memory. Going past any of them raises `TemplateBudget`, one line naming what ran out; nothing here depends
on the machine's speed, so a template passes or fails the same everywhere.

- steps: every item a loop goes through, every call (a macro, `caller()`, a recursive loop's `loop()`, a
  method), every filter and intercepted operation, and one more step per 64 characters of what they make or
  walk through. Repetition in Jinja is loops and calls, so loops that are each bounded but together endless,
  and recursion, run out of steps. (Counting the template's lines with a `sys.settrace` hook would do as well,
  but made rendering seven times slower; counting loop items and calls costs a generator step each);
- size: no value the template makes (a string, a list, the text captured by `{% set %}` or a macro, an integer's
  digits) and not its output may exceed it. The operations that can make a large value in one go are checked
  before they run: `*`, `**`, `+`, `%`, `~`, `str.format`, and the filters and method calls whose integer
  arguments or inputs say how large their result is (`center`, `indent`, `replace`, `join`, `tojson`, ...): an
  integer argument beyond the size, or a container that would print larger than it, is refused;
- memory: a last resort for what the checks above do not see (a list of a million strings, each within the
  size): the process's resident memory may not grow by more than the margin while the template renders
  (checked every 4,096 steps, on Linux).

For a chat of C characters in T messages, the budget is 100,000 + 1,000 T + C / 2 steps, a size of
1 MiB + 4 C characters and a memory margin of 128 MiB + 8 C bytes: the templates in use take 30 to 50 steps
per message of 600 characters (ChatML, Llama 3 and Qwen 2.5's templates measured) and print what they are given
plus a few markers, so only a template built to loop or to grow comes near it; one that does stops within a
fraction of a second.
"""

from __future__ import annotations

import json
import os
import re
import string
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from zaya.errors import ZayaError
from zaya.reading import size_text

_MiB = 1 << 20
_STEP_CHARS = 64  # an intercepted operation costs one step per this many characters it makes
_MEMORY_EVERY = 4096  # steps between two looks at the resident memory
_INT_BITS = 1 << 16  # integers the template makes: ~20,000 digits at most (far beyond any count or id)
_TOJSON_INDENT = 16
_COUNTED = "zaya_counted"  # the filter every loop's items go through
# filters that never turn a container into text: no need to weigh their arguments before they run
_NOT_PRINTING = frozenset({"length", "count", "first", "last", "default", "d", "list", "sort", "unique", "map",
                           "select", "reject", "selectattr", "rejectattr", "groupby", "batch", "slice", "sum",
                           "min", "max", "dictsort", "items", "attr", "random", "reverse", "round", "abs", "int",
                           "float", "bool", "safe"})
_PERCENT = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


class TemplateBudget(ZayaError):
    """A template went past its budget (`what` says which part)."""


@dataclass(frozen=True)
class Budget:
    """What one render may spend: steps, the size of any value it makes, and growth of resident memory."""

    steps: int
    size: int
    memory: int


def budget_for(chars: int, turns: int) -> Budget:
    """The budget of a render of a chat of `chars` characters in `turns` messages (see the module docstring)."""
    return Budget(steps=100_000 + 1_000 * turns + chars // 2, size=_MiB + 4 * chars,
                  memory=128 * _MiB + 8 * chars)


class _Run:
    """What one render has spent. The hot paths (a loop's items, `+` on strings) add to `steps` themselves and
    call `look` only once it reaches `next_look`."""

    __slots__ = ("budget", "next_look", "resident", "size", "steps")

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self.size = budget.size
        self.steps = 0
        self.next_look = min(_MEMORY_EVERY, budget.steps + 1)
        self.resident: int | None = None  # taken at the first look: what came before is within the checks

    def step(self, count: int = 1) -> None:
        self.steps += count
        if self.steps >= self.next_look:
            self.look()

    def look(self) -> None:
        """Past `next_look`: refuse a run past its steps, else look at the resident memory."""
        if self.steps > self.budget.steps:
            raise TemplateBudget(f"more than {self.budget.steps:,} steps")
        self.next_look = min(self.steps + _MEMORY_EVERY, self.budget.steps + 1)
        now = _resident()
        if now is None:
            return
        if self.resident is None:
            self.resident = now
        elif now - self.resident > self.budget.memory:
            raise TemplateBudget(f"more than {size_text(self.budget.memory)} of memory")

    def check(self, size: int, what: str = "a value") -> None:
        """Refuse something of `size` characters (or items) before it is made."""
        if size > self.size:
            raise TemplateBudget(f"{what} of more than {self.size:,} characters")

    def made(self, value: Any) -> Any:
        """Account for a value the template made: its size, and one step per `_STEP_CHARS` of it."""
        size = _shallow(value)
        self.check(size)
        self.step(1 + size // _STEP_CHARS)
        return value

    def check_int(self, value: Any) -> None:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.size:
            raise TemplateBudget(f"an argument of {_shown_int(value)}, more than the {self.size:,} characters a "
                                 "value may have")

    def check_printed(self, value: Any) -> None:
        """Refuse a container whose text would be larger than the size (its `str` is made in one go)."""
        if not isinstance(value, str) and _deep(value, self.size) > self.size:
            raise TemplateBudget(f"a value that prints as more than {self.size:,} characters")


_ACTIVE = threading.local()


def _run() -> _Run:
    """The render under way in this thread, or a fresh run with the smallest budget (a template rendered
    outside `render`)."""
    run = getattr(_ACTIVE, "run", None)
    return run if run is not None else _Run(budget_for(0, 0))


def render(template, variables: dict, budget: Budget) -> str:
    """`template` (compiled by `compile_bounded`) rendered with `variables` under `budget`."""
    run = _Run(budget)
    outer = getattr(_ACTIVE, "run", None)
    _ACTIVE.run = run
    try:
        parts, size, limit = [], 0, run.size
        for part in template.generate(**variables):
            size += len(part)
            if size > limit:
                run.check(size, "an output")
            parts.append(part)
        return "".join(parts)
    finally:
        _ACTIVE.run = outer


def _counted(iterable: Iterable) -> Iterable:
    """A loop's items, one step each (every `{% for %}` iterates through this)."""
    run = _run()
    for item in iterable:
        run.steps += 1
        if run.steps >= run.next_look:
            run.look()
        yield item


def compile_bounded(template: str, globals_: dict, filters: dict, extensions: list):
    """The template compiled in a bounded sandbox (trim_blocks and lstrip_blocks, as transformers renders)."""
    import jinja2.compiler
    import jinja2.nodes
    from jinja2.runtime import LoopContext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generator(jinja2.compiler.CodeGenerator):
        # `a ~ b` is compiled to a join of the operands' text, which no operator hook sees: send it through
        # the environment's `join_checked`
        def visit_Concat(self, node, frame) -> None:
            self.write("environment.join_checked((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Environment(ImmutableSandboxedEnvironment):
        code_generator_class = Generator
        intercepted_binops = frozenset({"+", "*", "**", "%"})

        def _parse(self, source, name, filename):
            # every loop iterates through `_counted`: repetition in Jinja is loops and calls, and both are
            # counted (`call`); recursive loops' `loop(...)` calls too
            tree = super()._parse(source, name, filename)
            for loop in list(tree.find_all(jinja2.nodes.For)):
                loop.iter = jinja2.nodes.Filter(loop.iter, _COUNTED, [], [], None, None, lineno=loop.iter.lineno)
            return tree

        def call_binop(self, context, operator, left, right):
            run = _run()
            if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept quick
                size = len(left) + len(right)
                if size > run.size:
                    run.check(size, "a joined value")
                run.steps += 1 + size // _STEP_CHARS
                if run.steps >= run.next_look:
                    run.look()
                return left + right
            _check_binop(run, operator, left, right)
            return run.made(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):
            run = _run()
            run.step()  # macros, caller(), a recursive loop's loop(): every call is a step
            args = _check_call(run, __obj, args, kwargs)
            if isinstance(__obj, LoopContext) and args:  # a recursive loop: its items are counted too
                args = (_counted(args[0]), *args[1:])
            return run.made(super().call(__context, __obj, *args, **kwargs))

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            text = value.__self__

            def checked(*args, **kwargs):
                run = _run()
                _check_format(run, text, args, kwargs)
                return run.made(wrapped(*args, **kwargs))

            return checked

        def concat(self, parts: Iterable[str]) -> str:
            # the text captured by {% set %} blocks, {% filter %} blocks and macros
            run, size, held = _run(), 0, []
            for part in parts:
                size += len(part)
                run.check(size, "a captured text")
                held.append(part)
            return run.made("".join(held))

        def join_checked(self, values: tuple) -> str:
            run = _run()
            for value in values:
                run.check_printed(value)
            return self.concat(str(value) for value in values)

    def finalize(value):
        if type(value) is not str:
            _run().check_printed(value)  # `{{ value }}` prints it in one go
        return value

    environment = Environment(trim_blocks=True, lstrip_blocks=True, extensions=extensions, finalize=finalize)
    environment.filters.update(filters)
    environment.filters = {name: _guarded(name, function) for name, function in environment.filters.items()}
    environment.filters[_COUNTED] = _counted
    # `lipsum(n, html, min, max)` writes n times max words, each argument within the size: not for chat templates
    environment.globals.pop("lipsum", None)
    environment.globals.update(globals_)
    return environment.from_string(template)


def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' `tojson` filter (Jinja's own escapes HTML characters), with a bounded indent."""
    if (isinstance(indent, int) and not isinstance(indent, bool) and not 0 <= indent <= _TOJSON_INDENT) or (
            isinstance(indent, str) and len(indent) > _TOJSON_INDENT):
        raise TemplateBudget(f"tojson's indent must be at most {_TOJSON_INDENT}")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# ---- the checks -----------------------------------------------------------------------------------------


def _guarded(name: str, function: Callable) -> Callable:
    """A filter whose integer arguments and printed inputs are checked before it runs, and its result after."""

    def guarded(*args, **kwargs):
        run = _run()
        values = [*args, *kwargs.values()]
        work = 1
        for value in values:
            run.check_int(value)
            if isinstance(value, (str, list, tuple, dict, range)):
                work += len(value) // _STEP_CHARS  # what a filter walks through costs steps too
        run.step(work)
        if name not in _NOT_PRINTING:
            for value in values:
                if isinstance(value, (list, tuple, dict)):
                    run.check_printed(value)
        text = next((a for a in args if isinstance(a, str)), None)
        if name == "replace" and text is not None:
            _check_replace(run, text, args[args.index(text) + 1:], kwargs)
        elif name == "indent" and text is not None:
            width = kwargs.get("width", args[args.index(text) + 1] if len(args) > args.index(text) + 1 else 4)
            _check_lines(run, text, len(width) if isinstance(width, str) else width)
        elif name == "wordwrap" and text is not None:
            wrap = kwargs.get("wrapstring") or "\n"
            run.check(len(text) * (1 + len(wrap)) if isinstance(wrap, str) else len(text), "a wrapped text")
        elif name == "join":
            args = _materialized(run, args)
        elif name == "format" and text is not None:
            _check_percent(run, text, args[args.index(text) + 1:] or tuple(kwargs.values()))
        return run.made(function(*args, **kwargs))

    guarded.__dict__.update(getattr(function, "__dict__", {}))  # jinja's pass_context and friends
    guarded.__name__ = getattr(function, "__name__", name)
    return guarded


def _materialized(run: _Run, args: tuple) -> tuple:
    """`join`'s arguments with its iterable made a list, weighed before it is joined."""
    args = list(args)
    for i, value in enumerate(args):
        if not isinstance(value, (str, int, float)) and hasattr(value, "__iter__") and not hasattr(
                value, "environment"):  # not the eval context join gets first
            items = []
            for item in value:
                items.append(item)
                run.check(len(items), "a list")
            run.check_printed(items)
            args[i] = items
            break
    return tuple(args)


def _check_binop(run: _Run, operator: str, left: Any, right: Any) -> None:
    sequences = (str, bytes, list, tuple)
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int) and not isinstance(left, bool):
            if abs(left).bit_length() + abs(right).bit_length() > _INT_BITS:
                raise TemplateBudget(f"an integer of more than {_INT_BITS:,} bits")
            return
        seq, count = (left, right) if isinstance(left, sequences) else (right, left)
        if isinstance(seq, sequences) and isinstance(count, int):
            run.check(_deep(seq, run.budget.size) * max(0, count), "a repeated value")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0 and (
                right > _INT_BITS or right * abs(left).bit_length() > _INT_BITS):
            raise TemplateBudget(f"an integer of more than {_INT_BITS:,} bits")
    elif operator == "+":
        if isinstance(left, sequences) and isinstance(right, sequences):
            limit = run.budget.size
            run.check(_deep(left, limit) + _deep(right, limit), "a joined value")
    elif operator == "%" and isinstance(left, str):
        _check_percent(run, left, right)


def _check_percent(run: _Run, text: str, values: Any) -> None:
    """`text % values`: the widths and precisions it asks for, and what it prints."""
    for match in _PERCENT.finditer(text):
        for number in match.groups():
            if number and number != "*":
                run.check_int(int(number))
    for value in values if isinstance(values, tuple) else (values,):
        run.check_int(value)
        run.check_printed(value)
    run.check(len(text))


def _check_format(run: _Run, text: str, args: tuple, kwargs: dict) -> None:
    """`text.format(...)`: the widths its fields ask for, and what it prints."""
    try:
        fields = list(string.Formatter().parse(text))
    except ValueError:
        return  # format itself refuses it
    for _, _, spec, _ in fields:
        for number in _DIGITS.findall(spec or ""):
            run.check_int(int(number))
    for value in (*args, *kwargs.values()):
        run.check_int(value)
        run.check_printed(value)


def _check_replace(run: _Run, text: str, rest: tuple, kwargs: dict) -> None:
    old = kwargs.get("old", rest[0] if rest else None)
    new = kwargs.get("new", rest[1] if len(rest) > 1 else None)
    if isinstance(old, (str, bytes)) and isinstance(new, (str, bytes)) and len(new) > len(old):
        count = len(text) + 1 if not old else text.count(old)
        run.check(len(text) + count * (len(new) - len(old)), "a replaced text")


def _check_lines(run: _Run, text: str, width: Any) -> None:
    if isinstance(width, int) and not isinstance(width, bool):
        run.check(len(text) + (text.count("\n") + 1) * max(0, width), "an indented text")


def _check_call(run: _Run, function: Any, args: tuple, kwargs: dict) -> tuple:
    """Check a call's integer arguments, and what str methods that grow their string would make; returns the
    arguments (an iterable given to `str.join` made a list, to be weighed)."""
    for value in (*args, *kwargs.values()):
        run.check_int(value)
    owner, name = getattr(function, "__self__", None), getattr(function, "__name__", "")
    if not isinstance(owner, (str, bytes)):
        return args
    if name == "replace":
        _check_replace(run, owner, args, kwargs)
    elif name == "join" and args:
        args = _materialized(run, args)
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(size, int):
            run.check(len(owner) + owner.count(b"\t" if isinstance(owner, bytes) else "\t") * max(0, size),
                      "an expanded text")
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))), default=1)
        run.check(len(owner) * max(1, longest), "a translated text")
    return args


def _shallow(value: Any) -> int:
    """A value's size as made: characters, items, or an integer's bytes."""
    if isinstance(value, (str, bytes)):
        return len(value)
    if isinstance(value, (list, tuple, dict, range)):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > _INT_BITS:
            raise TemplateBudget(f"an integer of more than {_INT_BITS:,} bits")
        return value.bit_length() // 8
    return 0


def _deep(value: Any, limit: int) -> int:
    """About how many characters a value prints as (a container: its items', each time it holds them), counted
    only up to `limit`."""
    total, todo = 0, [value]
    while todo and total <= limit:
        item = todo.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, dict):
            total += 2 + len(item)
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + len(item)
            todo.extend(item)
        elif isinstance(item, range):
            total += 2 + 8 * len(item)
        else:
            total += 8
    return total


def _shown_int(value: int) -> str:
    return f"{value:,}" if value.bit_length() < 64 else f"about 10^{int(value.bit_length() * 0.30103)}"


def _resident() -> int | None:
    """The process's resident memory in bytes (Linux), or None."""
    try:
        with open("/proc/self/statm", "rb") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None
