"""Train-step throughput (forward + backward + optimizer) of zaya's model against transformers' ZAYA.

Both sides get the same weights, the same batches, the same loss (next-token cross-entropy in fp32) and the
same optimizer (torch AdamW, foreach); only the model implementation differs. Run:

    python benchmarks/train_step.py [--preset small] [--batch 8] [--seq 512] [--steps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
import warnings

import torch
import torch.nn.functional as F

import zaya
from common import header, ratio_line, time_it
from zaya.device import measure_matmul_flops
from zaya.model.flops import training_flops_per_token

warnings.filterwarnings("ignore")


def hf_twin(model: zaya.Zaya):
    """The transformers ZayaForCausalLM with `model`'s weights (exported and loaded the public way)."""
    from transformers import AutoModelForCausalLM

    directory = tempfile.mkdtemp() + "/hf"
    zaya.export_hf(model, directory)
    return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)


def train_step(forward, optimizer, batch: torch.Tensor, autocast: bool) -> None:
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        logits = forward(batch[:, :-1])
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtypes", default="bf16,fp32", help="comma-separated: bf16 (autocast), fp32")
    args = parser.parse_args()

    header(f"train step, preset {args.preset}, batch {args.batch} x {args.seq}")
    # The peer computes its LM head under autocast like every other matmul; ours does the same here.
    config = zaya.get_preset(args.preset, fp32_logits=False, temp_init=1.0)
    ours = zaya.build_model(config, seed=0).train()
    peer = hf_twin(ours).train()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=generator) for _ in range(4)]
    tokens = args.batch * args.seq
    flops_per_step = training_flops_per_token(config, args.seq) * tokens
    print(f"# model FLOPs per step: {flops_per_step / 1e9:.1f} GFLOP (zaya.model.flops convention)")

    for name in args.dtypes.split(","):
        autocast = name == "bf16"
        peak = measure_matmul_flops(torch.device("cpu"), torch.bfloat16 if autocast else torch.float32)
        results = {}
        for side, model in (("ours", ours), ("peer", peer)):
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
            forward = model if side == "ours" else (lambda ids, m=model: m(input_ids=ids).logits)
            state = iter(range(10**9))

            def step(forward=forward, optimizer=optimizer, state=state, autocast=autocast):
                train_step(forward, optimizer, batches[next(state) % len(batches)], autocast)

            results[side] = time_it(step, repeats=args.steps, warmup=1)
        ours_tps, peer_tps = tokens / results["ours"], tokens / results["peer"]
        print(ratio_line(f"tokens/s, {name}{' autocast' if autocast else ''}", ours_tps, peer_tps, "tok/s"))
        for side in ("ours", "peer"):
            achieved = flops_per_step / results[side]
            print(f"  {side}: {achieved / 1e9:7.1f} GFLOP/s = {achieved / peak:5.1%} of measured {name} matmul peak "
                  f"({peak / 1e9:.0f} GFLOP/s)")


if __name__ == "__main__":
    main()
