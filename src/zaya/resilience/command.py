"""The worker command the supervisor runs: plain `zaya train ...`, or `torchrun ... zaya train ...` (also as
`zaya launch ... train ...`, torchrun run by zaya), and how it is rewritten to run on fewer GPUs or nodes.

    torchrun --nnodes 2 --nproc-per-node 8 ...   cordon GPU 3 -> --nproc-per-node 7, visible GPUs 0-2,4-7
                                                 cordon a node -> --nnodes 1 (an elastic "1:2" -> "1:1")

Both spellings torchrun accepts are understood (`--nproc-per-node 8`, `--nproc_per_node=8`); given twice, the last
counts, as for torchrun. Both values are checked before anything is sized from them: `--nproc-per-node` is an
integer in 1..1,024 (or one of torchrun's names: auto, cpu, gpu, xpu), `--nnodes` is N or MIN:MAX with
1 <= MIN <= MAX <= 65,536. Anything else is one line and exit 2, never a run to restart.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from zaya.errors import ZayaError

NPROC = ("--nproc-per-node", "--nproc_per_node")
NNODES = ("--nnodes",)
MAX_NPROC = 1024  # processes per node: more than any node has devices (or cores to spare)
MAX_NODES = 65536
NPROC_NAMES = ("auto", "cpu", "gpu", "xpu")  # torchrun's names for "as many as there are"
_NUMBER = re.compile(r"[0-9]{1,6}")


def _launcher_words(argv: list[str]) -> int:
    """How many words name the launcher before torchrun's options (`torchrun`, `python -m torch.distributed.run`,
    `zaya launch`, `python -m zaya.cli launch`); 0 for a command of no launcher."""
    name = Path(argv[0]).name
    if name == "torchrun":
        return 1
    if name == "zaya" and argv[1:2] == ["launch"]:
        return 2
    if name.startswith("python") and argv[1:3] == ["-m", "torch.distributed.run"]:
        return 3
    if name.startswith("python") and argv[1:4] == ["-m", "zaya.cli", "launch"]:
        return 4
    return 0


def _find(argv: list[str], names: tuple[str, ...]) -> tuple[int, str | None, bool]:
    """Where the option is (index of its value), its value, and whether it was written `--name=value`; the last
    one when it is given twice, as torchrun's argument parser takes it."""
    found: tuple[int, str | None, bool] = (-1, None, False)
    for index, arg in enumerate(argv):
        for name in names:
            if arg == name and index + 1 < len(argv):
                found = index + 1, argv[index + 1], False
            elif arg.startswith(name + "="):
                found = index, arg.split("=", 1)[1], True
    return found


def _count(value: str, high: int) -> int:
    if _NUMBER.fullmatch(value) is None or not 1 <= int(value) <= high:
        raise ValueError
    return int(value)


def _shown(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:37] + "...")


def _set(argv: list[str], names: tuple[str, ...], value: str, insert_at: int) -> list[str]:
    argv = list(argv)
    index, _, joined = _find(argv, names)
    if index < 0:
        argv[insert_at:insert_at] = [names[0], value]
    elif joined:
        argv[index] = f"{argv[index].split('=', 1)[0]}={value}"
    else:
        argv[index] = value
    return argv


@dataclass
class WorkerCommand:
    argv: list[str]

    def __post_init__(self):
        if not self.argv:
            raise ZayaError("zaya supervise: no command given (zaya supervise [OPTIONS] -- COMMAND...)")
        program = self.argv[0]
        if shutil.which(program) is None and not (os.sep in program and os.access(program, os.X_OK)):
            raise ZayaError(f"zaya supervise: command '{program[:200]}' not found")
        if self.torchrun:  # checked before anything is sized from them
            self.nproc_per_node()
            self.nnodes()

    @property
    def torchrun(self) -> bool:
        """Whether torchrun starts the workers (itself, or run by `zaya launch`)."""
        return _launcher_words(self.argv) > 0

    @property
    def _options_at(self) -> int:
        return _launcher_words(self.argv)

    def nproc_per_node(self) -> int | None:
        """The processes per node as a number (None for a plain command or torchrun's "gpu"/"auto")."""
        if not self.torchrun:
            return None
        _, value, _ = _find(self.argv, NPROC)
        if value is None:
            return 1
        if value in NPROC_NAMES:
            return None
        try:
            return _count(value, MAX_NPROC)
        except ValueError:
            raise ZayaError(f"zaya supervise: torchrun --nproc-per-node {_shown(value)}: must be an integer in "
                            f"1..{MAX_NPROC:,} or one of {', '.join(NPROC_NAMES)}") from None

    def nnodes(self) -> tuple[int, int]:
        """torchrun's (min, max) nodes; (1, 1) for a plain command."""
        if not self.torchrun:
            return 1, 1
        _, value, _ = _find(self.argv, NNODES)
        if value is None:
            return 1, 1
        low, colon, high = value.partition(":")
        try:
            low_n = _count(low, MAX_NODES)
            high_n = _count(high, MAX_NODES) if colon else low_n
        except ValueError:
            raise ZayaError(f"zaya supervise: torchrun --nnodes {_shown(value)}: must be N or MIN:MAX, each an integer "
                            f"in 1..{MAX_NODES:,}") from None
        if low_n > high_n:
            raise ZayaError(f"zaya supervise: torchrun --nnodes {_shown(value)}: the minimum is above the maximum "
                            "(MIN:MAX)")
        return low_n, high_n

    def resized(self, nproc: int | None, nodes: int | None) -> list[str]:
        """The command for `nproc` processes per node and at most `nodes` nodes (None: unchanged)."""
        argv = list(self.argv)
        if not self.torchrun:
            return argv
        if nproc is not None:
            argv = _set(argv, NPROC, str(nproc), self._options_at)
        if nodes is not None:
            low, high = self.nnodes()
            value = str(nodes) if low == high else f"{min(low, nodes)}:{nodes}"
            argv = _set(argv, NNODES, value, self._options_at)
        return argv
