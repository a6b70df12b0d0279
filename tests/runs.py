"""Training runs for tests, importable from spawned processes too: a small real dataset (Python sources) and a
fast micro-model run config (`write_config`)."""

from __future__ import annotations

import sysconfig
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


def write_config(path: Path, dataset: Path, **sections) -> Path:
    """A micro-model run config; `sections` replace or add keys, e.g. train={"max_steps": 4}."""
    base = {
        "model": {"preset": "micro", "temp_init": 1.0},
        "data": {"path": str(dataset), "seq_len": 32},
        "train": {"seed": 3, "max_steps": 10, "micro_batch_size": 4, "global_batch_size": 8, "precision": "fp32",
                  "eval_every": 5, "eval_batches": 2},
        "optim": {"lr": 0.01},
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
