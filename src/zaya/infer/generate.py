"""Autoregressive generation with the compressed decode cache: one prefill pass, then one token per step.

Each step runs the model on a single new token; the attention layers read their cached keys/values and
convolution/value-shift states, so the work per token besides attention itself is constant.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from zaya.errors import ZayaError
from zaya.infer.static import CompiledDecoder, StaticCache, round_capacity
from zaya.model.config import SIZE_LIMITS, ZayaConfig
from zaya.model.transformer import Zaya
from zaya.schema import shown

# Sampling is computed in fp32 on logits shifted so that the best allowed one is 0 (see `distribution`), which is
# safe for any temperature above fp32's smallest normal number; the bounds are what is useful. At 0.001 a logit
# gap of 0.01 is already a factor e^10: anything colder is greedy decoding, which --greedy says plainly. Above
# 100 every distribution a model makes is close to uniform. A repetition penalty beyond 100 (or below 0.01)
# scales a logit past any difference a model's logits have.
TEMPERATURE_RANGE = (1e-3, 100.0)
PENALTY_RANGE = (1e-2, 100.0)
MAX_TOP_K = SIZE_LIMITS["vocab_size"]  # no model has more tokens to choose from
MAX_SEED = 2**63 - 1  # torch's generators take a 64-bit seed; the run config's train.seed has this bound too
MAX_TOKEN_ID = SIZE_LIMITS["vocab_size"] - 1  # above any model's vocabulary, known before a model is loaded
MAX_POSITIONS = SIZE_LIMITS["max_position_embeddings"]  # the longest sequence any model may have
_FP32_MAX = torch.finfo(torch.float32).max


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_sampling(*, greedy: bool = True, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
                   repetition_penalty: float = 1.0, seed: int | None = None, prefix: str = "") -> None:
    """Refuse a sampling parameter outside its range with one line naming it (`prefix` + its name: "--" for the
    command's flags) and the range."""
    greedy_hint = "--greedy" if prefix else "greedy=True"
    low, high = TEMPERATURE_RANGE
    if not isinstance(greedy, bool):
        raise ZayaError(f"{prefix}greedy must be True or False, got {shown(greedy)}")
    if not (_real(temperature) and low <= temperature <= high):
        raise ZayaError(f"{prefix}temperature must be a number in [{low:g}, {high:g}] ({greedy_hint} picks the "
                        f"most likely token), got {shown(temperature)}")
    if not (_real(top_p) and 0 < top_p <= 1):
        raise ZayaError(f"{prefix}top-p must be a number in (0, 1], got {shown(top_p)}")
    if not (_integer(top_k) and 0 <= top_k <= MAX_TOP_K):
        raise ZayaError(f"{prefix}top-k must be an integer in 0..{MAX_TOP_K:,} (0: every token), got {shown(top_k)}")
    low, high = PENALTY_RANGE
    if not (_real(repetition_penalty) and low <= repetition_penalty <= high):
        raise ZayaError(f"{prefix}repetition-penalty must be a number in [{low:g}, {high:g}] (1: none), got "
                        f"{shown(repetition_penalty)}")
    if seed is not None and not (_integer(seed) and 0 <= seed <= MAX_SEED):
        raise ZayaError(f"{prefix}seed must be an integer in 0..2**63-1, got {shown(seed)}")


@dataclass
class Sampling:
    """How the next token is picked, in transformers' order: the logits of tokens already in the sequence (prompt
    included) divided by `repetition_penalty` where positive and multiplied by it where negative (CTRL's penalty;
    1: none); then greedy (argmax), or sampled at `temperature` from the `top_k` most likely tokens (0: all) and
    of those the top-p nucleus. The ranges are `check_sampling`'s."""

    greedy: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        check_sampling(greedy=self.greedy, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                       repetition_penalty=self.repetition_penalty, seed=self.seed)

    def penalise(self, logits_BV: torch.Tensor, seen_BV: torch.Tensor | None) -> torch.Tensor:
        """The logits with the repetition penalty applied to the tokens marked in `seen_BV` [B, V] (bool)."""
        if self.repetition_penalty == 1.0 or seen_BV is None:
            return logits_BV
        penalised = torch.where(logits_BV < 0, logits_BV * self.repetition_penalty,
                                logits_BV / self.repetition_penalty)
        return torch.where(seen_BV, penalised, logits_BV)


def check_prompt(prompt_ids: torch.Tensor, vocab_size: int) -> None:
    """Refuse empty prompts and ids outside the vocabulary with one clear line."""
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.ndim != 2:
        raise ZayaError(f"the prompt must be a [batch, length] tensor of token ids, got "
                        f"{tuple(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else shown(prompt_ids)}")
    if prompt_ids.dtype.is_floating_point or prompt_ids.dtype.is_complex or prompt_ids.dtype == torch.bool:
        raise ZayaError(f"the prompt's token ids must be integers, got {prompt_ids.dtype}")
    if prompt_ids.shape[0] == 0 or prompt_ids.shape[1] == 0:
        raise ZayaError("the prompt is empty")
    bad = prompt_ids[(prompt_ids < 0) | (prompt_ids >= vocab_size)]
    if bad.numel():
        raise ZayaError(f"prompt id {int(bad[0])} is outside the model's vocabulary (0..{vocab_size - 1})")


def check_token_ids(ids: list[int], prefix: str = "") -> None:
    """Refuse, before any model is loaded, more prompt ids than any model has positions, and an id outside
    any vocabulary (one beyond int64 would overflow `torch.tensor`)."""
    if len(ids) > MAX_POSITIONS:
        raise ZayaError(f"{prefix}prompt-ids holds {len(ids):,} ids, more than any model's positions "
                        f"({MAX_POSITIONS:,})")
    bad = next((i for i in ids if not (_integer(i) and 0 <= i <= MAX_TOKEN_ID)), None)
    if bad is not None:
        raise ZayaError(f"{prefix}prompt-ids: {shown(bad)} is not a token id (0..{MAX_TOKEN_ID:,}, the largest "
                        "vocabulary a model may have)")


def check_max_new_tokens(max_new_tokens: int, prefix: str = "") -> None:
    """Refuse a count of new tokens that is not an integer in 0..MAX_POSITIONS (no model has more)."""
    if not (_integer(max_new_tokens) and 0 <= max_new_tokens <= MAX_POSITIONS):
        raise ZayaError(f"{prefix}max-new-tokens must be an integer in 0..{MAX_POSITIONS:,} (the longest sequence "
                        f"a model may have), got {shown(max_new_tokens)}")


def check_length(config: ZayaConfig, prompt_len: int, max_new_tokens: int, prefix: str = "") -> None:
    """Refuse a prompt, or a prompt and its continuation, longer than the model's `max_position_embeddings`,
    before anything is allocated for it (a compiled decoder's cache is sized for the whole sequence)."""
    check_max_new_tokens(max_new_tokens, prefix)
    limit = config.max_position_embeddings
    if prompt_len > limit:
        raise ZayaError(f"the prompt has {prompt_len:,} tokens, more than the model's max_position_embeddings "
                        f"({limit:,})")
    if prompt_len + max_new_tokens > limit:
        raise ZayaError(f"the prompt's {prompt_len:,} tokens and {prefix}max-new-tokens {max_new_tokens:,} make "
                        f"{prompt_len + max_new_tokens:,}, more than the model's max_position_embeddings "
                        f"({limit:,}): at most {limit - prompt_len:,} new tokens fit")


def check_allowed(allowed_V: torch.Tensor | None, vocab_size: int) -> None:
    """Refuse a mask of allowed ids that is not [vocab_size] bool with at least one id allowed."""
    if allowed_V is None:
        return
    if not isinstance(allowed_V, torch.Tensor) or allowed_V.dtype != torch.bool or allowed_V.shape != (vocab_size,):
        raise ZayaError(f"the allowed ids must be a bool tensor of shape ({vocab_size},)")
    if not bool(allowed_V.any()):
        raise ZayaError("no token id is allowed")


BROKEN_LOGITS = ("the model's logits hold NaN or infinity (damaged weights, or an overflow in its dtype): no token "
                 "can be picked")


def broken_rows(logits_BV: torch.Tensor) -> torch.Tensor:
    """[B] bool: rows a model cannot have given (NaN or +inf anywhere, or nothing above -inf), computed on the
    device: the decode loop gathers them and reads them once, at its end, so that no step waits for the host."""
    return ~torch.isfinite(logits_BV.float().amax(dim=-1))  # amax is NaN or +inf with any NaN or +inf in the row


def _prepared(logits_BV: torch.Tensor, sampling: Sampling, seen_BV: torch.Tensor | None,
              allowed_V: torch.Tensor | None, broken_B: torch.Tensor | None = None) -> torch.Tensor:
    """The logits in fp32, penalised, finite, and -inf where not allowed. A broken row (`broken_rows`, unless the
    caller has them as `broken_B` already) is made uniform, so that `multinomial` never sees NaN (on a GPU that is a
    device-side assert that ends the process); `decode_loop` refuses the whole generation once it has ended."""
    logits = logits_BV.float()
    logits = logits.masked_fill((broken_rows(logits) if broken_B is None else broken_B)[:, None], 0.0)
    # a huge penalised logit saturates instead of overflowing; a -inf the model gave stays far below the others
    logits = sampling.penalise(logits, seen_BV).clamp(-_FP32_MAX, _FP32_MAX)
    if allowed_V is not None:
        logits = logits.masked_fill(~allowed_V.to(logits.device), float("-inf"))
    return logits


def distribution(logits_BV: torch.Tensor, sampling: Sampling, seen_BV: torch.Tensor | None = None,
                 allowed_V: torch.Tensor | None = None, broken_B: torch.Tensor | None = None) -> torch.Tensor:
    """The probabilities [B, V] a sampled token is drawn from (see `Sampling`): zero outside the top-k and the
    nucleus, which keeps the smallest set of most likely tokens whose mass reaches top_p (at least one), and zero
    for ids that `allowed_V` [V] (bool) leaves out.

    The logits are shifted so that the largest allowed one is 0 before the temperature divides them: every
    scaled logit is <= 0 and one is 0, so no temperature makes an overflow (inf - inf) or a 0/0, and the
    softmax always has a token of weight 1 to normalise by."""
    logits = _prepared(logits_BV, sampling, seen_BV, allowed_V, broken_B)
    scaled = (logits - logits.amax(dim=-1, keepdim=True)) / sampling.temperature
    if 0 < sampling.top_k < scaled.shape[-1]:
        kth = scaled.topk(sampling.top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        outside = sorted_probs.cumsum(dim=-1) - sorted_probs >= sampling.top_p
        outside[:, 0] = False  # the most likely token stays, however small top_p is
        scaled = scaled.masked_fill(outside.scatter(-1, order, outside), float("-inf"))
    return torch.softmax(scaled, dim=-1)


def next_token(logits_BV: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
               seen_BV: torch.Tensor | None = None, allowed_V: torch.Tensor | None = None,
               broken_B: torch.Tensor | None = None) -> torch.Tensor:
    """Pick one token per row from last-position logits [B, V]; `seen_BV` marks the tokens each row has had, for
    the repetition penalty; `allowed_V` [V] (bool), if given, the only ids that may be picked; `broken_B`: the
    rows' `broken_rows`, if the caller has them."""
    if sampling.greedy:
        return _prepared(logits_BV, sampling, seen_BV, allowed_V, broken_B).argmax(dim=-1)
    return torch.multinomial(distribution(logits_BV, sampling, seen_BV, allowed_V, broken_B), 1,
                             generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(
    model: Zaya,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    sampling: Sampling | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    decoder: CompiledDecoder | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Continue each row of `prompt_ids` [B, T] by up to `max_new_tokens` tokens; returns [B, n].

    Generation stops early once every row has produced `eos_token_id`, or one of its ids if it is several (a chat
    model's end of turn and end of document, as transformers takes a list); later positions of a finished row
    repeat the id it ended with. `on_token` receives each step's new tokens [B] as they are produced. With a
    `decoder` (a `CompiledDecoder` of this model) the steps after the prompt run as one compiled graph each, on a
    cache of fixed capacity; the tokens are the same. `allowed` [V] (bool), if given, marks the only ids that may
    be produced (those a tokenizer can decode, say: `zaya.infer.vocab`).

    The prompt and its continuation must fit the model's `max_position_embeddings` (`check_length`).
    """
    sampling = sampling or Sampling()
    if not isinstance(sampling, Sampling):
        raise ZayaError(f"sampling must be a Sampling, got {shown(sampling)}")
    if decoder is not None and decoder.model is not model:
        raise ZayaError("the compiled decoder belongs to another model")
    check_prompt(prompt_ids, model.config.vocab_size)
    check_length(model.config, prompt_ids.shape[1], max_new_tokens)
    check_allowed(allowed, model.config.vocab_size)
    device = model.embed.weight.device
    prompt_ids = prompt_ids.to(device)
    allowed = allowed.to(device) if allowed is not None else None
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
                       on_token=on_token, prompt_ids=prompt_ids, allowed=allowed)


def decode_loop(
    logits: torch.Tensor,
    step: Callable[[torch.Tensor], torch.Tensor],
    max_new_tokens: int,
    sampling: Sampling,
    generator: torch.Generator | None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    on_token: Callable[[torch.Tensor], None] | None = None,
    agree: Callable[[torch.Tensor], torch.Tensor] | None = None,
    prompt_ids: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """The token loop of `generate` once the prompt's last logits [B, V] are known: pick a token (among the
    `allowed` [V] ids, if given), stop at eos (any of its ids) or after `max_new_tokens`, else `step(token)` for
    the next logits.
    Returns the tokens [B, n]. The repetition penalty counts the `prompt_ids` [B, T] and the tokens picked.

    `agree` maps each picked token [B] to the one every process uses (a sharded decoder broadcasts one
    rank's choice, so that ranks whose logits differ in the last bit cannot drift apart)."""
    finished = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    stops = _stop_ids(eos_token_id, logits.device)
    seen = None
    if sampling.repetition_penalty != 1.0:
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
        if prompt_ids is not None:
            seen.scatter_(1, prompt_ids.to(seen.device), True)
    out = []
    broken = torch.zeros_like(finished)
    for i in range(max_new_tokens):
        broken_B = broken_rows(logits)  # once per step: gathered here, made harmless in next_token
        broken |= broken_B
        token = next_token(logits, sampling, generator, seen, allowed, broken_B)
        if agree is not None:
            token = agree(token)
        if seen is not None:
            seen.scatter_(1, token[:, None], True)
        if stops is not None:
            if out:
                token = torch.where(finished, out[-1], token)
            finished |= torch.isin(token, stops)
        out.append(token)
        if on_token is not None:
            on_token(token)
        if i == max_new_tokens - 1 or (stops is not None and bool(finished.all())):
            break
        logits = step(token)
    if bool(broken.any()):  # read once, here: each step stays free of host syncs
        raise ZayaError(BROKEN_LOGITS)
    if not out:
        return torch.zeros(logits.shape[0], 0, dtype=torch.long, device=logits.device)
    return torch.stack(out, dim=1)


def _stop_ids(eos_token_id: int | Sequence[int] | None, device: torch.device) -> torch.Tensor | None:
    """The ids generation stops at, as a tensor [S] (None: it does not stop early)."""
    if eos_token_id is None:
        return None
    ids = [eos_token_id] if _integer(eos_token_id) else eos_token_id
    if not isinstance(ids, Sequence) or not ids or not all(_integer(i) and 0 <= i <= MAX_TOKEN_ID for i in ids):
        raise ZayaError(f"eos_token_id must be a token id or a non-empty list of them, got {shown(eos_token_id)}")
    return torch.tensor(list(ids), dtype=torch.long, device=device)
