"""The `zaya` command. Each subcommand is a thin layer over the Python API; a `ZayaError` (bad input) becomes
one line on stderr and exit code 2, without a traceback."""

from __future__ import annotations

import errno
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from zaya.errors import (
    EXIT_BAD_INPUT,
    EXIT_PREEMPTED,
    STOPPED_LINE,
    StartupFailed,
    ZayaError,
    storage_error,
    storage_message,
)
from zaya.reading import os_reason

if TYPE_CHECKING:
    import torch

    from zaya.parallel.launch import Launch

# --dtype's names, and the torch dtype each means (torch is imported only by the commands that run a model)
DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
          "float16": "float16", "fp16": "float16"}


def _dtype(name: str | None) -> torch.dtype | None:
    import torch

    return None if name is None else getattr(torch, DTYPES[name])


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="zaya-stack")
def cli() -> None:
    """zaya: train, run and convert ZAYA1-style Mixture-of-Experts language models."""


# ---- params -------------------------------------------------------------------------------------------


@cli.command()
@click.argument("model")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def params(model: str, as_json: bool) -> None:
    """Parameter counts of a preset or a model directory (computed without allocating weights)."""
    from zaya.model.params import parameter_report
    from zaya.model.presets import PRESETS, get_preset

    config = get_preset(model) if model in PRESETS else _config_of_dir(Path(model))
    report = parameter_report(config)
    click.echo(json.dumps(report.to_dict(), indent=2) if as_json else report.format())


def _config_of_dir(path: Path):
    from zaya.checkpoint import read_checkpoint_config
    from zaya.weights import read_hf_config, resolve_model_dir

    if not path.exists():
        from zaya.model.presets import PRESETS

        raise ZayaError(f"'{path}' is neither a preset ({', '.join(PRESETS)}) nor an existing directory")
    path, kind = resolve_model_dir(path)
    if kind == "checkpoint":
        return read_checkpoint_config(path)[0]
    return read_hf_config(path)[0]


# ---- generate -----------------------------------------------------------------------------------------


def _parse_ids(text: str) -> list[int]:
    from zaya.infer.generate import check_token_ids
    from zaya.schema import shown

    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part != ""]
    except ValueError:  # a word, or an integer of more digits than Python converts
        raise ZayaError(f"--prompt-ids must be comma-separated integers, got {shown(text)}") from None
    if not ids:
        raise ZayaError("--prompt-ids is empty")
    check_token_ids(ids, prefix="--")
    return ids


@cli.command()
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path),
              help="An HF directory (config.json + safetensors) or a zaya checkpoint directory.")
@click.option("--prompt", default=None, help="Prompt text (needs a tokenizer.json).")
@click.option("--prompt-ids", default=None, help="Prompt as comma-separated token ids, e.g. 5,17,3.")
@click.option("--chat", is_flag=True,
              help="Send --prompt as a user message in the model's chat template and stop at its end-of-turn token.")
@click.option("--max-new-tokens", default=32, show_default=True, type=click.IntRange(min=0))
@click.option("--greedy", is_flag=True,
              help="Pick the most likely token (the default without --temperature, --top-p or --top-k).")
@click.option("--temperature", type=float, default=None, help="Sample at this temperature.")
@click.option("--top-p", type=float, default=None, help="Sample from the smallest set of tokens with this mass.")
@click.option("--top-k", type=int, default=None, help="Sample from the k most likely tokens.")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Divide the positive logits of tokens already in the text by this, multiply the negative ones "
                   "(CTRL's penalty, as in transformers); with greedy decoding too.")
@click.option("--seed", type=int, default=None, help="Seed for sampling.")
@click.option("--output", type=click.Choice(["text", "ids"]), default="text", show_default=True,
              help="'ids' prints only the generated ids, comma-separated, on one line.")
@click.option("--tokenizer", type=click.Path(path_type=Path), default=None,
              help="tokenizer.json to use instead of the one in the model directory.")
@click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the accelerator if any).")
@click.option("--dtype", type=click.Choice(sorted(DTYPES)), default=None, help="Default: as stored.")
@click.option("--stop-at-eos/--no-stop-at-eos", default=True, show_default=True)
@click.option("--compile", "compile_", is_flag=True,
              help="Compile the decode step into one graph first (10-20 s once; pays off for long outputs).")
@click.option("--shard-kv", is_flag=True,
              help="Split the KV cache along the sequence over the job's ranks (torchrun; one rank without it) and "
                   "decode with tree attention. Every rank loads the whole model; rank 0 prints.")
@click.option("--shard-kernel", type=click.Choice(["tree", "ring"]), default="tree", show_default=True,
              help="How --shard-kv combines the shards' attention: two small all-reduces (tree), or each shard "
                   "passed around the ring of ranks (ring, the baseline).")
def generate(model_path, prompt, prompt_ids, chat, max_new_tokens, greedy, temperature, top_p, top_k,
             repetition_penalty, seed, output, tokenizer, device, dtype, stop_at_eos, compile_, shard_kv,
             shard_kernel) -> None:
    """Continue a prompt with a model (with --shard-kv under torchrun: over a KV cache split across the ranks)."""
    import torch

    from zaya.data.tokenizer import find_tokenizer, load_tokenizer
    from zaya.device import rank_device, resolve_device
    from zaya.infer.chat import chat_prompt, require_chat_template
    from zaya.infer.generate import Sampling, check_length, check_max_new_tokens, check_prompt, check_sampling
    from zaya.infer.generate import generate as run_generate
    from zaya.infer.loading import load_model
    from zaya.infer.static import CompiledDecoder
    from zaya.infer.vocab import allowed_ids, check_tokenizer, trained_tokenizer
    from zaya.parallel.launch import Launch
    from zaya.weights import resolve_model_dir

    # with --shard-kv every rank checks its input; bad input on any of them stops all of them, reported once
    launch = Launch.from_env(os.environ) if shard_kv else Launch()
    with launch.startup():
        if (prompt is None) == (prompt_ids is None):
            raise ZayaError("give exactly one of --prompt and --prompt-ids")
        if chat and prompt is None:
            raise ZayaError("--chat needs --prompt: the user's message")
        sampled = temperature is not None or top_p is not None or top_k is not None
        if greedy and sampled:
            raise ZayaError("--greedy cannot be combined with --temperature, --top-p or --top-k")
        if shard_kv and compile_:
            raise ZayaError("--compile does not apply to --shard-kv")
        # every number is checked before the model loads (the lengths again once its positions are known)
        choices = dict(greedy=not sampled, temperature=1.0 if temperature is None else temperature,
                       top_p=1.0 if top_p is None else top_p, top_k=0 if top_k is None else top_k,
                       repetition_penalty=repetition_penalty, seed=seed)
        check_sampling(**choices, prefix="--")
        sampling = Sampling(**choices)
        check_max_new_tokens(max_new_tokens, prefix="--")
        parsed_ids = _parse_ids(prompt_ids) if prompt_ids is not None else None
        model_path, _ = resolve_model_dir(model_path)  # a run directory means its newest valid checkpoint
        template = require_chat_template(model_path) if chat else None
        tokenizer_path = tokenizer or find_tokenizer(model_path)
        tok = load_tokenizer(tokenizer_path) if tokenizer_path is not None else None
        if prompt is not None and tok is None:
            raise ZayaError(f"{model_path}: no tokenizer.json found; pass --tokenizer or use --prompt-ids")
        as_text = output == "text" and tok is not None
        if shard_kv:  # torchrun starts one process per GPU
            device = rank_device(resolve_device(device), launch.local_rank)
        model = load_model(model_path, device=device, dtype=_dtype(dtype))
        known_ids = None
        if prompt is not None or as_text:  # the tokenizer is used: it must be this model's (zaya.infer.vocab)
            known_ids = check_tokenizer(tok, tokenizer_path, model.config.vocab_size,
                                        trained_tokenizer(model_path, tokenizer))
        reply_ends = None
        if chat:
            rendered = chat_prompt(template, model_path, tok, model.config, prompt)
            ids, reply_ends = rendered.ids, rendered.stop_ids
        else:
            ids = tok.encode(prompt).ids if prompt is not None else parsed_ids
        check_length(model.config, len(ids), max_new_tokens, prefix="--")
        ids_tensor = torch.tensor([ids], dtype=torch.long)
        check_prompt(ids_tensor, model.config.vocab_size)

    eos = (reply_ends if chat else model.config.eos_token_id) if stop_at_eos else None
    # text is made only of ids the tokenizer can decode (a reply's ends are its tokens); ids printed as ids are
    # the model's own choice
    allowed = allowed_ids(known_ids, model.config.vocab_size, None if chat else eos) if as_text else None
    if shard_kv:
        from zaya.infer.tree import generate_sharded

        joined = _join_job(launch, model.embed.weight.device)

        def run(on_token):
            return generate_sharded(model, ids_tensor, max_new_tokens, sampling, kernel=shard_kernel,
                                    eos_token_id=eos, on_token=on_token, allowed=allowed)
    else:
        decoder = CompiledDecoder(model) if compile_ else None
        joined = False

        def run(on_token):
            return run_generate(model, ids_tensor, max_new_tokens, sampling, eos_token_id=eos, on_token=on_token,
                                decoder=decoder, allowed=allowed)
    try:
        _print_generation(run, None if chat else prompt, output, tok, launch.is_main)  # a reply, not a continuation
    finally:
        if joined:
            _leave_job()


def _print_generation(run: Callable[..., torch.Tensor], prompt: str | None, output: str, tok: Any,
                      printing: bool) -> None:
    """`run(on_token)` generates; the ids, or the text as it streams, are printed where `printing`."""
    if output == "ids" or tok is None:
        new = run(None)
        if printing:
            click.echo(",".join(str(i) for i in new[0].tolist()))
        return
    from zaya.infer.stream import TextStream

    if not printing:
        run(None)
        return
    stream = TextStream(tok)
    if prompt is not None:
        click.echo(prompt, nl=False)
    run(lambda token: click.echo(stream.push(int(token[0])), nl=False))
    click.echo(stream.rest())


def _join_job(launch: Launch, device: torch.device) -> bool:
    """Make the job's default process group (gloo on the CPU, the device's backend otherwise) on the
    attempt's own store, unless there is one already; returns whether it was made here."""
    import torch.distributed as dist

    from zaya.device import distributed_backend

    if dist.is_initialized():
        return False
    dist.init_process_group(backend=distributed_backend(device), store=launch.store(), rank=launch.rank,
                            world_size=launch.world_size)
    return True


def _leave_job() -> None:
    import gc

    import torch.distributed as dist

    gc.collect()  # gloo work held by reference cycles aborts the process when finalised late
    dist.destroy_process_group()


# ---- convert ------------------------------------------------------------------------------------------


@cli.command()
@click.argument("src", type=click.Path(path_type=Path))
@click.argument("dst", type=click.Path(path_type=Path))
@click.option("--layout", type=click.Choice(["auto", "native", "legacy"]), default="auto", show_default=True,
              help="Key layout of an HF source: 'legacy' is ZAYA1-base's 80-layer layout.")
@click.option("--dtype", type=click.Choice(["bf16", "bfloat16", "fp32", "float32"]), default=None,
              help="Dtype of an export's weights (zaya->hf)  [default: as stored in SRC]")
@click.option("--max-shard-size", metavar="SIZE", default=None,
              help="Split an export's weights into files of at most SIZE (5GB, 500MB, 2GiB, bytes), with "
                   "model.safetensors.index.json  [default: 5GB]")
@click.option("--overwrite", is_flag=True,
              help="Replace DST, an earlier export or checkpoint, once the new one is complete.")
def convert(src: Path, dst: Path, layout: str, dtype: str | None, max_shard_size: str | None,
            overwrite: bool) -> None:
    """Convert between a Hugging Face directory and a zaya checkpoint (the direction follows from SRC)."""
    from zaya.api import convert as run_convert
    from zaya.model.safetensors_files import parse_size

    shard_bytes = None if max_shard_size is None else parse_size(max_shard_size, "--max-shard-size")
    direction = run_convert(src, dst, layout=layout, dtype=_dtype(dtype), max_shard_bytes=shard_bytes,
                            overwrite=overwrite)
    click.echo(f"{direction}: wrote {dst}")


# ---- train / eval / report ----------------------------------------------------------------------------


@cli.command()
@click.argument("config_path", metavar="CONFIG", type=click.Path(path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. --set optim.lr=3e-3 (repeatable).")
@click.option("--run-dir", type=click.Path(), default=None,
              help="Where the run writes everything (default: runs/<config name>). Resumes if it holds a checkpoint.")
@click.option("--allow-data-change", is_flag=True, help="Resume even though the data fingerprint changed.")
@click.option("--allow-tokenizer-change", is_flag=True,
              help="Train even though the data's tokenizer is not the one of the checkpoint resumed or of the "
                   "weights of init_from (said in the log).")
@click.option("--allow-over-memory", is_flag=True,
              help="Start even though the plan says the run needs more memory than the device has (said in the log).")
@click.option("--print-param-groups", is_flag=True, help="Print the optimizer's parameter split and exit.")
@click.option("--print-config", is_flag=True,
              help="Print the resolved config (defaults and --set applied) as TOML and exit, writing nothing.")
def train(config_path: Path, overrides: tuple[str, ...], run_dir: str | None, allow_data_change: bool,
          allow_tokenizer_change: bool, allow_over_memory: bool, print_param_groups: bool, print_config: bool) -> None:
    """Train (or resume training) a model from a TOML run config; under torchrun, one process per device."""
    from zaya.config import load_config
    from zaya.parallel.launch import Launch

    launch = Launch.from_env(os.environ)
    if print_config:
        from zaya.config_toml import to_toml

        config = load_config(config_path, list(overrides))
        chosen = ""
        if config.parallel.layout == "auto":
            from zaya.training import layout_to_print

            config, chosen = layout_to_print(config, launch, os.environ)
        if launch.is_main:  # under torchrun every rank would print the same document
            click.echo(f"# {json.dumps(str(config_path))} resolved: defaults and --set overrides applied")
            if chosen:
                click.echo(f"# {chosen}")
            click.echo(to_toml(config), nl=False)
        return
    if print_param_groups:
        import torch

        from zaya.model.transformer import Zaya
        from zaya.optim.hybrid import describe_param_groups

        config = load_config(config_path, list(overrides))
        with torch.device("meta"):
            model = Zaya(config.model_config())
        click.echo(describe_param_groups(model, config.optim))
        return
    from zaya.training import TrainingJob, check_run_dir

    # every rank checks its config and inputs; bad input on any of them stops all of them, reported once
    with launch.startup():
        # as given: an empty --run-dir (an unset variable) is refused, not taken as the working directory
        run_dir = Path("runs") / config_path.stem if run_dir is None else check_run_dir(run_dir)
        config = load_config(config_path, list(overrides))
        job = TrainingJob.check(config, run_dir, launch=launch, environ=os.environ,
                                allow_data_change=allow_data_change, allow_tokenizer_change=allow_tokenizer_change,
                                allow_over_memory=allow_over_memory)
    trainer = job.trainer()
    last = trainer.run()
    step = trainer.progress.step
    if trainer.stopped:
        if launch.is_main:
            click.echo(f"{STOPPED_LINE} {step} ({trainer.stopped}); exit code {EXIT_PREEMPTED}: resubmit the same "
                       f"command to resume; run directory {run_dir}")
        raise click.exceptions.Exit(EXIT_PREEMPTED)
    if not last:
        from zaya.training import nothing_to_do

        click.echo(nothing_to_do(trainer, run_dir))
        return
    summary = {k: last[k] for k in ("step", "loss", "eval_loss", "tokens") if k in last}
    if launch.is_main:
        click.echo(f"done: {json.dumps(summary)}; run directory {run_dir}")


@cli.command(name="eval")
@click.option("--model", "model_path", required=True, type=click.Path(path_type=Path),
              help="An HF directory, a zaya checkpoint or a run directory.")
@click.option("--data", "data_path", default=None, type=click.Path(path_type=Path),
              help="A dataset directory: held-out loss and perplexity, as JSON.")
@click.option("--tasks", default=None, help="lm-evaluation-harness tasks, comma-separated (needs the eval extra).")
@click.option("--split", default=None, type=click.Choice(["val", "train"]), help="With --data [default: val].")
@click.option("--seq-len", default=None, type=click.IntRange(min=1), help="With --data [default: 512].")
@click.option("--max-batches", default=None, type=click.IntRange(min=1),
              help="With --data [default: the whole split].")
@click.option("--include-path", default=None, type=click.Path(path_type=Path),
              help="With --tasks: a directory of more task YAMLs.")
@click.option("--limit", default=None, type=click.IntRange(min=1), help="With --tasks: at most N examples per task.")
@click.option("--num-fewshot", default=None, type=click.IntRange(min=0), help="With --tasks: K few-shot examples.")
@click.option("--output", default=None, type=click.Path(path_type=Path),
              help="With --tasks: write the full results JSON here [default: in the run directory].")
@click.option("--overwrite", is_flag=True, help="With --output: replace an existing file (never a link or FIFO).")
@click.option("--allow-tokenizer-change", is_flag=True,
              help="With --data: evaluate even though the data's tokenizer is not the model's (said on stderr).")
@click.option("--batch-size", default=8, show_default=True, type=click.IntRange(min=1))
@click.option("--device", default=None, help="cpu, cuda, cuda:1, ... (default: the accelerator if any).")
def evaluate(model_path: Path, data_path: Path | None, tasks: str | None, split: str | None, seq_len: int | None,
             max_batches: int | None, include_path: Path | None, limit: int | None, num_fewshot: int | None,
             output: Path | None, overwrite: bool, allow_tokenizer_change: bool, batch_size: int,
             device: str | None) -> None:
    """Evaluate a model: held-out loss on a dataset (--data), or lm-evaluation-harness tasks (--tasks).

    Either way, a model inside a run directory gets one line in RUN_DIR/evals.jsonl (read by zaya report);
    --tasks also writes lm_eval's full results as JSON to RUN_DIR/evals/ (or --output)."""
    if (data_path is None) == (tasks is None):
        raise ZayaError("give exactly one of --data (held-out loss) and --tasks (lm-evaluation-harness tasks)")
    given = {"--split": split, "--seq-len": seq_len, "--max-batches": max_batches,
             "--allow-tokenizer-change": allow_tokenizer_change or None} if tasks is not None else {
        "--include-path": include_path, "--limit": limit, "--num-fewshot": num_fewshot, "--output": output,
        "--overwrite": overwrite or None}
    misplaced = [name for name, value in given.items() if value is not None]
    if misplaced:
        raise ZayaError(f"{', '.join(misplaced)} {'does' if len(misplaced) == 1 else 'do'} not apply to "
                        f"{'--tasks' if tasks is not None else '--data'}")
    from zaya.evals.heldout import check_task_sizes

    check_task_sizes(batch_size, limit, num_fewshot)  # before anything loads (--data's sizes: evaluate_model)
    if data_path is not None:
        from zaya.evals.heldout import evaluate_model

        result = evaluate_model(model_path, data_path, split=split or "val", seq_len=seq_len or 512,
                                batch_size=batch_size, max_batches=max_batches, device=device, record=True,
                                allow_tokenizer_change=allow_tokenizer_change,
                                say=lambda line: click.echo(f"zaya: {line}", err=True))
        click.echo(json.dumps(result, indent=2))
        return
    from zaya.evals.run import TaskRun, format_summary, parse_tasks, run_tasks

    run = TaskRun(model=model_path, tasks=parse_tasks(tasks), include_path=include_path, limit=limit,
                  num_fewshot=num_fewshot, batch_size=batch_size, device=device, output=output, overwrite=overwrite)
    done = run_tasks(run)
    click.echo(format_summary(done.summary))
    click.echo(f"wrote {done.results_file}" + (f"; appended {done.record_file}" if done.record_file else ""))


@cli.command()
@click.argument("run_dir", type=click.Path(path_type=Path))
def report(run_dir: Path) -> None:
    """Plots of a run's metrics and an index.html, written to RUN_DIR/report; the run's summary (steps, tokens,
    time, losses, throughput, memory, evaluations) and the incident timeline.

    RUN_DIR may also be a supervisor state directory: then only its incident timeline is shown."""
    from zaya.report.report import run_report
    from zaya.report.summary import format_text
    from zaya.resilience.incidents import timeline

    done = run_report(run_dir)  # every log read bounded; rows that cannot be used are counted in a warning
    for warning in done.warnings:
        click.echo(f"warning: {warning}", err=True)
    if done.report is not None:
        click.echo(f"wrote {done.report.index}\n{format_text(done.report.summary)}")
    if done.incidents:
        click.echo(f"incidents ({len(done.incidents)}):\n{timeline(done.incidents)}")


# ---- supervise ----------------------------------------------------------------------------------------


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--policy", "policy_file", type=click.Path(path_type=Path), default=None,
              help="A policy TOML file (default: the built-in policy).")
@click.option("--state-dir", type=click.Path(path_type=Path), default=None,
              help="Where incidents, heartbeats and logs go (default: RUN_DIR/supervisor, else ./supervisor).")
@click.option("--node", default=None, help="This node's name in the job (default: the host name).")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def supervise(policy_file: Path | None, state_dir: Path | None, node: str | None, command: tuple[str, ...]) -> None:
    """Run COMMAND (torchrun ... zaya train ..., or zaya train ...), watch it and recover on its own.

    Exit codes: 0 finished, 2 bad input, 3 no progress after K restarts, 4 stopped by policy,
    5 nothing left to run on."""
    from zaya.resilience.supervisor import supervise as run_supervisor

    code = run_supervisor(list(command), policy_file, state_dir, node, environ=os.environ)
    if code:
        raise click.exceptions.Exit(code)


@cli.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.argument("args", nargs=-1, type=click.UNPROCESSED, required=True, metavar="[TORCHRUN OPTIONS] COMMAND ARGS...")
def launch(args: tuple[str, ...]) -> None:
    """Run a zaya command on torchrun's workers: `zaya launch --nproc-per-node 8 train CONFIG`.

    The options are torchrun's own (`torchrun --help`), and every worker runs `python -m zaya.cli COMMAND ARGS`,
    as under `torchrun ... -m zaya.cli`. A signal (Ctrl-C, SIGTERM) or a failed worker ends it in one line
    instead of a traceback. Exit codes: 128 + the signal, the first failed worker's code, or 75 when every
    worker stopped early with a checkpoint."""
    from zaya.launcher import launch as run_launcher

    commands = sorted(name for name in cli.commands if name not in ("launch", "supervise"))
    code = run_launcher(args, commands, say=lambda line: click.echo(line, err=True))
    if code:
        raise click.exceptions.Exit(code)


def _mount_subsystem_groups() -> None:
    # Subsystems own their command groups; they join the top-level command here.
    from zaya.data_cli import data as data_group
    from zaya.plan.plan_cli import plan
    from zaya.plan.shapes_cli import shapes
    from zaya.resilience.diagnose_cli import diagnose

    if "data" not in cli.commands:
        cli.add_command(data_group)
    if "diagnose" not in cli.commands:
        cli.add_command(diagnose)
    for command in (plan, shapes):
        if command.name not in cli.commands:
            cli.add_command(command)


# what the operating system says of a path that is not what the command needs (a file where a directory must be
# made, a directory without the right to write, a loop of links, a name too long): the user's to fix, in one line
_PATH_ERRNOS = {errno.ENOTDIR, errno.EISDIR, errno.EACCES, errno.EPERM, errno.EEXIST, errno.ENOENT, errno.ELOOP,
                errno.ENAMETOOLONG, errno.ETXTBSY, errno.EMLINK, errno.EXDEV, errno.ENXIO}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `zaya` console script."""
    from zaya.owned import interrupt_on_sigterm

    _mount_subsystem_groups()
    interrupt_on_sigterm()  # SIGTERM unwinds like Ctrl-C: a command's own staging and lock go with it
    try:
        code = cli.main(args=argv, prog_name="zaya", standalone_mode=False)
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.exceptions.Abort:
        click.echo("zaya: aborted", err=True)
        return 130
    except click.ClickException as exc:  # click's own usage errors: its message and usage line, exit code 2
        exc.show()
        return exc.exit_code
    except ZayaError as exc:
        if not getattr(exc, "quiet", False):
            rank = int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0
            click.echo(f"zaya: error{f' (rank {rank})' if rank else ''}: {exc}", err=True)
        if isinstance(exc, StartupFailed):
            exc.reported()
        return EXIT_BAD_INPUT
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        error = storage_error(exc)
        if error is not None:
            click.echo(f"zaya: error: {storage_message(error)}", err=True)
            return 1  # not bad input: the same command works once the disk does
        if isinstance(exc, OSError) and exc.errno in _PATH_ERRNOS and exc.filename:  # a path that cannot be used so
            click.echo(f"zaya: error: {exc.filename}: {os_reason(exc)}", err=True)
            return EXIT_BAD_INPUT
        raise  # a bug: its traceback is what a report needs
    return code if isinstance(code, int) else 0  # a command's exit code (click returns it, unraised)


if __name__ == "__main__":
    sys.exit(main())
