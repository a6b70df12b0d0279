"""`zaya plan`: what a run config needs and how long it takes, before it runs.

    zaya plan configs/zaya1-base.toml --gpus 1024 --gpus-per-node 8 --device mi300x
    zaya plan configs/zaya1-base.toml --gpus 1 --device h100          # does not fit: the smallest layout that does
    zaya plan configs/tiny.toml --device local --set train.precision=fp32   # after `zaya shapes`
    zaya plan configs/zaya1-base.toml --gpus 256 --device h200 --search
    zaya plan --devices
    zaya plan --calibrate-from runs/first --device mi300x    # what that run measured, folded into mi300x's figures
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import click

from zaya.errors import ZayaError

GB = 1e9


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:10.2f} GB"


def load_target(device: str, precision: str, table_path: Path | None, cache: Path, uncalibrated: bool = False):
    """(DeviceSpec, measured table or None) for `device`; "local" reads the table `zaya shapes` wrote under the
    cache directory `cache`, or `table_path`. The device carries its calibration in `precision` from the cache
    (`zaya.plan.calibration`) unless `uncalibrated`."""
    from zaya.plan.calibration import calibrated
    from zaya.plan.devices import get_device

    if device != "local":
        if table_path is not None:
            raise ZayaError("--table applies to --device local only")
        spec = get_device(device)
        return (spec if uncalibrated else calibrated(spec, cache, precision)), None
    from zaya.plan.table import EfficiencyTable, default_table_path

    dtype = "bf16" if precision == "bf16" else "fp32"
    path = table_path or default_table_path(dtype, cache)
    if table_path is None and not _exists(path):
        raise ZayaError(f"no measured table for the local device at {path}: run `zaya shapes --dtype {dtype}` first")
    table = EfficiencyTable.load(path)  # a regular file of at most 64 MiB, its every field checked
    spec = get_device("local", table)
    return (spec if uncalibrated else calibrated(spec, cache, dtype)), table


def _exists(path: Path) -> bool:
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError:
        return True  # there, but unusable (a loop of links, a name too long): the read says which
    return True


def check_counts(gpus: int, gpus_per_node: int | None, top: int) -> None:
    """The command's numbers, before anything is planned: one line naming the flag and its range."""
    from zaya.plan.search import MAX_GPUS

    for flag, value, high in (("--gpus", gpus, MAX_GPUS), ("--gpus-per-node", gpus_per_node, MAX_GPUS_PER_NODE),
                              ("--top", top, MAX_TOP)):
        if value is not None and not 1 <= value <= high:
            raise ZayaError(f"{flag} must be an integer in 1..{high:,}, got {value:,}")


MAX_GPUS_PER_NODE = 1 << 10  # nodes hold 8 today; a thousand is no node
MAX_TOP = 1000  # layouts --search prints


def format_plan(plan) -> str:
    """The plan as the text `zaya plan` prints."""
    data = plan.to_dict()
    first = plan.first
    layout = first.layout
    memory = first.memory.to_dict()
    unit = plan.device.unit  # a GPU, or on a CPU one process of the host
    lines = [
        f"plan of {plan.source} on {layout.gpus} x {plan.device.label} ({plan.device.name}), {plan.precision}",
        f"  layout: {layout.describe()}",
    ]
    if plan.device.calibrated_from:
        lines.append(f"  calibrated: compute time x{plan.device.compute_factor:.3f}, memory "
                     f"x{plan.device.memory_factor:.3f}, as {plan.device.calibrated_from} measured "
                     "(--uncalibrated: without)")
    lines += [
        f"  parameters: {plan.params.total:,} total, {plan.params.active:,} active, {plan.params.embedding:,} "
        f"embedding; {plan.flops_per_token / 1e9:.2f} GFLOP per token (training, seq {first.seq_len})",
    ]
    if plan.sliding:
        lines.append(f"  attention: {plan.sliding['blocks']} of {plan.sliding['of']} blocks within a sliding window "
                     f"of {plan.sliding['window']:,} positions; decode cache {first.decode_cache / GB:.2f} GB per "
                     f"sequence of {first.seq_len:,} tokens")
    lines += [
        "",
        f"memory per {unit} (phase '{first.name}', micro-batch of {layout.micro_batch_size} x "
        f"{first.seq_len // layout.cp} tokens)",
    ]
    for key in ("parameters", "gradients", "optimizer_state", "master_weights", "activations", "transient",
                "communication_buffers", "optimizer_workspace"):
        lines.append(f"  {key:<24}{_gb(memory[key])}")
    verdict = "fits" if plan.fits else "does NOT fit"
    lines.append(f"  {'total':<24}{_gb(memory['total'])}  of {plan.device.memory_bytes / GB:.0f} GB: {verdict}")
    modes = "; ".join(f"{mode} {nbytes / GB:.2f} GB" for mode, nbytes in first.activations_by_mode.items())
    lines.append(f"  activations by checkpointing: {modes}")
    for phase in plan.phases[1:]:
        if phase.memory.total != first.memory.total:
            lines.append(f"  phase '{phase.name}': {phase.memory.total / GB:.2f} GB in all "
                         f"({'fits' if phase.fits else 'does NOT fit'})")
    for problem in plan.problems:
        lines.append(f"  cannot run: {problem}")
    lines += ["", f"communication per step and {unit} ({first.micro_batches} micro-batch(es))"]
    for kind, nbytes in sorted(first.traffic.by_kind.items(), key=lambda item: -item[1]):
        lines.append(f"  {kind:<24}{_gb(nbytes)}")
    for dim, nbytes in first.traffic.by_dimension().items():
        lines.append(f"  over {dim:<19}{_gb(nbytes)} at {plan.bandwidths[dim] / GB:.0f} GB/s")
    parts = first.time.to_dict()
    lines += ["", "step time (predicted)"]
    for key in ("gemm", "attention", "elementwise", "overhead", "optimizer", "comm_exposed"):
        lines.append(f"  {key:<24}{parts[key]:12.4f} s")
    lines.append(f"  {'total':<24}{parts['total']:12.4f} s: {data['tokens_per_s_per_gpu']:,.0f} tokens/s per {unit}, "
                 f"MFU {data['mfu']:.1%}")
    lines += ["", f"{'phase':<16}{'seq_len':>8}{'cp':>4}{'steps':>12}{'tokens':>18}{'step s':>10}{'hours':>10}"]
    for phase in plan.phases:
        lines.append(f"{phase.name:<16}{phase.seq_len:>8}{phase.cp:>4}{phase.steps:>12,}{phase.tokens:>18,}"
                     f"{phase.time.total:>10.3f}{phase.hours:>10.1f}")
    hours = plan.hours
    lines.append(f"{'run':<16}{'':>24}{sum(p.tokens for p in plan.phases):>18,}{'':>10}{hours:>10.1f} "
                 f"({hours / 24:.1f} days)")
    for phase in plan.phases:
        if phase.documents is not None:
            lines.append(f"phase '{phase.name}' keeps packed documents apart: attention over documents of "
                         f"{phase.documents.tokens:,} tokens ({phase.documents.source}), "
                         f"{phase.memory.total / GB:.2f} GB per {unit}")
    return "\n".join(lines)


@click.command()
@click.argument("config_path", metavar="CONFIG", required=False, type=click.Path(path_type=Path))
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs (ranks) the run would use (1 to 131,072).")
@click.option("--gpus-per-node", type=int, default=None,
              help="1 to 1,024 [default: the device's, 8 for the GPUs listed].")
@click.option("--device", "device_name", default="local", show_default=True,
              help="A device of --devices; 'local' uses the table `zaya shapes` measured on this machine.")
@click.option("--table", "table_path", type=click.Path(path_type=Path), default=None,
              help="The measured table for --device local (default: the one `zaya shapes` writes).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a config key (repeatable).")
@click.option("--search", is_flag=True, help="Rank every layout that fits; say why the others do not.")
@click.option("--top", type=int, default=10, show_default=True, help="Layouts --search shows (1 to 1,000).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON (keys in docs/planning.md).")
@click.option("--devices", is_flag=True, help="List the devices and their calibrations, and exit.")
@click.option("--calibrate-from", "calibrate_from", type=click.Path(path_type=Path), default=None, metavar="RUN_DIR",
              help="Fold what the run in RUN_DIR measured (step time, peak memory) into --device's figures, for "
                   "the next plans.")
@click.option("--uncalibrated", is_flag=True, help="Plan with the published (or measured) figures alone, not a "
                                                   "calibration.")
@click.pass_context
def plan(ctx, config_path, gpus, gpus_per_node, device_name, table_path, overrides, search, top, as_json, devices,
         calibrate_from, uncalibrated) -> None:
    """Predict memory per GPU, communication, step time, MFU and run time of a training config."""
    from zaya.config import load_config
    from zaya.plan.devices import describe_devices
    from zaya.plan.planner import plan_compile, plan_precision, plan_run
    from zaya.plan.search import MAX_GPUS, NEAR, Constraints, describe, search_layouts, smallest_fit
    from zaya.plan.table import cache_dir

    check_counts(gpus, gpus_per_node, top)
    cache = cache_dir(os.environ)
    if devices:
        from zaya.plan.calibration import describe_calibrations

        click.echo("\n".join([describe_devices(cache), *describe_calibrations(cache)]))
        return
    if calibrate_from is not None:
        _calibrate(ctx, calibrate_from, config_path, device_name, gpus_per_node, table_path, cache, as_json)
        return
    if config_path is None:
        raise ZayaError("give a run config (zaya plan CONFIG), or --devices")
    config = load_config(config_path, list(overrides))
    # as the trainer would resolve `auto` on the target
    precision = plan_precision(device_name) if config.train.precision == "auto" else config.train.precision
    device, table = load_target(device_name, precision, table_path, cache, uncalibrated)
    per_node = gpus_per_node or min(device.gpus_per_node, gpus)
    run = config.resolve(gpus, precision, plan_compile(device_name, table))
    constraints = Constraints.of_config(config, run)
    ranked = search_layouts(run, per_node, device, table, not as_json, constraints) if search else []
    chosen, unchosen = None, ""
    if config.parallel.layout == "auto":  # planned as the trainer would launch it on these GPUs
        from zaya.plan.auto import Cluster, LayoutCache, choose

        try:
            chosen = choose(config, run, Cluster(gpus, per_node, device, table),
                            cache=LayoutCache(cache, writable=False), ranked=ranked or None, progress=not as_json)
        except ZayaError as exc:  # nothing fits: the config's own layout is planned, and why it does not fit
            unchosen = str(exc)
        else:
            config = chosen.config
            run = config.resolve(gpus, precision, plan_compile(device_name, table))
    result = plan_run(run, device, table, per_node)
    data = result.to_dict()
    data["calibration"] = None if not device.calibrated_from else {
        "compute_factor": device.compute_factor, "memory_factor": device.memory_factor, "run": device.calibrated_from}
    data["layout_auto"] = None if config.parallel.layout != "auto" else {
        "settings": chosen.settings if chosen else None, "line": chosen.line if chosen else unchosen}
    smallest = None if result.fits else smallest_fit(config, precision, device,
                                                     gpus_per_node or device.gpus_per_node, table)
    if as_json:
        if smallest is not None:
            data["smallest_fit"] = {"gpus": smallest.layout.gpus, "layout": smallest.layout.__dict__,
                                    "phase_cp": list(smallest.phase_cp), "hours": smallest.hours,
                                    "settings": smallest.settings()}
        if search:
            data["search"] = [{"layout": c.layout.__dict__, "phase_cp": list(c.phase_cp),
                               "hours": c.hours if not c.reason else None, "reason": c.reason,
                               "settings": c.settings()} for c in ranked]
        click.echo(json.dumps(data, indent=2))
        return
    if search:  # the answer first: the fastest layouts and the line that applies the best; the config's own after
        fitting = [c for c in ranked if not c.reason]
        click.echo(f"{len(fitting)} of {len(ranked)} layouts fit on {gpus} x {device.name}; the fastest:")
        for candidate in fitting[:top]:
            click.echo(f"  {describe(candidate)}  {candidate.plan.tokens_per_s_per_gpu:>9,.0f} tok/s/GPU  "
                       f"MFU {candidate.plan.mfu:5.1%}  {candidate.peak_memory / GB:6.1f} GB  "
                       f"{candidate.hours:10,.0f} h")
        fastest = min(fitting, key=lambda c: c.hours) if fitting else None
        if fastest is not None and fastest is not fitting[0]:
            click.echo(f"  (the first is within {NEAR:.0%} of the fastest's {fastest.hours:,.1f} h, a tie the "
                       f"predictions cannot break, and of those it needs the least memory)")
        if fitting:
            sets = " ".join(f"--set {setting}" for setting in fitting[0].settings())
            click.echo(f"the fastest, applied: zaya train {config_path} {sets}")
        reasons: dict[str, list] = {}
        for candidate in ranked:
            if candidate.reason:
                reasons.setdefault(_reason_kind(candidate.reason), []).append(candidate)
        if reasons:
            click.echo("rejected:")
        for members in reasons.values():
            click.echo(f"  {len(members):>4} like {describe(members[0])}: {members[0].reason}")
        click.echo("\nthe config's own layout:" if chosen is None else "\nthe layout auto launches:")
    if config.parallel.layout == "auto":
        click.echo(chosen.line if chosen is not None else unchosen)
    click.echo(format_plan(result))
    if not result.fits:
        if smallest is None:
            click.echo(f"\nno layout of up to {MAX_GPUS:,} GPUs fits")
        else:
            click.echo(f"\nsmallest layout that fits: {smallest.layout.gpus} GPU(s), {describe(smallest)}: "
                       f"{smallest.plan.first.memory.total / GB:.1f} GB per {device.unit}, {smallest.hours:,.0f} hours")


def _calibrate(ctx, run_dir: Path, config_path, device_name: str, gpus_per_node, table_path, cache: Path,
               as_json: bool) -> None:
    """`--calibrate-from RUN_DIR`: the run gives the config, its ranks and its precision, so the flags that would
    give them are refused rather than ignored."""
    from zaya.plan.calibration import calibrate

    if config_path is not None:
        raise ZayaError("--calibrate-from takes the run's own config: give RUN_DIR alone, without CONFIG")
    for name in ("gpus", "overrides", "search"):
        if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE:
            flag = {"overrides": "--set"}.get(name, f"--{name}")
            raise ZayaError(f"{flag} does not apply to --calibrate-from: the run's config and ranks are what it "
                            "measured")
    found, path, line = calibrate(run_dir, cache, lambda precision: load_target(device_name, precision, table_path,
                                                                                cache, uncalibrated=True),
                                  gpus_per_node)
    click.echo(json.dumps({**found.to_dict(), "path": str(path)}, indent=2) if as_json else line)


def _reason_kind(reason: str) -> str:
    """A rejection reason without its numbers: the key that groups like ones (never shown)."""
    import re

    return re.sub(r"\d[\d.,]*", "N", reason.split(";")[0])[:90]
