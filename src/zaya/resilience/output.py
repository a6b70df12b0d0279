"""What a worker group prints, as the supervisor takes it: read from the pipe as it comes, line by line, copied to
the run's log and to the supervisor's own stdout, the last lines kept for the classifier.

Nothing here grows with what the group prints. A line is cut at `LINE_CAP` (64 KiB) as it is read, the rest
skipped and never held; the log keeps the cut line with a marker saying how many bytes were cut. The tail keeps
at most `TAIL_LINES` lines of at most `TAIL_LINE` bytes each, `TAIL_BYTES` in all: the classifier matches the
first 8 KiB of a line, and a failure's story is in the last lines.
"""

from __future__ import annotations

import collections
import os
import threading
from collections.abc import Callable, Iterator

from zaya.reading import LINE_CAP

TAIL_LINES = 5000
TAIL_LINE = 8192
TAIL_BYTES = 8 << 20
CHUNK = 1 << 16


def output_lines(read: Callable[[int], bytes], max_line: int = LINE_CAP) -> Iterator[tuple[bytes, int]]:
    """(line, bytes cut) for each line of a stream read with `read(n)` (b"" at its end), each line without its
    newline and cut to `max_line` bytes; a last line without a newline counts too."""
    partial, cut = bytearray(), 0
    while True:
        block = read(CHUNK)
        if not block:
            break
        start = 0
        while True:
            end = block.find(b"\n", start)
            stop = len(block) if end < 0 else end
            room = max(max_line - len(partial), 0)
            partial += block[start:min(stop, start + room)]
            cut += max(stop - start - room, 0)
            if end < 0:
                break
            yield bytes(partial), cut
            partial, cut, start = bytearray(), 0, end + 1
    if partial or cut:
        yield bytes(partial), cut


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


class GroupOutput:
    """Copies a group's output (`read`, b"" at its end) to the log descriptor `log` and to `echo` (None: nowhere), in
    a thread of its own; `lines()` is the tail so far."""

    def __init__(self, read: Callable[[int], bytes], log: int, echo: int | None = 1):
        self._lock = threading.Lock()
        self._tail: collections.deque[str] = collections.deque()
        self._size = 0
        self._thread = threading.Thread(target=self._copy, args=(read, log, echo), daemon=True)
        self._thread.start()

    def lines(self) -> list[str]:
        with self._lock:
            return list(self._tail)

    def join(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the end of the output (every writer gone); whether it came."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _keep(self, line: str) -> None:
        with self._lock:
            self._tail.append(line)
            self._size += len(line)
            while len(self._tail) > TAIL_LINES or self._size > TAIL_BYTES:
                self._size -= len(self._tail.popleft())

    def _copy(self, read: Callable[[int], bytes], log: int | None, echo: int | None) -> None:
        log_fd = log
        try:
            for line, cut in output_lines(read):
                data = line + (f" [... {cut:,} bytes cut]".encode() if cut else b"") + b"\n"
                for fd in (log, echo):
                    if fd is None:
                        continue
                    try:
                        _write_all(fd, data)
                    except OSError:  # a full disk, a closed stdout: go on draining the pipe, the group must not block
                        if fd == log:
                            log = None
                        else:
                            echo = None
                self._keep(line[:TAIL_LINE].decode("utf-8", errors="replace"))
        except (OSError, ValueError):  # the pipe closed under us
            pass
        finally:
            os.close(log_fd)
