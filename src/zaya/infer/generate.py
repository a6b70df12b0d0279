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
    """How the next token is picked, in transformers' order: the logits of tokens already in the sequence (prompt
    included) divided by `repetition_penalty` where positive and multiplied by it where negative (CTRL's penalty;
    1: none); then greedy (argmax), or sampled at `temperature` from the `top_k` most likely tokens (0: all) and
    of those the top-p nucleus."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ZayaError(f"temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ZayaError(f"top-p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ZayaError(f"top-k must be a non-negative integer, got {self.top_k!r}")
        if not self.repetition_penalty > 0 or self.repetition_penalty == float("inf"):
            raise ZayaError(f"repetition-penalty must be a positive number, got {self.repetition_penalty}")

    def penalise(self, logits_BV: torch.Tensor, seen_BV: torch.Tensor | None) -> torch.Tensor:
        """The logits with the repetition penalty applied to the tokens marked in `seen_BV` [B, V] (bool)."""
        if self.repetition_penalty == 1.0 or seen_BV is None:
            return logits_BV
        penalised = torch.where(logits_BV < 0, logits_BV * self.repetition_penalty,
                                logits_BV / self.repetition_penalty)
        return torch.where(seen_BV, penalised, logits_BV)


def check_prompt(prompt_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse empty prompts and ids outside the vocabulary with one clear line."""
    if prompt_ids.ndim != 2 or prompt_ids.shape[1] == 0:
        raise ZayaError("the prompt is empty")
    bad = prompt_ids[(prompt_ids < 0) | (prompt_ids >= vocab_size)]
    if bad.numel():
        raise ZayaError(f"prompt id {int(bad[0])} is outside the model's vocabulary (0..{vocab_size - 1})")


def distribution(logits_BV: torch.Tensor, sampling: Sampling, seen_BV: torch.Tensor | None = None) -> torch.Tensor:
    """The probabilities [B, V] a sampled token is drawn from (see `Sampling`): zero outside the top-k and the
    nucleus, which keeps the smallest set of most likely tokens whose mass reaches top_p (at least one)."""
    scaled = sampling.penalise(logits_BV.float(), seen_BV) / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
        scaled = scaled.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return torch.softmax(scaled, dim=-1)


def next_token(logits_BV: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
               seen_BV: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token per row from last-position logits [B, V]; `seen_BV` marks the tokens each row has had, for
    the repetition penalty."""
    if sampling.greedy:
        return sampling.penalise(logits_BV.float(), seen_BV).argmax(dim=-1)
    return torch.multinomial(distribution(logits_BV, sampling, seen_BV), 1, generator=generator).squeeze(-1)


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
                       on_token=on_token, prompt_ids=prompt_ids)


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
    prompt_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token loop of `generate` once the prompt's last logits [B, V] are known: pick a token, stop at eos
    or after `max_new_tokens`, else `step(token)` for the next logits. Returns the tokens [B, n]. The
    repetition penalty counts the `prompt_ids` [B, T] and the tokens picked.

    `agree` maps each picked token [B] to the one every process uses (a sharded decoder broadcasts one
    rank's choice, so that ranks whose logits differ in the last bit cannot drift apart)."""
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    seen = None
    if sampling.repetition_penalty != 1.0:
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        if prompt_ids is not None:
            seen.scatter_(1, prompt_ids.to(seen.device), True)
    out = []
    for i in range(max_new_tokens):
        token = next_token(logits, sampling, generator, seen)
        if agree is not None:
            token = agree(token)
        if seen is not None:
            seen.scatter_(1, token[:, None], True)
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
