"""`make demo`: build a tiny ZAYA1-style model, report its parameters, and generate from it.

(The trainer turns this into the full demo: build data, train, sample, report.)
"""

from __future__ import annotations

import time

import torch

import zaya
from zaya.infer.generate import generate
from zaya.model.params import parameter_report


def main() -> None:
    for preset in ("tiny", "zaya1-base"):
        print(f"== parameters of the '{preset}' preset (counted on the meta device)")
        print(parameter_report(zaya.get_preset(preset)).format())
        print()
    model = zaya.build_model("tiny", seed=0).eval()
    prompt = torch.tensor([[2, 17, 42, 7]])
    start = time.perf_counter()
    new = generate(model, prompt, 24)
    seconds = time.perf_counter() - start
    print(f"== greedy continuation of {prompt[0].tolist()} by an untrained 'tiny' model")
    print(",".join(map(str, new[0].tolist())))
    print(f"({new.shape[1]} tokens in {seconds:.2f} s)")


if __name__ == "__main__":
    main()
