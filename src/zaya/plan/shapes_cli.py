"""`zaya shapes`: measure the model's GEMMs on this machine and write the table `zaya plan --device local` uses.

    zaya shapes --preset tiny                         # fp32 on a CPU, bf16 on an accelerator
    zaya shapes --preset zaya1-base --tokens 4096,8192 --budget-s 300
    zaya shapes --preset micro --tokens 256 --out table.json --json
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import click

from zaya.errors import ZayaError
from zaya.plan.sweep_defaults import DEFAULT_BUDGET_S, DEFAULT_TOKENS

MAX_BUDGET_S = 86_400.0  # a day: a sweep of the largest preset on a GPU takes minutes


def _parse_tokens(text: str | None) -> list[int] | None:
    """--tokens as integers, each in 1..2**24 (`zaya.plan.shapes.MAX_TOKENS`), at most 64 of them."""
    from zaya.plan.shapes import MAX_SIZES, MAX_TOKENS

    if text is None:
        return None
    parts = [part for part in text.replace(" ", "").split(",") if part]
    if not parts or len(parts) > MAX_SIZES:
        raise ZayaError(f"--tokens must be 1 to {MAX_SIZES} comma-separated integers, got {len(parts)}")
    tokens = []
    for part in parts:
        if not part.isdigit() or len(part) > 12:  # 1e11, -1, 0x10, a digit string of any length: refused as text
            raise ZayaError(f"--tokens must be comma-separated integers in 1..{MAX_TOKENS:,}, got '{part[:40]}'")
        tokens.append(int(part))
    bad = [t for t in tokens if not 1 <= t <= MAX_TOKENS]
    if bad:
        raise ZayaError(f"--tokens must be comma-separated integers in 1..{MAX_TOKENS:,}, got {bad[0]:,}")
    return tokens


@click.command()
@click.option("--device", "device_name", default="local", show_default=True,
              help="Only 'local' (this machine's accelerator, else its CPU): a published device cannot be "
                   "measured from here.")
@click.option("--preset", default="tiny", show_default=True, help="The model preset whose GEMMs are swept.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default=None,
              help="[default: bf16 on an accelerator, fp32 on a CPU]")
@click.option("--tokens", default=None, metavar="N,N,...",
              help=f"Tokens per micro-batch, the GEMMs' rows [default: {','.join(map(str, DEFAULT_TOKENS))}].")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Where to write the table; an existing file is replaced only with --overwrite [default: the cache "
                   "path `zaya plan --device local` reads, where a table zaya wrote is replaced].")
@click.option("--json", "as_json", is_flag=True, help="Print the table and the recommendations as JSON.")
@click.option("--progress/--no-progress", default=True, show_default=True,
              help="A progress bar on stderr (only when it is a terminal).")
@click.option("--budget-s", type=float, default=DEFAULT_BUDGET_S, show_default=True,
              help="Seconds to spend timing shapes (more than 0, at most a day); the rest are skipped (the preset's "
                   "own shapes come first).")
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file (never a link, FIFO or device).")
def shapes(device_name: str, preset: str, dtype: str | None, tokens: str | None, out: Path | None, as_json: bool,
           progress: bool, budget_s: float, overwrite: bool) -> None:
    """Measure the GEMMs of a preset and of variants around it on this machine; recommend dimensions."""
    from zaya.device import default_device, default_gemm_dtype
    from zaya.model.presets import get_preset
    from zaya.owned import check_output
    from zaya.plan.shapes import sweep
    from zaya.plan.shapes_report import format_recommendations, format_skipped, format_table, recommend
    from zaya.plan.table import DTYPES, cache_dir, check_cache, default_table_path, dtype_name

    if device_name != "local":
        from zaya.plan.devices import DEVICES

        known = f" ('{device_name}' is a published device: `zaya plan` uses its datasheet figures)" \
            if device_name in DEVICES else ""
        raise ZayaError(f"--device must be 'local': only this machine can be measured{known}")
    # everything that can be refused is, before the measurement (minutes) starts
    get_preset(preset)
    token_list = _parse_tokens(tokens)
    if not (math.isfinite(budget_s) and 0 < budget_s <= MAX_BUDGET_S):
        raise ZayaError(f"--budget-s must be a number of seconds in (0, {MAX_BUDGET_S:,.0f}], got {budget_s}")
    device = default_device()
    name = dtype or dtype_name(default_gemm_dtype(device))
    path = out if out is not None else default_table_path(name, cache_dir(os.environ))
    if out is not None:
        check_output(path, overwrite)
    else:  # the cache: replaced only where it holds a table zaya wrote
        check_cache(path)
    table = sweep(preset, device, DTYPES[name], token_list, progress=progress, budget_s=budget_s)
    recommendations = recommend(table, preset)
    written = table.save(path, overwrite=overwrite) if out is not None else table.save_cache(path)
    if as_json:
        payload = {"table": table.to_dict(), "recommendations": [r.to_dict() for r in recommendations],
                   "path": str(written)}
        click.echo(json.dumps(payload, indent=1))
        return
    click.echo(format_table(table))
    click.echo("")
    click.echo(format_recommendations(recommendations))
    click.echo("")
    click.echo(format_skipped(table))
    click.echo(f"wrote {written}")
