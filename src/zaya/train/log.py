"""The run's messages: rank 0 shows each (above the progress bar once there is one) and appends it, time-stamped,
to RUN_DIR/train.log; every other rank appends its own to RUN_DIR/logs/rank-R.log."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Protocol

from zaya.run_dir import LOG_FILE, RANK_LOG


class Screen(Protocol):
    def message(self, text: str) -> None: ...


class RunLog:
    """`log(text)` says one message (see the module docstring); `screen` (the metrics logger, once open) shows
    rank 0's."""

    def __init__(self, run_dir: Path, rank: int):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.screen: Screen | None = None

    def __call__(self, text: str) -> None:
        stamped = f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n"
        if self.rank != 0:
            if self.run_dir.is_dir():
                path = self.run_dir / RANK_LOG.format(self.rank)
                path.parent.mkdir(exist_ok=True)
                with path.open("a", encoding="utf-8") as handle:
                    handle.write(stamped)
            return
        if self.screen is not None:
            self.screen.message(text)
        else:
            print(text, flush=True)
        if self.run_dir.is_dir():
            with (self.run_dir / LOG_FILE).open("a", encoding="utf-8") as handle:
                handle.write(stamped)
