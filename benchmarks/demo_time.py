"""`make demo` from a fresh clone, timed: setup (venv and packages), then the demo itself (data build, six
minutes of training, sampling, evaluation, report), against the promise of 10 minutes in all and a held-out
loss of at most 0.50 ln(vocab).

    python benchmarks/demo_time.py [--keep DIR]

It clones this repository's HEAD into a temporary directory (uncommitted changes are not part of a fresh
clone), runs `make demo` there with the same `python3`, and prints the CPU model, the times and the loss.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import clone_from_args, machine, run_timed  # noqa: E402

LIMIT_S = 600.0
LOSS_SHARE = 0.50


def main() -> None:
    with clone_from_args(ROOT, __doc__.split("\n\n")[0], "zaya-demo-") as clone:
        _measure(clone)


def _measure(clone: Path) -> None:
    print(machine())
    setup_s, _ = run_timed(["make", ".venv/.zaya-demo"], clone)
    demo_s, _ = run_timed(["make", "demo"], clone)
    total = setup_s + demo_s

    run = clone / "runs" / "tiny"
    state = json.loads(sorted((run / "checkpoints").glob("step_*/train_state.json"))[-1].read_text())["state"]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # the demo printed it; asked again here as JSON, outside the timing
    _, printed = run_timed([".venv/bin/zaya", "eval", "--model", "runs/tiny", "--data", "data/stdlib",
                            "--seq-len", "256"], clone)
    loss = json.loads(printed[printed.index("{"):printed.rindex("}") + 1])["loss"]
    vocab = json.loads((run / "run_config.json").read_text())
    vocab_size = _vocab_size(vocab)
    bound = LOSS_SHARE * math.log(vocab_size)
    print(f"make demo from a fresh clone: {total:.0f} s in all ({total / 60:.1f} min; limit {LIMIT_S / 60:.0f} min)")
    print(f"  setup (venv, torch, packages): {setup_s:.0f} s; the demo itself: {demo_s:.0f} s, of which "
          f"{state['train_seconds']:.0f} s in {rows[-1]['step']} training steps "
          f"(precision {json.loads((run / 'run_config.json').read_text())['train']['precision']})")
    print(f"  held-out loss {loss:.3f} against {LOSS_SHARE:.2f} ln({vocab_size}) = {bound:.3f}: "
          f"{'ok' if loss <= bound else 'ABOVE'}; time {'ok' if total <= LIMIT_S else 'OVER'}")


def _vocab_size(run_config: dict) -> int:
    sys.path.insert(0, str(ROOT / "src"))
    from zaya.model.presets import get_preset

    model = run_config["model"]
    return get_preset(model["preset"], **model.get("overrides", {})).vocab_size


if __name__ == "__main__":
    main()
