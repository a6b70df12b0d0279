"""Time to quality: the held-out loss zaya reaches in a wall-clock budget against the loop a user would write
with transformers' `ZayaForCausalLM` of the same shape, on the same tokens, scored by one function.

    python benchmarks/time_to_quality.py [--budgets 30 60 120] [--plain-budgets 120 240] [--seeds 0 1 2]
        [--config configs/tiny.toml] [--set KEY=VALUE ...] [--sides zaya plain] [--plain-lr 1e-3]
        [--plain-precision auto] [--data DIR] [--work DIR] [--json OUT] [--plot OUT.png]
    python benchmarks/time_to_quality.py --from-json OUT [--plot OUT.png]     # report saved results again

Each side runs as its own process, timed from its launch to its exit (start-up, imports, evaluations,
checkpoints and the final save included), once per budget and seed:
- zaya: `zaya train CONFIG --set train.time_budget_s=BUDGET` (the budget counts the run's wall time);
- plain: this script's `--plain-worker`: `ZayaForCausalLM` built from the config's model shape with transformers'
  own initialisation, torch AdamW (lr 1e-3, the best of 1e-3, 3e-3 and 1e-2 at 120 s; betas 0.9/0.95, weight
  decay 0.1 on the matrices, 20 warm-up steps, then a linear decay to zero timed to the budget), batches of
  16 x seq_len tokens from random places of the training split, the precision zaya's "auto" chooses (bf16
  autocast where bf16 matmuls are fast), gradients clipped at 1.0.
Both are then scored by `heldout_loss`: the mean next-token loss over every whole window of seq_len + 1 tokens
of the dataset's validation split, in fp32. The script prints each side's loss at each budget (mean and spread
over seeds), the time each side needs to reach the other's loss (interpolated in log time between budgets),
and where zaya's time went (start-up, steps, optimizer, evaluations, checkpoints), with the CPU model.

Without --data it builds the standard-library dataset into the work directory (`zaya data build --input stdlib
--val-fraction 0.02`, the demo's). Files named by --json and --plot are refused if they exist.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "src"))

from common import machine, refuse_existing, write_new  # noqa: E402

PLAIN_LR = 1e-3  # 120 s, seed 0, 2026-12-05 (Zen 4): 5.93 held-out; 3e-3: 6.37; 1e-2: 6.66
PLAIN_WARMUP = 20
PLAIN_BATCH = 16


# ---- the one scorer -----------------------------------------------------------------------------------


def heldout_windows(data: Path, seq_len: int):
    """Every whole window of seq_len + 1 tokens of the validation split, in order: [N, seq_len + 1] int64."""
    import numpy as np
    import torch

    from zaya.data.dataset_reader import open_dataset

    split = open_dataset(data).split("val")
    count = (split.num_tokens - 1) // seq_len
    return torch.from_numpy(split.gather(np.arange(count), seq_len).astype(np.int64))


def heldout_loss(logits_of, windows, batch: int = 16) -> float:
    """The mean next-token cross-entropy (nats) of `logits_of(ids [B, T]) -> [B, T, V]` over `windows`, in fp32."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(windows), batch):
            rows = windows[start:start + batch]
            logits = logits_of(rows[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(), reduction="sum")
            total, count = total + float(loss), count + rows[:, 1:].numel()
    return total / count


# ---- zaya ---------------------------------------------------------------------------------------------


def run_zaya(config: Path, data: Path, seed: int, budget: float, run_dir: Path, sets: list[str]) -> dict:
    command = [sys.executable, "-m", "zaya.cli", "train", str(config), "--run-dir", str(run_dir),
               "--set", f"data.path={json.dumps(str(data))}", "--set", f"train.seed={seed}",
               "--set", f"train.time_budget_s={budget}", "--set", "logging.progress=false"]
    for item in sets:
        command += ["--set", item]
    wall = _timed(command, run_dir.parent / f"{run_dir.name}.log")
    import torch

    from zaya.api import load_model

    model = load_model(run_dir, device="cpu", dtype=torch.float32).eval()
    return {"wall_s": wall, "model": model, "breakdown": zaya_breakdown(run_dir, wall)}


def zaya_breakdown(run_dir: Path, wall: float) -> dict:
    """Where a run's wall time went, from its metrics log: steps (of which the optimizer), evaluations and
    checkpoints (what lies between one step's end and the next one's start), and the rest (start-up before the
    first step, the end after the last)."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_time" in r]
    log = (run_dir / "train.log").read_text()
    first = steps[0]
    # a row is logged every log_every steps and holds that step's times: it stands for the steps since the last
    spans = [r["step"] - p["step"] for p, r in itertools.pairwise([{"step": 0}, *steps])]
    step_s = sum(r["step_time"] * n for r, n in zip(steps, spans, strict=True))
    optimizer_s = sum(r.get("optimizer_time", 0.0) * n for r, n in zip(steps, spans, strict=True))
    saves = [float(x) for x in _numbers_after(log, "saved in ")]
    loop_s = steps[-1]["time"] - first["time"] + first["step_time"] * first["step"]
    evals = sum(1 for r in rows if "eval_loss" in r)
    return {"steps": steps[-1]["step"], "step_s": step_s, "optimizer_s": optimizer_s, "checkpoint_s": sum(saves),
            "eval_and_other_in_loop_s": max(0.0, loop_s - step_s - sum(saves)), "evaluations": evals,
            "outside_loop_s": max(0.0, wall - loop_s), "tokens": steps[-1].get("tokens", 0)}


def _numbers_after(text: str, marker: str) -> list[str]:
    out = []
    for line in text.splitlines():
        if marker in line:
            out.append(line.split(marker, 1)[1].split()[0])
    return out


# ---- the plain loop -----------------------------------------------------------------------------------


def run_plain(config: Path, data: Path, seed: int, budget: float, out: Path, sets: list[str],
              precision: str, lr: float) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--plain-worker", "--config", str(config),
               "--data", str(data), "--seed", str(seed), "--budget", str(budget), "--out", str(out),
               "--launched", repr(time.time()), "--plain-precision", precision, "--plain-lr", repr(lr)]
    for item in sets:
        command += ["--set", item]
    wall = _timed(command, out.parent / f"{out.name}.log")
    model = plain_model(config, sets)
    from safetensors.torch import load_model

    load_model(model, str(out / "model.safetensors"))
    report = json.loads((out / "report.json").read_text())
    return {"wall_s": wall, "model": model.eval(), "breakdown": report}


def plain_model(config: Path, sets: list[str]):
    """transformers' ZayaForCausalLM of the config's model shape, initialised as transformers does."""
    import torch
    import transformers

    from zaya.config import load_config
    from zaya.model.hf_config import native_config_json

    fields = native_config_json(load_config(config, _model_sets(sets)).model_config(), torch.float32)
    for key in ("architectures", "model_type", "zaya_stack", "dtype"):
        fields.pop(key)
    return transformers.ZayaForCausalLM(transformers.ZayaConfig(**fields))


def _model_sets(sets: list[str]) -> list[str]:
    return [item for item in sets if item.startswith("model.")]


def plain_worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from zaya.config import load_config
    from zaya.data.dataset_reader import open_dataset
    from zaya.device import auto_precision

    torch.manual_seed(args.seed)
    config = load_config(args.config, _model_sets(args.set))
    seq_len = config.data.seq_len
    model = plain_model(args.config, args.set).train()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                                  lr=args.plain_lr, betas=(0.9, 0.95))
    train = open_dataset(args.data).split("train")
    windows = (train.num_tokens - 1) // seq_len
    rng = np.random.default_rng(args.seed)
    precision = auto_precision(torch.device("cpu")) if args.plain_precision == "auto" else args.plain_precision
    bf16 = precision == "bf16"
    args.out.mkdir()
    started = time.time()
    end = args.launched + args.budget - 1.0  # a second for the save and the exit
    step, step_s, optimizer_s = 0, 0.0, 0.0
    while (now := time.time()) < end:
        progress = (now - started) / max(1e-9, end - started)
        lr = args.plain_lr * min((step + 1) / PLAIN_WARMUP, 1.0 - progress)
        for group in optimizer.param_groups:
            group["lr"] = max(0.0, lr)
        t0 = time.perf_counter()
        rows = torch.from_numpy(train.gather(rng.integers(0, windows, PLAIN_BATCH), seq_len).astype(np.int64))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=rows[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), rows[:, 1:].flatten())
        loss.backward()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        step, step_s, optimizer_s = step + 1, step_s + t2 - t0, optimizer_s + t2 - t1
    from safetensors.torch import save_model

    save_model(model, str(args.out / "model.safetensors"))  # the head is tied to the embedding
    (args.out / "report.json").write_text(json.dumps({
        "steps": step, "step_s": step_s, "optimizer_s": optimizer_s, "precision": "bf16" if bf16 else "fp32",
        "outside_loop_s": started - args.launched, "tokens": step * PLAIN_BATCH * seq_len}))


# ---- the comparison -----------------------------------------------------------------------------------


def _timed(command: list[str], log: Path) -> float:
    started = time.perf_counter()
    with open(log, "x", encoding="utf-8") as handle:
        result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - started
    if result.returncode:
        sys.exit(f"{' '.join(command)} failed ({result.returncode}):\n{log.read_text()[-4000:]}")
    return wall


def time_to_reach(points: list[tuple[float, float]], loss: float) -> float | None:
    """The seconds a side needs to reach `loss`, interpolated linearly in log time between its (seconds, loss)
    points (sorted by seconds); None where its points do not bracket it."""
    points = sorted(points)
    for (t0, l0), (t1, l1) in itertools.pairwise(points):
        if l1 < l0 and l1 <= loss <= l0:
            share = (l0 - loss) / (l0 - l1)
            return math.exp(math.log(t0) + share * (math.log(t1) - math.log(t0)))
    return None


def summarise(results: list[dict], budgets: list[float]) -> dict:
    sides = sorted({r["side"] for r in results})
    table = {}
    for side in sides:
        for budget in budgets:
            runs = [r for r in results if r["side"] == side and r["budget"] == budget]
            if runs:
                losses = [r["loss"] for r in runs]
                table[(side, budget)] = {
                    "loss": statistics.mean(losses), "spread": max(losses) - min(losses),
                    "wall_s": statistics.mean(r["wall_s"] for r in runs), "seeds": len(runs),
                    "steps": statistics.mean(r["breakdown"]["steps"] for r in runs)}
    return table


def report(results: list[dict], budgets: list[float]) -> list[str]:
    table = summarise(results, budgets)
    lines = ["side   budget   wall s   steps   held-out loss (mean, spread over seeds)"]
    for (side, budget), row in sorted(table.items()):
        lines.append(f"{side:<6} {budget:>6.0f} {row['wall_s']:>8.1f} {row['steps']:>7.0f}   {row['loss']:.3f} "
                     f"(spread {row['spread']:.3f}, {row['seeds']} seeds)")
    curves = {side: [(row["wall_s"], row["loss"]) for (s, _), row in table.items() if s == side]
              for side in ("zaya", "plain")}
    if curves["zaya"] and curves["plain"]:
        lines.append("time to reach the other side's loss (interpolated in log time between budgets):")
        for budget in budgets:
            for side, other in (("plain", "zaya"), ("zaya", "plain")):
                if (side, budget) in table:
                    lines.append(_reach_line(side, table[(side, budget)], other, curves[other]))
        for budget in budgets:
            half, full = table.get(("zaya", budget / 2)), table.get(("plain", budget))
            if half and full:
                verdict = "met" if half["loss"] <= full["loss"] else "not met"
                lines.append(f"zaya at half the plain loop's {budget:.0f} s: {half['loss']:.3f} against "
                             f"{full['loss']:.3f}: {verdict}")
    for side in ("zaya", "plain"):
        for budget in budgets:
            runs = [r["breakdown"] for r in results if r["side"] == side and r["budget"] == budget]
            if runs:
                mean = {k: statistics.mean(run[k] for run in runs) for k in runs[0] if k != "precision"}
                parts = ", ".join(f"{k.removesuffix('_s')} {v:.1f} s" for k, v in mean.items()
                                  if k.endswith("_s"))
                lines.append(f"where {side}'s {budget:.0f} s went: {parts}; {mean['steps']:.0f} steps, "
                             f"{mean['tokens'] / 1e3:.0f}k tokens")
    return lines


def _reach_line(side: str, row: dict, other: str, curve: list[tuple[float, float]]) -> str:
    """How long `other` (its points `curve`) needs to reach the loss `side` reached in `row`."""
    need = time_to_reach(curve, row["loss"])
    took = f"{need:.0f} s, {need / row['wall_s']:.2f}x the time" if need else "a time outside its budgets"
    return f"  {side} at {row['wall_s']:.0f} s reaches {row['loss']:.3f}; {other} needs {took}"


def plot(results: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for side, colour in (("zaya", "tab:blue"), ("plain", "tab:orange")):
        runs = sorted((r for r in results if r["side"] == side), key=lambda r: r["wall_s"])
        if not runs:
            continue
        axes.scatter([r["wall_s"] for r in runs], [r["loss"] for r in runs], color=colour, alpha=0.5, s=18)
        table = summarise(runs, sorted({r["budget"] for r in runs}))
        means = sorted((row["wall_s"], row["loss"]) for row in table.values())
        label = "zaya" if side == "zaya" else "transformers ZayaForCausalLM + AdamW"
        axes.plot([m[0] for m in means], [m[1] for m in means], color=colour, marker="o", label=label)
    axes.set_xscale("log")
    ticks = sorted({r["budget"] for r in results})
    axes.set_xticks(ticks, [f"{t:g}" for t in ticks])
    axes.minorticks_off()
    axes.set_xlabel("wall-clock seconds (process launch to exit)")
    axes.set_ylabel("held-out loss (nats)")
    axes.set_title(title, fontsize=8)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    with open(path, "xb") as handle:
        figure.savefig(handle, format="png", dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "tiny.toml")
    parser.add_argument("--set", action="append", default=[], help="KEY=VALUE for zaya's config (model.* also "
                        "shapes the plain loop's model)")
    parser.add_argument("--budgets", type=float, nargs="+", default=[30.0, 60.0, 120.0], help="zaya's budgets (s)")
    parser.add_argument("--plain-budgets", type=float, nargs="+", default=[120.0, 240.0],
                        help="the plain loop's budgets (s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--sides", nargs="+", choices=("zaya", "plain"), default=["zaya", "plain"])
    parser.add_argument("--data", type=Path, default=None)
    parser.add_argument("--work", type=Path, default=None, help="a new directory for the runs (default: a "
                        "temporary one, removed after)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--plain-precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="the plain loop's: bf16 autocast or fp32 (auto: as zaya's train.precision = auto)")
    parser.add_argument("--plain-lr", type=float, default=PLAIN_LR, help="the plain loop's AdamW rate")
    parser.add_argument("--plain-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--launched", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--from-json", type=Path, default=None,
                        help="report (and with --plot draw) the results an earlier --json wrote, running nothing")
    args = parser.parse_args()
    if args.plain_worker:
        plain_worker(args)
        return
    if args.from_json:
        refuse_existing(args.plot)
        saved = json.loads(args.from_json.read_text())
        print("\n".join(report(saved["results"], sorted({r["budget"] for r in saved["results"]}))))
        if args.plot:
            plot(saved["results"], args.plot, f"{saved['date']}, {saved['machine']}")
        return
    for path in (args.json, args.plot, args.work):
        refuse_existing(path)
    with tempfile.TemporaryDirectory(prefix="zaya-ttq-") as temporary:
        work = args.work or Path(temporary)
        work.mkdir(exist_ok=args.work is None)
        compare(args, work)


def compare(args: argparse.Namespace, work: Path) -> None:
    from zaya.config import load_config

    title = f"{time.strftime('%Y-%m-%d')}, {machine()}"
    print(f"# time to quality, {args.config.name} {' '.join(args.set)}\n# {title}", flush=True)
    data = args.data
    if data is None:
        data = work / "stdlib"
        _timed([sys.executable, "-m", "zaya.cli", "data", "build", "--input", "stdlib", "--out", str(data),
                "--val-fraction", "0.02"], work / "data-build.log")
    windows = heldout_windows(data, load_config(args.config, _model_sets(args.set)).data.seq_len)
    print(f"held-out: {len(windows)} windows of {windows.shape[1]} tokens from {data.name}'s validation split",
          flush=True)
    results = []
    budgets = {"zaya": args.budgets, "plain": args.plain_budgets}
    for seed in args.seeds:
        for budget in sorted(set(budgets["zaya"]) | set(budgets["plain"])):
            for side in (side for side in args.sides if budget in budgets[side]):
                name = f"{side}-seed{seed}-{budget:g}s"
                if side == "zaya":
                    run = run_zaya(args.config, data, seed, budget, work / name, args.set)
                    loss = heldout_loss(lambda ids, model=run["model"]: model(ids), windows)
                else:
                    run = run_plain(args.config, data, seed, budget, work / name, args.set, args.plain_precision,
                                    args.plain_lr)
                    loss = heldout_loss(lambda ids, model=run["model"]: model(input_ids=ids).logits, windows)
                results.append({"side": side, "seed": seed, "budget": budget, "wall_s": run["wall_s"],
                                "loss": loss, "breakdown": run["breakdown"]})
                print(f"{name}: {run['wall_s']:.1f} s, {run['breakdown']['steps']} steps, held-out {loss:.4f}",
                      flush=True)
    lines = report(results, sorted(set(budgets["zaya"]) | set(budgets["plain"])))
    print("\n".join(lines))
    if args.json:
        write_new(args.json, {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "config": str(args.config),
                              "sets": args.set, "results": results, "report": lines})
    if args.plot:
        plot(results, args.plot, title)


if __name__ == "__main__":
    main()
