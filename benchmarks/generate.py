"""Greedy generation tokens/s of zaya against transformers' `generate` on the same weights.

Batch 1, a 32-token prompt, 128 new tokens, `tiny` preset by default, fp32, both sides greedy and
without early stopping. Run:

    python benchmarks/generate.py [--preset tiny] [--prompt 32] [--new 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
import warnings

import torch

import zaya
from common import header, ratio_line, time_it
from zaya.device import measure_matmul_flops
from zaya.infer.generate import generate
from zaya.model.flops import forward_flops_per_token

warnings.filterwarnings("ignore")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    header(f"greedy generation, preset {args.preset}, batch 1, prompt {args.prompt}, {args.new} new tokens, fp32")
    ours = zaya.build_model(zaya.get_preset(args.preset, temp_init=1.0), seed=0).eval()
    directory = tempfile.mkdtemp() + "/hf"
    zaya.export_hf(ours, directory)
    peer = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = torch.randint(0, ours.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))

    ours_ids = generate(ours, prompt, args.new)
    with torch.inference_mode():
        peer_ids = peer.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[:, args.prompt:]
    agree = int((ours_ids == peer_ids).all(dim=0).long().cumprod(0).sum())
    print(f"# identical greedy tokens before the first difference: {agree} of {args.new}")

    ours_s = time_it(lambda: generate(ours, prompt, args.new), repeats=args.repeats)

    def peer_run():
        with torch.inference_mode():
            peer.generate(prompt, max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                          eos_token_id=None, pad_token_id=0)

    peer_s = time_it(peer_run, repeats=args.repeats)
    print(ratio_line("generated tokens/s", args.new / ours_s, args.new / peer_s, "tok/s"))
    peak = measure_matmul_flops(torch.device("cpu"), torch.float32)
    flops = forward_flops_per_token(ours.config, args.prompt + args.new) * (args.prompt + args.new)
    for side, seconds in (("ours", ours_s), ("peer", peer_s)):
        print(f"  {side}: {flops / seconds / 1e9:6.2f} GFLOP/s = {flops / seconds / peak:6.2%} of measured fp32 "
              f"matmul peak ({peak / 1e9:.0f} GFLOP/s); batch-1 decoding is bound by per-token overhead")


if __name__ == "__main__":
    main()
