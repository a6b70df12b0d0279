"""The documented path from one's own corpus to one's own chat model, on one tokenizer (docs/data.md, "Fine-tuning
on chats"), each step through the `zaya` command as a user types it:

    zaya data build --input corpus/ --out base --reserve-chat-markers
    zaya train base.toml --run-dir runs/base
    zaya data build --format chat --input chats.jsonl --out sft --tokenizer runs/base
    zaya train sft.toml --run-dir runs/sft --set train.init_from=runs/base
    zaya convert runs/sft hf
    transformers: apply_chat_template + generate == zaya generate --chat, both ending at <|im_end|>

and the same path with the chat data built on a tokenizer of its own, which the SFT refuses."""

import json
import sysconfig
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from runs import REPLY_WORD, make_chats, write_chats, write_config
from zaya.data.tokenizer import tokenizer_fingerprint

MAX_NEW = 32  # the fine-tuned model ends its replies after a few tokens


def _corpus(root: Path) -> Path:
    """Some of the standard library's sources as .txt documents: a corpus with no chat in it."""
    corpus = root / "corpus"
    corpus.mkdir()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for source in sorted((stdlib / "json").glob("*.py")) + sorted((stdlib / "email").glob("*.py"))[:12]:
        (corpus / f"{source.parent.name}_{source.stem}.txt").write_text(source.read_text(encoding="utf-8"),
                                                                      encoding="utf-8")
    return corpus


def _one_word_chats(count: int) -> list[list[dict]]:
    """Questions of six words, each answered with one word: a reply whose end a dozen steps teach."""
    words = [message["content"] for chat in make_chats(count) for message in chat if message["role"] == "user"]
    return [[{"role": "user", "content": question}, {"role": "assistant", "content": REPLY_WORD}]
            for question in words[:count]]


def test_own_corpus_to_a_chat_model_that_stops_at_the_end_of_its_turn(tmp_path, cli):
    def zaya(*args):
        code, out, err = cli(*args)
        assert code == 0, f"zaya {' '.join(map(str, args))}: {err}"
        return out, err

    zaya("data", "build", "--input", _corpus(tmp_path), "--out", tmp_path / "base", "--vocab-size", 400,
         "--reserve-chat-markers", "--workers", 1)
    base = write_config(tmp_path / "base.toml", tmp_path / "base", train={"max_steps": 4, "eval_every": 0},
                        checkpoint={"every": 4, "keep": 1}, logging={"log_every": 100})
    zaya("train", base, "--run-dir", tmp_path / "runs" / "base")

    chats = write_chats(tmp_path / "chats.jsonl", _one_word_chats(200))
    zaya("data", "build", "--format", "chat", "--input", chats, "--out", tmp_path / "sft", "--tokenizer",
         tmp_path / "runs" / "base", "--workers", 1)
    assert tokenizer_fingerprint(tmp_path / "sft" / "tokenizer.json") == tokenizer_fingerprint(
        tmp_path / "base" / "tokenizer.json")
    sft = write_config(tmp_path / "sft.toml", tmp_path / "sft", train={"max_steps": 12, "eval_every": 0},
                       checkpoint={"every": 12, "keep": 1}, logging={"log_every": 100})
    zaya("train", sft, "--run-dir", tmp_path / "runs" / "sft", "--set", f"train.init_from={tmp_path / 'runs' / 'base'}")
    assert json.loads((tmp_path / "runs" / "sft" / "init_from.json").read_text())  # started from the base run

    zaya("convert", tmp_path / "runs" / "sft", tmp_path / "hf")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "hf")
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn in json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32, trust_remote_code=False).eval()
    for question in ("what is a banana?", "alpha def omega kappa"):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                               return_tensors="pt", return_dict=False)
        theirs = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False)[0, prompt.shape[1]:].tolist()
        assert theirs[-1] == end_of_turn and end_of_turn not in theirs[:-1], theirs  # stopped at the turn's end
        out, _ = zaya("generate", "--model", tmp_path / "runs" / "sft", "--chat", "--prompt", question,
                      "--output", "ids", "--max-new-tokens", MAX_NEW)
        assert [int(i) for i in out.strip().split(",")] == theirs


def test_chat_data_on_a_tokenizer_of_its_own_is_refused_by_the_sft_and_by_eval(tmp_path, cli):
    """The old docs' path: a chat build that trains a new tokenizer, then `init_from` the base run. Its ids mean
    other words to the base model: refused at start in one line, nothing written; `zaya eval --data` alike."""
    code, _, err = cli("data", "build", "--input", _corpus(tmp_path), "--out", tmp_path / "base", "--vocab-size",
                       400, "--workers", 1)
    assert code == 0, err
    base = write_config(tmp_path / "base.toml", tmp_path / "base", train={"max_steps": 2, "eval_every": 0},
                        checkpoint={"every": 2, "keep": 1}, logging={"log_every": 100})
    assert cli("train", base, "--run-dir", tmp_path / "runs" / "base")[0] == 0
    chats = write_chats(tmp_path / "chats.jsonl", make_chats(100))
    code, _, err = cli("data", "build", "--format", "chat", "--input", chats, "--out", tmp_path / "sft",
                       "--vocab-size", 300, "--workers", 1)
    assert code == 0, err
    sft = write_config(tmp_path / "sft.toml", tmp_path / "sft", train={"max_steps": 2, "eval_every": 0})
    code, _, err = cli("train", sft, "--run-dir", tmp_path / "runs" / "sft", "--set",
                       f"train.init_from={tmp_path / 'runs' / 'base'}")
    lines = [line for line in err.splitlines() if line.startswith("zaya: error")]
    assert code == 2 and len(lines) == 1 and "tokenizer" in lines[0], err
    assert not (tmp_path / "runs" / "sft").exists()
    code, _, err = cli("eval", "--model", tmp_path / "runs" / "base", "--data", tmp_path / "sft")
    assert code == 2 and "tokenizer" in err, err
