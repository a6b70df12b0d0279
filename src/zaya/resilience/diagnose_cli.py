"""`zaya diagnose`: name the root cause of a failed run from its logs, or say that the run did not fail.

    zaya diagnose worker0.log worker1.log dmesg.txt
    journalctl -k --since -1h | zaya diagnose -
    zaya diagnose --json run/logs/*.log

It prints one line (the root class, what it means, where, and the evidence) and how many cascade lines (the
watchdog timeouts, aborts and lost peers that followed) it set aside. A run's own log (RUN/train.log, or what
`zaya train` printed) also tells a run that completed (`completed`, its last step, exit code 0) or was stopped
on purpose (`stopped`: a signal, Ctrl-C, train.max_time_s; resumable) from one that failed. The exit status is
0 whatever it finds: the command reports, it does not judge. Only unreadable input is an error: a named log
must be a regular file (a FIFO would block, /dev/zero never end; pipe a stream into '-' instead). Every line is
read cut at 64 KiB, and the evidence printed is cut at 500 characters, with a marker.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import click

from zaya.reading import bounded_lines
from zaya.resilience.diagnose import classify_streams, log_lines

STDIN = "-"


@click.command()
@click.argument("logs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the diagnosis as one JSON object.")
def diagnose(logs: tuple[Path, ...], as_json: bool) -> None:
    """Attribute a training failure to its root cause (a GPU Xid, ECC error or hang, a NIC or PCIe fault,
    out of memory, a NaN loss, storage, a Python exception) rather than to the timeouts it caused. LOGS are
    worker logs and kernel logs, read in the order given; '-' reads standard input. A run's own log
    (RUN/train.log) also says whether the run completed, or was stopped on purpose (Ctrl-C, SIGTERM, a time
    limit: `stopped`, resumable)."""
    diagnosis = classify_streams(_input(path) for path in logs)
    if as_json:
        click.echo(json.dumps(diagnosis.to_dict()))
        return
    click.echo(diagnosis.one_line())
    total = max(diagnosis.cascade_total, len(diagnosis.cascade))
    if total and diagnosis.root in ("completed", "stopped"):  # a launcher's closing signals, peers leaving
        click.echo(f"cascade: {total} line(s) of the kind a failure leaves (timeouts, aborts, lost peers, closing "
                   f"signals), none of them a failure here; the first: {diagnosis.cascade[0]}")
    elif total:
        click.echo(f"cascade: {total} line(s) that follow from a failure (timeouts, aborts, lost peers); "
                   f"the first: {diagnosis.cascade[0]}")


def _input(path: Path) -> tuple[str, Iterable[str]]:
    if str(path) == STDIN:
        return "<stdin>", _stdin_lines()
    return str(path), log_lines(path)


def _stdin_lines() -> Iterator[str]:
    # Bytes, cut and decoded here: a log with binary junk (or no newline at all) in it is still a log.
    for line in bounded_lines(click.get_binary_stream("stdin")):
        yield line.decode("utf-8", errors="replace").rstrip("\r")
