"""HF exports load in every Hugging Face tool as they are: AutoTokenizer, AutoModelForCausalLM, pipelines.

The model is a really trained micro run (a BPE of the json package's sources, 30 steps); tests/evals runs
`lm_eval --model hf` on such an export.
"""

import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

import zaya
from runs import build_code_dataset, write_config
from zaya import checkpoint
from zaya.config import load_config
from zaya.infer.generate import generate
from zaya.infer.hf_files import HF_FILES, training_hints
from zaya.training import build_trainer

TEXTS = ["def f(x):\n    return x + 1\n", "import json\nprint(json.dumps({'a': [1, 2.5]}))",
         "  leading spaces and unicode: caf\u00e9 \u03bb \u2192 \U0001f600", "tokens <eos> and <bos> inside"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(run directory, its HF export)."""
    root = tmp_path_factory.mktemp("trained")
    data = build_code_dataset(root, ["json"], val_fraction=0.2)
    config = write_config(root / "run.toml", data, train={"max_steps": 30, "eval_every": 1000, "micro_batch_size": 8},
                          checkpoint={"every": 30, "keep": 1}, optim={"lr": 0.01, "ns_dtype": "float32"})
    build_trainer(load_config(config), root / "run").run()
    assert zaya.convert(root / "run", root / "hf") == "zaya->hf"
    return root / "run", root / "hf"


def test_the_export_declares_the_tokenizers_real_special_tokens(trained):
    run, hf = trained
    for name in ("config.json", "model.safetensors", "tokenizer.json", *HF_FILES):
        assert (hf / name).is_file(), name
    tokenizer_config = json.loads((hf / "tokenizer_config.json").read_text())
    assert tokenizer_config == {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "model_max_length": 32,  # the run's data.seq_len; a byte-level BPE has no <unk>
    }
    assert json.loads((hf / "special_tokens_map.json").read_text()) == {
        "bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    assert json.loads((hf / "generation_config.json").read_text()) == {
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    hints = training_hints(checkpoint.resolve_checkpoint(run))
    assert (hints.seq_len, hints.eos_id) == (32, 1)  # the dataset's manifest names its end-of-document id


def test_auto_tokenizer_encodes_and_decodes_as_ours(trained):
    _, hf = trained
    theirs = AutoTokenizer.from_pretrained(hf)
    ours = Tokenizer.from_file(str(hf / "tokenizer.json"))
    assert (theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, theirs.unk_token) == (2, 1, 0, None)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert theirs.encode(text) == ids, text
        assert theirs(text)["input_ids"] == ids
        assert theirs.decode(ids, skip_special_tokens=True) == ours.decode(ids), text
        assert theirs.decode(ids) == ours.decode(ids, skip_special_tokens=False), text


def test_auto_model_gives_our_logits(trained):
    run, hf = trained
    ours = zaya.load_model(run, device="cpu")
    theirs = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    ids = torch.tensor([tokenizer.encode(TEXTS[0] + TEXTS[1])])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids), atol=1e-5, rtol=0)


def test_a_text_generation_pipeline_continues_as_our_generate(trained):
    run, hf = trained
    generator = pipeline("text-generation", model=str(hf), device="cpu")
    prompt = "def decode(self, s):\n"
    out = generator(prompt, max_new_tokens=12, do_sample=False, return_full_text=False)
    assert isinstance(out[0]["generated_text"], str) and out[0]["generated_text"]
    ours = zaya.load_model(run, device="cpu")
    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))
    new = generate(ours, torch.tensor([tokenizer.encode(prompt).ids]), 12, eos_token_id=1)[0].tolist()
    assert out[0]["generated_text"] == tokenizer.decode(new)


def test_hf_to_zaya_to_hf_keeps_the_tokenizer_and_generation_files(trained, tmp_path):
    _, hf = trained
    original = tmp_path / "original"
    zaya.convert(hf, tmp_path / "ckpt")
    zaya.convert(tmp_path / "ckpt", original)  # an HF directory as any other tool would have it
    # an imported model's own settings, which a fresh export would not make
    tokenizer_config = json.loads((original / "tokenizer_config.json").read_text())
    tokenizer_config.update(model_max_length=77, padding_side="left", chat_template="{{ messages }}")
    (original / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (original / "generation_config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": [1, 0],
                                                                 "max_new_tokens": 5}))
    (original / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<eos>"}}))

    assert zaya.convert(original, tmp_path / "imported") == "hf->zaya"
    for name in ("tokenizer.json", *HF_FILES):
        assert (tmp_path / "imported" / name).read_bytes() == (original / name).read_bytes(), name
    checkpoint.verify_checkpoint(tmp_path / "imported")  # the manifest covers them
    assert zaya.convert(tmp_path / "imported", tmp_path / "back") == "zaya->hf"
    for name in ("tokenizer.json", *HF_FILES):
        assert (tmp_path / "back" / name).read_bytes() == (original / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(tmp_path / "back").model_max_length == 77


def test_a_tokenizer_with_unk_and_a_bos_post_processor_is_declared_as_it_is(make_model, tmp_path):
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"])
    tokenizer.train_from_iterator(["def main():\n    return 0\n"] * 50, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    zaya.export_hf(make_model("micro"), tmp_path / "hf", tokenizer=tmp_path / "tokenizer.json")
    tokenizer_config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert tokenizer_config["unk_token"] == "<unk>" and tokenizer_config["add_bos_token"] is True
    assert tokenizer_config["model_max_length"] == zaya.get_preset("micro").max_position_embeddings
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    assert theirs.encode("def main():") == tokenizer.encode("def main():").ids
    assert theirs.encode("def main():")[0] == 2


def test_an_export_without_a_tokenizer_still_has_a_generation_config(make_model, tmp_path):
    zaya.export_hf(make_model("micro"), tmp_path / "hf")
    assert not (tmp_path / "hf" / "tokenizer_config.json").exists()
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text()) == {
        "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "hf").generation_config.eos_token_id == 1
