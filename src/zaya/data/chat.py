"""Chats as training documents: a conversation rendered with a chat template, and which of its characters the
model learns to produce.

    chat = ChatFormat.create(template, bos_token="<bos>", eos_token="<eos>")
    record = chat.record(index, {"messages": [...]})     # a document with its spans, or a bad record
    mask = span_mask(encoding.offsets, record.spans)     # 1 for each token that overlaps a span

A template is Jinja2 in transformers' convention: it sees `messages` (each {"role", "content"}),
`add_generation_prompt`, `bos_token` and `eos_token`, and may call `raise_exception` and `tojson` and use loop
controls; it is rendered as `apply_chat_template` renders it (a sandbox, trim_blocks, lstrip_blocks), so an
export's `AutoTokenizer` gives the ids zaya trains on. `{% generation %}` blocks render as their contents.
Nothing time-dependent is offered (`strftime_now`): a build must not depend on the day it ran.

The spans are found without searching the text for the messages, which could occur in it more than once: an
assistant turn starts where the rendering of the turns before it, with the generation prompt, ends (chat
templates render a conversation as its beginning plus the new turn), and it ends after the first end-of-turn
marker that follows its content. The end-of-turn marker is what the template writes right after an
assistant's content, found once, by rendering a probe conversation.

Rendering every assistant turn's beginning costs time quadratic in the chat's length, so it is done only for
chats of up to `_EXACT_REPLIES` replies (nearly all of them). A longer chat is rendered twice more: with a
private-use character (U+E000 and up, or U+F0000 and up if the chat uses those) in front of each reply's
content, and if the template trims it, after its leading whitespace instead. Where those characters land is
where the replies start; the tagged text without them must be the plain one, and the first and last replies'
starts are checked against the renderings of the turns before them, as for a short chat. Whatever does not
agree makes the chat a bad record rather than a guess. Every render runs under a budget sized from the chat
(`sandbox.py`): a template that loops without end or grows a string without bound stops the build with one
line naming the template and the chat. A chat has at most `MAX_CHAT_TURNS` (10,000) messages and
`MAX_CHAT_BYTES` (16 MiB).

Markers are the strings shaped `<|name|>`, `<name>` or `</name>` that a template writes around the messages
(`<|im_start|>` and `<|im_end|>` for the default, a ChatML-like template). A BPE trained for a chat dataset
gets them as special tokens; a given tokenizer must have each as one token already, as a text build's has when
it reserved them (`--reserve-chat-markers`: pre-training and the chats after it then share one tokenizer).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from zaya.data.records import MAX_CHAT_TURNS, Record, clean
from zaya.data.sandbox import TemplateBudget, budget_for, compile_bounded, render, tojson
from zaya.errors import ZayaError
from zaya.reading import MAX_DEPTH, check_depth, read_text

ROLES = ("system", "user", "assistant")
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_MARKER = re.compile(r"<\|[^\s<>|]+\|>|</?[A-Za-z][\w.-]*>")
# probe contents: plain words, so that no template transformation (trim, capitalize aside) changes them
_PROBE = {"system": "zaya probe system", "user": "zaya probe user", "assistant": "zaya probe assistant"}
_EXACT_REPLIES = 8  # chats with more replies are rendered in linear time (see the module docstring)
# the character put before the k-th reply is chr(first + k), from the first of these ranges of private-use
# characters that the chat does not use: the basic plane's keeps the tagged text at two bytes a character
_TAG_RANGES = ((0xE000, 0xF8FF), (0xF0000, 0xFFFFD))


class ChatProblem(ValueError):
    """A chat the template cannot render into spans (a bad record, not a bad template)."""


@dataclass(frozen=True)
class ChatFormat:
    """A chat template with what the builder needs to know about it: the special-token strings it is given,
    its markers and its end-of-turn marker. Only strings: it travels to the worker processes."""

    template: str
    bos_token: str | None
    eos_token: str | None
    markers: tuple[str, ...]
    end_of_turn: str
    source: str = "the chat template"  # the template's name in messages: its file, or what it is

    @classmethod
    def create(cls, template: str, *, bos_token: str | None = None, eos_token: str | None = None,
               tokens: Sequence[str] = (), source: str = "the chat template") -> ChatFormat:
        """Check a template and find its markers and end-of-turn marker; `tokens` are further strings that
        count as markers (a given tokenizer's added tokens), `source` names the template in errors."""
        compile_template(template, source)
        probe = cls(template, bos_token, eos_token, (), "", source)
        markers = _scaffold_markers(probe, source)
        end = _end_of_turn(probe, {*markers, *tokens, *(t for t in (bos_token, eos_token) if t)}, source)
        if end not in markers:
            markers = (*markers, end)
        return cls(template, bos_token, eos_token, markers, end, source)

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for a conversation, rendered under the budget of its size (exceptions of the
        template and of Jinja pass through; going past the budget is a `TemplateBudget` naming the template)."""
        variables = {"messages": [dict(m) for m in messages], "add_generation_prompt": add_generation_prompt}
        variables.update({k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v})
        try:
            return render(compile_template(self.template, self.source), variables, _budget(messages))
        except TemplateBudget as exc:
            raise TemplateBudget(f"{self.source}: the chat template went past its budget ({exc})") from None

    def render_with_spans(self, messages: Sequence[dict]) -> tuple[str, tuple[tuple[int, int], ...]]:
        """The conversation's text, and the character span [start, stop) of each assistant turn: its content and
        the end-of-turn marker after it (see the module docstring). Raises `ChatProblem`."""
        text = self.render(messages)
        replies = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
        if len(replies) <= _EXACT_REPLIES:
            starts = [self._start(messages, i, text) for i in replies]
        else:
            starts = self._tagged_starts(messages, replies, text)
        spans = []
        for i, start in zip(replies, starts, strict=True):
            content = messages[i]["content"]
            after = start + len(content) if text.startswith(content, start) else start
            stop = text.find(self.end_of_turn, after)
            if stop < 0:
                raise ChatProblem(f"the chat template writes no {self.end_of_turn} after message {i + 1}")
            spans.append((start, stop + len(self.end_of_turn)))
        return text, tuple(spans)

    def _start(self, messages: Sequence[dict], i: int, text: str) -> int:
        """Where message `i` (a reply) starts: where the turns before it end, with the generation prompt."""
        prefix = self.render(messages[:i], add_generation_prompt=True)
        if not text.startswith(prefix):
            raise ChatProblem(f"the chat template renders the turns before message {i + 1} differently once "
                              "it follows, so its start cannot be told")
        return len(prefix)

    def _tagged_starts(self, messages: Sequence[dict], replies: list[int], text: str) -> list[int]:
        """The replies' starts from one more render, with a private-use character before each reply's content (or
        after its leading whitespace, for templates that trim it); checked against `_start` for the first and
        the last reply."""
        first, tags = _free_tags(messages, len(replies))
        for after_space in (False, True):
            tagged = [dict(m) for m in messages]
            for k, i in enumerate(replies):
                content = tagged[i]["content"]
                cut = len(content) - len(content.lstrip()) if after_space else 0
                tagged[i]["content"] = content[:cut] + chr(first + k) + content[cut:]
            marked = self.render(tagged)
            found = [(m.start(), ord(m.group()) - first) for m in tags.finditer(marked)]
            if [k for _, k in found] == list(range(len(replies))) and _same_but_tags(marked, found, text):
                break
        else:
            raise ChatProblem("the chat template does not write each reply's content as it is given, so the "
                              "replies of a chat this long cannot be told")
        del marked, tagged
        starts = [position - k for position, k in found]
        for k in {0, len(replies) - 1}:
            if self._start(messages, replies[k], text) != starts[k]:
                raise ChatProblem(f"the chat template does not start message {replies[k] + 1} right after the "
                                  "generation prompt, so the replies of a chat this long cannot be told")
        return starts

    def record(self, index: int, value: dict, invalid_utf8: bool = False) -> Record:
        """The document of one chat record (a JSON object with `messages`), or a bad record saying what is
        wrong (a fatal one when the template goes past its budget: that is the template's problem)."""
        messages, problem = check_messages(value)
        if problem is not None:
            return Record(index, None, problem)
        invalid = invalid_utf8
        for message in messages:
            message["content"], bad = clean(message["content"])
            invalid = invalid or bad
        try:
            text, spans = self.render_with_spans(messages)
        except ChatProblem as exc:
            return Record(index, None, str(exc))
        except TemplateBudget as exc:
            return Record(index, None, f"{exc} on this chat", fatal=True)
        except Exception as exc:  # whatever the template raises is this record's problem
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            return Record(index, None, f"the chat template failed on this chat ({first[:200]})")
        return Record(index, text, invalid_utf8=invalid, spans=spans)


def _free_tags(messages: Sequence[dict], count: int):
    """The first of `count` private-use characters that no field of the chat holds, and a pattern finding them."""
    for low, high in _TAG_RANGES:
        if count <= high - low + 1:
            tags = re.compile(f"[{chr(low)}-{chr(low + count - 1)}]")
            if not any(tags.search(v) for m in messages for v in m.values() if isinstance(v, str)):
                return low, tags
    raise ChatProblem("the chat holds the private-use characters zaya needs to find the replies of a chat this "
                      "long")


def _same_but_tags(marked: str, found: list[tuple[int, int]], text: str) -> bool:
    """Whether `marked` without the characters at `found` is `text`, compared piece by piece (no whole copy)."""
    if len(marked) != len(text) + len(found):
        return False
    start = 0
    for shift, (position, _) in enumerate(found):
        if marked[start:position] != text[start - shift:position - shift]:
            return False
        start = position + 1
    return marked[start:] == text[start - len(found):]


def _budget(messages: Sequence[dict]):
    chars = sum(len(v) for m in messages for v in m.values() if isinstance(v, str))
    return budget_for(chars, len(messages))


def check_messages(value: dict) -> tuple[list[dict] | None, str | None]:
    """The messages of a chat record, or what is wrong with them. A message's other fields (`name`, ...) go to
    the template with it, as transformers' `apply_chat_template` passes them."""
    if "messages" not in value:
        return None, "no field 'messages'"
    messages = value["messages"]
    if not isinstance(messages, list):
        return None, f"field 'messages' is {type(messages).__name__}, not a list"
    if len(messages) > MAX_CHAT_TURNS:
        return None, f"a chat of {len(messages):,} messages, more than {MAX_CHAT_TURNS:,} (the limit for one chat)"
    try:
        check_depth(messages, "", MAX_DEPTH)  # the template may walk what a message holds
    except ZayaError:
        return None, f"field 'messages' is nested more than {MAX_DEPTH} deep"
    checked = []
    for i, message in enumerate(messages, start=1):
        if not isinstance(message, dict):
            return None, f"message {i} is {type(message).__name__}, not an object"
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            return None, f"message {i} has role {role!r}, not one of {', '.join(ROLES)}"
        if not isinstance(content, str):
            return None, f"message {i}'s content is {type(content).__name__}, not a string"
        checked.append(dict(message))
    if not any(m["role"] == "assistant" for m in checked):
        return None, "no assistant message"
    return checked, None


def span_mask(offsets: np.ndarray | Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """1 for each token whose characters [start, stop) overlap one of the sorted, disjoint `spans`, else 0.

    A token that straddles a span's edge (a run of newlines merged across it, say) is one the model must
    produce to produce the span, so it counts, as transformers' assistant masks count it."""
    offsets = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    if not len(spans):
        return np.zeros(len(offsets), dtype=np.uint8)
    starts = np.array([s for s, _ in spans], dtype=np.int64)
    stops = np.array([e for _, e in spans], dtype=np.int64)
    # the last span starting before a token ends is the only one it can overlap: spans are disjoint
    last = np.searchsorted(starts, offsets[:, 1], side="left") - 1
    return ((last >= 0) & (stops[np.maximum(last, 0)] > offsets[:, 0])).astype(np.uint8)


def read_template(path) -> str:
    """A chat template file's text (a regular file of at most 1 MiB, UTF-8), checked to compile."""
    template = read_text(path, "template", "a chat template")
    compile_template(template, str(path))
    return template


@functools.lru_cache(maxsize=8)
def _compiled(template: str):
    import jinja2
    import jinja2.ext

    class Generation(jinja2.ext.Extension):
        # transformers marks assistant text with {% generation %}; zaya finds the spans itself
        tags = frozenset({"generation"})

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(str(message)[:1000])

    return compile_bounded(template, {"raise_exception": raise_exception}, {"tojson": tojson},
                           [Generation, jinja2.ext.loopcontrols])


def compile_template(template: str, source: str = "the chat template"):
    """The compiled Jinja template (cached per process); a syntax error is a `ZayaError` naming `source`."""
    import jinja2

    try:
        return _compiled(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ZayaError(f"{source}: not a valid Jinja template (line {exc.lineno}: {exc.message})") from None
    except RecursionError:
        raise ZayaError(f"{source}: not a valid Jinja template (nested too deeply)") from None


def _probe_render(chat: ChatFormat, messages: list[dict], source: str, add_generation_prompt: bool = False) -> str:
    try:
        return chat.render(messages, add_generation_prompt)
    except TemplateBudget:
        raise  # it names the template and what ran out
    except Exception as exc:  # a template that cannot render a plain chat is unusable
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ZayaError(f"{source}: the chat template fails on a plain conversation ({first[:200]})") from None


def _scaffold_markers(chat: ChatFormat, source: str) -> tuple[str, ...]:
    """The marker-shaped strings a template writes around the messages, in order of first appearance."""
    texts = []
    for roles in (("system", "user", "assistant", "user"), ("user", "assistant", "user")):
        try:
            texts.append(chat.render([{"role": r, "content": _PROBE[r]} for r in roles], True))
        except Exception:  # some templates refuse a system message; the next probe has none
            continue
    if not texts:
        _probe_render(chat, [{"role": "user", "content": _PROBE["user"]}], source, True)
    found: dict[str, None] = {}
    for text in texts:
        for content in _PROBE.values():
            text = text.replace(content, "\0")
        found.update(dict.fromkeys(_MARKER.findall(text)))
    return tuple(found)


def _end_of_turn(chat: ChatFormat, candidates: set[str], source: str) -> str:
    """The marker a template writes right after an assistant's content (whitespace between them allowed)."""
    user = {"role": "user", "content": _PROBE["user"]}
    reply = {"role": "assistant", "content": _PROBE["assistant"]}
    prefix = _probe_render(chat, [user], source, add_generation_prompt=True)
    text = _probe_render(chat, [user, reply], source)
    if not text.startswith(prefix) or not text.startswith(reply["content"], len(prefix)):
        raise ZayaError(f"{source}: the chat template does not write an assistant's reply right after the "
                        "generation prompt, so zaya cannot tell which tokens are the reply")
    after = text[len(prefix) + len(reply["content"]):].lstrip()
    for marker in sorted(candidates, key=len, reverse=True):
        if after.startswith(marker):
            return marker
    raise ZayaError(f"{source}: the chat template writes no end-of-turn marker (such as <|im_end|>) right after "
                    f"an assistant's reply; it writes {after[:20]!r}")
