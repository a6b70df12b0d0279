"""A run config's messages blame what gave the wrong value: a `--set` on the command line, else the file."""

from __future__ import annotations

import pytest

from zaya.config import load_config
from zaya.errors import ZayaError

BASE = '[model]\npreset = "micro"\n[data]\npath = "data"\nseq_len = 64\n[train]\nglobal_batch_size = 8\n'


def _message(tmp_path, text: str, overrides: list[str]) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ZayaError) as error:
        load_config(path, overrides)
    message = str(error.value)
    assert "\n" not in message
    return message.replace(str(path), "FILE")


@pytest.mark.parametrize(("text", "overrides", "expected"), [
    # a value of the wrong type or out of range
    (BASE, ["train.max_steps=ten"], "--set train.max_steps=ten: key 'train.max_steps' must be an integer, got 'ten'"),
    (BASE + "max_steps = 'ten'\n", [], "FILE: key 'train.max_steps' must be an integer, got 'ten'"),
    (BASE + "max_steps = 'ten'\n", ["optim.lr=0.01"], "FILE: key 'train.max_steps' must be an integer"),
    (BASE, ["optim.adamw_betas=[0.9, 1.0]"], "--set optim.adamw_betas=[0.9, 1.0]: key 'optim.adamw_betas.1'"),
    (BASE, ["train.seed=" + "9" * 400], "--set train.seed: key 'train.seed' must be an integer in"),  # not echoed
    # keys that must agree, one of them given by --set
    (BASE, ["train.micro_batch_size=3"], "--set train.micro_batch_size=3: train.global_batch_size (8) is not a "
                                         "multiple of train.micro_batch_size (3)"),
    (BASE, ["data.seq_len=8192"], "--set data.seq_len=8192: key 'data.seq_len' = 8,192 is longer than "
                                  "model.max_position_embeddings = 4,096"),
    (BASE, ["model.max_position_embeddings=32"], "--set model.max_position_embeddings=32: key 'data.seq_len' = 64 "
                                                 "is longer than model.max_position_embeddings = 32"),
    (BASE.replace("seq_len = 64", "seq_len = 8192"), ["optim.lr=0.01"], "FILE: key 'data.seq_len' = 8,192"),
    # a section's own checks: the schedule (whose total_steps is train.max_steps), the model's fields, [parallel]
    (BASE + "[schedule]\nwarmup_steps = 20\n", ["train.max_steps=10"], "--set train.max_steps=10: [schedule]"),
    (BASE + "max_steps = 10\n[schedule]\nwarmup_steps = 20\n", ["schedule.min_ratio=0.1"], "FILE: [schedule]"),
    (BASE, ["schedule.warmup_steps=5000"], "--set schedule.warmup_steps=5000: [schedule] schedule config: field "
                                           "'warmup_steps' (5000)"),
    (BASE, ["model.temp_init=1e9"], "--set model.temp_init=1e9: [model]: field 'temp_init' must be in"),
    (BASE, ["model.num_key_value_heads=3"], "--set model.num_key_value_heads=3: [model]: num_attention_heads"),
    (BASE, ["model.preset=nope"], "--set model.preset=nope: model.preset 'nope' does not exist"),
    (BASE + "[parallel]\nsharding = 'zero3'\n", ["parallel.cp=1"], "FILE: key 'parallel.sharding' must be one of"),
    (BASE, ["parallel.sharding=zero3"], "--set parallel.sharding=zero3: key 'parallel.sharding' must be one of"),
    # packed documents kept apart split into cp x parallel.cp_document_chunks chunks of at least 2 tokens
    (BASE + "[parallel]\ncp = 2\ncp_document_chunks = 6\n", ["data.isolate_documents=true"],
     "FILE: key 'data.seq_len' = 64 with parallel.cp = 2 and parallel.cp_document_chunks = 6 (phase 'main' keeps "
     "documents apart): a sequence of 64 tokens does not split into cp x parallel.cp_document_chunks = 2 x 6"),
    (BASE, ["data.isolate_documents=true", "parallel.cp=2", "parallel.cp_document_chunks=32"],
     "--set parallel.cp=2: key 'data.seq_len' = 64 with parallel.cp = 2 and parallel.cp_document_chunks = 32"),
    (BASE + "[[phases]]\nname = 'sft'\ncp = 4\nisolate_documents = true\n", ["data.seq_len=72"],
     "--set data.seq_len=72: key 'data.seq_len' = 72 with phases.0.cp = 4 and parallel.cp_document_chunks = 8"),
    (BASE + "[[phases]]\nname = 'sft'\ndocument_tokens = 512\n", [],
     "FILE: key 'phases.0.document_tokens' = 512: phase 'sft' does not keep documents apart"),
])
def test_a_message_names_the_set_that_gave_the_value_else_the_file(tmp_path, text, overrides, expected):
    message = _message(tmp_path, text, overrides)
    assert message.startswith(expected), message
