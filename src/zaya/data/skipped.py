"""What a build did not read, said in one line each: the files of its input directories that it passed over,
by reason and kind, and its bad records, by reason; each with the flag that would read them.

A directory is read by the kinds of its files (`corpus.py`): without `--include` only the kinds a build reads,
with it only the files a pattern matches. A build that skips the rest without a word reads 4 files of a
source tree of 166 and says nothing. So the scan notes every file it passes over (`SkippedFiles`), counted by
reason and by its kind (the extension of its name), with a few names. Whether the files of an unread kind are
text, which `--include` would read, or binary is told from the first bytes of a few files of each kind (a NUL
byte, or mostly bytes that are not text): a directory of a million images costs a few reads.

Bad records are counted by reason (`reason_of`: the message without what differs from record to record), and
the most common reason is named with the flag that would fix it (`bad_records_text`): `--text-field` for a
missing text field, with the fields the records do have; `--format chat` for records that hold `messages`;
`--doc-separator` for a text file too long to be one document.

A split that came out empty, or a val split smaller than one evaluation batch at the defaults, is said too
(`split_warnings`): the split goes by a hash of each document's text, so a small set may hold out none, and a
run that evaluates on it would stop at its first evaluation.

Everything kept is bounded, whatever the corpus: `_MAX_KINDS` kinds and `MAX_REASONS` reasons counted apart,
`_EXAMPLES` names per reason, a few of each in a line.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from zaya.errors import ZayaError
from zaya.reading import open_regular

# Why a file of an input directory is not read, in the order a line lists them. The first five are worth a
# warning; the rest are what the user asked for (hidden entries, --exclude) and go to build.json only.
UNREAD, BINARY, UNMATCHED, SPECIAL, LINKED = "unread", "binary", "unmatched", "special", "linked"
EXCLUDED, HIDDEN = "excluded", "hidden"
_LABELS = {
    UNREAD: "of unread kinds",
    BINARY: "binary",
    UNMATCHED: "not matching --include",
    SPECIAL: ("not a regular file", "not regular files"),
    LINKED: ("link to a directory (not followed)", "links to directories (not followed)"),
    EXCLUDED: "excluded by --exclude",
    HIDDEN: "hidden",
}
_SAID = (UNREAD, BINARY, UNMATCHED, SPECIAL, LINKED)
_PLAIN_KIND = re.compile(r"\.[A-Za-z0-9_+-]+(\.[A-Za-z0-9_+-]+)?")  # a kind a shell pattern can name as it is
NO_EXTENSION = "no extension"
_COMPRESSED = (".gz", ".zst", ".zstd")
_MAX_KINDS = 64  # kinds counted apart per reason; the rest count as "other kinds"
_OTHER_KINDS = "other kinds"
_EXAMPLES = 3  # names kept per reason
_SHOWN_KINDS = 4  # kinds a line names per reason
_SAMPLED = 3  # files of a kind whose first bytes tell whether the kind is binary
_SNIFF_BYTES = 8192
_NAME_CHARS = 60  # a name longer than this is shown by its end
_HINT_KINDS = 3  # kinds an --include hint names
FIELDS = "their fields: "
_NO_FIELDS = "none"
MAX_REASONS = 32  # bad-record reasons counted apart; the rest count as OTHER_REASON
OTHER_REASON = "other problems"


@dataclass
class _Group:
    """The files skipped for one reason."""

    files: int = 0
    directories: int = 0
    kinds: Counter = field(default_factory=Counter)
    named: dict[str, str] = field(default_factory=dict)  # the first name of each kind
    examples: list[str] = field(default_factory=list)  # the first names, of any kind
    samples: dict[str, list[Path]] = field(default_factory=dict)  # a few paths of each kind, to sniff

    def add(self, name: str, kind: str | None, path: Path | None, directory: bool) -> None:
        if directory:
            self.directories += 1
        else:
            self.files += 1
        name = _short(name + ("/" if directory else ""))
        if kind is not None:
            if kind not in self.kinds and len(self.kinds) >= _MAX_KINDS:
                kind = _OTHER_KINDS
            self.kinds[kind] += 1
            if kind != _OTHER_KINDS:
                self.named.setdefault(kind, name)
            if path is not None and kind != _OTHER_KINDS and len(self.samples.setdefault(kind, [])) < _SAMPLED:
                self.samples[kind].append(path)
        if len(self.examples) < _EXAMPLES:
            self.examples.append(name)

    def move(self, kind: str, other: _Group) -> None:
        """Move the files of one kind to another group."""
        count = self.kinds.pop(kind)
        self.files -= count
        other.files += count
        other.kinds[kind] += count
        other.named.setdefault(kind, self.named.pop(kind))
        other.examples += [e for e in self.examples if kind_label(e) == kind][:_EXAMPLES - len(other.examples)]
        self.examples = [e for e in self.examples if kind_label(e) != kind]

    def shown_examples(self) -> list[str]:
        """A name of each of the most common kinds, or the first names if the group has no kinds."""
        if self.kinds:
            return [self.named[k] for k, _ in self.kinds.most_common() if k in self.named][:_EXAMPLES]
        return self.examples

    @property
    def count(self) -> int:
        return self.files + self.directories


class SkippedFiles:
    """The files of input directories a build passed over, by reason (see the module docstring); `note_read`
    counts those it reads. `resolve` tells the binary kinds from the text ones: call it before reading."""

    def __init__(self) -> None:
        self.read = 0
        self.read_kinds: Counter = Counter()  # the kinds of the files read, for a hint that keeps reading them
        self.included = False  # --include was given
        self.groups: dict[str, _Group] = {}
        self._resolved = True

    def note_read(self, name: str) -> None:
        self.read += 1
        kind = kind_label(name)
        if kind in self.read_kinds or len(self.read_kinds) < _MAX_KINDS:
            self.read_kinds[kind] += 1

    def skip(self, reason: str, relative: str, path: Path | None = None, directory: bool = False) -> None:
        """Note a file (or a directory, with all in it) passed over; `path` for the files whose kind may be
        binary (those of unread kinds and those not matching --include)."""
        counted = reason in (UNREAD, UNMATCHED, BINARY) and not directory  # (what the user skipped has no kinds)
        kind = kind_label(relative.rsplit("/", 1)[-1]) if counted else None
        self.groups.setdefault(reason, _Group()).add(relative, kind, path, directory)
        self._resolved = self._resolved and path is None

    def update(self, other: SkippedFiles) -> None:
        """Add what another scan noted (one input directory's, into the build's)."""
        other.resolve()
        self.read += other.read
        self.read_kinds.update(other.read_kinds)
        self.included = self.included or other.included
        for reason, theirs in other.groups.items():
            mine = self.groups.setdefault(reason, _Group())
            mine.files += theirs.files
            mine.directories += theirs.directories
            mine.kinds.update(theirs.kinds)
            for kind, name in theirs.named.items():
                if kind in mine.named or len(mine.named) < _MAX_KINDS:
                    mine.named.setdefault(kind, name)
            mine.examples = (mine.examples + theirs.examples)[:_EXAMPLES]

    def resolve(self) -> None:
        """Move the kinds whose sampled files are mostly binary from `unread`/`unmatched` to `binary`."""
        if self._resolved:
            return
        self._resolved = True
        for reason in (UNREAD, UNMATCHED):
            group = self.groups.get(reason)
            if group is None:
                continue
            binary_kinds = {kind for kind, paths in group.samples.items() if _mostly_binary(paths)}
            group.samples = {}
            if not binary_kinds:
                continue
            moved = self.groups.setdefault(BINARY, _Group())
            for kind in sorted(binary_kinds):
                group.move(kind, moved)
            if not group.count:
                del self.groups[reason]

    # ---- what is said -------------------------------------------------------------------------------------

    def worth_saying(self) -> bool:
        """Whether anything was skipped that the user may not know of (not only hidden or excluded entries)."""
        self.resolve()
        return any(reason in self.groups for reason in _SAID)

    def text(self) -> str:
        """One line: how many files were skipped, and why, with a few kinds and names of each."""
        self.resolve()
        files = sum(g.files for g in self.groups.values())
        directories = sum(g.directories for g in self.groups.values())
        lead = f"skipped {files:,} of {self.read + files:,} files in the input directories"
        if directories:
            lead += f" and {directories:,} director{'y' if directories == 1 else 'ies'}"
        parts = [self._group_text(reason) for reason in _LABELS if reason in self.groups]
        hint = self.hint()
        return f"{lead}: {', '.join(parts)}" + (f"; {hint}" if hint else "")

    def _group_text(self, reason: str) -> str:
        group = self.groups[reason]
        details = []
        if group.kinds:
            details.append(_kinds_text(group.kinds))
        if examples := group.shown_examples():
            details.append(f"e.g. {', '.join(examples)}")
        label = _LABELS[reason]
        if isinstance(label, tuple):
            label = label[group.count != 1]
        return f"{group.count:,} {label}" + (f" ({'; '.join(details)})" if details else "")

    def hint(self) -> str | None:
        """The --include patterns that would read the skipped text files as text (and still read what was read)."""
        reason = UNMATCHED if self.included else UNREAD
        group = self.groups.get(reason)
        if group is None:
            return None
        kinds = [k for k, _ in group.kinds.most_common() if _PLAIN_KIND.fullmatch(k)][:_HINT_KINDS]
        if not kinds:
            return None
        patterns = " ".join(f"--include '*{kind}'" for kind in kinds)
        if self.included:
            return f"add {patterns} to read them too"
        kept = [k for k, _ in self.read_kinds.most_common() if _PLAIN_KIND.fullmatch(k)]
        keep = " ".join(f"--include '*{kind}'" for kind in kept)
        kept_names = ", ".join(kept)
        return f"read them as text with {patterns}" + (f" (and {keep} to keep the {kept_names} files)" if keep else "")

    def kinds_text(self) -> str:
        """The kinds of files skipped (for a directory of which nothing is read)."""
        self.resolve()
        kinds = Counter()
        for reason in (UNREAD, BINARY):
            if reason in self.groups:
                kinds.update(self.groups[reason].kinds)
        return _kinds_text(kinds)

    def to_dict(self) -> dict:
        """For build.json: the counts, the kinds (the most common `_MAX_KINDS`) and a few names of each."""
        self.resolve()
        return {
            "read": self.read,
            "skipped": {
                reason: {"files": g.files, "directories": g.directories, "kinds": dict(g.kinds.most_common()),
                         "examples": g.shown_examples()}
                for reason, g in self.groups.items()
            },
        }


def _kinds_text(kinds: Counter) -> str:
    """`.py 120, .c 20, 14 of other kinds`: the most common kinds and their counts."""
    ranked = [(kind, count) for kind, count in kinds.most_common() if kind != _OTHER_KINDS]
    rest = sum(count for _, count in ranked[_SHOWN_KINDS:]) + kinds.get(_OTHER_KINDS, 0)
    shown = ", ".join(f"{kind} {count:,}" for kind, count in ranked[:_SHOWN_KINDS])
    return shown + (f", {rest:,} of other kinds" if rest else "")


def kind_label(name: str) -> str:
    """A file's kind as a line names it: its extension (`.py`), with the one before a compression's (`.md.gz`)."""
    stem, suffix = os.path.splitext(name)
    if not suffix or not stem:
        return NO_EXTENSION
    if suffix.lower() in _COMPRESSED:
        inner = os.path.splitext(stem)[1]
        suffix = inner + suffix if inner else suffix
    return _printable(suffix)


def _short(name: str) -> str:
    name = _printable(name)
    return name if len(name) <= _NAME_CHARS else "..." + name[-(_NAME_CHARS - 3):]


def _printable(name: str) -> str:
    """A file name as one line of text: undecodable bytes and control characters escaped."""
    name = name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return name if name.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in name)


def _mostly_binary(paths: list[Path]) -> bool:
    verdicts = [v for v in (_binary(p) for p in paths) if v is not None]
    return 2 * sum(verdicts) > len(verdicts)


def _binary(path: Path) -> bool | None:
    """Whether a file looks binary from its first bytes: a NUL byte, or not UTF-8 and mostly not text (None if
    it cannot be read: it is then not counted either way)."""
    try:
        with open_regular(path, "an input") as handle:
            head = handle.read(_SNIFF_BYTES)
    except (ZayaError, OSError):
        return None
    if b"\0" in head:
        return True
    try:
        head.decode("utf-8")
        return False
    except UnicodeDecodeError as exc:
        if exc.start >= len(head) - 3:  # a character cut by the end of the sample
            return False
    text = sum(1 for b in head if b >= 0x20 or b in b"\t\n\r\f")
    return text < 0.7 * len(head)


# ---- bad records ------------------------------------------------------------------------------------------

_MESSAGE_NUMBER = re.compile(r"\bmessage \d+")
_CHAT_LENGTH = re.compile(r"^a chat of [\d,]+ messages, more than")
_TEXT_NAMES = ("content", "body", "document", "article", "story", "passage", "code", "markdown", "sentence")


def reason_of(problem: str, fields: tuple[str, ...] | None = None) -> str:
    """What kind of problem a bad record has, for counting: its message without the details that differ from
    record to record (a parser's position, a message's number, a length), with the `fields` a record without
    the text field has (`no field 'text' (their fields: messages)`)."""
    head = problem.partition(" (")[0]
    head = _CHAT_LENGTH.sub("a chat of more messages than", _MESSAGE_NUMBER.sub("a message", head))
    if fields is not None:
        return f"{head} ({FIELDS}{', '.join(fields) if fields else _NO_FIELDS})"
    return head


def count_reason(reasons: dict[str, int], reason: str, count: int = 1) -> None:
    """Add to a bounded count of reasons: past `MAX_REASONS` reasons, new ones count as `OTHER_REASON`."""
    if reason not in reasons and len(reasons) >= MAX_REASONS:
        reason = OTHER_REASON
    reasons[reason] = reasons.get(reason, 0) + count


def bad_records_text(reasons: dict[str, int], text_field: str, chat: bool) -> tuple[str, str | None]:
    """The bad records by reason, the most common first (the reasons that differ only in the fields the records
    hold counted as one), and the flag that fixes the most common, if one would: `2 have no field 'text' (their
    fields: messages)` and `use --text-field NAME, or --format chat for chats`."""
    merged: Counter = Counter()
    fields: dict[str, Counter] = {}
    for reason, count in reasons.items():
        head, _, detail = reason.partition(f" ({FIELDS}")
        merged[head] += count
        if detail:
            fields.setdefault(head, Counter())[detail.removesuffix(")")] += count
    ranked = merged.most_common()
    parts = []
    for head, count in ranked[:3]:
        seen = f" ({FIELDS}{fields[head].most_common(1)[0][0]})" if head in fields else ""
        parts.append(f"{count:,} {_verb(head, count)}{head}{seen}")
    if len(ranked) > 3:
        parts.append(f"{sum(c for _, c in ranked[3:]):,} other")
    top = ranked[0][0]
    fix = _fix(top, fields.get(top), text_field, chat)
    return ", ".join(parts), fix


def _verb(reason: str, count: int) -> str:
    """What joins a count to a reason: `2 have no field 'text'`, `3 whose field 'text' is null`."""
    if reason.startswith("no "):
        return "have " if count > 1 else "has "
    if reason.startswith(("not ", "expected ")):
        return ""
    if reason.startswith("field "):
        return "whose "
    if " of more than " in reason:
        return "are " if count > 1 else "is "
    return "where "


def _fix(reason: str, fields: Counter | None, text_field: str, chat: bool) -> str | None:
    """The flag that would read the records a reason rejects, where one would."""
    names = [] if fields is None else fields.most_common(1)[0][0].split(", ")
    names = [] if names == [_NO_FIELDS] else names
    if not chat and reason == f"no field '{text_field}'" and names:  # (a CSV row too short has no fields)
        if "messages" in names:
            return "use --format chat for chats, or --text-field NAME"
        likely = next((n for n in names if n.lower() in _TEXT_NAMES), None)
        return f"use --text-field {likely}" if likely else "use --text-field NAME"
    if not chat and reason.startswith(f"field '{text_field}' is ") and reason.endswith("not a string"):
        return "use --text-field NAME for a field that holds text"
    if chat and reason == "no field 'messages'" and text_field in names:
        return "these are documents, not chats: build them without --format chat"
    if reason.startswith("a document of more than"):
        return "use --doc-separator STRING to cut text files into documents"
    return None


# ---- the splits -------------------------------------------------------------------------------------------

# One evaluation batch at the defaults: 8 sequences (train.global_batch_size) of 512 + 1 tokens (data.seq_len).
# A val split smaller cannot fill one, and a run that evaluates on it stops at its first evaluation.
SMALL_VAL_TOKENS = 8 * (512 + 1)
_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


def split_warnings(manifest: dict, val_fraction: float) -> list[str]:
    """A line for a split that came out empty, or a val split too small to evaluate on, with what to do."""
    train, val = manifest["splits"]["train"], manifest["splits"]["val"]
    documents = train["num_documents"] + val["num_documents"]
    if not train["num_documents"]:
        return [f"the train split is empty: --val-fraction {val_fraction:g} held out all {documents:,} documents "
                "(the split goes by a hash of each document's text); build with a smaller --val-fraction"]
    stops = "a run that evaluates on it stops at its first evaluation"
    if not val["num_documents"]:
        larger = next((f for f in _FRACTIONS if f > val_fraction and f * documents >= 4), _FRACTIONS[-1])
        if val_fraction == 0:
            return [f"the val split is empty (--val-fraction 0): {stops}; build with --val-fraction 0.01, evaluate on "
                    "another dataset, or set train.eval_every = 0"]
        return [f"the val split is empty: --val-fraction {val_fraction:g} held out none of the {documents:,} "
                f"documents (the split goes by a hash of each document's text, so a small set may get none) and "
                f"{stops}; build with --val-fraction {larger:g} or more, or set train.eval_every = 0"]
    if val["num_tokens"] >= SMALL_VAL_TOKENS:
        return []
    plural = "s" if val["num_documents"] > 1 else ""
    fix = _fix_val(val_fraction, train["num_tokens"] + val["num_tokens"])
    return [f"the val split holds only {val['num_tokens']:,} tokens in {val['num_documents']:,} document{plural}, "
            f"fewer than one evaluation batch at the defaults (train.global_batch_size 8 x data.seq_len 512 + 1): "
            f"{stops} unless its batches are smaller; {fix}"]


def _fix_val(fraction: float, tokens: int) -> str:
    """What gives a val split of one evaluation batch at the defaults: a larger fraction, if one would."""
    otherwise = "or evaluate with smaller batches, on another dataset, or not at all (train.eval_every = 0)"
    for candidate in _FRACTIONS:
        if candidate > fraction and candidate * tokens >= 2 * SMALL_VAL_TOKENS:  # twice: the hash is uneven
            return f"build with --val-fraction {candidate:g} or more, {otherwise}"
    return f"the whole set holds {tokens:,} tokens: build from more documents, {otherwise}"
