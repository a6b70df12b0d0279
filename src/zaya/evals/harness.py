"""`ZayaLM`, the `zaya` model of lm-evaluation-harness: `lm_eval --model zaya --model_args path=RUN_DIR`.

The model loads with `zaya.load_model` (an HF directory, a zaya checkpoint or a run directory) and its
tokenizer is the tokenizer.json found with it; the special tokens are those an HF export of it declares
(`zaya.infer.hf_files`), so that this model and `lm_eval --model hf` on the export see the same token ids.

Requests are scored as lm_eval's HF model scores them: the same context/continuation split, the same
truncation to `max_length` (the model's `max_position_embeddings`), the same rolling windows, the same
one-token-continuation sharing. Loglikelihood requests are sorted by length, right-padded and scored many
at a time in one forward pass; padding sits after every real token, so a causal model's scores of the real
tokens do not see it, and only the continuation positions go through the LM head. Generation runs greedily
(or sampled, if the task asks) on zaya's decode cache, rows of equal prompt length as one batch, and stops at
eos, at any `until` string or after `max_gen_toks` tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from tqdm import tqdm

from zaya.data.tokenizer import find_tokenizer, load_tokenizer
from zaya.device import device_present
from zaya.errors import ZayaError
from zaya.infer.generate import TEMPERATURE_RANGE, Sampling, check_prompt, next_token
from zaya.infer.hf_files import SpecialTokens, special_tokens_of
from zaya.infer.loading import load_model
from zaya.weights import resolve_model_dir

log = logging.getLogger(__name__)
DEFAULT_BATCH_SIZE = 8
DEFAULT_MAX_GEN_TOKS = 256  # lm_eval's HF model's default
# a request's (context, continuation) strings, its context ids and its continuation ids
TokenRequest = tuple[tuple[str, str] | None, list[int], list[int]]


@register_model("zaya")
class ZayaLM(TemplateLM):
    """A zaya model for lm_eval. `path` (or `pretrained`) is an HF directory, a zaya checkpoint or a run
    directory (its newest valid checkpoint); `dtype` "float32", "bfloat16", ... (default: as stored)."""

    def __init__(self, path: str | None = None, *, pretrained: str | None = None, device: str | None = None,
                 dtype: str | torch.dtype | None = None, batch_size: int | str | None = DEFAULT_BATCH_SIZE,
                 max_batch_size: int | None = None, max_length: int | str | None = None,
                 max_gen_toks: int | str = DEFAULT_MAX_GEN_TOKS, tokenizer: str | None = None) -> None:
        super().__init__()
        if (path is None) == (pretrained is None):
            raise ZayaError("the zaya model needs exactly one of path=DIR and pretrained=DIR")
        self.path = str(path if path is not None else pretrained)
        model_dir, _ = resolve_model_dir(self.path)
        tokenizer_path = Path(tokenizer) if tokenizer else find_tokenizer(model_dir)
        if tokenizer_path is None:
            raise ZayaError(f"{model_dir}: no tokenizer.json found (pass tokenizer=FILE); lm_eval works on text")
        self.model = load_model(model_dir, device=_available(device), dtype=_dtype(dtype))
        self.tokenizer = load_tokenizer(tokenizer_path)
        self.specials: SpecialTokens = special_tokens_of(model_dir, self.tokenizer, self.model.config)
        if self.specials.eos is None:
            raise ZayaError(f"{tokenizer_path}: the tokenizer has no end-of-text token (the model config's "
                            f"eos_token_id {self.model.config.eos_token_id} is not one of its special tokens)")
        self._device = self.model.embed.weight.device
        self._batch_size = _positive_int(batch_size, "batch_size", DEFAULT_BATCH_SIZE)
        if max_batch_size is not None:
            self._batch_size = min(self._batch_size, _positive_int(max_batch_size, "max_batch_size", 1))
        self._max_length = _positive_int(max_length, "max_length", self.model.config.max_position_embeddings)
        self._max_gen_toks = _positive_int(max_gen_toks, "max_gen_toks", DEFAULT_MAX_GEN_TOKS)

    # ---- what lm_eval asks of a model -------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.specials.eos.id

    @property
    def prefix_token_id(self) -> int:
        # what an empty context and a rolling window start from: bos if the tokenizer has one, as in lm_eval's HF model
        return (self.specials.bos or self.specials.eos).id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return self.path

    def get_model_info(self) -> dict:
        """What lm_eval records about the model in its results' config."""
        params = sum(p.numel() for p in self.model.parameters())
        return {"model_num_parameters": params, "model_dtype": str(self.model.embed.weight.dtype),
                "model_path": self.path}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None,
                   **kwargs: Any) -> list[int]:
        """Token ids of `string`; the tokenizer's own special tokens are added unless the text already starts
        with the prefix token (lm_eval's HF model does the same)."""
        if add_special_tokens is None:
            prefix = (self.specials.bos or self.specials.eos).text
            add_special_tokens = not string.startswith(prefix)
        ids = self.tokenizer.encode(string, add_special_tokens=add_special_tokens).ids
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # ---- scoring ----------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests: list[TokenRequest], disable_tqdm: bool = False,
                              override_bs: int | None = None) -> list[tuple[float, bool]]:
        """(log p(continuation | context), whether greedy decoding gives the continuation) per request."""
        collator = Collator(requests, sort_fn=_longest_first, group_by="contexts", group_fn=_one_token_key)
        results: list[tuple[float, bool]] = []
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="Running loglikelihood requests")
        for chunk in collator.get_batched(n=override_bs or self.batch_size):
            for _, _, continuation in chunk:
                if len(continuation) > self.max_length:
                    raise ZayaError(f"a continuation of {len(continuation)} tokens does not fit the model's "
                                    f"max_length ({self.max_length})")
            inputs = [(context + continuation)[-(self.max_length + 1):][:-1] for _, context, continuation in chunk]
            for (strings, context, continuation), scored in zip(chunk, self._continuation_logprobs(inputs, chunk),
                                                                strict=True):
                for request_strings, cont, logprobs in collator.get_cache(
                        req_str=strings, cxt_toks=context, cont_toks=continuation, logits=scored):
                    target = torch.tensor(cont, dtype=torch.long, device=logprobs.device)[None]
                    greedy = bool((logprobs.argmax(dim=-1)[:, -target.shape[1]:] == target).all())
                    answer = (float(logprobs[:, -target.shape[1]:].gather(2, target[..., None]).sum()), greedy)
                    results.append(answer)
                    if request_strings is not None:
                        self.cache_hook.add_partial("loglikelihood", request_strings, answer)
                    progress.update(1)
        progress.close()
        return collator.get_original(results)

    @torch.inference_mode()
    def _continuation_logprobs(self, inputs: list[list[int]], chunk: Sequence[TokenRequest]) -> list[torch.Tensor]:
        """One forward pass over right-padded `inputs`; per row the log-softmax [1, n, V] at the positions that
        predict its continuation's n tokens."""
        pad = self.specials.pad.id if self.specials.pad is not None else self.eot_token_id
        width = max(len(row) for row in inputs)
        ids = torch.full((len(inputs), width), pad, dtype=torch.long)
        for i, row in enumerate(inputs):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        check_prompt(ids, self.model.config.vocab_size)
        hidden = self.model.hidden_states(ids.to(self.device))
        out = []
        for i, (row, (_, _, continuation)) in enumerate(zip(inputs, chunk, strict=True)):
            n = len(continuation)  # the last n positions of the row predict the continuation
            logits = self.model.logits(hidden[i, len(row) - n:len(row)])
            out.append(F.log_softmax(logits.float(), dim=-1)[None])
        return out

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        """log p(text) of whole texts, in windows of `max_length` tokens as lm_eval's HF model cuts them."""
        windows: list[TokenRequest] = []
        owners: list[int] = []
        for index, (string,) in enumerate(req.args for req in requests):
            pairs = lm_utils.get_rolling_token_windows(token_list=self.tok_encode(string),
                                                       prefix_token=self.prefix_token_id,
                                                       max_seq_len=self.max_length, context_len=1)
            for context, continuation in map(lm_utils.make_disjoint_window, pairs):
                windows.append((None, context, continuation))
                owners.append(index)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm)
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owners, scores, strict=True):
            totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---- generation -------------------------------------------------------------------------------------

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Continue each context until eos, an `until` string or `max_gen_toks` tokens; the text before the
        first stop string."""
        collator = Collator([req.args for req in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                            group_by="gen_kwargs", group_fn=lambda r: r[1])
        eos_text = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        results: list[str] = []
        progress = tqdm(total=len(requests), disable=disable_tqdm, desc="Running generate_until requests")
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = kwargs.pop("max_gen_toks")
            if max_gen_toks >= self.max_length:
                raise ZayaError(f"max_gen_toks ({max_gen_toks}) must be below the model's max_length "
                                f"({self.max_length})")
            prompts = [self.tok_encode(c, left_truncate_len=self.max_length - max_gen_toks) or [self.prefix_token_id]
                       for c in contexts]
            texts = self._generate(prompts, max_gen_toks, until, _sampling(kwargs))
            for context, gen_kwargs, text in zip(contexts, all_kwargs, texts, strict=True):
                text = postprocess_generated_text(text, until, think_end_token=None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                progress.update(1)
        progress.close()
        return collator.get_original(results)

    def _generate(self, prompts: list[list[int]], max_new: int, until: list[str], sampling: Sampling) -> list[str]:
        """The decoded continuations of `prompts`; rows of the same length share one decode cache (no padding,
        so no row's tokens ever attend to another's pads)."""
        texts: list[str | None] = [None] * len(prompts)
        by_length: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            by_length.setdefault(len(prompt), []).append(i)
        for rows in by_length.values():
            for i, text in zip(rows, self._generate_rows([prompts[i] for i in rows], max_new, until, sampling),
                               strict=True):
                texts[i] = text
        return texts

    @torch.inference_mode()
    def _generate_rows(self, prompts: list[list[int]], max_new: int, until: list[str],
                       sampling: Sampling) -> list[str]:
        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        check_prompt(ids, self.model.config.vocab_size)
        generator = None if sampling.seed is None else torch.Generator(self.device).manual_seed(sampling.seed)
        cache = self.model.new_cache()
        logits = self.model.logits(self.model.hidden_states(ids, cache)[:, -1])
        produced: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        stops = [s for s in until if s]
        for step in range(max_new):
            tokens = next_token(logits, sampling, generator)
            for row, token in enumerate(tokens.tolist()):
                if done[row]:
                    continue
                if token == self.eot_token_id:
                    done[row] = True
                    continue
                produced[row].append(token)
                text = self.tok_decode(produced[row])
                done[row] = any(stop in text for stop in stops)
            if all(done) or step == max_new - 1:
                break
            logits = self.model.logits(self.model.hidden_states(tokens[:, None], cache)[:, -1])
        return [self.tok_decode(row) for row in produced]


# ---- helpers ------------------------------------------------------------------------------------------


def _longest_first(request: TokenRequest) -> tuple[int, tuple[int, ...]]:
    # longest first, as lm_eval's HF model orders them: the first batch is the widest
    tokens = request[1] + request[2]
    return -len(tokens), tuple(tokens)


def _one_token_key(request: TokenRequest) -> list[int]:
    # requests that differ only in a one-token continuation share one forward pass
    return request[1] + request[2][:-1]


def _sampling(kwargs: dict) -> Sampling:
    """The task's decoding: greedy unless it asks for sampling (do_sample with a temperature colder than which
    sampling cannot be told from greedy decoding); a task's value that is not a number is one line."""
    temperature = _number(kwargs, "temperature", 0.0)
    if not kwargs.get("do_sample") or temperature < TEMPERATURE_RANGE[0]:
        return Sampling()
    seed = kwargs.get("seed")
    if seed is not None:
        try:
            seed = int(seed)
        except (TypeError, ValueError):
            raise ZayaError(f"the task's generation seed must be an integer, got {seed!r}"[:200]) from None
    return Sampling(greedy=False, temperature=temperature, top_p=_number(kwargs, "top_p", 1.0), seed=seed)


def _number(kwargs: dict, key: str, default: float) -> float:
    value = kwargs.get(key)
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ZayaError(f"the task's generation setting {key} must be a number, got {value!r}"[:200]) from None


def _available(device: str | None) -> str | None:
    """`device`, or None (the default device) for an accelerator this machine lacks: lm_eval's command line
    asks for cuda:0 unless told otherwise."""
    if device is not None and not device_present(device):
        log.warning("no %s here; the zaya model runs on the default device instead", device)
        return None
    return device


def _dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    if value is None or isinstance(value, torch.dtype) or value == "auto":
        return None if value == "auto" else value
    dtype = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ZayaError(f"dtype must be a floating-point torch dtype such as float32 or bfloat16, got '{value}'")
    return dtype


def _positive_int(value: int | str | None, name: str, default: int) -> int:
    if value is None or value == "auto":  # lm_eval's "auto" batch size: zaya's default
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ZayaError(f"{name} must be a positive integer, got '{value}'") from None
    if number <= 0:
        raise ZayaError(f"{name} must be a positive integer, got '{value}'")
    return number
