"""Greedy generation tokens/s of zaya against transformers' `generate` on the same weights.

Batch 1, a 32-token prompt, 128 new tokens, `tiny` preset by default, fp32, both sides greedy and
without early stopping. Ours runs twice: eager, and with the compiled decode step (`zaya generate
--compile`; its one-time compilation is timed apart). The three are timed in interleaved rounds and the
medians compared. Run:

    python benchmarks/generate.py [--preset tiny] [--prompt 32] [--new 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable

import torch

import zaya
from common import header, ratio_line
from zaya.device import measure_matmul_flops
from zaya.infer.generate import generate
from zaya.infer.static import CompiledDecoder
from zaya.model.flops import forward_flops_per_token

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    header(f"greedy generation, preset {args.preset}, batch 1, prompt {args.prompt}, {args.new} new tokens, fp32")
    ours = zaya.build_model(zaya.get_preset(args.preset, temp_init=1.0), seed=0).eval()
    directory = tempfile.mkdtemp() + "/hf"
    zaya.export_hf(ours, directory)
    peer = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.randint(0, ours.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    def peer_run() -> torch.Tensor:
        with torch.inference_mode():
            return peer.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[:, args.prompt:]

    decoder = CompiledDecoder(ours)
    start = time.perf_counter()
    compiled_ids = generate(ours, prompt, args.new, decoder=decoder)
    print(f"# compiling the decode step (once per model and shape): {time.perf_counter() - start:.1f} s")
    peer_ids = peer_run()
    for name, ids in (("eager", generate(ours, prompt, args.new)), ("compiled", compiled_ids)):
        agree = int((ids == peer_ids).all(dim=0).long().cumprod(0).sum())
        print(f"# {name}: identical greedy tokens before the first difference: {agree} of {args.new}")

    sides = {
        "eager": lambda: generate(ours, prompt, args.new),
        "compiled": lambda: generate(ours, prompt, args.new, decoder=decoder),
        "peer": peer_run,
    }
    seconds = interleaved_medians(sides, args.repeats)
    print(ratio_line("generated tokens/s, zaya eager", args.new / seconds["eager"], args.new / seconds["peer"],
                     "tok/s"))
    print(ratio_line("generated tokens/s, zaya compiled decode step", args.new / seconds["compiled"],
                     args.new / seconds["peer"], "tok/s") + "  (target >= 5x: "
          f"{'met' if seconds['peer'] / seconds['compiled'] >= 5 else 'NOT met'})")
    peak = measure_matmul_flops(torch.device("cpu"), torch.float32)
    flops = forward_flops_per_token(ours.config, args.prompt + args.new) * (args.prompt + args.new)
    for side, time_s in seconds.items():
        print(f"  {side:>8}: {flops / time_s / 1e9:6.2f} GFLOP/s = {flops / time_s / peak:6.2%} of measured fp32 "
              f"matmul peak ({peak / 1e9:.0f} GFLOP/s); batch-1 decoding is bound by per-token overhead")


def interleaved_medians(sides: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Median seconds of each side over `repeats` rounds that run every side once, after one warm-up round:
    interleaving spreads the machine's slow and fast spells over all sides alike."""
    samples: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(repeats + 1):
        for name, fn in sides.items():
            start = time.perf_counter()
            fn()
            if round_:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in samples.items()}


if __name__ == "__main__":
    main()
