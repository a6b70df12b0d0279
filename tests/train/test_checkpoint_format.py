"""Our checkpoint format: atomic writes, manifest checks, and metadata that can never run code."""

import json
import pickle

import pytest
import torch

import zaya
from zaya import checkpoint
from zaya.errors import ZayaError


def test_save_and_load_round_trip(make_model, tmp_path):
    model = make_model("micro")
    checkpoint.save_model_checkpoint(tmp_path / "ckpt", model, model.config)
    assert not (tmp_path / "ckpt.tmp").exists()
    checkpoint.verify_checkpoint(tmp_path / "ckpt")
    loaded = zaya.load_model(tmp_path / "ckpt", device="cpu")
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ZayaError, match="already exists"):
        checkpoint.save_model_checkpoint(tmp_path / "ckpt", model, model.config)


def test_manifest_detects_a_flipped_bit_and_a_truncated_shard(make_model, tmp_path):
    model = make_model("micro")
    checkpoint.save_model_checkpoint(tmp_path / "ckpt", model, model.config)
    shard = next((tmp_path / "ckpt").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    with pytest.raises(ZayaError, match="checksum"):
        checkpoint.verify_checkpoint(tmp_path / "ckpt")
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(ZayaError, match="size"):
        checkpoint.verify_checkpoint(tmp_path / "ckpt")


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("touch pwned-by-checkpoint",))


def test_metadata_that_would_run_code_is_refused(make_model, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = make_model("micro")
    checkpoint.save_model_checkpoint(tmp_path / "ckpt", model, model.config)
    metadata_path = tmp_path / "ckpt" / checkpoint.METADATA_FILE
    metadata = pickle.loads(metadata_path.read_bytes())
    metadata.planner_data = _Payload()
    metadata_path.write_bytes(pickle.dumps(metadata))
    # with its manifest rewritten to match (else the checksum would refuse it first): the unpickler must
    from zaya.checkpoint.files import file_checksum

    manifest = tmp_path / "ckpt" / "manifest.rank0.json"
    listed = json.loads(manifest.read_text())
    listed["files"][checkpoint.METADATA_FILE] = {"bytes": metadata_path.stat().st_size,
                                                 "crc32": file_checksum(metadata_path)}
    manifest.write_text(json.dumps(listed))
    with pytest.raises(ZayaError, match="not allowed"):
        zaya.load_model(tmp_path / "ckpt", device="cpu")
    assert not (tmp_path / "pwned-by-checkpoint").exists()
