"""Training runs for tests, importable from the pool's ranks too: a small real dataset (Python sources), chats
for fine-tuning (`write_chats`, `build_chat_dataset`), a fast micro-model run config (`write_config`), and the
`zaya` command in this process (`zaya_command`)."""

from __future__ import annotations

import contextlib
import io
import json
import random
import sysconfig
from collections.abc import Sequence
from pathlib import Path

from zaya.data.build import BuildOptions, build_dataset


def build_code_dataset(root: Path, packages: list[str], val_fraction: float) -> Path:
    """Python sources of some standard-library packages, as .txt documents, built with a 400-token BPE."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus = root / "corpus"
    corpus.mkdir()
    for package in packages:
        for source in sorted((stdlib / package).glob("*.py")):
            (corpus / f"{package}_{source.stem}.txt").write_text(source.read_text(encoding="utf-8"), encoding="utf-8")
    out = root / "code"
    build_dataset(BuildOptions(inputs=(str(corpus),), out=out, vocab_size=400, val_fraction=val_fraction, workers=1))
    return out


# the assistant says only this word, which nothing else in the chats contains: its tokens are the reply's
REPLY_WORD = "banana"
_CHAT_WORDS = ("alpha", "gamma", "delta", "theta", "kappa", "sigma", "omega", "def", "return", "class", "import")


def make_chats(count: int, seed: int = 0) -> list[list[dict]]:
    """Chats of one to three exchanges, half with a system message; every reply is REPLY_WORD 1-4 times."""
    rng = random.Random(seed)
    chats = []
    for i in range(count):
        messages = [{"role": "system", "content": "answer in fruit"}] if i % 2 else []
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "user", "content": " ".join(rng.choice(_CHAT_WORDS) for _ in range(6))})
            messages.append({"role": "assistant", "content": " ".join([REPLY_WORD] * rng.randint(1, 4))})
        chats.append(messages)
    return chats


def write_chats(path: Path, chats: list[list[dict]]) -> Path:
    """The chats as JSON lines, {"messages": [...]} each."""
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats), encoding="utf-8")
    return path


def build_chat_dataset(root: Path, count: int = 300, val_fraction: float = 0.1, **options) -> Path:
    """`make_chats(count)` built with `--format chat` (the default template) and a 300-token BPE."""
    chats = write_chats(root / "chats.jsonl", make_chats(count))
    out = root / "chat"
    build_dataset(BuildOptions(inputs=(str(chats),), out=out, vocab_size=300, val_fraction=val_fraction, workers=1,
                               format="chat", **options))
    return out


# the layout configs/zaya1-base.toml named by hand before it chose its layout at launch (`parallel.layout =
# "auto"`): FSDP2 over every GPU with ZeRO-2, one sequence per micro-batch, cp 8 for the long-context and SFT
# phases; for the tests of the planner's figures of one fixed layout
ZAYA1_BASE_HAND = ('parallel.layout="config"', 'parallel.sharding="zero2"', "train.micro_batch_size=1", "phases.2.cp=8",
                   "phases.3.cp=8")


def write_config(path: Path, dataset: Path, **sections) -> Path:
    """A micro-model run config; `sections` replace or add keys, e.g. train={"max_steps": 4}."""
    base = {
        "model": {"preset": "micro", "temp_init": 1.0},
        "data": {"path": str(dataset), "seq_len": 32},
        "train": {"seed": 3, "max_steps": 10, "micro_batch_size": 4, "global_batch_size": 8, "precision": "fp32",
                  "eval_every": 5, "eval_batches": 2},
        "optim": {"lr": 0.01, "ns_dtype": "float32"},  # bf16 Newton-Schulz crawls on CPUs without bf16 units
        "schedule": {"warmup_steps": 2, "decay_fraction": 0.2},
        "checkpoint": {"every": 3, "keep": 2},
        "logging": {"log_every": 1, "tensorboard": False, "progress": False},
    }
    for name, values in sections.items():
        if isinstance(values, list):
            base[name] = values
        else:
            base.setdefault(name, {}).update(values)
    lines = []
    for name, values in base.items():
        if isinstance(values, list):
            for item in values:
                lines.append(f"[[{name}]]")
                lines += [f"{k} = {_toml(v)}" for k, v in item.items()]
        else:
            lines.append(f"[{name}]")
            lines += [f"{k} = {_toml(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\") + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    return repr(value)


def zaya_command(args: Sequence[str]) -> tuple[int, str, str]:
    """`zaya ARGS` in this process: (exit code, stdout, stderr). The command's own code path without an
    interpreter's start; a fault that kills the process (sigkill, sigstop) needs `ranks.run_command` instead."""
    from zaya.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


class SteppedClock:
    """A clock for the stop rules that moves only as steps start: each step takes `step_s` seconds of it. Give
    it to the trainer as its clock and its timer, and `listen` among its hooks."""

    def __init__(self, step_s: float):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        return self.now

    def listen(self, event: str, step: int, path: Path | None = None) -> None:
        if event == "step-work":  # inside the step's timing
            self.now += self.step_s


# ---- what runs left on disk ------------------------------------------------------------------------------


def checkpoint_tensors(directory: Path) -> dict:
    """Every tensor of the checkpoint in `directory`, whole, read in this one process, by its flat key
    ("model.…", "optim.…")."""
    import torch

    from zaya import checkpoint as ckpt

    nested: dict = {}
    for key, meta in ckpt.read_metadata(directory).state_dict_metadata.items():
        top, rest = key.split(".", 1)
        nested.setdefault(top, {})[rest] = torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
    ckpt.load_tensors(directory, nested)
    return {f"{top}.{k}": v for top, d in nested.items() for k, v in d.items()}


def committed_step(run_dir: Path) -> int:
    """The step of the run's newest committed checkpoint."""
    from zaya import checkpoint as ckpt

    return ckpt.read_json(ckpt.resolve_checkpoint(run_dir) / ckpt.INFO_FILE)["step"]


def losses(run_dir: Path) -> list[tuple[int, float, float | None]]:
    """(step, loss, eval loss) of every metrics row."""
    from zaya.train.metrics import read_metrics

    return [(r["step"], r["loss"], r.get("eval_loss")) for r in read_metrics(run_dir)]


def assert_same_run(a: Path, b: Path) -> None:
    """Two runs logged the same losses and ended with bitwise the same model and optimizer state."""
    import torch

    from zaya import checkpoint as ckpt

    assert losses(a) == losses(b)
    ta, tb = checkpoint_tensors(ckpt.resolve_checkpoint(a)), checkpoint_tensors(ckpt.resolve_checkpoint(b))
    assert set(ta) == set(tb) and any(k.startswith("optim.") for k in ta)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
