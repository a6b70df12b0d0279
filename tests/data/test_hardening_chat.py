"""Chats and chat templates under bounds: a chat's size and turns are limited, a long chat renders in linear time
with the tokens and masks the turn-by-turn rendering gives, and a template runs under a budget, so that one
written to loop without end or to grow a string ends in one line, quickly and in little memory."""

from __future__ import annotations

import json
import time
import tracemalloc

import pytest

from zaya.data import chat as chat_module
from zaya.data import records as records_module
from zaya.data.chat import DEFAULT_CHAT_TEMPLATE, ChatFormat
from zaya.data.corpus import ReadOptions, discover, read_piece, split_file
from zaya.errors import ZayaError

BOMBS = {
    "endless loops": "{% for m in messages %}{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                     "{% endfor %}{% endfor %}",
    "a string times a billion": "{{ 'x' * 10**9 }}",
    "center": "{{ 'x'|center(10**9) }}",
    "ljust": "{{ 'x'.ljust(10**9) }}",
    "a power": "{{ 2 ** 10000000 }}",
    "doubling with +": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
                       "{% endfor %}{{ ns.s|length }}",
    "doubling with ~": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
                       "{% endfor %}",
    "doubling by recursion": "{% macro d(s, n) %}{% if n %}{{ d(s ~ s, n - 1) }}{% endif %}{% endmacro %}"
                             "{{ d('x', 64) }}",
    "a recursive loop": "{% for x in range(99999) recursive %}{{ loop(range(99999)) }}{% endfor %}",
    "joining a huge list": "{{ (range(99999)|list * 99999)|join }}",
    "joining a list of big strings": "{% set s = 'x' * 500000 %}{{ [s, s, s, s, s, s]|join }}",
    "replace": "{% set s = 'x' * 100000 %}{{ s.replace('', s)|length }}",
    "str.format": "{{ '{:>999999999}'.format(1) }}",
    "percent": "{{ '%999999999d' % 1 }}",
    "a list of big strings": "{% set ns = namespace(l=[]) %}{% for i in range(99999) %}"
                             "{% set ns.l = ns.l + ['x' * 900000] %}{% endfor %}",
    "nested literals": "{% set a = ['x' * 500000] %}{% set b = [a, a, a, a, a, a, a, a, a, a] %}"
                       "{% set c = [b, b, b, b, b, b, b, b, b, b] %}{{ c }}",
    "a captured block": "{% filter length %}{% for i in range(99999) %}{{ 'y' * 100000 }}{% endfor %}{% endfilter %}",
    "filters over ranges": "{% for i in range(99999) %}{{ range(99999)|map('string')|join|length }}{% endfor %}",
    "tojson indent": "{{ messages|tojson(indent=1000000000) }}",
    "translate": "{{ ('a' * 1000).translate({97: 'b' * 100000}) }}",
    "bytes": "{{ ('x'.encode() * 10**9)|length }}",
}


# the bombs that grow a value, whose memory is measured (tracing every allocation would slow the loops tenfold)
GROWING = ("a string times a billion", "doubling with +", "doubling with ~", "doubling by recursion",
           "joining a list of big strings", "a list of big strings", "nested literals", "a captured block")


@pytest.mark.parametrize("traced", [False, True], ids=["all", "growing, traced"])
def test_template_bombs_end_quickly_in_one_line_and_little_memory(traced):
    if traced:
        tracemalloc.start()
    try:
        for name, bomb in BOMBS.items():
            if traced and name not in GROWING:
                continue
            started = time.perf_counter()
            with pytest.raises(ZayaError) as error:
                ChatFormat.create(bomb + DEFAULT_CHAT_TEMPLATE, source=f"{name}.jinja")
            message = str(error.value)
            assert "\n" not in message and message.startswith(f"{name}.jinja: the chat template went past its "
                                                              "budget ("), message
            assert time.perf_counter() - started < 30, name  # a few tenths of a second; the old ones never ended
        peak = tracemalloc.get_traced_memory()[1] if traced else 0
    finally:
        if traced:
            tracemalloc.stop()
    assert peak < 64 << 20


def test_a_template_past_its_budget_on_one_chat_stops_the_build_naming_both(cli, tmp_path):
    template = tmp_path / "slow.jinja"  # quadratic in the chat's turns: fine for short chats, not for long ones
    template.write_text("{% for m in messages %}{% for n in messages %}{% for i in range(100) %}{% endfor %}"
                        "{% endfor %}{% endfor %}" + DEFAULT_CHAT_TEMPLATE)
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [short, short * 50]))
    code, _, err = cli("data", "build", "--format", "chat", "--chat-template", template, "--input", chats,
                       "--out", tmp_path / "out", "--vocab-size", "300", "--workers", "1", "--no-progress")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"zaya: error: {chats}:2: {template}: the chat template went past its budget (more than ")
    assert not (tmp_path / "out").exists()


def test_a_chats_turns_and_size_are_bounded(tmp_path, monkeypatch):
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    big = [{"role": "user", "content": "x" * 10_000}, *reply]
    options = ReadOptions(chat=ChatFormat.create(DEFAULT_CHAT_TEMPLATE))
    pa = pytest.importorskip("pyarrow")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n" for m in [reply, reply * 5001, big, reply]))
    table = pa.table({"messages": [reply, reply * 5001, big, reply]})
    with pa.OSFile(str(tmp_path / "chats.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    turns = "a chat of 10,002 messages, more than 10,000 (the limit for one chat)"
    size = "a chat of more than 8 KiB (the limit for one record)"
    for path in (chats, tmp_path / "chats.arrow"):
        (file,) = discover([path])
        for limit, expected in [(16 << 20, [None, turns, None, None]), (8 << 10, [None, turns, size, None])]:
            monkeypatch.setattr(records_module, "MAX_CHAT_BYTES", limit)
            records = read_piece(file, split_file(file, 0, options, 1 << 20)[0], options).records
            if path.suffix == ".jsonl" and limit == 8 << 10:
                expected = [None, size, size, None]  # a line is measured before it is parsed
            assert [r.problem for r in records] == expected, path


# templates in the style of real ones: ChatML, Llama 3 (trims the content), Phi-3 (an eos_token at the end, but
# not after the generation prompt), Gemma (trims, alternating roles, raise_exception)
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")
PHI3 = ("{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\\n' + message['content'] + "
        "'<|end|>\\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\\n' + message['content'] + '<|end|>\\n'}}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% else %}{{ eos_token }}"
        "{% endif %}")
GEMMA = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
         "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
         "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
         "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\\n'}}{% endif %}")
CONTENTS = ["plain words", " leading space", "trailing space ", "\n\nnewlines\n", "", "  both  ", "日本語 ünïcödé"]


@pytest.mark.parametrize("template", [DEFAULT_CHAT_TEMPLATE, LLAMA3, PHI3, GEMMA], ids=["chatml", "llama3", "phi3",
                                                                                       "gemma"])
def test_long_chats_render_in_linear_time_with_the_same_spans(template, monkeypatch):
    chat = ChatFormat.create(template, bos_token="<bos>", eos_token="<eos>")
    renders = []
    render = ChatFormat.render
    monkeypatch.setattr(ChatFormat, "render", lambda self, *a, **k: renders.append(1) or render(self, *a, **k))
    for n in (20, 21, 40):  # more replies than are rendered turn by turn
        messages = [{"role": ("user", "assistant")[i % 2], "content": CONTENTS[i * 5 % len(CONTENTS)] + f" {i}"}
                    for i in range(n)]
        renders.clear()
        fast = chat.render_with_spans(messages)
        assert len(renders) <= 5  # the chat, with its replies tagged (twice for templates that trim), two checks
        monkeypatch.setattr(chat_module, "_EXACT_REPLIES", 10**9)
        assert chat.render_with_spans(messages) == fast  # what rendering every reply's beginning gives
        monkeypatch.undo()
        monkeypatch.setattr(ChatFormat, "render", lambda self, *a, **k: renders.append(1) or render(self, *a, **k))
    long = [{"role": ("user", "assistant")[i % 2], "content": f"turn {i}"} for i in range(10_000)]
    renders.clear()
    text, spans = chat.render_with_spans(long)
    assert len(renders) <= 5 and len(spans) == 5_000
    assert all(text[a:b].lstrip().startswith(f"turn {2 * k + 1}") for k, (a, b) in enumerate(spans))
