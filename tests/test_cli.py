"""The `zaya` command end to end: generate, convert, params, and one-line errors for bad input."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

import zaya
from zaya.data.chat import DEFAULT_CHAT_TEMPLATE
from zaya.data.tokenizer import train_bpe
from zaya.infer.generate import generate


@pytest.fixture
def hf_dir(make_model, tmp_path):
    model = make_model("micro")
    zaya.export_hf(model, tmp_path / "hf")
    return tmp_path / "hf", model


def _assert_one_line_error(code, err, *fragments):
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zaya: error: "), err
    assert "Traceback" not in err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_generate_prints_ids_matching_the_api(cli, hf_dir, monkeypatch):
    path, model = hf_dir
    code, out, _ = cli("generate", "--model", path, "--prompt-ids", "5,17,3", "--max-new-tokens", "9",
                       "--output", "ids", "--no-stop-at-eos")
    assert code == 0
    expected = generate(model, torch.tensor([[5, 17, 3]]), 9)[0].tolist()
    assert out.strip() == ",".join(map(str, expected))
    # --compile decodes with a compiled step: traced whole (fullgraph) here, run by the eager backend, since
    # what inductor makes of it is tests/infer/test_static.py's (and costs a C++ build)
    compiled_with, compile = [], torch.compile

    def traced(fn, **options):
        compiled_with.append(options)
        return compile(fn, backend="eager", fullgraph=options["fullgraph"], dynamic=options["dynamic"])

    monkeypatch.setattr(torch, "compile", traced)
    code, compiled, _ = cli("generate", "--model", path, "--prompt-ids", "5,17,3", "--max-new-tokens", "9",
                            "--output", "ids", "--no-stop-at-eos", "--compile")
    assert code == 0 and compiled == out
    assert len(compiled_with) == 1 and compiled_with[0]["fullgraph"]


def test_generate_sampling_is_seeded(cli, hf_dir):
    path, _ = hf_dir
    args = ["generate", "--model", path, "--prompt-ids", "1,2", "--temperature", "1.3", "--top-p", "0.9",
            "--seed", "4", "--output", "ids", "--max-new-tokens", "12", "--no-stop-at-eos"]
    first, second = cli(*args), cli(*args)
    assert first[0] == 0 and first[1] == second[1]
    code, _, err = cli("generate", "--model", path, "--prompt-ids", "1", "--greedy", "--temperature", "2")
    _assert_one_line_error(code, err, "--greedy")


def test_generate_with_a_tokenizer_streams_text(cli, hf_dir):
    path, _ = hf_dir
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<eos>", "<bos>", "<unk>"])
    tokenizer.train_from_iterator(["def main():\n    return 0\n"] * 50, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    code, out, _ = cli("generate", "--model", path, "--prompt", "def main", "--max-new-tokens", "5")
    assert code == 0 and out.startswith("def main")


def test_generate_without_tokenizer_needs_prompt_ids(cli, hf_dir):
    path, _ = hf_dir
    _assert_one_line_error(*cli("generate", "--model", path, "--prompt", "hello")[::2], "tokenizer")


def test_prompt_id_outside_the_vocabulary(cli, hf_dir):
    path, _ = hf_dir
    _assert_one_line_error(*cli("generate", "--model", path, "--prompt-ids", "3,512")[::2], "512", "vocabulary")
    _assert_one_line_error(*cli("generate", "--model", path, "--prompt-ids", "3,x")[::2], "--prompt-ids")


# user turns end with another marker than replies: the prompt holds no end-of-turn token
SEPARATED_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                      "{{ '<|im_end|>' if m['role'] == 'assistant' else '<|im_sep|>' }}\n{% endfor %}"
                      "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat_model(directory, model, template: str) -> Tokenizer:
    """`model` exported with a tokenizer whose special tokens include the markers, and `template` beside it."""
    zaya.export_hf(model, directory)
    tokenizer = train_bpe(["hello there, how are you?\n"] * 20, 300,
                          extra_special_tokens=["<|im_start|>", "<|im_end|>", "<|im_sep|>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "chat_template.jinja").write_text(template)
    return tokenizer


def test_generate_chat_renders_the_prompt_with_the_template(cli, make_model, tmp_path):
    model = make_model("micro")
    tok = _chat_model(tmp_path / "m", model, DEFAULT_CHAT_TEMPLATE)
    args = ["--output", "ids", "--max-new-tokens", "6", "--no-stop-at-eos"]
    code, chat, err = cli("generate", "--model", tmp_path / "m", "--chat", "--prompt", "hello there", *args)
    assert code == 0, err
    by_hand = tok.encode("<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n").ids
    assert tok.token_to_id("<|im_start|>") in by_hand  # the markers are single tokens
    code, plain, _ = cli("generate", "--model", tmp_path / "m", "--prompt-ids", ",".join(map(str, by_hand)), *args)
    assert code == 0 and chat == plain
    assert chat.strip() == ",".join(map(str, generate(model, torch.tensor([by_hand]), 6)[0].tolist()))


@torch.no_grad()
def test_generate_chat_stops_at_the_end_of_turn_token(cli, make_model, tmp_path):
    model = make_model("micro")
    tok = _chat_model(tmp_path / "probe", model, SEPARATED_TEMPLATE)
    end = tok.token_to_id("<|im_end|>")
    prompt = tok.encode("<|im_start|>user\nhello<|im_sep|>\n<|im_start|>assistant\n").ids
    assert end not in prompt
    # make the model answer one token and then end its turn: the end token's (tied) embedding is turned towards
    # the second step's hidden state, orthogonally to the first's, so only the second step picks it
    first = model.hidden_states(torch.tensor([prompt]))[0, -1]
    logits = model.logits(first)
    token = int(logits.argmax())
    assert token != end and float(logits.max()) > 0.1
    second = model.hidden_states(torch.tensor([[*prompt, token]]))[0, -1]
    toward = second - (second @ first) / (first @ first) * first
    model.embed.weight[end] = 100 * toward / toward.norm()
    _chat_model(tmp_path / "m", model, SEPARATED_TEMPLATE)
    code, out, err = cli("generate", "--model", tmp_path / "m", "--chat", "--prompt", "hello", "--output", "ids",
                         "--max-new-tokens", "8")
    assert code == 0 and out.strip() == f"{token},{end}", err
    code, out, _ = cli("generate", "--model", tmp_path / "m", "--chat", "--prompt", "hello", "--output", "ids",
                       "--max-new-tokens", "8", "--no-stop-at-eos")
    assert code == 0 and out.strip().split(",")[:2] == [str(token), str(end)] and len(out.split(",")) == 8
    # text: the reply alone, without the prompt or the end-of-turn marker
    code, out, _ = cli("generate", "--model", tmp_path / "m", "--chat", "--prompt", "hello", "--max-new-tokens", "8")
    assert code == 0 and out == tok.decode([token]) + "\n"


def test_generate_chat_needs_a_template_and_a_prompt(cli, hf_dir, tmp_path):
    path, model = hf_dir
    _chat_model(tmp_path / "m", model, DEFAULT_CHAT_TEMPLATE)
    (tmp_path / "m" / "chat_template.jinja").unlink()
    _assert_one_line_error(*cli("generate", "--model", tmp_path / "m", "--chat", "--prompt", "hi")[::2],
                           "no chat template", "--format chat")
    _assert_one_line_error(*cli("generate", "--model", path, "--chat", "--prompt-ids", "3")[::2],
                           "--chat needs --prompt")


def test_convert_both_directions_and_params(cli, hf_dir, tmp_path):
    path, _ = hf_dir
    code, out, _ = cli("convert", path, tmp_path / "ckpt")
    assert code == 0 and "hf->zaya" in out
    code, out, _ = cli("convert", tmp_path / "ckpt", tmp_path / "back")
    assert code == 0 and "zaya->hf" in out
    a, b = load_file(path / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    code, out, _ = cli("params", tmp_path / "ckpt", "--json")
    assert code == 0 and json.loads(out)["non_embedding"] == 402_598
    code, out, _ = cli("params", "zaya1-base")
    assert code == 0 and "8,303,355,728" in out
    _assert_one_line_error(*cli("convert", path, tmp_path / "ckpt")[::2], "already exists")


def test_convert_exports_in_the_dtype_and_shards_asked_for(cli, hf_dir, tmp_path):
    path, model = hf_dir
    assert cli("convert", path, tmp_path / "ckpt")[0] == 0
    code, out, _ = cli("convert", tmp_path / "ckpt", tmp_path / "bf16", "--dtype", "bfloat16",
                       "--max-shard-size", "400KB")
    assert code == 0 and "zaya->hf" in out
    export = tmp_path / "bf16"
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    shards = sorted(export.glob("model-*-of-*.safetensors"))
    assert len(shards) > 2 and not (export / "model.safetensors").exists()
    assert set(json.loads((export / "model.safetensors.index.json").read_text())["weight_map"].values()) == {
        f.name for f in shards}
    assert all(t.dtype == torch.bfloat16 for f in shards for t in load_file(f).values())
    loaded = zaya.load_model(export, device="cpu")
    assert torch.equal(loaded.embed.weight, model.embed.weight.to(torch.bfloat16))
    code, _, _ = cli("convert", tmp_path / "ckpt", tmp_path / "fp32", "--dtype", "fp32", "--max-shard-size", "2GiB")
    assert code == 0 and json.loads((tmp_path / "fp32" / "config.json").read_text())["dtype"] == "float32"
    assert (tmp_path / "fp32" / "model.safetensors").is_file()
    _assert_one_line_error(*cli("convert", tmp_path / "ckpt", tmp_path / "x", "--max-shard-size", "5XB")[::2],
                           "--max-shard-size", "5XB")
    _assert_one_line_error(*cli("convert", path, tmp_path / "x", "--dtype", "bf16")[::2], "exports")
    assert not (tmp_path / "x").exists()


def _tree(directory):
    return {p.relative_to(directory): p.read_bytes() for p in directory.rglob("*") if p.is_file()}


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def test_convert_overwrite_replaces_an_export_only_once_the_new_one_is_whole(cli, hf_dir, tmp_path, monkeypatch,
                                                                            umask_022):
    path, _ = hf_dir
    assert cli("convert", path, tmp_path / "ckpt")[0] == 0
    out = tmp_path / "out"
    assert cli("convert", tmp_path / "ckpt", out)[0] == 0
    _assert_one_line_error(*cli("convert", tmp_path / "ckpt", out)[::2], "already exists", "--overwrite")
    before = _tree(out)

    def fail(*args, **kwargs):
        raise zaya.ZayaError("disk full")

    monkeypatch.setattr("zaya.api.write_hf_files", fail)  # fails after the weights are written
    _assert_one_line_error(*cli("convert", tmp_path / "ckpt", out, "--overwrite")[::2], "disk full")
    assert _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "out"], "no staging left behind"
    monkeypatch.undo()
    code, _, _ = cli("convert", tmp_path / "ckpt", out, "--overwrite", "--dtype", "bf16")
    assert code == 0 and json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "out"], "no staging left behind"
    assert os.stat(out).st_mode & 0o777 == 0o755, "made in a private staging directory, but not private"
    assert {os.stat(f).st_mode & 0o777 for f in out.iterdir()} == {0o644}
    # a checkpoint is replaced alike (hf->zaya)
    assert cli("convert", out, tmp_path / "ckpt", "--overwrite")[0] == 0
    assert zaya.load_model(tmp_path / "ckpt", device="cpu").embed.weight.dtype == torch.bfloat16


def test_convert_overwrite_refuses_what_is_not_an_earlier_export(cli, hf_dir, tmp_path):
    path, _ = hf_dir
    assert cli("convert", path, tmp_path / "ckpt")[0] == 0
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"meow")
    (other / "config.json").write_text("{}")
    _assert_one_line_error(*cli("convert", tmp_path / "ckpt", other, "--overwrite")[::2], "photos", "neither")
    (tmp_path / "notes.txt").write_text("keep")
    _assert_one_line_error(*cli("convert", tmp_path / "ckpt", tmp_path / "notes.txt", "--overwrite")[::2],
                           "not a directory")
    _assert_one_line_error(*cli("convert", path, path, "--overwrite")[::2], "holds the source")
    _assert_one_line_error(*cli("convert", tmp_path / "ckpt", tmp_path, "--overwrite")[::2], "holds the source")
    assert (other / "cat.jpg").read_bytes() == b"meow" and (tmp_path / "notes.txt").read_text() == "keep"
    assert (path / "model.safetensors").is_file() and (tmp_path / "ckpt" / "zaya.json").is_file()


def _convert_error(cli, src, dst):
    code, _, err = cli("convert", src, dst)
    _assert_one_line_error(code, err)
    assert not dst.exists() and not dst.with_name(dst.name + ".tmp").exists(), "nothing half-written"
    return err


def test_missing_and_malformed_config(cli, hf_dir, tmp_path):
    path, _ = hf_dir
    (path / "config.json").rename(path / "config.bak")
    assert "config.json" in _convert_error(cli, path, tmp_path / "out")
    (path / "config.json").write_text("{not json")
    err = _convert_error(cli, path, tmp_path / "out")
    assert "config.json" in err and "JSON" in err
    config = json.loads((path / "config.bak").read_text())
    (path / "config.json").write_text(json.dumps({**config, "hidden_size": "wide"}))
    err = _convert_error(cli, path, tmp_path / "out")
    assert "config.json" in err and "hidden_size" in err
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "num_hidden_layers"}))
    assert "num_hidden_layers" in _convert_error(cli, path, tmp_path / "out")


@pytest.mark.parametrize("fault", ["missing", "extra", "misshaped"])
def test_bad_safetensors(cli, hf_dir, tmp_path, fault):
    path, _ = hf_dir
    tensors = load_file(path / "model.safetensors")
    key = "model.layers.1.self_attn.qkv_proj.q_proj.weight"
    if fault == "missing":
        del tensors[key]
    elif fault == "extra":
        tensors["model.layers.1.mystery.weight"] = torch.zeros(3)
    else:
        tensors[key] = torch.zeros(5, 5)
    save_file(tensors, str(path / "model.safetensors"))
    err = _convert_error(cli, path, tmp_path / "out")
    assert "model.layers.1" in err
    assert {"missing": "missing", "extra": "unexpected", "misshaped": "shape"}[fault] in err


def test_the_console_script_exits_2_with_one_line(tmp_path):
    result = subprocess.run([sys.executable, "-m", "zaya.cli", "generate", "--model", str(tmp_path / "nope"),
                             "--prompt-ids", "1"], capture_output=True, text=True, timeout=120)
    _assert_one_line_error(result.returncode, result.stderr, "no such directory")


@pytest.mark.parametrize(("args", "shows"), [
    (["--help"], "Usage: "), (["--version"], "zaya"), (["diagnose", "--help"], "diagnose"),
    (["data", "--help"], "data"), (["shapes", "--help"], "[default: 1024,2048,4096,8192]"),
], ids=["help", "version", "diagnose", "data-help", "shapes-help"])
def test_the_quick_commands_import_no_torch(args, shows):
    """`zaya --help`, `--version`, `zaya diagnose` and the commands' help start without loading torch
    (`-X importtime` lists every module a process imports); `zaya shapes --help` still states the sweep's
    defaults."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "zaya.cli", *args], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert shows in " ".join(result.stdout.split()), result.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in result.stderr.splitlines() if "|" in line}
    assert "zaya.errors" in imported and "torch" not in imported


def test_diagnose_reads_a_log_without_torch(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("[ 12.5] NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python, GPU has fallen off the bus.\n")
    code = (f"import runpy, sys; sys.argv = ['zaya', 'diagnose', {str(log)!r}]\n"
            "try:\n    runpy.run_module('zaya.cli', run_name='__main__')\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "gpu_xid" in result.stdout and result.stdout.strip().endswith("False"), result.stdout + result.stderr


def test_a_run_config_loads_without_torch(tmp_path):
    """The config sections import none of their packages' implementations (zaya.config composes them)."""
    config = tmp_path / "run.toml"
    config.write_text('[model]\npreset = "micro"\n[data]\npath = "data"\n[parallel]\ncp = 2\n')
    code = (f"import sys; from zaya.config import load_config; c = load_config({str(config)!r})\n"
            "print(c.parallel.cp, c.model_config().hidden_size, 'torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.split() == ["2", "128", "False"], result.stdout + result.stderr


def test_the_readme_python_snippet_runs(tmp_path, monkeypatch):
    readme = (Path(__file__).parents[1] / "README.md").read_text(encoding="utf-8")
    (snippet,) = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(snippet, "README.md", "exec"), namespace)
    assert namespace["logits"].shape == (1, 4, namespace["model"].config.vocab_size)
    assert namespace["model"].embed.weight.dtype == torch.bfloat16 and (tmp_path / "out_dir").is_dir()
