"""One tokenizer from pre-training to chat, on the model side: a chat build reuses a run's tokenizer (found in the
run, its checkpoint or its export), and the weights a run starts from, the checkpoint it resumes and the model
`zaya eval --data` evaluates must carry the data's tokenizer (by content), or the command stops in one line
naming both and writes nothing; `--allow-tokenizer-change` goes on and says so."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from runs import make_chats, write_chats, write_config, zaya_command
from zaya import checkpoint as ckpt
from zaya.config import load_config
from zaya.data.build import BuildOptions, build_dataset
from zaya.data.dataset_reader import open_dataset
from zaya.data.tokenizer import tokenizer_fingerprint
from zaya.locking import lock_path
from zaya.parallel.launch import Launch
from zaya.tokenizer_source import short, tokenizer_file
from zaya.training import TrainingJob, build_trainer


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The documented path's first half: a text build that reserves the chat markers, a two-step run on it and
    its export; chats built on the run's tokenizer ("sft") and chats with a BPE of their own ("other")."""
    root = tmp_path_factory.mktemp("one-tokenizer")
    corpus = root / "corpus"
    corpus.mkdir()
    for source in sorted((Path(sysconfig.get_paths()["stdlib"]) / "json").glob("*.py")):
        (corpus / f"{source.stem}.txt").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    build_dataset(BuildOptions(inputs=(str(corpus),), out=root / "text", vocab_size=300, val_fraction=0.2,
                               workers=1, reserve_chat_markers=True))
    config = write_config(root / "base.toml", root / "text", train={"max_steps": 2, "eval_every": 0},
                          checkpoint={"every": 2})
    build_trainer(load_config(config), root / "run").run()
    code, _, err = zaya_command(["convert", root / "run", root / "hf"])
    assert code == 0, err
    chats = write_chats(root / "chats.jsonl", make_chats(120))
    code, _, err = zaya_command(["data", "build", "--format", "chat", "--input", chats, "--out", root / "sft",
                                 "--tokenizer", root / "run", "--workers", "1", "--val-fraction", "0.2"])
    assert code == 0, err
    build_dataset(BuildOptions(inputs=(str(chats),), out=root / "other", vocab_size=300, val_fraction=0.2,
                               workers=1, format="chat"))
    return root


def _snapshot(root: Path) -> dict:
    """Every path under `root` (and `root`'s lock file beside it) with its size and modification time."""
    found = {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(root.rglob("*"))}
    return {**found, "lock file": lock_path(root).exists()}


def _one_line(result, *fragments) -> str:
    code, _, err = result
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("zaya: error: "), err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def _fingerprints(base: Path) -> tuple[str, str]:
    return short(tokenizer_fingerprint(base / "text" / "tokenizer.json")), short(
        tokenizer_fingerprint(base / "other" / "tokenizer.json"))


def test_a_chat_build_takes_the_tokenizer_of_a_run_its_checkpoint_or_its_export(base):
    checkpoint = ckpt.resolve_checkpoint(base / "run")
    assert tokenizer_file(base / "run") == checkpoint / "tokenizer.json"
    assert tokenizer_file(checkpoint) == checkpoint / "tokenizer.json"
    assert tokenizer_file(base / "hf") == base / "hf" / "tokenizer.json"
    assert tokenizer_file(base / "text") == base / "text" / "tokenizer.json"
    same = {tokenizer_fingerprint(tokenizer_file(p)) for p in (base / "run", base / "hf", base / "text", base / "sft")}
    assert len(same) == 1
    assert open_dataset(base / "sft").tokenizer_sha256 == open_dataset(base / "text").tokenizer_sha256
    assert tokenizer_fingerprint(base / "other" / "tokenizer.json") not in same


@pytest.mark.parametrize("where", ["train.init_from", "phases.0.init_from", "phases.1.init_from"])
def test_weights_of_another_tokenizer_are_one_line_and_nothing_is_written(base, tmp_path, where):
    run = tmp_path / "run"
    if where == "train.init_from":
        config = write_config(tmp_path / "sft.toml", base / "other", train={"init_from": str(base / "run")})
    elif where == "phases.0.init_from":
        config = write_config(tmp_path / "sft.toml", base / "other",
                              phases=[{"name": "sft", "init_from": str(base / "run")}])
    else:  # continued pre-training, then SFT from the run on chats of another tokenizer: refused at the start
        config = write_config(tmp_path / "sft.toml", base / "text", phases=[
            {"name": "pre", "tokens": 512}, {"name": "sft", "init_from": str(base / "hf"),
                                             "sources": [{"path": str(base / "other")}]}])
    ours, theirs = _fingerprints(base)
    line = _one_line(zaya_command(["train", config, "--run-dir", run]), f"zaya: error: {where}: ",
                     "is another tokenizer than the data's", str(base / "other" / "tokenizer.json"), ours, theirs,
                     "--allow-tokenizer-change", "--tokenizer ")
    assert str(base / ("hf" if where == "phases.1.init_from" else "run")) in line
    assert not run.exists() and not lock_path(run).exists()


def test_a_resume_on_another_tokenizer_is_one_line_and_the_run_stays_as_it_was(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    before = _snapshot(run)
    config = write_config(tmp_path / "other.toml", base / "other", train={"max_steps": 3})
    ours, theirs = _fingerprints(base)
    _one_line(zaya_command(["train", config, "--run-dir", run, "--allow-data-change"]), "zaya: error: resume: ",
              "another tokenizer", ours, theirs, str(base / "other" / "tokenizer.json"), "--allow-tokenizer-change")
    assert _snapshot(run) == before


def test_eval_on_data_of_another_tokenizer_is_one_line_unless_allowed(base, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(base / "run", run)
    before = _snapshot(run)
    args = ["eval", "--model", run, "--data", base / "other", "--seq-len", 32, "--max-batches", 1]
    ours, theirs = _fingerprints(base)
    _one_line(zaya_command(args), "zaya: error: --data: ", "another tokenizer", ours, theirs,
              f"--tokenizer {run}", "--allow-tokenizer-change")
    assert _snapshot(run) == before
    code, out, err = zaya_command([*args, "--allow-tokenizer-change"])
    assert code == 0, err
    (said,) = [line for line in err.splitlines() if "another tokenizer" in line]
    assert said.startswith("zaya: warning: --data: ") and ours in said and theirs in said
    assert json.loads(out)["tokens"] > 0
    # the data built on the run's tokenizer: nothing to say
    code, _, err = zaya_command(["eval", "--model", base / "hf", "--data", base / "sft", "--seq-len", 32,
                                 "--max-batches", 1])
    assert code == 0 and "tokenizer" not in err, err


def _check(config: Path, run_dir: Path, **flags) -> TrainingJob:
    """The start-up checks of `zaya train`, in this process; the run directory's lock is let go again."""
    launch = Launch()
    with launch.startup():
        job = TrainingJob.check(load_config(config), run_dir, launch=launch, environ={}, **flags)
    job.lock.release()
    return job


def test_the_same_tokenizer_written_otherwise_passes_and_the_vocabulary_note_fits_init_from(base, tmp_path):
    # the run's tokenizer, written compact with its keys in another order: another file, the same tokenizer
    data = json.loads((base / "text" / "tokenizer.json").read_text())
    rewritten = tmp_path / "tokenizer.json"
    rewritten.write_text(json.dumps({k: data[k] for k in reversed(list(data))}, separators=(",", ":")))
    assert Tokenizer.from_file(str(rewritten)).to_str() == Tokenizer.from_file(str(base / "text" /
                                                                                    "tokenizer.json")).to_str()
    chats = write_chats(tmp_path / "chats.jsonl", make_chats(40))
    build_dataset(BuildOptions(inputs=(str(chats),), out=tmp_path / "sft", tokenizer=rewritten, workers=1,
                               format="chat", val_fraction=0.2))
    assert open_dataset(tmp_path / "sft").tokenizer_sha256 != open_dataset(base / "text").tokenizer_sha256
    config = write_config(tmp_path / "sft.toml", tmp_path / "sft", train={"init_from": str(base / "run")})
    job = _check(config, tmp_path / "run")
    assert job.init_from is not None and not [n for n in job.notes if "tokenizer" in n and "another" in n]
    # the model has more rows than the data has tokens, and the weights started from fix that shape: the note
    # says so, instead of advising a vocabulary that would be refused as another shape
    (note,) = [n for n in job.notes if "embedding rows" in n]
    assert "weights of train.init_from" in note and "set model.vocab_size" not in note
    assert not (tmp_path / "run").exists()


def test_weights_without_a_tokenizer_are_noted_not_refused(base, tmp_path):
    hf = tmp_path / "hf"
    shutil.copytree(base / "hf", hf)
    (hf / "tokenizer.json").unlink()
    config = write_config(tmp_path / "sft.toml", base / "other", train={"init_from": str(hf)})
    job = _check(config, tmp_path / "run")
    (note,) = [n for n in job.notes if "tokenizer.json" in n]
    assert note.startswith(f"note: train.init_from: {hf} carries no tokenizer.json") and "cannot be checked" in note


def test_the_override_goes_on_and_says_so_in_the_log(base, tmp_path):
    config = write_config(tmp_path / "sft.toml", base / "other",
                          train={"init_from": str(base / "run"), "max_steps": 2, "eval_every": 0},
                          checkpoint={"every": 10})
    code, _, err = zaya_command(["train", config, "--run-dir", tmp_path / "run", "--allow-tokenizer-change"])
    assert code == 0, err
    ours, theirs = _fingerprints(base)
    (said,) = [line for line in (tmp_path / "run" / "train.log").read_text().splitlines()
               if "another tokenizer" in line]
    assert "warning: train.init_from: " in said and ours in said and theirs in said
    assert str(base / "other" / "tokenizer.json") in said and "--allow-tokenizer-change" in said


def test_data_too_large_for_the_weights_vocabulary_names_the_tokenizer_not_a_larger_model(base, tmp_path):
    build_dataset(BuildOptions(inputs=(str(base / "corpus"),), out=tmp_path / "wide", vocab_size=700, workers=1))
    assert open_dataset(tmp_path / "wide").max_token_id >= 512  # the micro model's vocabulary
    config = write_config(tmp_path / "sft.toml", tmp_path / "wide", train={"init_from": str(base / "run")})
    line = _one_line(zaya_command(["train", config, "--run-dir", tmp_path / "run"]), "does not fit the vocabulary",
                     "weights of train.init_from", f"build it with --tokenizer {base / 'run'}")
    assert "vocab_size >=" not in line and not (tmp_path / "run").exists()
