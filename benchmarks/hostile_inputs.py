"""Hostile and careless inputs, tried on the `zaya` command as a user would: each case runs in a fresh process with a
timeout, beside files a user owns, and is scored from what happened:

    data loss     a file the case did not ask zaya to write changed, moved or vanished
    wrong result  the case's own check failed (a NaN checkpoint committed, an exit 0 that should not be)
    hang          still running at the timeout
    resource      a resource case whose process (with its children) peaked above 500 MB
    traceback     a Python traceback on stderr
    silent        a case that must be refused ran to exit 0
    message       refused, but not in one line naming what the case expects
    clean         refused in one line (or, for a case that may succeed, succeeded)

    python benchmarks/hostile_inputs.py [--only WORD] [--timeout-s 90] [--keep DIR]

It prints one line per case and the counts by class and outcome. docs/hardening.md lists what zaya refuses; this
script is how the list is checked against a build of zaya from the outside.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from common import header

ZAYA = [sys.executable, "-m", "zaya.cli"]
RSS_BOUND_KB = 500 * 1024
TIME = shutil.which("time", path="/usr/bin:/bin")  # GNU time, for each case's peak memory
# the interpreter's own scripts (torchrun) first on the PATH, as in an activated environment
ENV = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
KILL_KB = 3 << 20  # a case past 3 GB is ended and counted as a resource failure


@dataclass
class Case:
    name: str
    kind: str  # ownership, result, hang, resource, traceback, silent, message
    setup: Callable[[Path, Path], list[str]]  # (case dir, fixtures) -> the command's arguments
    expect: str = "refuse"  # refuse | succeed | either
    words: tuple[str, ...] = ()  # what the one error line must say
    check: Callable[[Path], str | None] | None = None  # -> a wrong result's description
    user_files: Callable[[Path], list[Path]] = field(default=lambda d: [d / "user"])


# ---- fixtures: a dataset, a config, a trained run, its export, chats -------------------------------------


def _zaya(args: list, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*ZAYA, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def make_fixtures(root: Path) -> Path:
    fx = root / "fixtures"
    (fx / "corpus").mkdir(parents=True)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "import", "self", "value"]
    for i in range(40):
        text = "\n".join(" ".join(words[(i * j + k) % len(words)] for k in range(12)) for j in range(30))
        (fx / "corpus" / f"doc{i}.txt").write_text(text + "\n", encoding="utf-8")
    for args in (["data", "build", "--input", fx / "corpus", "--out", fx / "data", "--vocab-size", "300",
                  "--val-fraction", "0.1", "--workers", "1", "--no-progress"],):
        done = _zaya(args, fx)
        assert done.returncode == 0, done.stderr
    (fx / "run.toml").write_text(config_text(fx / "data"), encoding="utf-8")
    done = _zaya(["train", fx / "run.toml", "--run-dir", fx / "run"], fx)
    assert done.returncode == 0, done.stderr
    done = _zaya(["convert", fx / "run", fx / "hf"], fx)
    assert done.returncode == 0, done.stderr
    chats = [{"messages": [{"role": "user", "content": "hi " * (i % 5 + 1)},
                           {"role": "assistant", "content": "banana"}]} for i in range(60)]
    (fx / "chats.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    return fx


def config_text(data: Path, **extra: str) -> str:
    sections = {
        "model": 'preset = "micro"',
        "data": f'path = "{data}"\nseq_len = 32',
        "train": 'seed = 0\nmax_steps = 2\nmicro_batch_size = 4\nglobal_batch_size = 4\nprecision = "fp32"\n'
                 'eval_every = 0',
        "optim": 'lr = 0.01\nns_dtype = "float32"',
        "schedule": "warmup_steps = 0",
        "checkpoint": "every = 1\nkeep = 2",
        "logging": "log_every = 1\ntensorboard = false\nprogress = false",
    }
    for key, value in extra.items():
        sections[key] = sections.get(key, "") + "\n" + value
    return "".join(f"[{name}]\n{body}\n" for name, body in sections.items())


def copy_run(fx: Path, d: Path) -> Path:
    shutil.copytree(fx / "run", d / "run", symlinks=True)
    return d / "run"


def newest(run: Path) -> Path:
    return sorted((run / "checkpoints").glob("step_*[0-9]"))[-1]


def refresh_manifest(checkpoint: Path, name: str) -> None:
    """Give `name` its right size and CRC in rank 0's manifest, as if zaya had written it so."""
    manifest = checkpoint / "manifest.rank0.json"
    data = json.loads(manifest.read_text())
    payload = (checkpoint / name).read_bytes()
    data["files"][name] = {"bytes": len(payload), "crc32": f"{zlib.crc32(payload):08x}"}
    manifest.write_text(json.dumps(data))


def user_dir(d: Path, *names: str) -> Path:
    """A directory of the user's with a few files in it."""
    user = d / "user"
    user.mkdir(exist_ok=True)
    for name in names or ("notes.txt",):
        path = user / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"the user's {name}\n")
    return user


def fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


# ---- the cases -----------------------------------------------------------------------------------------


def args(*items):
    """A case's setup that only names its arguments: {fx} is the fixtures' directory, {d} the case's own."""
    def setup(d, fx):
        return [str(a).replace("{fx}", str(fx)).replace("{d}", str(d)) for a in items]
    return setup


def ownership_cases() -> list[Case]:
    def webapp(d, fx):
        app = user_dir(d, "manifest.json", "index.html")
        return ["data", "build", "--input", fx / "corpus", "--out", app, "--overwrite", "--vocab-size", "300",
                "--workers", "1", "--no-progress"]

    def convert_tmp(d, fx):
        user_dir(d)
        os.rename(d / "user", d / "out.tmp")
        return ["convert", fx / "run", d / "out"]

    def lock_link(d, fx):
        user_dir(d)
        (d / ".out.lock").symlink_to(d / "user" / "notes.txt")
        return ["data", "build", "--input", fx / "corpus", "--out", d / "out", "--vocab-size", "300",
                "--workers", "1", "--no-progress"]

    def run_lock_link(d, fx):
        user_dir(d)
        (d / ".run.lock").symlink_to(d / "user" / "notes.txt")
        return ["train", fx / "run.toml", "--run-dir", d / "run"]

    def checkpoint_dir_user(d, fx):
        user = user_dir(d, "step_00000001.tmp/keep.txt", "step_1/keep.txt", "step_00000002/keep.txt", "latest")
        (d / "c.toml").write_text(config_text(fx / "data", checkpoint=f'dir = "{user}"'))
        return ["train", d / "c.toml", "--run-dir", d / "run"]

    def shapes_existing(d, fx):
        user_dir(d)
        return ["shapes", "--out", d / "user" / "notes.txt", "--tokens", "64", "--budget-s", "1", "--no-progress"]

    def shapes_fifo(d, fx):
        user_dir(d)
        fifo(d / "user" / "pipe")
        return ["shapes", "--out", d / "user" / "pipe", "--tokens", "64", "--budget-s", "1", "--no-progress",
                "--overwrite"]

    def convert_overwrite_user(d, fx):
        user_dir(d, "config.json", "model.safetensors")
        return ["convert", fx / "run", d / "user", "--overwrite"]

    def build_into_file(d, fx):
        user_dir(d)
        return ["data", "build", "--input", fx / "corpus", "--out", d / "user" / "notes.txt", "--overwrite",
                "--workers", "1", "--no-progress"]

    def stale_names(d, fx):
        user_dir(d)
        for name in (".out.partial-abc", ".out.old-abc", ".out.zaya-1-abc"):
            (d / "user" / name).mkdir()
            (d / "user" / name / "keep.txt").write_text("mine")
        return ["data", "build", "--input", fx / "corpus", "--out", d / "user" / "out", "--vocab-size", "300",
                "--workers", "1", "--no-progress"]

    return [
        Case("data build --overwrite of a web app with a manifest.json", "ownership", webapp, "refuse",
             ("not a",)),
        Case("convert beside a user's OUT.tmp", "ownership", convert_tmp, "succeed",
             user_files=lambda d: [d / "out.tmp"]),
        Case("data build with its lock file planted as a link", "ownership", lock_link, "refuse", ("lock",)),
        Case("train with its run lock planted as a link", "ownership", run_lock_link, "refuse", ("lock",)),
        Case("checkpoint.dir in a user's directory of step_* names", "ownership", checkpoint_dir_user, "either"),
        Case("shapes --out an existing file", "ownership", shapes_existing, "refuse", ("--overwrite",)),
        Case("shapes --out a FIFO with --overwrite", "ownership", shapes_fifo, "refuse", ("not a regular file",)),
        Case("convert --overwrite of a user directory", "ownership", convert_overwrite_user, "refuse", ()),
        Case("data build --overwrite --out a file", "ownership", build_into_file, "refuse", ()),
        Case("data build beside staging-like names", "ownership", stale_names, "succeed"),
    ]


def result_cases() -> list[Case]:
    def no_nan_checkpoint(d: Path) -> str | None:
        import torch  # noqa: F401  (the probe's own process reads the checkpoint)

        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
        from zaya.checkpoint import resolve_checkpoint
        from zaya.infer.loading import load_model

        try:
            model = load_model(resolve_checkpoint(d / "run"), device="cpu")
        except Exception:
            return None  # nothing committed, or nothing loadable: no NaN weights to use
        bad = [n for n, p in model.named_parameters() if not p.isfinite().all()]
        return f"committed non-finite weights ({bad[0]})" if bad else None

    def train_with(key: str, value: str):
        def setup(d, fx):
            return ["train", fx / "run.toml", "--run-dir", d / "run", "--set", f"{key}={value}"]
        return setup

    return [Case(f"train --set {k}={v}", "result", train_with(k, v), "refuse", (k.split(".")[-1],),
                 check=no_nan_checkpoint)
            for k, v in (("optim.lr", "1e30"), ("model.initializer_range", "1e30"), ("optim.lr", "1e6"))]


def hang_cases() -> list[Case]:
    def config_fifo(d, fx):
        return ["train", fifo(d / "c.toml"), "--run-dir", d / "run"]

    def manifest_fifo(d, fx):
        shutil.copytree(fx / "data", d / "data")
        (d / "data" / "manifest.json").unlink()
        fifo(d / "data" / "manifest.json")
        return ["data", "inspect", d / "data"]

    def template_fifo(d, fx):
        return ["data", "build", "--input", fx / "chats.jsonl", "--format", "chat", "--chat-template",
                fifo(d / "t.jinja"), "--out", d / "out", "--workers", "1", "--no-progress", "--vocab-size", "300"]

    def endless_template(d, fx):
        loops = "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}" \
                "{% endfor %}{% endfor %}{% endfor %}"
        (d / "t.jinja").write_text(loops + "{% for m in messages %}{{ m.content }}{% endfor %}")
        return ["data", "build", "--input", fx / "chats.jsonl", "--format", "chat", "--chat-template", d / "t.jinja",
                "--out", d / "out", "--workers", "1", "--no-progress", "--vocab-size", "300"]

    def diagnose_fifo(d, fx):
        return ["diagnose", fifo(d / "worker.log")]

    def policy_fifo(d, fx):
        return ["supervise", "--policy", fifo(d / "policy.toml"), "--state-dir", d / "state", "--",
                *ZAYA, "train", fx / "run.toml", "--run-dir", d / "run"]

    def heartbeat_fifo(d, fx):
        beats = d / "state" / "heartbeats"
        beats.mkdir(parents=True)
        return ["supervise", "--state-dir", d / "state", "--", sys.executable, "-c",
                f"import os; os.mkfifo({str(beats / 'rank0.json')!r}); raise SystemExit(0)"]

    def tokenizer_fifo(d, fx):
        return ["data", "build", "--input", fx / "corpus", "--tokenizer", fifo(d / "tok.json"), "--out", d / "out",
                "--workers", "1", "--no-progress"]

    return [
        Case("a FIFO as the run config", "hang", config_fifo, "refuse", ("FIFO",)),
        Case("a FIFO as a dataset's manifest", "hang", manifest_fifo, "refuse", ("FIFO",)),
        Case("a FIFO as a chat template", "hang", template_fifo, "refuse", ("FIFO",)),
        Case("a chat template of endless nested loops", "hang", endless_template, "refuse", ("t.jinja",)),
        Case("a FIFO as a log to diagnose", "hang", diagnose_fifo, "refuse", ("FIFO",)),
        Case("a FIFO as a policy", "hang", policy_fifo, "refuse", ("FIFO",)),
        Case("a FIFO planted as a heartbeat", "hang", heartbeat_fifo, "either"),
        Case("a FIFO as a tokenizer", "hang", tokenizer_fifo, "refuse", ("FIFO",)),
    ]


def resource_cases() -> list[Case]:
    def device_as(kind: str, device: str):
        def setup(d, fx):
            if kind == "config":
                return ["train", device, "--run-dir", d / "run"]
            if kind == "table":
                return ["plan", fx / "run.toml", "--table", device]
            if kind == "manifest":
                shutil.copytree(fx / "data", d / "data")
                (d / "data" / "manifest.json").unlink()
                (d / "data" / "manifest.json").symlink_to(device)
                return ["data", "inspect", d / "data"]
            if kind == "template":
                return ["data", "build", "--input", fx / "chats.jsonl", "--format", "chat", "--chat-template", device,
                        "--out", d / "out", "--workers", "1", "--no-progress", "--vocab-size", "300"]
            if kind == "policy":
                return ["supervise", "--policy", device, "--state-dir", d / "state", "--", *ZAYA, "train",
                        fx / "run.toml", "--run-dir", d / "run"]
            return ["diagnose", device]
        return setup

    def gzip_bomb(d, fx):
        with gzip.open(d / "bomb.txt.gz", "wb", compresslevel=9) as handle:
            for _ in range(200):
                handle.write(bytes(1 << 20))
        return ["data", "build", "--input", d / "bomb.txt.gz", "--out", d / "out", "--workers", "1",
                "--no-progress", "--vocab-size", "300"]

    def big_chat(d, fx):
        chat = {"messages": [{"role": "user", "content": "word " * 4_000_000}, {"role": "assistant", "content": "ok"}]}
        (d / "chats.jsonl").write_text(json.dumps(chat) + "\n")
        return ["data", "build", "--input", d / "chats.jsonl", "--format", "chat", "--out", d / "out", "--workers",
                "1", "--no-progress", "--vocab-size", "300"]

    def many_turns(d, fx):
        turns = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}"} for i in range(20_000)]
        (d / "chats.jsonl").write_text(json.dumps({"messages": turns}) + "\n")
        return ["data", "build", "--input", d / "chats.jsonl", "--format", "chat", "--out", d / "out", "--workers",
                "1", "--no-progress", "--vocab-size", "300"]

    def string_bomb(template: str):
        def setup(d, fx):
            (d / "t.jinja").write_text(template)
            return ["data", "build", "--input", fx / "chats.jsonl", "--format", "chat", "--chat-template",
                    d / "t.jinja", "--out", d / "out", "--workers", "1", "--no-progress", "--vocab-size", "300"]
        return setup

    def many_ranks(d, fx):
        return ["supervise", "--state-dir", d / "state", "--", "torchrun", "--nproc-per-node", "1000000000",
                "-m", "zaya.cli", "train", fx / "run.toml", "--run-dir", d / "run"]

    def huge_line(d, fx):
        (d / "worker.log").write_text("RuntimeError: CUDA error: an illegal memory access " + "x" * 50_000_000 + "\n")
        return ["diagnose", d / "worker.log"]

    def worker_line(d, fx):
        return ["supervise", "--state-dir", d / "state", "--", sys.executable, "-c",
                "import sys\nfor _ in range(300): sys.stdout.write('x' * 1_000_000)\nprint(); raise SystemExit(0)"]

    cases = []
    for kind, device in (("config", "/dev/zero"), ("config", "/dev/urandom"), ("table", "/dev/zero"),
                         ("manifest", "/dev/zero"), ("template", "/dev/urandom"), ("policy", "/dev/zero"),
                         ("diagnose", "/dev/urandom")):
        cases.append(Case(f"{device} as a {kind}", "resource", device_as(kind, device), "refuse",
                          ("not a regular file",) if kind != "manifest" else ()))
    bombs = {"'x' * 10**9": "{{ 'x' * 1000000000 }}",
             "center(10**9)": "{{ 'x' | center(1000000000) }}",
             "a doubling namespace": "{% set ns = namespace(s='xx') %}{% for i in range(40) %}"
                                     "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
             "10 ** (10 ** 10)": "{{ 10 ** (10 ** 10) }}"}
    for name, template in bombs.items():
        cases.append(Case(f"a chat template bomb: {name}", "resource", string_bomb(template), "refuse", ("t.jinja",)))
    cases += [
        Case("a gzip of 200 MB of NULs", "resource", gzip_bomb, "either"),
        Case("one chat of 20 MB", "resource", big_chat, "either"),
        Case("one chat of 20,000 turns", "resource", many_turns, "either"),
        Case("torchrun --nproc-per-node 1e9 under the supervisor", "resource", many_ranks, "refuse",
             ("nproc",)),
        Case("diagnose a log with a 50 MB matching line", "resource", huge_line, "either",
             check=lambda d: None),
        Case("a worker's 300 MB line under the supervisor", "resource", worker_line, "either"),
    ]
    return cases


def traceback_cases() -> list[Case]:
    def latest_not_utf8(action: str):
        def setup(d, fx):
            run = copy_run(fx, d)
            (run / "checkpoints" / "latest").write_bytes(b"\xff\xfe\x00garbage")
            if action == "convert":
                return ["convert", run, d / "out"]
            return ["train", fx / "run.toml", "--run-dir", run, "--set", "train.max_steps=3"]
        return setup

    def train_state_types(d, fx):
        run = copy_run(fx, d)
        checkpoint = newest(run)
        state = json.loads((checkpoint / "train_state.json").read_text())
        state["state"]["step"] = "two"
        (checkpoint / "train_state.json").write_text(json.dumps(state))
        refresh_manifest(checkpoint, "train_state.json")
        return ["train", fx / "run.toml", "--run-dir", run, "--set", "train.max_steps=3"]

    def manifest_types(d, fx):
        shutil.copytree(fx / "data", d / "data")
        manifest = json.loads((d / "data" / "manifest.json").read_text())
        for key in list(manifest)[:3]:
            manifest[key] = {"nested": [1, 2]} if isinstance(manifest[key], str) else "wrong"
        (d / "data" / "manifest.json").write_text(json.dumps(manifest))
        return ["data", "inspect", d / "data"]

    def deep_config_json(d, fx):
        shutil.copytree(fx / "hf", d / "hf")
        config = json.loads((d / "hf" / "config.json").read_text())
        (d / "hf" / "config.json").write_text(json.dumps(config)[:-1] + ', "x": ' + "[" * 5000 + "]" * 5000 + "}")
        return ["params", d / "hf"]

    def deep_tokenizer_config(d, fx):
        shutil.copytree(fx / "hf", d / "hf")
        (d / "hf" / "tokenizer_config.json").write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
        return ["generate", "--model", d / "hf", "--prompt-ids", "5", "--max-new-tokens", "2"]

    def far_timestamps(d, fx):
        (d / "w.log").write_text("[99999-01-01 00:00:00] RuntimeError: CUDA error: an illegal memory access\n"
                                 "[0001-01-01 00:00:00] Xid 79\n1e300 NCCL watchdog timeout\n"
                                 "[1970-01-01T00:00:00.000000000+99:99] oom\n")
        return ["diagnose", d / "w.log"]

    def incidents_types(d, fx):
        state = d / "state"
        state.mkdir()
        (state / "incidents.jsonl").write_text('{"time": "x", "evidence": 5, "action": [1]}\n[1, 2]\n"text"\n')
        return ["report", state]

    def loop_as(kind: str):
        def setup(d, fx):
            (d / "loop").symlink_to(d / "loop")
            if kind == "config":
                return ["train", d / "loop"]
            if kind == "run-dir":
                return ["train", fx / "run.toml", "--run-dir", d / "loop" / "run"]
            return ["data", "build", "--input", d / "loop", "--out", d / "out", "--workers", "1", "--no-progress"]
        return setup

    long_name = "n" * 300
    cases = [
        Case("generate --max-new-tokens -1", "traceback", args("generate", "--model", "{fx}/hf", "--prompt-ids", "5",
                                                                "--max-new-tokens", "-1"), "refuse"),
        Case("data build --format bogus", "traceback", args("data", "build", "--format", "bogus", "--out", "{d}/o"),
             "refuse"),
        Case("convert with no arguments", "traceback", args("convert"), "refuse"),
        Case("plan --top 0", "traceback", args("plan", "{fx}/run.toml", "--top", "0"), "refuse"),
        Case("eval --batch-size 0", "traceback", args("eval", "--model", "{fx}/hf", "--data", "{fx}/data",
                                                      "--batch-size", "0"), "refuse"),
        Case("convert a run whose latest is not UTF-8", "traceback", latest_not_utf8("convert"), "succeed"),
        Case("resume a run whose latest is not UTF-8", "traceback", latest_not_utf8("train"), "succeed"),
        Case("resume from a train_state.json of wrong types", "traceback", train_state_types, "either"),
        Case("inspect a manifest of wrong types", "traceback", manifest_types, "refuse", ("manifest.json",)),
        Case("params of a config.json nested 5,000 deep", "traceback", deep_config_json, "refuse", ("config.json",)),
        Case("generate with a tokenizer_config.json nested 100,000 deep", "traceback", deep_tokenizer_config,
             "either"),
        Case("diagnose timestamps of year 99999 and 1", "traceback", far_timestamps, "succeed"),
        Case("report of incidents of wrong types", "traceback", incidents_types, "either"),
        Case("a link loop as the config", "traceback", loop_as("config"), "refuse"),
        Case("a link loop in --run-dir", "traceback", loop_as("run-dir"), "refuse"),
        Case("a link loop as a build input", "traceback", loop_as("input"), "refuse"),
        Case("a --run-dir name of 300 characters", "traceback",
             args("train", "{fx}/run.toml", "--run-dir", "{d}/" + long_name), "refuse", ("too long",)),
        Case("a data build --out name of 300 characters", "traceback",
             args("data", "build", "--input", "{fx}/corpus", "--out", "{d}/" + long_name, "--workers", "1",
                  "--no-progress"), "refuse", ("too long",)),
        Case("generate --temperature 1e-40", "traceback",
             args("generate", "--model", "{fx}/hf", "--prompt-ids", "5", "--temperature", "1e-40", "--seed", "0"),
             "either"),
        Case("generate --repetition-penalty 1e-300", "traceback",
             args("generate", "--model", "{fx}/hf", "--prompt-ids", "5", "--repetition-penalty", "1e-300",
                  "--temperature", "1", "--seed", "0"), "either"),
        Case("generate --prompt-ids beyond int64", "traceback",
             args("generate", "--model", "{fx}/hf", "--prompt-ids", "99999999999999999999999"), "refuse"),
        Case("generate --seed beyond int64", "traceback",
             args("generate", "--model", "{fx}/hf", "--prompt-ids", "5", "--temperature", "1", "--seed", str(2**70)),
             "refuse", ("--seed",)),
        Case("generate --max-new-tokens 10**12 --compile", "traceback",
             args("generate", "--model", "{fx}/hf", "--prompt-ids", "5", "--max-new-tokens", str(10**12),
                  "--compile"), "refuse"),
        Case("train.device = meta", "traceback", args("train", "{fx}/run.toml", "--run-dir", "{d}/run", "--set",
                                                      "train.device=\"meta\""), "refuse", ("meta",)),
    ]
    for key, value in (("parallel.timeout_s", "1e300"), ("checkpoint.timeout_s", "1e15"),
                       ("train.max_steps", "1" * 400), ("train.stop_grace_s", "1e300")):
        cases.append(Case(f"train --set {key}={value[:12]}", "traceback",
                          args("train", "{fx}/run.toml", "--run-dir", "{d}/run", "--set", f"{key}={value}"),
                          "refuse", (key,)))
    return cases


def silent_cases() -> list[Case]:
    def unlisted_weights(d, fx):
        run = copy_run(fx, d)
        for checkpoint in (run / "checkpoints").glob("step_*[0-9]"):
            manifest = json.loads((checkpoint / "manifest.rank0.json").read_text())
            manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.endswith(".distcp")}
            (checkpoint / "manifest.rank0.json").write_text(json.dumps(manifest))
        return ["convert", newest(run), d / "out"]

    def empty_run_dir(d, fx):
        return ["train", fx / "run.toml", "--run-dir", ""]

    return [
        Case("a checkpoint manifest that omits the weight files", "silent", unlisted_weights, "refuse"),
        Case("--run-dir ''", "silent", empty_run_dir, "refuse", ("run-dir",)),
        Case("train seq_len beyond max_position_embeddings", "silent",
             args("train", "{fx}/run.toml", "--run-dir", "{d}/run", "--set", "data.seq_len=2048", "--set",
                  "model.max_position_embeddings=1024"), "refuse", ("max_position_embeddings",)),
        Case("generate beyond max_position_embeddings", "silent",
             args("generate", "--model", "{fx}/hf", "--prompt-ids", "5", "--max-new-tokens", "5000000"),
             "refuse", ("max_position_embeddings",)),
        Case("generate --temperature inf", "silent",
             args("generate", "--model", "{fx}/hf", "--prompt-ids", "5", "--temperature", "inf"), "refuse",
             ("--temperature",)),
        Case("--set with a newline", "silent",
             args("train", "{fx}/run.toml", "--run-dir", "{d}/run", "--set", "train.max_steps=1\nseed = 5"),
             "refuse", ("--set",)),
        Case("--split with a text input", "silent",
             args("data", "build", "--input", "{fx}/corpus", "--out", "{d}/out", "--split", "test", "--workers", "1",
                  "--no-progress"), "refuse", ("--split",)),
        Case("shapes --tokens 1e11", "silent", args("shapes", "--tokens", "100000000000", "--out", "{d}/t.json",
                                                    "--no-progress"), "refuse", ("--tokens",)),
    ]


def message_cases() -> list[Case]:
    def safetensors_dir(d, fx):
        shutil.copytree(fx / "hf", d / "hf")
        (d / "hf" / "model.safetensors").unlink()
        (d / "hf" / "model.safetensors").mkdir()
        return ["generate", "--model", d / "hf", "--prompt-ids", "5"]

    train = ["-m", "zaya.cli", "train", "{fx}/run.toml", "--run-dir", "{d}/run"]
    return [
        Case("torchrun --nnodes 0 under the supervisor", "message",
             args("supervise", "--state-dir", "{d}/state", "--", "torchrun", "--nnodes", "0", *train), "refuse",
             ("--nnodes",)),
        Case("torchrun --nnodes 3:1 under the supervisor", "message",
             args("supervise", "--state-dir", "{d}/state", "--", "torchrun", "--nnodes", "3:1", *train), "refuse",
             ("--nnodes",)),
        Case("--set phases.0.name without phases", "message",
             args("train", "{fx}/run.toml", "--run-dir", "{d}/run", "--set", "phases.0.name=x"), "refuse",
             ("phases",)),
        Case("a model.safetensors that is a directory", "message", safetensors_dir, "refuse",
             ("model.safetensors", "directory")),
    ]


# ---- running and scoring -------------------------------------------------------------------------------


def snapshot(paths: list[Path]) -> dict:
    found = {}
    for top in paths:
        items = [top, *top.rglob("*")] if top.is_dir() and not top.is_symlink() else [top]
        for path in items:
            try:
                info = path.lstat()
            except OSError:
                continue
            if path.is_symlink():
                found[path] = ("link", os.readlink(path))
            elif path.is_file():
                found[path] = ("file", zlib.crc32(path.read_bytes()))
            else:
                found[path] = ("other", info.st_mode)
    return found


def run_case(case: Case, d: Path, fx: Path, timeout_s: float) -> tuple[str, str, float, int]:
    argv = case.setup(d, fx)
    protected = [p for p in case.user_files(d) if p.exists() or p.is_symlink()]
    before, fixtures = snapshot(protected), snapshot([fx])
    start = time.monotonic()
    with open(d / ".stdout", "wb") as out, open(d / ".stderr", "wb") as err_file:
        # GNU time, small itself, reports the peak of the command and its waited children: a child of this
        # process would carry this process's own peak over its exec in the kernel's accounting
        timed = [TIME, "-f", "%M", "-o", str(d / ".rss"), *ZAYA] if TIME else ZAYA
        process = subprocess.Popen([*timed, *map(str, argv)], cwd=d, stdout=out, stderr=err_file,
                                   stdin=subprocess.DEVNULL, start_new_session=True, env=ENV)
    status = usage = None
    peak = pid = 0
    while time.monotonic() - start < timeout_s:
        pid, status, usage = os.wait4(process.pid, os.WNOHANG)  # its rusage: itself and its waited children
        if pid:
            break
        peak = max(peak, _session_rss_kb(process.pid))
        if peak > KILL_KB:  # a runaway case would take the machine with it: stop it here and count it
            break
        time.sleep(0.1)
    else:
        status = None
    subprocess.run(["pkill", "-9", "-s", str(process.pid)], capture_output=True)  # what it left running
    if status is None or not pid:
        os.wait4(process.pid, 0)
        if peak > KILL_KB:
            return "resource", f"killed above {KILL_KB >> 20} GB", time.monotonic() - start, peak
        return "hang", f"still running after {timeout_s:.0f} s", timeout_s, peak
    process.returncode = os.waitstatus_to_exitcode(status)
    elapsed = time.monotonic() - start
    measured = (d / ".rss").read_text().split() if TIME and (d / ".rss").is_file() else []
    rss = max(int(measured[-1]) if measured and measured[-1].isdigit() else usage.ru_maxrss, peak)
    err = (d / ".stderr").read_bytes()
    err_text = err.decode("utf-8", "replace")
    lines = [line for line in err_text.splitlines() if line.strip() and not line.startswith(("warning:", "note:"))]
    after = snapshot(protected)
    changed = [p for p, v in before.items() if after.get(p) != v]  # new files beside them are the command's own
    if changed or snapshot([fx]) != fixtures:
        where = changed[0] if changed else "the fixtures"
        return "data loss", f"changed or removed: {where}", elapsed, rss
    if case.check is not None and (problem := case.check(d)):
        return "wrong result", problem, elapsed, rss
    if case.kind == "resource" and rss > RSS_BOUND_KB:
        return "resource", f"peaked at {rss / 1024:.0f} MB", elapsed, rss
    if "Traceback" in err_text:
        return "traceback", _last(err_text), elapsed, rss
    code = process.returncode
    if code == 0:
        if case.expect == "refuse":
            return "silent", "exit 0", elapsed, rss
        return "clean", "succeeded", elapsed, rss
    if case.expect == "succeed":
        return "message", f"exit {code}: {_last(err_text)}", elapsed, rss
    usage_error = code == 2 and err_text.startswith("Usage: ")
    one_line = len(lines) == 1 and lines[0].startswith("zaya: error: ")
    if not (usage_error or one_line):
        return "message", f"exit {code}, {len(lines)} lines: {_last(err_text)}", elapsed, rss
    if not all(w.lower() in err_text.lower() for w in case.words):
        return "message", f"does not say {case.words}: {_last(err_text)}", elapsed, rss
    return "clean", f"refused: {lines[0][:100] if lines else 'usage'}", elapsed, rss


def _session_rss_kb(session: int) -> int:
    """The resident memory of every process of the case's session, in KiB."""
    done = subprocess.run(["ps", "-s", str(session), "-o", "rss="], capture_output=True, text=True)
    return sum(int(x) for x in done.stdout.split() if x.isdigit())


def _last(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return (lines[-1][:140] if lines else "(no output)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="Run only the cases whose name contains this.")
    parser.add_argument("--timeout-s", type=float, default=90.0)
    parser.add_argument("--keep", type=Path, default=None, help="Work in this directory and keep it.")
    args = parser.parse_args()
    header("hostile inputs: each case in its own process, scored by what it did")
    root = args.keep or Path(tempfile.mkdtemp(prefix="zaya-hostile-"))
    root.mkdir(parents=True, exist_ok=True)
    fx = root / "fixtures" if (root / "fixtures" / "hf").is_dir() else make_fixtures(root)
    cases = [*ownership_cases(), *result_cases(), *hang_cases(), *resource_cases(), *traceback_cases(),
             *silent_cases(), *message_cases()]
    if args.only:
        cases = [c for c in cases if args.only in c.name]
    tally: Counter = Counter()
    failures = []
    for i, case in enumerate(cases):
        d = root / "cases" / f"{i:03d}"
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir(parents=True)
        outcome, detail, elapsed, rss = run_case(case, d, fx, args.timeout_s)
        tally[(case.kind, outcome)] += 1
        print(f"{outcome:12s} {elapsed:6.1f} s {rss / 1024:6.0f} MB  [{case.kind}] {case.name}: {detail}", flush=True)
        if outcome != "clean":
            failures.append((case, outcome, detail))
    print(f"\n{len(cases)} cases: {sum(v for (k, o), v in tally.items() if o == 'clean')} clean, "
          f"{len(failures)} failures")
    for outcome in ("data loss", "wrong result", "hang", "resource", "traceback", "silent", "message"):
        count = sum(v for (_, o), v in tally.items() if o == outcome)
        print(f"  {outcome:12s} {count}")
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
