"""The files besides config.json and the weights that every Hugging Face tool expects in a model directory.

    tokenizer_config.json     tokenizer class, the special tokens, whether encoding adds bos/eos, max length
    special_tokens_map.json   the special tokens alone
    generation_config.json    bos/eos/pad token ids for `generate` and pipelines (eos: every id that ends a reply)
    chat_template.jinja       the chat template, where the model has one (transformers reads it too)

Without tokenizer_config.json, `AutoTokenizer` guesses a tokenizer class from the model type and its default
`<unk>`, which a byte-level BPE does not have, and fails on the first encode; with these files
`AutoTokenizer`, `AutoModelForCausalLM`, `pipeline("text-generation")` and `lm_eval --model hf` load the
directory with no extra arguments.

The special tokens are the ones the tokenizer really has: a role (bos, eos, pad) takes the model config's id
when that id is a special token of the tokenizer, eos the end-of-document id of the dataset the model was
trained on when the checkpoint says which, unk the BPE model's unknown token if it has one. A model imported
from Hugging Face keeps its own files: they are carried in the checkpoint and written back unchanged.

A model trained on chats has the chat template of its data (`chat_template_of`): a checkpoint's
chat_template.jinja, else the template of the dataset the run trained on (found as the end-of-document id is).
A tokenizer_config.json made here carries it as `chat_template`, so `apply_chat_template` renders as zaya does.
Such a model ends a reply with the template's end-of-turn token (`<|im_end|>`), not with the end-of-document
token that tokenizer_config.json declares as eos (the template may write `eos_token`, so that one stays): the
generation_config.json made here lists both as `eos_token_id` (`stop_ids`), which is what transformers'
`generate` and pipelines stop at, and what `zaya generate --chat` stops at too.

Every one of these files is read as any input (`zaya.reading`: a regular file, a size cap, a depth bound), its
fields typed (`zaya.schema`): a wrong one is one line naming the file and the key. What only hints at a better
export (a training checkpoint's run config, its dataset's manifest) is skipped when it is not as expected.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from zaya import reading
from zaya.checkpoint.files import TRAIN_STATE_FILE, copy_input, read_json
from zaya.data.chat import ChatFormat
from zaya.data.tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_FILE, added_tokens, load_tokenizer
from zaya.errors import ZayaError
from zaya.model.config import ZayaConfig
from zaya.schema import Fields, is_a, shown

TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
GENERATION_CONFIG_FILE = "generation_config.json"
HF_FILES = (TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_FILE, GENERATION_CONFIG_FILE)
TOKENIZER_CLASS = "PreTrainedTokenizerFast"
ROLES = ("bos", "eos", "pad", "unk")
_PROBE = "a"


@dataclass(frozen=True)
class Token:
    """A special token: its text and its id in the tokenizer."""

    text: str
    id: int


@dataclass(frozen=True)
class SpecialTokens:
    """A tokenizer's special tokens as Hugging Face tools see them (None: the tokenizer has no such token),
    and whether encoding a text adds bos in front or eos at the end."""

    bos: Token | None = None
    eos: Token | None = None
    pad: Token | None = None
    unk: Token | None = None
    add_bos: bool = False
    add_eos: bool = False

    def tokens(self) -> dict[str, Token]:
        """The roles the tokenizer has, e.g. {"bos": Token("<bos>", 2), ...}."""
        return {role: getattr(self, role) for role in ROLES if getattr(self, role) is not None}


@dataclass(frozen=True)
class TrainingHints:
    """What a training checkpoint knows about its tokenizer: the longest sequence length it was trained at
    and the dataset's end-of-document id (when the dataset is still there and has the same tokenizer)."""

    seq_len: int | None = None
    eos_id: int | None = None
    chat_template: str | None = None  # the dataset's, for a model trained on chats


# ---- what a tokenizer has -----------------------------------------------------------------------------


def derive_special_tokens(tokenizer: Tokenizer, config: ZayaConfig, eos_id: int | None = None) -> SpecialTokens:
    """The special tokens of a tokenizer made by (or for) zaya, from the model config's ids."""
    specials = {i: t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}

    def pick(token_id: int | None, must_be_special: bool = True) -> Token | None:
        if token_id is None:
            return None
        text = specials.get(token_id) if must_be_special else tokenizer.id_to_token(token_id)
        return Token(text, token_id) if text is not None else None

    eos = pick(eos_id, must_be_special=False) or pick(config.eos_token_id)
    unk_text = _model_unk_token(tokenizer)
    unk_id = tokenizer.token_to_id(unk_text) if unk_text is not None else None
    bos = pick(config.bos_token_id)
    add_bos, add_eos = _added_on_encode(tokenizer, bos, eos)
    return SpecialTokens(bos=bos, eos=eos, pad=pick(config.pad_token_id),
                         unk=Token(unk_text, unk_id) if unk_id is not None else None, add_bos=add_bos, add_eos=add_eos)


def read_special_tokens(tokenizer_config: dict, tokenizer: Tokenizer, source: Path | str) -> SpecialTokens:
    """The special tokens a tokenizer_config.json names (strings or {"content": ...} entries); `source` names
    the file in errors."""
    fields = Fields(tokenizer_config, source)
    found: dict[str, Token | None] = {}
    for role in ROLES:
        key = f"{role}_token"
        value = fields.obj(key) if isinstance(tokenizer_config.get(key), dict) else fields
        text = value.str("content" if value is not fields else key, None)
        # a token the vocabulary lacks (a stock "<unk>", say) is one the tokenizer cannot produce
        token_id = tokenizer.token_to_id(text) if text is not None else None
        found[role] = Token(text, token_id) if token_id is not None else None
    add_bos, add_eos = _added_on_encode(tokenizer, found["bos"], found["eos"])
    return SpecialTokens(**found, add_bos=_flag(fields, "add_bos_token", add_bos),
                         add_eos=_flag(fields, "add_eos_token", add_eos))


def _flag(fields: Fields, name: str, default: bool) -> bool:
    """A boolean setting; null (which transformers writes for "not set") is the default."""
    return default if fields.data.get(name) is None else fields.bool(name)


def special_tokens_of(model_dir: Path, tokenizer: Tokenizer, config: ZayaConfig) -> SpecialTokens:
    """The special tokens of the tokenizer of a model directory (an HF directory or a zaya checkpoint): those
    of its tokenizer_config.json if it has one, else derived as an export would write them."""
    path = Path(model_dir) / TOKENIZER_CONFIG_FILE
    if os.path.lexists(path):
        return read_special_tokens(read_json(path), tokenizer, path)
    return derive_special_tokens(tokenizer, config, training_hints(model_dir).eos_id)


def training_hints(checkpoint_dir: Path) -> TrainingHints:
    """Sequence length and end-of-document id from a training checkpoint's train_state.json (empty hints for
    any other directory, or when the run's config does not say)."""
    directory = Path(checkpoint_dir)
    state_path = directory / TRAIN_STATE_FILE
    if not os.path.lexists(state_path):
        return TrainingHints()
    run = _object(read_json(state_path).get("config"))
    data = _object(run.get("data"))
    phases = [_object(p) for p in _list(run.get("phases"))]
    lengths = [n for n in [data.get("seq_len"), *(p.get("seq_len") for p in phases)] if is_a(n, int) and n > 0]
    sources = [data.get("path"), *(_object(s).get("path") for p in phases for s in _list(p.get("sources")))]
    eos_id, template = _dataset_tokenizer([s for s in sources if isinstance(s, str)], directory)
    return TrainingHints(seq_len=max(lengths) if lengths else None, eos_id=eos_id, chat_template=template)


def chat_template_of(model_dir: Path) -> str | None:
    """The chat template of a model directory: its chat_template.jinja, its tokenizer_config.json's
    `chat_template` (the one named "default" of a list), or a training checkpoint's dataset's; None if none."""
    directory = Path(model_dir)
    if os.path.lexists(directory / CHAT_TEMPLATE_FILE):
        return reading.read_text(directory / CHAT_TEMPLATE_FILE, "template", "a chat template")
    if os.path.lexists(directory / TOKENIZER_CONFIG_FILE):
        path = directory / TOKENIZER_CONFIG_FILE
        template = read_json(path).get("chat_template")
        if isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ZayaError(f"{path}: field 'chat_template' must be a string or a list of named templates, got "
                            f"{type(template).__name__}")
        if template is not None:
            return template
    return training_hints(directory).chat_template


# ---- where a reply ends ---------------------------------------------------------------------------------


def chat_format(template: str, tokenizer: Tokenizer, specials: SpecialTokens, source: str) -> ChatFormat:
    """`template` as the model's chats are rendered: with the special tokens the tokenizer declares (what
    `apply_chat_template` passes as `bos_token` and `eos_token`) and its added tokens as markers. Raises
    `ZayaError`, or whatever the template raises."""
    return ChatFormat.create(template, bos_token=specials.bos.text if specials.bos else None,
                             eos_token=specials.eos.text if specials.eos else None,
                             tokens=added_tokens(tokenizer), source=source)


def stop_ids(chat: ChatFormat, tokenizer: Tokenizer, specials: SpecialTokens, source: str) -> tuple[int, ...]:
    """The ids a reply ends at: the template's end-of-turn token first, then the end-of-document token (a chat
    is a training document, so it follows the last turn), each once. One line if the end-of-turn marker is not
    one token of the tokenizer."""
    end = tokenizer.token_to_id(chat.end_of_turn)
    if end is None:
        raise ZayaError(f"{source}: the chat template ends a turn with {shown(chat.end_of_turn)}, which is not a "
                        "token of the tokenizer")
    return (end,) if specials.eos is None or specials.eos.id == end else (end, specials.eos.id)


def _reply_ends(template: str | None, tokenizer: Tokenizer, specials: SpecialTokens, source: Path) -> tuple[int, ...]:
    """`stop_ids` of a model with a chat template, for its export; none for a model without one, or with a template
    zaya cannot read its end of turn from (an imported model's: a hint, not a requirement, as its other files)."""
    if template is None:
        return ()
    try:
        return stop_ids(chat_format(template, tokenizer, specials, f"{source}'s chat template"), tokenizer, specials,
                        str(source))
    except Exception:  # whatever the template raises: the export is made without it
        return ()


# ---- writing them -------------------------------------------------------------------------------------


def tokenizer_config_json(specials: SpecialTokens, model_max_length: int, chat_template: str | None = None) -> dict:
    """tokenizer_config.json for `PreTrainedTokenizerFast` over the directory's tokenizer.json."""
    data = {"tokenizer_class": TOKENIZER_CLASS, "model_max_length": model_max_length,
            "add_bos_token": specials.add_bos, "add_eos_token": specials.add_eos,
            # the tokenizers library decodes without it; HF's clean-up would change " ." into "."
            "clean_up_tokenization_spaces": False}
    data.update({f"{role}_token": token.text for role, token in specials.tokens().items()})
    if chat_template is not None:
        data["chat_template"] = chat_template
    return data


def special_tokens_map_json(specials: SpecialTokens) -> dict:
    """special_tokens_map.json: each role's token text."""
    return {f"{role}_token": token.text for role, token in specials.tokens().items()}


def generation_config_json(specials: SpecialTokens | None, config: ZayaConfig,
                           reply_ends: tuple[int, ...] = ()) -> dict:
    """generation_config.json: the tokenizer's bos/eos/pad ids (the model config's without a tokenizer); with
    `reply_ends` (a chat model's `stop_ids`) eos is a list: the end-of-document id, then those."""
    if specials is None:
        ids = {"bos": config.bos_token_id, "eos": config.eos_token_id, "pad": config.pad_token_id}
    else:
        ids = {role: token.id for role, token in specials.tokens().items() if role != "unk"}
    ends = list(dict.fromkeys(i for i in (ids.get("eos"), *reply_ends) if i is not None))
    if ends:
        ids["eos"] = ends if len(ends) > 1 else ends[0]
    return {f"{role}_token_id": token_id for role, token_id in ids.items() if token_id is not None}


def write_hf_files(directory: Path, config: ZayaConfig, tokenizer_path: Path | None = None,
                   source: Path | None = None) -> None:
    """Write the three files into `directory` (which holds, or is about to hold, `tokenizer_path` as its
    tokenizer.json). Those that `source` (the model's checkpoint or HF directory) has are copied unchanged;
    the others are made from the tokenizer, the model config and what `source` knows about its training."""
    directory = Path(directory)
    preserved = {name for name in HF_FILES if source is not None and os.path.lexists(Path(source) / name)}
    for name in preserved:
        copy_input(Path(source) / name, directory)
    if source is not None and os.path.lexists(Path(source) / CHAT_TEMPLATE_FILE):
        copy_input(Path(source) / CHAT_TEMPLATE_FILE, directory)
    specials, reply_ends = None, ()
    if tokenizer_path is not None and Path(tokenizer_path).is_file():
        tokenizer = load_tokenizer(tokenizer_path)
        hints = training_hints(source) if source is not None else TrainingHints()
        if TOKENIZER_CONFIG_FILE in preserved:
            specials = read_special_tokens(read_json(directory / TOKENIZER_CONFIG_FILE), tokenizer,
                                           Path(source) / TOKENIZER_CONFIG_FILE)
        else:
            specials = derive_special_tokens(tokenizer, config, hints.eos_id)
        template = chat_template_of(source) if source is not None else None
        reply_ends = _reply_ends(template, tokenizer, specials, source)
        made = {TOKENIZER_CONFIG_FILE: tokenizer_config_json(specials, hints.seq_len or config.max_position_embeddings,
                                                             template),
                SPECIAL_TOKENS_FILE: special_tokens_map_json(specials)}
        for name, data in made.items():
            if name not in preserved:
                _write_json(directory / name, data)
    if GENERATION_CONFIG_FILE not in preserved:
        _write_json(directory / GENERATION_CONFIG_FILE, generation_config_json(specials, config, reply_ends))


def present_hf_files(directory: Path) -> list[Path]:
    """The files of HF_FILES (and the chat template) that `directory` holds (to carry into a checkpoint; one that
    is not a regular file is refused as it is copied)."""
    return [Path(directory) / name for name in (*HF_FILES, CHAT_TEMPLATE_FILE)
            if os.path.lexists(Path(directory) / name)]


# ---- helpers ------------------------------------------------------------------------------------------


def _model_unk_token(tokenizer: Tokenizer) -> str | None:
    unk = json.loads(tokenizer.to_str()).get("model", {}).get("unk_token")
    return unk if isinstance(unk, str) else None


def _added_on_encode(tokenizer: Tokenizer, bos: Token | None, eos: Token | None) -> tuple[bool, bool]:
    """Whether the tokenizer's post-processor puts bos in front of, or eos after, an encoded text."""
    plain = tokenizer.encode(_PROBE, add_special_tokens=False).ids
    full = tokenizer.encode(_PROBE, add_special_tokens=True).ids
    added = len(full) > len(plain)
    return (added and bos is not None and full[0] == bos.id), (added and eos is not None and full[-1] == eos.id)


def _dataset_tokenizer(paths: list[str], checkpoint_dir: Path) -> tuple[int | None, str | None]:
    """The end-of-document id of the first dataset whose tokenizer is the checkpoint's own, and the chat
    template of the first such dataset that has one."""
    from zaya.data.shards import MANIFEST_FILE

    tokenizer = checkpoint_dir / TOKENIZER_FILE
    if not os.path.lexists(tokenizer):
        return None, None
    digest = hashlib.sha256(reading.read_bytes(tokenizer, "tokenizer", "a tokenizer")).hexdigest()
    eos_id, template = None, None
    for path in paths:
        manifest = Path(path) / MANIFEST_FILE
        try:
            if not os.path.lexists(manifest):
                continue
            info = _object(reading.read_json_object(manifest, "manifest").get("tokenizer"))
            if info.get("sha256") != digest:
                continue
            chat = _object(info.get("chat_template"))
            if template is None and isinstance(chat.get("file"), str):
                data = reading.read_bytes(Path(path) / Path(chat["file"]).name, "template", "a chat template")
                if hashlib.sha256(data).hexdigest() == chat.get("sha256"):
                    template = reading.decode_text(data, Path(path) / Path(chat["file"]).name)
        except (ZayaError, OSError, ValueError):
            continue  # a hint, not a requirement: a damaged dataset just does not inform the export
        if eos_id is None and is_a(info.get("eos_id"), int) and 0 <= info["eos_id"] < 1 << 31:
            eos_id = info["eos_id"]
    return eos_id, template


def _object(value) -> dict:
    """A hint's object, or an empty one when it is something else."""
    return value if isinstance(value, dict) else {}


def _list(value) -> list:
    return value if isinstance(value, list) else []


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
