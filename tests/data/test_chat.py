"""Chat datasets (`zaya data build --format chat`): chats rendered with a chat template, a loss mask beside the
tokens that flags exactly the assistant turns, and loaders that hand the mask out with the windows."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from runs import REPLY_WORD, make_chats, write_chats
from zaya.data.build import BuildOptions, build_dataset
from zaya.data.chat import DEFAULT_CHAT_TEMPLATE, span_mask
from zaya.data.dataset_reader import open_dataset
from zaya.data.loader import TokenLoader
from zaya.data.loss_mask import inputs_and_targets, loss_mask, token_ids
from zaya.data.shards import fingerprint_of
from zaya.errors import ZayaError

# a Llama-3-like template: a bos token, headers between markers, and another end-of-turn marker
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _build(tmp_path: Path, chats, name: str = "chat", **options):
    source = options.pop("source", None) or write_chats(tmp_path / f"{name}.jsonl", chats)
    defaults = {"vocab_size": 300, "val_fraction": 0.0, "workers": 1, "format": "chat"}
    return build_dataset(BuildOptions(inputs=(str(source),), out=tmp_path / name, **{**defaults, **options}))


def _documents(dataset, split="train"):
    """(tokens, mask) of each document of a split."""
    tokens = dataset.split(split)
    ends = np.asarray(tokens.document_ends())
    starts = np.concatenate([[0], ends[:-1]])
    return [(tokens.read(a, b), tokens.read_mask(a, b)) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


def _flagged_runs(tokens: np.ndarray, mask: np.ndarray) -> list[np.ndarray]:
    """The maximal runs of flagged tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    return [tokens[a:b] for a, b in zip(edges[::2], edges[1::2], strict=True)]


def test_the_mask_flags_exactly_the_replies_and_their_end_markers(tmp_path):
    chats = make_chats(60)
    _build(tmp_path, chats, shard_tokens=700)  # several shards: the masks are cut where the tokens are
    dataset = open_dataset(tmp_path / "chat")
    tok = Tokenizer.from_file(str(dataset.tokenizer_path))
    assert dataset.has_loss_mask and dataset.end_of_turn == "<|im_end|>"
    assert dataset.special_ids == {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    assert dataset.chat_template_path.read_text() == DEFAULT_CHAT_TEMPLATE
    entry = dataset.entries["train"]
    assert len(entry.shards) > 2 and [m.bytes for m in entry.masks] == list(entry.shard_tokens)

    # by construction: the reply tokens are the reply word's, and each reply ends with <|im_end|>
    reply_ids = {tok.token_to_id(REPLY_WORD), tok.token_to_id("Ġ" + REPLY_WORD)}
    assert None not in reply_ids
    documents = _documents(dataset)
    assert len(documents) == len(chats)
    for tokens, mask in documents:
        reply = np.isin(tokens, list(reply_ids))
        ends_reply = (tokens == 4) & np.concatenate([[False], reply[:-1]])
        np.testing.assert_array_equal(mask, (reply | ends_reply).astype(np.uint8))
    replies = [m["content"] for chat in chats for m in chat if m["role"] == "assistant"]
    assert entry.loss_tokens == sum(len(r.split()) + 1 for r in replies) == sum(int(m.sum()) for _, m in documents)


def test_a_document_is_the_rendered_chat_and_its_eos(tmp_path):
    chats = make_chats(5)
    _build(tmp_path, chats)
    dataset = open_dataset(tmp_path / "chat")
    tok = Tokenizer.from_file(str(dataset.tokenizer_path))
    for chat, (tokens, _) in zip(chats, _documents(dataset), strict=True):
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in chat)
        assert tokens.tolist() == [*tok.encode(text, add_special_tokens=False).ids, dataset.eos_id]


def test_a_custom_template_with_unicode_replies(tmp_path):
    chats = [[{"role": "system", "content": "sé brëf"}, {"role": "user", "content": "日本語 は?"},
              {"role": "assistant", "content": "ünïcödé 日本語 ok"}, {"role": "user", "content": "again"},
              {"role": "assistant", "content": " spaced\n\nreply "}]] * 8
    template = tmp_path / "header.jinja"
    template.write_text(HEADER_TEMPLATE, encoding="utf-8")
    _build(tmp_path, chats, chat_template=template)
    dataset = open_dataset(tmp_path / "chat")
    tok = Tokenizer.from_file(str(dataset.tokenizer_path))
    assert dataset.end_of_turn == "<|eot_id|>"
    assert {"<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"} <= set(dataset.special_ids)
    for tokens, mask in _documents(dataset):
        assert tokens[0] == dataset.special_ids["<bos>"] and mask[0] == 0
        runs = [tok.decode(run.tolist(), skip_special_tokens=False) for run in _flagged_runs(tokens, mask)]
        assert runs == ["ünïcödé 日本語 ok<|eot_id|>", " spaced\n\nreply <|eot_id|>"]  # multi-byte tokens included


def test_span_mask_counts_tokens_that_overlap_a_span():
    offsets = [(0, 2), (2, 5), (5, 6), (6, 9), (9, 12)]
    assert span_mask(offsets, [(3, 6), (9, 10)]).tolist() == [0, 1, 1, 0, 1]
    assert span_mask(offsets, []).tolist() == [0] * 5


def test_bad_chats_are_counted_or_stop_a_strict_build(tmp_path, cli):
    good = {"messages": make_chats(1)[0]}
    bad = [{"text": "no messages"}, {"messages": [{"role": "tool", "content": "x"}]},
           {"messages": [{"role": "user", "content": 3}]}, {"messages": [{"role": "user", "content": "hi"}]},
           {"messages": "hello"}]
    source = tmp_path / "mixed.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in [good, *bad, good]), encoding="utf-8")
    report = _build(tmp_path, None, source=source)
    assert report.bad_records == 5
    assert report.problems == [
        f"{source}:2: no field 'messages'",
        f"{source}:3: message 1 has role 'tool', not one of system, user, assistant",
        f"{source}:4: message 1's content is int, not a string",
        f"{source}:5: no assistant message",
        f"{source}:6: field 'messages' is str, not a list",
    ]
    code, _, err = cli("data", "build", "--format", "chat", "--strict", "--input", source, "--out", tmp_path / "s",
                       "--vocab-size", "300", "--workers", "1", "--no-progress")
    assert code == 2 and err.strip() == f"zaya: error: {source}:2: no field 'messages'"


def test_compressed_chats_and_more_workers_build_the_same_dataset(tmp_path):
    chats = make_chats(30)
    plain = _build(tmp_path, chats, name="plain")
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress((tmp_path / "plain.jsonl").read_bytes()))
    assert _build(tmp_path, None, name="packed", source=packed).fingerprint == plain.fingerprint
    split = tmp_path / "split"  # two files, tokenized by two worker processes
    split.mkdir()
    write_chats(split / "a.jsonl", chats[:15])
    write_chats(split / "b.jsonl", chats[15:])
    assert _build(tmp_path, None, name="workers", source=split, workers=2).fingerprint == plain.fingerprint


def test_the_fingerprint_follows_the_template_and_a_given_tokenizer_needs_its_markers(tmp_path, tokenizer_file):
    chats = make_chats(30)
    trained = _build(tmp_path, chats, name="trained")
    tokenizer = tmp_path / "trained" / "tokenizer.json"
    # the same template and tokenizer, given: the same dataset
    same = tmp_path / "same.jinja"
    same.write_text(DEFAULT_CHAT_TEMPLATE, encoding="utf-8")
    given = _build(tmp_path, chats, name="given", tokenizer=tokenizer, chat_template=same)
    assert given.fingerprint == trained.fingerprint
    # a template that renders the same text: the same tokens and mask, but another template, another dataset
    commented = tmp_path / "commented.jinja"
    commented.write_text("{# v2 #}" + DEFAULT_CHAT_TEMPLATE, encoding="utf-8")
    other = _build(tmp_path, chats, name="other", tokenizer=tokenizer, chat_template=commented)
    assert other.fingerprint != trained.fingerprint
    for (a, ma), (b, mb) in zip(_documents(open_dataset(tmp_path / "trained")), _documents(open_dataset(other.path)),
                                strict=True):
        assert a.tolist() == b.tolist() and ma.tolist() == mb.tolist()
    # a tokenizer without the markers is refused in one line
    with pytest.raises(ZayaError, match=r"marker '<\|im_start\|>' is not a token of this tokenizer"):
        _build(tmp_path, chats, name="plain_tokenizer", tokenizer=tokenizer_file)


def test_text_datasets_are_as_before(position_dataset, dataset):
    # the writer's manifest of a text dataset is byte for byte what it was before chat datasets, but for the
    # content each split records since datasets can be built in parts: without it, the fingerprint it always had
    # (pinned: the fingerprint of the datasets written before); with it, the one taken over the content (pinned)
    path = position_dataset("pinned", 5000, 700, shard_tokens=1024, vocab_size=1000)
    pinned = open_dataset(path)
    assert pinned.fingerprint == "335d02476896b6e68d32b9800a0ca2d544653a1b678d82210be62b237df0c09e"
    before = json.loads((path / "manifest.json").read_text())
    for split in before["splits"].values():
        del split["content"]
    assert fingerprint_of(before) == "3bc237661cf3b08192dc5072854b3ce4818de5514e6e0d388ba3d912a25d2828"
    built = open_dataset(dataset)
    manifest = json.loads((dataset / "manifest.json").read_text())
    assert "loss_mask" not in manifest and "chat_template" not in manifest["tokenizer"]
    assert all("mask" not in shard for split in manifest["splits"].values() for shard in split["shards"])
    assert not built.has_loss_mask and built.split("train").gather_mask(np.arange(3), 16) is None
    with TokenLoader([(dataset, 1.0)], 16, seed=0) as loader:
        batch = loader.next_batch(4)
    assert bool((batch >= 0).all())
    inputs, targets = inputs_and_targets(batch, -100)
    assert torch.equal(inputs, batch[:, :-1]) and torch.equal(targets, batch[:, 1:])


def test_loader_batches_carry_the_mask_and_mixtures_count_unmasked_data_whole(tmp_path):
    _build(tmp_path, make_chats(120), val_fraction=0.2, shard_tokens=500)
    chat = open_dataset(tmp_path / "chat")
    text_source = tmp_path / "notes.jsonl"
    text_source.write_text("".join(json.dumps({"text": f"notes {i} " * 20}) + "\n" for i in range(40)))
    build_dataset(BuildOptions(inputs=(str(text_source),), out=tmp_path / "text", workers=1, val_fraction=0.2,
                               tokenizer=chat.tokenizer_path))
    seq_len = 24
    train = chat.split("train")
    with TokenLoader([(chat, 1.0)], seq_len, seed=1) as loader:
        assert loader.has_loss_mask
        for _ in range(5):
            batch = loader.next_batch(8)
            _, samples = loader.order.lookup(loader.last_positions)
            assert torch.equal(token_ids(batch), torch.from_numpy(train.gather(samples, seq_len).astype(np.int64)))
            assert torch.equal(loss_mask(batch), torch.from_numpy(train.gather_mask(samples, seq_len) == 1))
        val = chat.split("val")
        batch = next(loader.iter_eval_batches(4))
        assert torch.equal(loss_mask(batch), torch.from_numpy(val.gather_mask(np.arange(4), seq_len) == 1))
    with TokenLoader([(chat, 0.5), (tmp_path / "text", 0.5)], seq_len, seed=1) as loader:
        batch = loader.next_batch(16)
        sources, _ = loader.order.lookup(loader.last_positions)
        assert set(sources.tolist()) == {0, 1}
        assert bool(loss_mask(batch)[torch.from_numpy(sources == 1)].all())
        assert not bool(loss_mask(batch)[torch.from_numpy(sources == 0)].all())
    # windows that cross from one shard file into the next read their mask across it too
    samples = np.arange(train.num_tokens // seq_len - 1)
    gathered = train.gather_mask(samples, seq_len)
    for row, sample in enumerate(samples.tolist()):
        assert gathered[row].tolist() == train.read_mask(sample * seq_len, sample * seq_len + seq_len + 1).tolist()


def test_verify_covers_the_masks_and_the_template(tmp_path, cli):
    _build(tmp_path, make_chats(20))
    path = tmp_path / "chat"
    assert open_dataset(path).verify() == 6  # tokenizer, template, train shard, its mask, both document indexes
    mask = path / "train.00000.mask.bin"
    data = bytearray(mask.read_bytes())
    data[5] ^= 1
    mask.write_bytes(bytes(data))
    code, _, err = cli("data", "inspect", path, "--verify", "--no-progress")
    assert code == 2 and f"{mask}: checksum mismatch" in err
    manifest = json.loads((path / "manifest.json").read_text())
    del manifest["splits"]["train"]["shards"][0]["mask"]
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ZayaError, match=r"missing field 'splits.train.shards\[0\].mask'"):
        open_dataset(path)


def test_the_command_line(tmp_path, cli):
    chats = write_chats(tmp_path / "chats.jsonl", make_chats(20))
    code, out, err = cli("data", "build", "--format", "chat", "--input", chats, "--out", tmp_path / "c",
                         "--vocab-size", "300", "--workers", "1", "--no-progress")
    assert code == 0, err
    assert "chat         template chat_template.jinja, end of turn <|im_end|>" in out and " learned)" in out
    for args, fragment in [
        (["--chat-template", tmp_path / "t.jinja"], "--chat-template is for chat data"),
        (["--format", "chat", "--input", tmp_path / "notes.txt"], "--format chat reads JSON lines"),
        (["--format", "chat", "--chat-template", tmp_path / "bad.jinja"], "not a valid Jinja template"),
    ]:
        (tmp_path / "notes.txt").write_text("text")
        (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
        code, _, err = cli("data", "build", "--input", chats, *args, "--out", tmp_path / "x", "--no-progress")
        assert code == 2 and len(err.strip().splitlines()) == 1 and fragment in err, err


def test_chat_tables_build_the_same_dataset_as_json_lines(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    chats = make_chats(30)
    plain = _build(tmp_path, chats, name="plain")
    table = pa.table({"id": list(range(len(chats))), "messages": chats})  # list<struct<role, content>>
    pq.write_table(table, tmp_path / "chats.parquet", row_group_size=7)
    assert _build(tmp_path, None, name="parquet", source=tmp_path / "chats.parquet").fingerprint == plain.fingerprint
    with pa.OSFile(str(tmp_path / "chats.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=4):
            writer.write_batch(batch)
    assert _build(tmp_path, None, name="arrow", source=tmp_path / "chats.arrow").fingerprint == plain.fingerprint
    # a table whose messages are not a list of structs is one line
    pq.write_table(pa.table({"messages": ["hello"]}), tmp_path / "text.parquet")
    with pytest.raises(ZayaError, match=r"text.parquet: column 'messages' holds string, not a list of messages"):
        _build(tmp_path, None, name="text", source=tmp_path / "text.parquet")


def test_other_message_fields_reach_the_template(tmp_path):
    template = tmp_path / "named.jinja"
    template.write_text(
        "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
        "{% if message.name %}{{ message.name }}: {% endif %}{{ message['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", encoding="utf-8")
    chats = [[{"role": "user", "content": "hi", "name": "alice"}, {"role": "assistant", "content": "hello"}]] * 4
    dataset = _build(tmp_path, chats, chat_template=template)
    tok = Tokenizer.from_file(str(open_dataset(dataset.path).tokenizer_path))
    tokens, mask = _documents(open_dataset(dataset.path))[0]
    assert "alice: hi" in tok.decode(tokens.tolist(), skip_special_tokens=False)
    assert tok.decode(tokens[mask.astype(bool)].tolist(), skip_special_tokens=False).strip() == "hello<|im_end|>"
