"""Train-step throughput (forward + backward + optimizer) of zaya's model against transformers' ZAYA.

Both sides get the same weights, the same batches and the same optimizer (torch's fused AdamW); each computes
next-token cross-entropy its own way (ours: the fused chunked LM-head loss; the peer: logits, then
`cross_entropy` in fp32). Steps of the two sides alternate, so that drift in the machine's speed hits both
alike, and the medians are compared. The process keeps freed memory (`zaya.device.tune_host_allocator`),
which speeds up both sides alike. "ours, compiled" is the same model with every block `torch.compile`d
(`train.compile = true`, one graph per block); its compilation time is reported, not counted. `--only SIDE` times
one side alone, for comparisons between separate processes. Run:

    python benchmarks/train_step.py [--preset small] [--batch 8] [--seq 512] [--steps 6] [--warmup 2]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import time
import warnings

import torch
import torch.nn.functional as F

import zaya
from common import header, ratio_line
from zaya.device import measure_matmul_flops, tune_host_allocator
from zaya.model.flops import training_flops_per_token

warnings.filterwarnings("ignore")


def hf_twin(model: zaya.Zaya):
    """The transformers ZayaForCausalLM with `model`'s weights (exported and loaded the public way)."""
    from transformers import AutoModelForCausalLM

    directory = tempfile.mkdtemp() + "/hf"
    zaya.export_hf(model, directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


class Side:
    """One model, its optimizer and its loss; `step` runs one training step and returns its seconds."""

    def __init__(self, name: str, model, loss_fn):
        self.name, self.model, self.loss_fn = name, model, loss_fn
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        self.times: list[float] = []

    def step(self, batch: torch.Tensor, autocast: bool) -> None:
        start = time.perf_counter()
        context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with context:
            loss = self.loss_fn(self.model, batch)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.times.append(time.perf_counter() - start)


def ours_loss(model, batch: torch.Tensor) -> torch.Tensor:
    return model.loss(batch[:, :-1], batch[:, 1:])


def peer_loss(model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=6, help="measured steps per side")
    parser.add_argument("--warmup", type=int, default=2, help="unmeasured steps per side first")
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16 (autocast), fp32")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled variant")
    parser.add_argument("--only", choices=["ours", "peer", "ours, compiled"], default=None,
                        help="time one side alone (run once per side, in separate processes, and compare)")
    args = parser.parse_args()

    header(f"train step, preset {args.preset}, batch {args.batch} x {args.seq}")
    tune_host_allocator()
    # The peer computes its LM head under autocast like every other matmul; ours does the same here.
    config = zaya.get_preset(args.preset, fp32_logits=False, temp_init=1.0)
    ours = zaya.build_model(config, seed=0).train()
    peer = hf_twin(ours).train()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator) for _ in range(4)]
    tokens = args.batch * args.seq
    flops_per_step = training_flops_per_token(config, args.seq) * tokens
    print(f"# model FLOPs per step: {flops_per_step / 1e9:.1f} GFLOP (zaya.model.flops convention); "
          f"median of {args.steps} alternating steps per side")

    for name in args.dtypes.split(","):
        autocast = name == "bf16"
        peak = measure_matmul_flops(torch.device("cpu"), torch.bfloat16 if autocast else torch.float32)
        sides = [Side("ours", zaya.build_model(config, seed=0).train(), ours_loss), Side("peer", peer, peer_loss)]
        if not args.no_compile:
            compiled = zaya.build_model(config, seed=0).train()
            for block in compiled.blocks:
                block.compile(fullgraph=True)
            sides.append(Side("ours, compiled", compiled, ours_loss))
        if args.only is not None:
            sides = [side for side in sides if side.name == args.only]
        for i in range(args.steps + args.warmup):
            for side in sides:
                if side.name == "ours, compiled" and i == 0:
                    start = time.perf_counter()
                    side.step(batches[0], autocast)
                    print(f"# compilation (first compiled step): {time.perf_counter() - start:.1f} s")
                    continue
                side.step(batches[i % len(batches)], autocast)
        rate = {side.name: tokens / statistics.median(side.times[args.warmup:]) for side in sides}
        label = f"{name}{' autocast' if autocast else ''}"
        if args.only is not None:
            print(f"tokens/s, {label}, {args.only} alone: {rate[args.only]:,.1f} "
                  f"({tokens / rate[args.only]:.3f} s per step)")
        else:
            print(ratio_line(f"tokens/s, {label}", rate["ours"], rate["peer"], "tok/s"))
        if "ours, compiled" in rate and "peer" in rate:
            print(ratio_line(f"tokens/s, {label}, ours compiled", rate["ours, compiled"], rate["peer"], "tok/s"))
        for side in sides:
            achieved = flops_per_step * rate[side.name] / tokens
            print(f"  {side.name:<15} {achieved / 1e9:7.1f} GFLOP/s = {achieved / peak:5.1%} of the measured "
                  f"{name} matmul peak ({peak / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
