"""Autoregressive generation with the compressed decode cache: one prefill pass, then one token per step.

Each step runs the model on a single new token; the attention layers read their cached keys/values and
convolution/value-shift states, so the work per token besides attention itself is constant.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from zaya.errors import ZayaError
from zaya.infer.static import CompiledDecoder, StaticCache, round_capacity
from zaya.model.transformer import Zaya


@dataclass
class Sampling:
    """How the next token is picked: greedy (argmax), or sampled at `temperature` from the top-p nucleus."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ZayaError(f"temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ZayaError(f"top-p must be in (0, 1], got {self.top_p}")


def check_prompt(prompt_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse empty prompts and ids outside the vocabulary with one clear line."""
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] == 0:
        raise ZayaError("the prompt is empty")
    bad = prompt_ids[(prompt_ids < 0) | (prompt_ids >= vocab_size)]
    if bad.numel():
        raise ZayaError(f"prompt id {int(bad[0])} is outside the model's vocabulary (0..{vocab_size - 1})")


def next_token(logits_BV: torch.Tensor, sampling: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """Pick one token per row from last-position logits [B, V]."""
    if sampling.greedy:
        return logits_BV.argmax(dim=-1)
    probs = torch.softmax(logits_BV.float() / sampling.temperature, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (the first token always stays)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
        sorted_probs = sorted_probs.masked_fill(outside, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return order.gather(-1, choice).squeeze(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(
    model: Zaya,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    *,
    eos_token_id: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    decoder: CompiledDecoder | None = None,
) -> torch.Tensor:
    """Continue each row of `prompt_ids` [B, T] by up to `max_new_tokens` tokens; returns [B, n].

    Generation stops early once every row has produced `eos_token_id` (later positions of finished rows
    repeat it). `on_token` receives each step's new tokens [B] as they are produced. With a `decoder` (a
    `CompiledDecoder` of this model) the steps after the prompt run as one compiled graph each, on a cache of
    fixed capacity; the tokens are the same.
    """
    sampling = sampling or Sampling()
    if max_new_tokens < 0:
        raise ZayaError(f"max-new-tokens must be >= 0, got {max_new_tokens}")
    if decoder is not None and decoder.model is not model:
        raise ZayaError("the compiled decoder belongs to another model")
    device = model.embed.weight.device
    prompt_ids = prompt_ids.to(device)
    check_prompt(prompt_ids, model.config.vocab_size)
    generator = None
    if sampling.seed is not None:
        generator = torch.Generator(device=device).manual_seed(sampling.seed)

    cache = model.new_cache()
    hidden = model.hidden_states(prompt_ids, cache)
    logits = model.logits(hidden[:, -1])
    if decoder is None:
        def step(token: torch.Tensor) -> torch.Tensor:
            return model.logits(model.hidden_states(token[:, None], cache)[:, -1])
    else:
        static = StaticCache.from_cache(cache, round_capacity(prompt_ids.shape[1] + max_new_tokens))
        position = torch.tensor(prompt_ids.shape[1], device=device)

        def step(token: torch.Tensor) -> torch.Tensor:
            logits = decoder(token, position, static)
            position.add_(1)
            return logits

    return decode_loop(logits, step, max_new_tokens, sampling, generator, eos_token_id=eos_token_id,
                       on_token=on_token)


def decode_loop(
    logits: torch.Tensor,
    step: Callable[[torch.Tensor], torch.Tensor],
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator | None,
    *,
    eos_token_id: int | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """The token loop of `generate` once the prompt's last logits [B, V] are known: pick a token, stop at eos
    or after `max_new_tokens`, else `step(token)` for the next logits. Returns the tokens [B, n].

    `agree` maps each picked token [B] to the one every process uses (a sharded decoder broadcasts one
    rank's choice, so that ranks whose logits differ in the last bit cannot drift apart)."""
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    out = []
    for i in range(max_new_tokens):
        token = next_token(logits, sampling, generator)
        if agree is not None:
            token = agree(token)
        if eos_token_id is not None:
            token = token.masked_fill(finished, eos_token_id)
            finished |= token == eos_token_id
        out.append(token)
        if on_token is not None:
            on_token(token)
        if i == max_new_tokens - 1 or (eos_token_id is not None and bool(finished.all())):
            break
        logits = step(token)
    if not out:
        return torch.zeros(logits.shape[0], 0, dtype=torch.long, device=logits.device)
    return torch.stack(out, dim=1)
