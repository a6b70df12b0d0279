"""What the main process of `zaya data build` keeps of the workers' results: each unit's tokens written into the
dataset in input order, and the counts of what was read and skipped, with the first problems by file and line.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zaya.data.build_worker import MAX_REPORTED_PROBLEMS, Job, JobResult
from zaya.data.corpus import ReadOptions, location
from zaya.data.dataset_writer import DatasetWriter
from zaya.data.shards import SPLITS
from zaya.data.skipped import bad_records_text, count_reason
from zaya.errors import ZayaError


@dataclass
class Tally:
    """Running totals over the results, in order."""

    text_bytes: int = 0
    documents: int = 0
    bad_records: int = 0
    invalid_utf8: int = 0
    problems: list[str] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)  # bad records by reason, bounded
    first_bad: str | None = None  # where the first bad record is

    def note(self, message: str) -> None:
        if len(self.problems) < MAX_REPORTED_PROBLEMS:
            self.problems.append(message)

    def reasons_text(self, text_field: str, chat: bool) -> str:
        """The bad records by reason, where the first is, and the flag that reads the most common kind (for a
        build that read no document: its problems are not listed)."""
        counted, fix = bad_records_text(self.reasons, text_field, chat)
        return counted + (f", the first at {self.first_bad}" if self.first_bad else "") + (f"; {fix}" if fix else "")

    def summary(self, text_field: str, chat: bool) -> list[str]:
        """The line after the problems: how many records were skipped and why, and the invalid UTF-8."""
        parts = []
        if self.bad_records:
            plural = "s" if self.bad_records > 1 else ""
            counted, fix = bad_records_text(self.reasons, text_field, chat)
            parts.append(f"skipped {self.bad_records:,} bad record{plural}: {counted}" + (f"; {fix}" if fix else ""))
        if self.invalid_utf8:
            had = "document had" if self.invalid_utf8 == 1 else "documents had"
            parts.append(f"{self.invalid_utf8:,} {had} invalid UTF-8 (replaced by U+FFFD)")
        if not parts:
            return []
        shown = f"; the first {len(self.problems)} are listed above" if self.problems else ""
        return ["; ".join(parts) + shown]

    def corpus(self) -> dict:
        # What the documents are, not how they were packaged: the number of input files stays out of the
        # manifest (and so out of the fingerprint); build.json records it.
        return {"text_bytes": self.text_bytes, "documents": self.documents, "bad_records": self.bad_records,
                "invalid_utf8_documents": self.invalid_utf8}


def collect(job: Job, result: JobResult, tally: Tally, records_before: list[int], read: ReadOptions,
            writer: DatasetWriter) -> None:
    """Write one unit's tokens and account for its records; `records_before` numbers records per file."""
    if result.fatal is not None:  # --strict's first bad record, or a template past its budget
        i, index, problem = result.fatal
        raise ZayaError(f"{location(job.files[i], records_before[job.pieces[i].file] + index, read)}: {problem}")
    for i, index, problem in result.problems:
        where = location(job.files[i], records_before[job.pieces[i].file] + index, read)
        tally.first_bad = tally.first_bad or where
        tally.note(f"{where}: {problem}")
    tally.bad_records += result.bad_records
    for reason, count in result.reasons.items():
        count_reason(tally.reasons, reason, count)
    for i, index in result.invalid_utf8:
        where = location(job.files[i], records_before[job.pieces[i].file] + index, read)
        tally.note(f"{where}: invalid UTF-8, replaced by U+FFFD")
    tally.invalid_utf8 += result.invalid_utf8_documents
    for piece, count in zip(job.pieces, result.counts, strict=True):
        records_before[piece.file] += count
    for split in SPLITS:
        for tokens, doc_lengths, mask in result.tokens.read(split):
            writer.write(split, tokens, doc_lengths, mask)
            tally.documents += len(doc_lengths)
    tally.text_bytes += result.text_bytes
