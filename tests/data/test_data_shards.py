import json

import numpy as np
import pytest

from zaya.data.dataset_reader import open_dataset
from zaya.data.dataset_writer import DatasetWriter, staged_directory
from zaya.data.shards import MANIFEST_FILE
from zaya.errors import ZayaError


def test_reads_cross_shard_files(position_dataset):
    path = position_dataset("d", 10_000, val_tokens=50, shard_tokens=3_000)
    dataset = open_dataset(path)
    assert [s.file for s in dataset.entries["train"].shards] == [f"train.{i:05d}.bin" for i in range(4)]
    assert dataset.entries["train"].shard_tokens == (3_000, 3_000, 3_000, 1_000)
    train = dataset.split("train")
    assert np.array_equal(train.read(2_990, 6_010), np.arange(2_990, 6_010))
    out = np.empty(7, dtype=np.int64)
    train.read_into(out, 9_993)
    assert out.tolist() == list(range(9_993, 10_000))
    with pytest.raises(IndexError):
        train.read_into(out, 9_994)
    assert dataset.num_tokens == 10_050 and dataset.max_token_id == 9_999
    assert dataset.split("val").read(0, 3).tolist() == [0, 1, 2]


def test_document_index_marks_document_ends(tmp_path):
    (tmp_path / "d").mkdir()
    writer = DatasetWriter(tmp_path / "d", "uint16", shard_tokens=4)
    writer.write("train", np.array([5, 6, 1, 7, 1]), np.array([3, 2]))
    writer.write("train", np.array([8, 8, 8, 1]), np.array([4]))
    writer.finish(b"{}", {"vocab_size": 10, "eos_id": 1, "special_ids": {}, "sha256": "0" * 64}, {})
    dataset = open_dataset(tmp_path / "d")
    train = dataset.split("train")
    assert train.document_ends().tolist() == [3, 5, 9]
    assert train.read(0, 9).tolist() == [5, 6, 1, 7, 1, 8, 8, 8, 1]
    assert dataset.entries["val"].num_tokens == 0 and dataset.split("val").document_ends().tolist() == []
    assert dataset.dtype == np.dtype("<u2")


def test_verify_finds_a_changed_byte(position_dataset):
    path = position_dataset("d", 5_000, shard_tokens=2_000)
    dataset = open_dataset(path)
    assert dataset.verify() == 6  # tokenizer, 3 train shards, 2 document indexes
    shard = path / "train.00001.bin"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ZayaError, match=r"train\.00001\.bin: checksum mismatch"):
        open_dataset(path).verify()


def test_fingerprint_is_the_manifest_hash_not_the_place(position_dataset):
    a = open_dataset(position_dataset("a", 3_000))
    b = open_dataset(position_dataset("b", 3_000))
    c = open_dataset(position_dataset("c", 3_000, offset=1))
    assert a.fingerprint == b.fingerprint != c.fingerprint
    assert len(a.fingerprint) == 64


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: (p / MANIFEST_FILE).unlink(), "manifest.json: file not found"),
        (lambda p: (p / MANIFEST_FILE).write_text("{oops"), "manifest.json: not a readable manifest"),
        (lambda p: _edit(p, lambda m: m.pop("dtype")), "missing field 'dtype'"),
        (lambda p: _edit(p, lambda m: m.update(version=9)), "field 'version' is 9"),
        (lambda p: _edit(p, lambda m: m["splits"]["train"].update(num_tokens="many")),
         "field 'splits.train.num_tokens' must be an integer"),
        (lambda p: _edit(p, lambda m: m["splits"]["train"]["shards"][0].update(file="../x.bin")),
         "must be a plain file name"),
        (lambda p: _edit(p, lambda m: m["tokenizer"].update(file="/etc/passwd")),
         "field 'tokenizer.file' must be a plain file name"),
        (lambda p: (p / "train.00000.bin").unlink(), r"train\.00000\.bin: file not found"),
        (lambda p: (p / "train.00000.bin").write_bytes(b"12"), "2 bytes, but the manifest says 4000"),
    ],
)
def test_damaged_datasets_give_one_line_errors(position_dataset, damage, message):
    path = position_dataset("d", 2_000, vocab_size=60_000)
    damage(path)
    with pytest.raises(ZayaError, match=message) as caught:
        open_dataset(path)
    assert "\n" not in str(caught.value)


def _edit(path, change):
    manifest = json.loads((path / MANIFEST_FILE).read_text())
    change(manifest)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest))


def test_a_failed_write_leaves_nothing(tmp_path):
    out = tmp_path / "data"
    with pytest.raises(RuntimeError), staged_directory(out) as staging:
        (staging / "train.00000.bin").write_bytes(b"half")
        raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_replacing_needs_overwrite_and_a_dataset(tmp_path, position_dataset):
    path = position_dataset("d", 2_000)
    with pytest.raises(ZayaError, match="already exists; pass --overwrite"), staged_directory(path):
        pass
    with staged_directory(path, overwrite=True) as staging:
        (staging / "new").write_text("x")
    assert [p.name for p in path.iterdir()] == ["new"]
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(ZayaError, match="is not a dataset; refusing"), staged_directory(precious, overwrite=True):
        pass
    assert (precious / "thesis.tex").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d", "precious"]


@pytest.mark.parametrize(("shard_tokens", "seq_len"), [(1_000, 16), (1_000, 999), (1_000, 1_000), (700, 1_500),
                                                       (1 << 20, 16)])
def test_gathered_windows_match_plain_reads(position_dataset, shard_tokens, seq_len):
    train = open_dataset(position_dataset("d", 10_001, shard_tokens=shard_tokens)).split("train")
    samples = np.random.default_rng(0).permutation((10_001 - 1) // seq_len)
    windows = train.gather(samples, seq_len)
    assert windows.dtype == train.dtype
    expected = samples[:, None] * seq_len + np.arange(seq_len + 1)
    assert np.array_equal(windows, expected)
