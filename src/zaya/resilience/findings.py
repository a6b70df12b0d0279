"""What every detector reports: a `Finding`, one observed fact with the line that shows it.

The log classifier, the probes, the heartbeat watcher and the trainer's training signals all speak this one
type, so the policy can match any of them by `signal` and act on its `subject`:

    signal    the class of the fact: a root class of `zaya diagnose` (gpu_xid, gpu_ecc, gpu_hang, nic, pcie,
              oom, nan, storage, python, and stopped, completed or unknown where no failure was found) or a
              watcher's own (hang, crash, loss_spike, straggler, nic_flap, disk_low)
    subject   what it concerns: "gpu:3" (a local GPU index), "node:NAME", "nic:eth0", "ib:mlx5_0/1",
              "rank:1", "path:/ckpt", or "" when it is the whole job
    line      the evidence, verbatim (a log line, a counter reading, a heartbeat age)
    detail    a human explanation (an Xid's meaning, a counter's delta)
    count     how many times it was seen, for thresholds (carrier changes in the window, ECC errors)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

EVIDENCE_CHARS = 500  # an evidence line is cut to this many characters where it is shown or recorded


def clip(text: str, limit: int = EVIDENCE_CHARS) -> str:
    """`text` cut to `limit` characters, with a marker saying how many were cut: a log line may hold megabytes,
    and a diagnosis or an incident record names the line, it does not copy it."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} [... {len(text) - limit:,} more characters cut]"


@dataclass(frozen=True)
class Finding:
    signal: str
    subject: str = ""
    line: str = ""
    detail: str = ""
    count: int = 1

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def gpu(self) -> int | None:
        """The local GPU index this finding names, if any."""
        kind, _, value = self.subject.partition(":")
        return int(value) if kind == "gpu" and value.isdigit() else None
