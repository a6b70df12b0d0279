"""A model fine-tuned on chats keeps its chat template: its checkpoint knows it, `zaya generate --chat` prompts with
it, and an export's tokenizer_config.json carries it, so that transformers' `apply_chat_template` gives the ids
zaya trained on; its generation_config.json lists the end-of-turn id, so that transformers' `generate` stops where
`zaya generate --chat` does."""

import json

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

import zaya
from runs import build_chat_dataset, make_chats, write_config
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.data.chat import DEFAULT_CHAT_TEMPLATE, ChatFormat
from zaya.data.dataset_reader import open_dataset
from zaya.infer.chat import chat_prompt
from zaya.infer.generate import generate
from zaya.infer.hf_files import chat_template_of
from zaya.training import build_trainer

# a Llama-3-like template that also writes the bos token
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    """(chat dataset, run directory, its HF export) of a short run on chats: long enough that the model answers
    with a few bananas and ends its turn (its logits at the end of a reply favour <|im_end|> by 1-2)."""
    root = tmp_path_factory.mktemp("chat-run")
    data = build_chat_dataset(root, count=200)
    config = write_config(root / "run.toml", data, train={"max_steps": 12, "eval_every": 0},
                          checkpoint={"every": 12, "keep": 1}, logging={"log_every": 100})
    build_trainer(load_config(config), root / "run").run()
    assert zaya.convert(root / "run", root / "hf") == "zaya->hf"
    return data, root / "run", root / "hf"


def _zaya_ids(template: str, tokenizer: Tokenizer, messages, add_generation_prompt=False) -> list[int]:
    chat = ChatFormat.create(template, bos_token="<bos>", eos_token="<eos>")
    return tokenizer.encode(chat.render(messages, add_generation_prompt), add_special_tokens=False).ids


def test_the_checkpoint_and_the_export_know_the_template(fine_tuned):
    _, run, hf = fine_tuned
    checkpoint = ckpt.resolve_checkpoint(run)
    assert (checkpoint / "chat_template.jinja").read_text() == DEFAULT_CHAT_TEMPLATE  # carried, not looked up
    assert chat_template_of(checkpoint) == DEFAULT_CHAT_TEMPLATE
    assert json.loads((hf / "tokenizer_config.json").read_text())["chat_template"] == DEFAULT_CHAT_TEMPLATE
    assert chat_template_of(hf) == DEFAULT_CHAT_TEMPLATE


def test_apply_chat_template_gives_the_ids_zaya_trained_on(fine_tuned):
    data, run, hf = fine_tuned
    theirs = AutoTokenizer.from_pretrained(hf)
    ours = Tokenizer.from_file(str(hf / "tokenizer.json"))
    dataset = open_dataset(data)
    tokens = dataset.split("train")
    first = tokens.read(0, int(tokens.document_ends()[0]))[:-1].tolist()  # a training document, without its eos
    found = False
    for messages in make_chats(200):
        ids = theirs.apply_chat_template(messages, tokenize=True, return_dict=False)
        assert ids == _zaya_ids(DEFAULT_CHAT_TEMPLATE, ours, messages)
        found = found or ids == first
    assert found, "the dataset's first document is one of the chats, as transformers renders it"
    # the prompt `zaya generate --chat` sends is transformers' with the generation prompt
    question = [{"role": "user", "content": "what is a banana?"}]
    model = zaya.load_model(run, device="cpu")
    checkpoint = ckpt.resolve_checkpoint(run)
    prompt = chat_prompt(DEFAULT_CHAT_TEMPLATE, checkpoint, ours, model.config, question[0]["content"])
    assert prompt.ids == theirs.apply_chat_template(question, tokenize=True, add_generation_prompt=True,
                                                    return_dict=False)
    assert prompt.end_of_turn_id == ours.token_to_id("<|im_end|>") == theirs.convert_tokens_to_ids("<|im_end|>")


def test_a_template_with_a_bos_token_renders_alike(fine_tuned, tmp_path):
    data, run, _ = fine_tuned
    source = tmp_path / "source"  # a checkpoint whose chat template is a file beside its tokenizer
    source.mkdir()
    (source / "chat_template.jinja").write_text(HEADER_TEMPLATE)
    tokenizer = Tokenizer.from_file(str(open_dataset(data).tokenizer_path))
    tokenizer.add_special_tokens(["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tokenizer.save(str(source / "tokenizer.json"))
    model = zaya.load_model(run, device="cpu")
    zaya.export_hf(model, tmp_path / "hf", tokenizer=source / "tokenizer.json", source=source)
    theirs = AutoTokenizer.from_pretrained(tmp_path / "hf")
    for messages in make_chats(5):
        assert theirs.apply_chat_template(messages, tokenize=True, return_dict=False) == _zaya_ids(
            HEADER_TEMPLATE, tokenizer, messages)
    # a reply ends at the template's <|eot_id|> as well as at the end of the document
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [theirs.eos_token_id, tokenizer.token_to_id("<|eot_id|>")]


def test_generate_chat_on_the_run_and_on_an_imported_export(fine_tuned, tmp_path, cli):
    _, run, hf = fine_tuned
    assert zaya.convert(hf, tmp_path / "ckpt") == "hf->zaya"
    assert chat_template_of(tmp_path / "ckpt") == DEFAULT_CHAT_TEMPLATE  # in the tokenizer_config.json it carries
    model = zaya.load_model(run, device="cpu")
    tokenizer = Tokenizer.from_file(str(hf / "tokenizer.json"))
    prompt = chat_prompt(DEFAULT_CHAT_TEMPLATE, hf, tokenizer, model.config, "hi")
    expected = generate(model, torch.tensor([prompt.ids]), 5, eos_token_id=prompt.end_of_turn_id)[0].tolist()
    for where in (run, tmp_path / "ckpt"):
        code, out, err = cli("generate", "--model", where, "--chat", "--prompt", "hi", "--output", "ids",
                             "--max-new-tokens", "5")
        assert code == 0 and out.strip() == ",".join(map(str, expected)), err


MAX_NEW = 32  # the fine-tuned model ends its replies after 1-5 tokens


def test_a_chat_export_stops_in_transformers_where_zaya_generate_chat_stops(fine_tuned, cli):
    _, run, hf = fine_tuned
    tokenizer = AutoTokenizer.from_pretrained(hf)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == "<eos>"  # the template's `eos_token` and the end of a document, as trained
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == [tokenizer.eos_token_id,
                                                                                       end_of_turn]
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, trust_remote_code=False).eval()
    assert type(model).__module__.startswith("transformers.models.zaya")  # transformers' own class
    for question in ("what is a banana?", "alpha def omega kappa"):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=False)
        theirs = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)[0, prompt.shape[1]:].tolist()
        assert theirs[-1] == end_of_turn and end_of_turn not in theirs[:-1] and len(theirs) < MAX_NEW, theirs
        assert "<|im_end|>" not in tokenizer.decode(theirs, skip_special_tokens=True)
        for where in (run, hf):
            code, out, err = cli("generate", "--model", where, "--chat", "--prompt", question, "--output", "ids",
                                 "--max-new-tokens", str(MAX_NEW))
            assert code == 0, err
            assert [int(i) for i in out.strip().split(",")] == theirs, where


def test_an_export_whose_template_ends_turns_with_eos_or_cannot_be_read_keeps_one_eos(fine_tuned, tmp_path):
    data, run, _ = fine_tuned
    model = zaya.load_model(run, device="cpu")
    tokenizer = open_dataset(data).tokenizer_path
    templates = {"eos": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}{% endfor %}"
                        "{% if add_generation_prompt %}assistant: {% endif %}",
                 "unreadable": "{{ raise_exception('no chats here') }}"}
    for name, template in templates.items():
        source = tmp_path / name
        source.mkdir()
        (source / "chat_template.jinja").write_text(template)
        zaya.export_hf(model, tmp_path / f"hf-{name}", tokenizer=tokenizer, source=source)
        generation = json.loads((tmp_path / f"hf-{name}" / "generation_config.json").read_text())
        assert generation["eos_token_id"] == 1, name
