"""What a run started from and how its settings changed, on record in its directory (rank 0 writes it).

RUN_DIR/run_config.json is the config the run started with, written once; a resume whose resolved config
differs from the one its checkpoint recorded says what changed and appends it to RUN_DIR/config_history.jsonl
(one JSON line per resume: time, step, and each changed key's old and new value), so that the original settings
are never overwritten and every change is on record. A layout that `parallel.layout = "auto"` chose (at the
start, or anew on another world size) is a line of its own there: time, step and `layout` (the ranks, the device,
the `--set` items that pin it, its prediction and the runner-up's). A run started from pretrained weights
(`train.init_from`) records them, with a fingerprint of their contents, in RUN_DIR/init_from.json.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from zaya.owned import write_output
from zaya.run_dir import CONFIG_HISTORY_FILE, INIT_FROM_FILE, RUN_CONFIG_FILE, open_append
from zaya.weights import WeightSource

_MISSING = "(unset)"


def changed_settings(before: dict[str, Any], after: dict[str, Any], prefix: str = "") -> dict[str, list]:
    """Every dotted key whose value differs between two resolved configs: {key: [old, new]} (lists of tables
    compare as whole values)."""
    changes: dict[str, list] = {}
    for key in sorted(set(before) | set(after)):
        old, new = before.get(key, _MISSING), after.get(key, _MISSING)
        name = f"{prefix}{key}"
        if isinstance(old, dict) and isinstance(new, dict):
            changes.update(changed_settings(old, new, f"{name}."))
        elif old != new:
            changes[name] = [old, new]
    return changes


def describe_changes(changes: dict[str, list]) -> str:
    """One line: `key: old -> new; ...`."""
    return "; ".join(f"{key}: {json.dumps(old)} -> {json.dumps(new)}" for key, (old, new) in changes.items())


def record_start(run_dir: Path, record: dict[str, Any], resumed: dict[str, Any] | None, step: int,
                 layout: dict | None = None) -> list[str]:
    """At the start of a run: write run_config.json for a fresh run; on a resume (`resumed`: the config its
    checkpoint recorded) append what changed to config_history.jsonl; and the layout chosen (`layout`), if one
    was. Returns the lines to say."""
    run_dir = Path(run_dir)
    original = run_dir / RUN_CONFIG_FILE
    if resumed is None or not original.is_file():
        write_output(original, json.dumps(record, indent=2), overwrite=True)
    if layout is not None:
        with open_append(run_dir / CONFIG_HISTORY_FILE) as handle:
            handle.write(json.dumps({"time": _now(), "step": step, "layout": layout}) + "\n")
    # compared as JSON holds them (a tuple in memory is a list once written)
    changes = changed_settings(resumed, json.loads(json.dumps(record))) if resumed is not None else {}
    if not changes:
        return []
    entry = {"time": _now(), "step": step, "changes": changes}
    with open_append(run_dir / CONFIG_HISTORY_FILE) as handle:
        handle.write(json.dumps(entry) + "\n")
    return [f"resumed with changed settings (recorded in {CONFIG_HISTORY_FILE}): {describe_changes(changes)}"]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def record_init(run_dir: Path, source: WeightSource, seconds: float, phase: str | None = None) -> str:
    """Record the weights a fresh run started from in init_from.json (a later phase's in init_from.PHASE.json),
    with their fingerprint; returns the line to say."""
    record = {"path": str(source.path.resolve()), "kind": source.kind, "layout": source.layout, "step": source.step,
              "fingerprint": source.fingerprint()}
    name = INIT_FROM_FILE if phase is None else INIT_FROM_FILE.replace(".json", f".{phase}.json")
    write_output(Path(run_dir) / name, json.dumps(record, indent=2), overwrite=True)
    return (f"initialised from {source.describe()} in {seconds:.2f} s ({record['fingerprint'][:19]}...; the "
            "optimizer and schedule start afresh)")
