"""The run's messages: rank 0 shows each (above the progress bar once there is one) and appends it, time-stamped,
to RUN_DIR/train.log; every other rank appends its own to RUN_DIR/logs/rank-R.log.

A logged step's line (`step_line`) always goes to train.log, and to the screen only where there is no progress
bar (the output is not a terminal: a batch job, `nohup`, a redirect), so that such a log shows the run's
course without `metrics.jsonl`. An error that ends the run ends its log too, in the line the command prints
(`zaya: error: ...`, or the exception of a bug), so that the log alone says how the run ended.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from zaya.errors import ZayaError
from zaya.run_dir import LOG_FILE, RANK_LOG, open_append


class Screen(Protocol):
    def message(self, text: str) -> None: ...


class RunLog:
    """`log(text)` says one message (see the module docstring); `screen` (the metrics logger, once open) shows
    rank 0's."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.screen: Screen | None = None

    def __call__(self, text: str, show: bool = True) -> None:
        """Say `text` (rank 0: on the screen unless `show` is false, and in train.log)."""
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n"
        if self.rank != 0:
            if self.run_dir.is_dir():
                path = self.run_dir / RANK_LOG.format(self.rank)
                path.parent.mkdir(exist_ok=True)
                with open_append(path) as handle:
                    handle.write(stamped)
            return
        if not show:
            pass
        elif self.screen is not None:
            self.screen.message(text)
        else:
            print(text, flush=True)
        if self.run_dir.is_dir():
            with open_append(self.run_dir / LOG_FILE) as handle:
                handle.write(stamped)

    @contextlib.contextmanager
    def failures(self) -> Iterator[None]:
        """Whatever error leaves the block is written to the log (not to the screen: the command prints it) once
        the run directory exists, and raised on. An interrupt or an exit is no error."""
        try:
            yield
        except (KeyboardInterrupt, SystemExit, GeneratorExit):
            raise
        except ZayaError as exc:
            self(f"zaya: error: {exc}", show=False)
            raise
        except BaseException as exc:
            first = str(exc).strip().splitlines()[:1]
            self(f"{type(exc).__name__}{f': {first[0]}' if first else ''}", show=False)
            raise


def step_line(row: dict, end_step: int, eta_seconds: float | None) -> str:
    """One logged step in a line: step, loss (and held-out loss), learning rate, tokens/s, MFU, gradient norm,
    the worst MoE layer's expert imbalance (busiest expert over the mean load) and the time left."""
    parts = [f"step {row['step']:,}/{end_step:,}", f"loss {row['loss']:.4f}"]
    if row.get("eval_loss") is not None:
        parts.append(f"eval loss {row['eval_loss']:.4f}")
    parts += [f"lr {row['lr']:.3g}", f"{row['tokens_per_s']:,.0f} tok/s", f"MFU {100 * row['mfu']:.1f}%",
              f"grad norm {row['grad_norm']:.3g}"]
    if row.get("expert_imbalance"):
        parts.append(f"expert imbalance {max(row['expert_imbalance']):.2f}")
    parts.append(f"ETA {_clock(eta_seconds)}")
    return " | ".join(parts)


def _clock(seconds: float | None) -> str:
    if seconds is None or seconds != seconds:
        return "-"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
