"""`zaya generate --chat`: a prompt sent as a user message, in the chat template the model was trained with.

    template = require_chat_template(model_dir)        # one clear line if the model has none
    prompt = chat_prompt(template, model_dir, tokenizer, model.config, "What is MoE?")
    generate(model, [prompt.ids], ..., eos_token_id=prompt.stop_ids)

The prompt is rendered with the generation prompt (`add_generation_prompt=True`) and encoded without the
tokenizer's post-processor, as the training data were and as transformers' `apply_chat_template` does; the
reply ends at the template's end-of-turn token, which the model learned to produce at the end of every reply,
or at the end-of-document token: the ids an export's generation_config.json lists as `eos_token_id`, so that
transformers' `generate` on the export stops where `zaya generate --chat` does (`zaya.infer.hf_files.stop_ids`).
The template sees the special tokens an export declares (`special_tokens_of`), so it renders as it did for the
dataset and as it will for `AutoTokenizer`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from zaya.errors import ZayaError
from zaya.infer.hf_files import chat_format, chat_template_of, special_tokens_of, stop_ids
from zaya.model.config import ZayaConfig


@dataclass(frozen=True)
class ChatPrompt:
    """A rendered prompt: its text, its ids, and the ids that end the reply (the end-of-turn id first)."""

    text: str
    ids: list[int]
    stop_ids: tuple[int, ...]

    @property
    def end_of_turn_id(self) -> int:
        """The template's end-of-turn token, which ends a reply the model finishes as it was trained to."""
        return self.stop_ids[0]


def require_chat_template(model_dir: Path) -> str:
    """The model's chat template (`chat_template_of`), or a `ZayaError` saying it has none."""
    template = chat_template_of(model_dir)
    if template is None:
        raise ZayaError(f"{model_dir}: no chat template (no chat_template.jinja, none in tokenizer_config.json, "
                        "no chat dataset behind the checkpoint); --chat needs a model trained on data built with "
                        "'zaya data build --format chat'")
    return template


def chat_prompt(template: str, model_dir: Path, tokenizer: Tokenizer, config: ZayaConfig, text: str) -> ChatPrompt:
    """`text` as the user's message of a new conversation, rendered and encoded (see the module docstring)."""
    specials = special_tokens_of(model_dir, tokenizer, config)
    try:
        chat = chat_format(template, tokenizer, specials, f"{model_dir}'s chat template")
        rendered = chat.render([{"role": "user", "content": text}], add_generation_prompt=True)
    except ZayaError:
        raise
    except Exception as exc:  # whatever the template raises (raise_exception, a sandbox refusal) is its problem
        raise ZayaError(f"{model_dir}'s chat template fails on this prompt ({_first_line(exc)})") from None
    return ChatPrompt(rendered, tokenizer.encode(rendered, add_special_tokens=False).ids,
                      stop_ids(chat, tokenizer, specials, str(model_dir)))


def _first_line(exc: BaseException, limit: int = 200) -> str:
    """An exception's message for a one-line error: its first line, cut to `limit` characters (a template can
    raise a message of any size)."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    return first if len(first) <= limit else first[: limit - 3] + "..."
