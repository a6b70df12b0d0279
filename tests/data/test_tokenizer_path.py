"""One tokenizer from pre-training to chat, on the data side: a text build reserves the chat markers (and any
special token) as single tokens, a chat build reuses that tokenizer by naming the dataset, and a tokenizer's
identity is its content, not its bytes."""

import json
import random

import pytest
from tokenizers import Tokenizer

from zaya.data.build import BuildOptions, build_dataset
from zaya.data.dataset_reader import open_dataset
from zaya.data.tokenizer import content_fingerprint, load_tokenizer, train_bpe
from zaya.tokenizer_source import tokenizer_file as resolve_tokenizer

_WORDS = ("alpha", "gamma", "delta", "theta", "kappa", "sigma", "omega", "def", "return", "class", "import")


def _corpus(root, with_markers: bool):
    """Text files; with `with_markers`, ChatML-shaped lines and a tool token run through them, as a corpus of
    transcripts or of code about chat templates has them."""
    rng = random.Random(0)
    root.mkdir()
    for i in range(40):
        words = " ".join(rng.choice(_WORDS) for _ in range(30))
        text = f"<|im_start|>user\n{words}<|im_end|>\n<|tool|>{words}\n" if with_markers else words + "\n"
        (root / f"d{i:02d}.txt").write_text(text * 3, encoding="utf-8")
    return root


def _build(cli, *args):
    code, out, err = cli("data", "build", *args, "--workers", "1", "--no-progress")
    assert code == 0, err
    return out


def _one_line(result, *fragments):
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("zaya: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_a_text_build_reserves_the_chat_markers_and_special_tokens_as_single_tokens(cli, tmp_path):
    corpus = _corpus(tmp_path / "corpus", with_markers=True)
    out = _build(cli, "--input", corpus, "--out", tmp_path / "base", "--vocab-size", 320, "--reserve-chat-markers",
                 "--special-token", "<|tool|>")
    assert "special      <|im_start|> 3, <|im_end|> 4, <|tool|> 5" in out
    tokenizer = load_tokenizer(tmp_path / "base" / "tokenizer.json")
    for token, expected in (("<|im_start|>", 3), ("<|im_end|>", 4), ("<|tool|>", 5)):
        assert tokenizer.encode(f"x {token}y", add_special_tokens=False).ids.count(expected) == 1
    # the BPE learned from the text cut at them: no merge reaches into a marker
    learned = [t for t in tokenizer.get_vocab() if t not in ("<|im_start|>", "<|im_end|>", "<|tool|>")]
    assert not [t for t in learned if "im_" in t or "tool" in t or "|>" in t]
    dataset = open_dataset(tmp_path / "base")
    assert dataset.special_ids["<|im_start|>"] == 3 and dataset.special_ids["<|tool|>"] == 5
    # the dataset's tokens hold them as such: every document has three of each marker
    tokens = dataset.split("train").read(0, dataset.split("train").num_tokens).tolist()
    documents = dataset.split("train").num_documents
    assert tokens.count(3) == tokens.count(4) == tokens.count(5) == 3 * documents

    # without the reservation the markers are text like any other, cut into pieces
    _build(cli, "--input", corpus, "--out", tmp_path / "plain", "--vocab-size", 320)
    plain = load_tokenizer(tmp_path / "plain" / "tokenizer.json")
    assert len(plain.encode("<|im_start|>", add_special_tokens=False).ids) > 1


def test_a_chat_build_reuses_the_tokenizer_of_the_text_dataset(cli, tmp_path):
    corpus = _corpus(tmp_path / "corpus", with_markers=False)
    _build(cli, "--input", corpus, "--out", tmp_path / "base", "--vocab-size", 300, "--reserve-chat-markers")
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"say {w}"},
                                                      {"role": "assistant", "content": w}]}) + "\n"
                             for w in _WORDS))
    _build(cli, "--format", "chat", "--input", chats, "--out", tmp_path / "sft", "--tokenizer", tmp_path / "base")
    base, sft = open_dataset(tmp_path / "base"), open_dataset(tmp_path / "sft")
    assert sft.tokenizer_sha256 == base.tokenizer_sha256
    assert sft.tokenizer_path.read_bytes() == base.tokenizer_path.read_bytes()
    assert sft.special_ids["<|im_start|>"] == 3 and sft.end_of_turn == "<|im_end|>"
    # a text build that did not reserve them: the chat build says what would have
    _build(cli, "--input", corpus, "--out", tmp_path / "plain", "--vocab-size", 300)
    _one_line(cli("data", "build", "--format", "chat", "--input", chats, "--out", tmp_path / "no", "--tokenizer",
                  tmp_path / "plain"), "'<|im_start|>' is not a token", "--reserve-chat-markers")
    assert not (tmp_path / "no").exists()


def test_a_custom_template_s_markers_are_reserved_by_a_text_build(cli, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                        "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    corpus = _corpus(tmp_path / "corpus", with_markers=False)
    _build(cli, "--input", corpus, "--out", tmp_path / "base", "--vocab-size", 300, "--reserve-chat-markers",
           "--chat-template", template)
    tokenizer = load_tokenizer(tmp_path / "base" / "tokenizer.json")
    for marker in ("<|user|>", "<|assistant|>", "<|end|>"):
        assert len(tokenizer.encode(marker, add_special_tokens=False).ids) == 1, marker


@pytest.mark.parametrize(("args", "says"), [
    (["--chat-template", "t.jinja"], "--chat-template is for chat data: add --format chat (or --reserve-chat"),
    (["--special-token", " "], "--special-token: ' ' is empty or only whitespace"),
    (["--special-token", "<" * 300], "more than the 256 a special token may have"),
    (["--vocab-size", 260, "--reserve-chat-markers"], "--vocab-size 260 leaves no room for the 2 reserved tokens"),
    (["--tokenizer", "base", "--special-token", "<|new|>"],
     "--special-token asks for '<|new|>', which is not one token of this tokenizer"),
    (["--tokenizer", "nowhere"], "--tokenizer nowhere: no such file or directory"),
    (["--tokenizer", "empty"], "--tokenizer empty: no tokenizer.json there; give a tokenizer.json, or a dataset"),
], ids=["template-without-reserve", "blank", "long", "no-room", "given-lacks-it", "missing", "empty-dir"])
def test_what_cannot_be_reserved_is_one_line_and_nothing_is_written(cli, tmp_path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.jinja").write_text("{{ messages }}")
    (tmp_path / "empty").mkdir()
    corpus = _corpus(tmp_path / "corpus", with_markers=False)
    if "base" in args:
        _build(cli, "--input", corpus, "--out", "base", "--vocab-size", 300, "--reserve-chat-markers")
    _one_line(cli("data", "build", "--input", corpus, "--out", "out", "--workers", "1", *args), says)
    assert not (tmp_path / "out").exists()


def test_a_tokenizer_is_its_content_not_its_bytes(tmp_path):
    texts = [" ".join(random.Random(i).choice(_WORDS) for _ in range(50)) for i in range(30)]
    tokenizer = train_bpe(texts, 300, extra_special_tokens=["<|im_start|>"])
    data = json.loads(tokenizer.to_str())
    # written compact, its keys in another order, its merges in the older "a b" form
    again = {key: data[key] for key in reversed(list(data))}
    again["model"] = {**again["model"], "merges": [" ".join(pair) for pair in data["model"]["merges"]]}
    rewritten = Tokenizer.from_str(json.dumps(again, separators=(",", ":")))
    assert json.dumps(again) != tokenizer.to_str()
    assert content_fingerprint(rewritten) == content_fingerprint(tokenizer)
    # another vocabulary, another special token, or another id for one: another tokenizer
    others = [train_bpe(texts, 299, extra_special_tokens=["<|im_start|>"]), train_bpe(texts, 300),
              train_bpe(texts, 300, extra_special_tokens=["<|im_end|>"])]
    assert len({content_fingerprint(t) for t in [tokenizer, *others]}) == 4


def test_a_tokenizer_is_found_in_a_file_or_a_dataset(tmp_path, tokenizer_file):
    assert resolve_tokenizer(tokenizer_file) == tokenizer_file
    corpus = _corpus(tmp_path / "corpus", with_markers=False)
    build_dataset(BuildOptions(inputs=(str(corpus),), out=tmp_path / "data", tokenizer=tokenizer_file, workers=1))
    assert resolve_tokenizer(tmp_path / "data") == tmp_path / "data" / "tokenizer.json"
