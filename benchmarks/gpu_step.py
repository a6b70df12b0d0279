"""One accelerator at the production settings, in a few minutes: the training step of `zaya train` on the
`zaya1-base` shapes cut to 16 blocks (the full width, 262k vocabulary and 16 experts; about 4B parameters, so
that the model, its gradients and its optimizer state fit one device), sequence 4096, bf16 autocast with the
bf16 LM head (fp32 softmax and loss), every block compiled, FSDP2 on a one-rank mesh. It prints, and writes
as JSON:

- tokens/s per GPU and MFU: model FLOPs per token by `zaya.model.flops` (6 x the active parameters a token
  multiplies with, the LM head included, plus causal attention, 3 x 4 H d (T + 1) / 2 per token and layer)
  over the device's dense bf16 peak (the device table; measured where the device is not in it);
- peak memory; the optimizer's share of the step (device-timed); host syncs per step (counted by CUDA's
  sync debug mode over the timed steps); the graphs compiled and the graph breaks;
- one grouped GEMM (the experts' gate/up projection, tokens spread evenly) against one dense GEMM of the same
  FLOPs.

    PYTHONPATH=src python3 benchmarks/gpu_step.py [--steps 8] [--layers 16] [--seq 4096] [--json out.json]

It needs torch with CUDA or ROCm, numpy and tokenizers (the dataset is built from the Python standard library);
nothing else. `--device cpu --preset micro --seq 64` runs the same script on a CPU, to try it.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from common import machine
from trainer_overhead import make_dataset
from zaya.config import load_config
from zaya.device import synchronize
from zaya.model.presets import get_preset
from zaya.plan.devices import peak_flops
from zaya.training import build_trainer


def write_config(path: Path, data: Path, args: argparse.Namespace) -> Path:
    path.write_text(f"""
[model]
preset = "{args.preset}"
num_hidden_layers = {args.layers}
fp32_logits = false
[data]
path = "{data}"
seq_len = {args.seq}
[train]
max_steps = 1000
micro_batch_size = {args.batch}
global_batch_size = {args.batch}
precision = "bf16"
compile = {"true" if args.compile else "false"}
device = "{args.device}"
eval_every = 0
[checkpoint]
every = 1000
[logging]
log_every = 1000
tensorboard = false
progress = false
""", encoding="utf-8")
    return path


def gemm_comparison(device: torch.device, tokens: int, hidden: int, ffn: int, experts: int, repeats: int = 20) -> dict:
    """The experts' gate/up projection as one grouped GEMM (tokens spread evenly over the experts) and a dense
    GEMM of the same FLOPs ([tokens, D] x [D, 2F]), bf16, in TFLOP/s."""
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    w = torch.randn(experts, 2 * ffn, hidden, device=device, dtype=torch.bfloat16)
    dense = torch.randn(2 * ffn, hidden, device=device, dtype=torch.bfloat16)
    offsets = torch.arange(1, experts + 1, device=device, dtype=torch.int32) * (tokens // experts)
    flops = 2.0 * (tokens // experts * experts) * hidden * 2 * ffn

    def timed(fn) -> float:
        for _ in range(3):
            fn()
        synchronize(device)
        started = time.perf_counter()
        for _ in range(repeats):
            fn()
        synchronize(device)
        return flops * repeats / (time.perf_counter() - started) / 1e12

    grouped = timed(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets))
    plain = timed(lambda: x @ dense.t())
    return {"grouped_tflops": grouped, "dense_tflops": plain, "grouped_over_dense": grouped / plain}


def count_syncs(device: torch.device, fn) -> int | None:
    """Host syncs while `fn` runs (CUDA and ROCm: the sync debug mode warns at each one); None on a CPU."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="zaya1-base")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1, help="sequences per step (one micro-batch)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps, after --warmup")
    parser.add_argument("--warmup", type=int, default=3, help="steps left out (the first compiles)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(f"# gpu_step.py  date {time.strftime('%Y-%m-%d')}  machine: {machine()}")
    print(f"# {args.preset} with {args.layers} blocks, {args.batch} x {args.seq} tokens a step, bf16, bf16 LM head, "
          f"compile {'on' if args.compile else 'off'}")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_dataset(root, min(8192, get_preset(args.preset).vocab_size), val_fraction=0.01, workers=4)
        trainer = build_trainer(load_config(write_config(root / "run.toml", data, args)), root / "run")
        try:
            with trainer.stops.request:
                trainer._build()  # the run's model, optimizer and data, without its checkpoints and metrics files
                built = time.perf_counter() - started
                counters.clear()
                for _ in range(args.warmup):
                    trainer.train_step()
                synchronize(device)
                warm = time.perf_counter() - started
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                timers, losses = [], []

                def steps() -> None:
                    for _ in range(args.steps):
                        losses.append(trainer.train_step()["loss"])
                        timers.append(trainer.optimizer_timer)

                synchronize(device)
                t0 = time.perf_counter()
                syncs = count_syncs(device, steps)
                if syncs is None:
                    steps()
                synchronize(device)
                seconds = (time.perf_counter() - t0) / args.steps
                optimizer = sum(t.seconds() for t in timers) / args.steps
                flops_per_token = trainer.curriculum.flops_per_token
                config = trainer.config.model
        finally:
            trainer.curriculum.close()
            if trainer.parallel is not None:
                trainer.parallel.close()
        tokens = args.batch * args.seq
        tokens_per_s = tokens / seconds
        peak, source = peak_flops(device, torch.bfloat16)
        result = {
            "date": time.strftime("%Y-%m-%d"), "machine": machine(), "preset": args.preset, "layers": args.layers,
            "seq_len": args.seq, "batch": args.batch, "compile": args.compile,
            "step_s": seconds, "tokens_per_s": tokens_per_s, "flops_per_token": flops_per_token,
            "peak_flops": peak, "peak_source": source, "mfu": tokens_per_s * flops_per_token / peak,
            "peak_memory_gib": (torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None),
            "optimizer_s": optimizer, "optimizer_share": optimizer / seconds,
            "host_syncs_per_step": None if syncs is None else syncs / args.steps,
            "graphs": counters["stats"]["unique_graphs"], "graph_breaks": sum(counters["graph_break"].values()),
            "loss_first_last": [losses[0], losses[-1]],
            "built_s": built, "warm_s": warm,
            "gemm": gemm_comparison(device, tokens, config.hidden_size, config.moe_intermediate_size,
                                    config.num_experts),
        }
    result["total_s"] = time.perf_counter() - started
    g = result["gemm"]
    print(f"tokens/s per GPU        {tokens_per_s:,.0f}   ({seconds:.3f} s a step)")
    print(f"MFU                     {result['mfu']:.1%}   ({flops_per_token / 1e9:.2f} GFLOP/token, peak "
          f"{peak / 1e12:.0f} TFLOP/s, {source})")
    if result["peak_memory_gib"] is not None:
        print(f"peak memory             {result['peak_memory_gib']:.1f} GiB")
    print(f"optimizer share         {result['optimizer_share']:.1%}   ({optimizer:.3f} s a step)")
    print(f"host syncs per step     {'n/a on a CPU' if syncs is None else f'{syncs / args.steps:g}'}")
    print(f"graphs compiled         {result['graphs']}   (graph breaks {result['graph_breaks']})")
    print(f"grouped GEMM            {g['grouped_tflops']:.1f} TFLOP/s against dense {g['dense_tflops']:.1f} "
          f"({g['grouped_over_dense']:.2f}x)")
    print(f"time                    built {built:.0f} s, warm (compiled) {warm:.0f} s, all {result['total_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
