"""Columnar inputs: parquet files, Arrow IPC files and Hugging Face `datasets` directories.

Each row's text column (`--text-field`) is one document; with `--format chat`, each row's `messages` column (a
list of message structs, as Hugging Face chat datasets store them) is one chat. The natural pieces are the
format's own blocks: a parquet file's row groups, an arrow file's record batches (grouped up to the target piece
size). Reading is batch by batch, `_ROWS` rows at a time, so a piece never sits in memory whole: arrow files are
memory-mapped (their pages are the operating system's file cache, dropped under pressure, not the build's
memory) and parquet row groups are decoded in batches.

An arrow file may be in the IPC stream format (what `datasets` writes, and what
`load_dataset("arrow", ...)` reads) or the IPC file format (Feather v2). A `datasets` directory is what
`Dataset.save_to_disk` writes (`state.json`, `dataset_info.json` and `data-*.arrow` files, listed in order
in `state.json`) or `DatasetDict.save_to_disk` (`dataset_dict.json` and one such directory per split).

All of this needs pyarrow (an optional dependency; `datasets` brings it).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from zaya.data.records import MAX_CHAT_TURNS, InputFile, Piece, ReadOptions, Record, column_record, too_long
from zaya.data.shards import plain_name
from zaya.errors import ZayaError
from zaya.reading import os_reason, read_json_object
from zaya.schema import Fields, shown

DATASET_STATE = "state.json"
DATASET_INFO = "dataset_info.json"
DATASET_DICT = "dataset_dict.json"
DEFAULT_SPLIT = "train"
_ROWS = 1024  # rows converted to Python strings at a time
_BATCH_BYTES = 16 << 20  # and about this many bytes of them (a cell over it on its own)
_IPC_FILE_MAGIC = b"ARROW1"
_MAX_ENTRIES = 1 << 20  # splits of a DatasetDict, arrow files of a Dataset


# ---- Hugging Face `datasets` directories -------------------------------------------------------------


def is_dataset_directory(path: Path) -> bool:
    """Whether a directory was written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return is_dataset_dict(path) or ((path / DATASET_STATE).is_file() and (path / DATASET_INFO).is_file())


def is_dataset_dict(path: Path) -> bool:
    """Whether a directory was written by `DatasetDict.save_to_disk` (a directory per split)."""
    return (path / DATASET_DICT).is_file()


def dataset_files(path: Path, split: str | None) -> list[Path]:
    """The arrow files of a saved dataset, in order; of a saved DatasetDict, those of `split` (`train` when
    None)."""
    if is_dataset_dict(path):
        splits = _read_json(path / DATASET_DICT).list("splits", of=str, max_len=_MAX_ENTRIES)
        chosen = split or DEFAULT_SPLIT
        if chosen not in splits:
            hint = "" if split else "; choose one with --split"
            listed = ", ".join(name if len(name) <= 60 else name[:57] + "..." for name in splits[:20])
            more = f" and {len(splits) - 20} more" if len(splits) > 20 else ""
            raise ZayaError(f"{path}: no split {shown(chosen)} (splits: {listed}{more}){hint}")
        if not plain_name(chosen):
            raise ZayaError(f"{path / DATASET_DICT}: split {shown(chosen)} must be a plain directory name")
        path = path / chosen
    state_path = path / DATASET_STATE
    entries = _read_json(state_path).list("_data_files", of=dict, max_len=_MAX_ENTRIES)
    files = []
    for i, entry in enumerate(entries):
        name = Fields(entry, state_path, f"_data_files.{i}").str("filename")
        if not plain_name(name):
            raise ZayaError(f"{state_path}: data file {shown(name)} must be a plain file name")
        if not (path / name).is_file():
            raise ZayaError(f"{path / name}: no such file (listed in {state_path})")
        files.append(path / name)
    return files


def _read_json(path: Path) -> Fields:
    # `datasets` metadata: a few KB, a list of file names at most (a cap of 16 MiB, nesting 64)
    return Fields(read_json_object(path, "document", "a datasets metadata file"), path)


# ---- pyarrow ------------------------------------------------------------------------------------------


def parquet_module(path: Path):
    """`pyarrow.parquet`, or a one-line error saying how to install it."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ZayaError(f"{path}: reading .parquet files needs pyarrow (pip install pyarrow)") from None
    return pq


def arrow_module(path: Path):
    """`pyarrow`, or a one-line error saying how to install it."""
    try:
        import pyarrow as pa
    except ImportError:
        raise ZayaError(f"{path}: reading arrow files needs pyarrow (pip install 'zaya-stack[corpora]')") from None
    return pa


CHAT_COLUMN = "messages"  # a chat table's column: a list of {role, content, ...} structs per row


def _column(options: ReadOptions) -> str:
    return CHAT_COLUMN if options.chat is not None else options.text_field


def _check_column(path: Path, schema, options: ReadOptions) -> None:
    """The column the rows are read from exists and holds text (or, for chats, lists of messages)."""
    import pyarrow as pa  # present: the caller opened the file with it

    name = _column(options)
    if name not in schema.names:
        raise ZayaError(f"{path}: no column '{name}' (columns: {', '.join(schema.names)})")
    column_type = schema.field(name).type
    if options.chat is not None:
        listed = (pa.types.is_list, pa.types.is_large_list)
        if not any(check(column_type) for check in listed) or not pa.types.is_struct(column_type.value_type):
            raise ZayaError(f"{path}: column '{name}' holds {column_type}, not a list of messages (structs)")
        return
    textual = (pa.types.is_string, pa.types.is_large_string, pa.types.is_binary, pa.types.is_large_binary)
    if not any(check(column_type) for check in textual):
        raise ZayaError(f"{path}: column '{name}' holds {column_type}, not text")


def _unreadable(path: Path, what: str, exc: Exception) -> ZayaError:
    if isinstance(exc, OSError) and exc.strerror:
        return ZayaError(f"{path}: cannot read ({os_reason(exc)})")
    # pyarrow raises ArrowInvalid (a ValueError) and friends for damaged files
    return ZayaError(f"{path}: not a readable {what} file ({str(exc).splitlines()[0] if str(exc) else exc!r})")


def _column_records(values: Iterator[list], options: ReadOptions) -> Generator[Record, None, int]:
    index, chat = 0, options.chat
    for chunk in values:
        for value in chunk:
            if isinstance(value, _Oversized):
                record = Record(index, None, value.problem)
            elif chat is None:
                record = column_record(index, value, options.text_field)
            elif value is None:
                record = Record(index, None, f"field '{CHAT_COLUMN}' is null")
            else:
                record = chat.record(index, {CHAT_COLUMN: value})
            if record is not None:
                yield record
            index += 1
    return index


# ---- parquet ------------------------------------------------------------------------------------------


def _parquet_file(path: Path):
    pq = parquet_module(path)
    try:
        return pq.ParquetFile(path)
    except Exception as exc:
        raise _unreadable(path, "parquet", exc) from None


def parquet_pieces(file: InputFile, index: int, options: ReadOptions) -> list[Piece]:
    """One piece per row group; checks the text column first."""
    parquet = _parquet_file(file.path)
    _check_column(file.path, parquet.schema_arrow, options)
    metadata = parquet.metadata
    return [Piece(index, group, group + 1, metadata.row_group(group).total_byte_size)
            for group in range(metadata.num_row_groups)]


def parquet_stream(file: InputFile, piece: Piece, options: ReadOptions) -> Generator[Record, None, int]:
    """The rows of a piece's row groups, decoded in batches of about `_BATCH_BYTES` (by the row groups' sizes)."""
    parquet = _parquet_file(file.path)
    groups = list(range(piece.start, piece.stop))
    batches = parquet.iter_batches(batch_size=_batch_rows(parquet.metadata, groups, _column(options)),
                                   row_groups=groups, columns=[_column(options)])
    return (yield from _column_records(_guarded(file.path, "parquet", batches, options), options))


def _batch_rows(metadata, groups: list[int], column: str) -> int:
    """Rows per decoded batch: about `_BATCH_BYTES` of the column, by its average size in these row groups."""
    size = rows = 0
    for group in groups:
        row_group = metadata.row_group(group)
        rows += row_group.num_rows
        for i in range(row_group.num_columns):
            chunk = row_group.column(i)
            if chunk.path_in_schema == column or chunk.path_in_schema.startswith(column + "."):
                size += chunk.total_uncompressed_size
    return max(1, min(_ROWS, _BATCH_BYTES * max(1, rows) // max(1, size)))


def _guarded(path: Path, what: str, batches, options: ReadOptions) -> Iterator[list]:
    try:
        for batch in batches:
            yield from _bounded(batch.column(0), options)
    except Exception as exc:
        raise _unreadable(path, what, exc) from None
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


# ---- arrow IPC ----------------------------------------------------------------------------------------


class _ArrowReader:
    """An arrow file's record batches, memory-mapped, in either IPC format."""

    def __init__(self, path: Path) -> None:
        pa = arrow_module(path)
        self.path = path
        try:
            self._map = pa.memory_map(str(path))
            self._stream = self._map.read(len(_IPC_FILE_MAGIC)) != _IPC_FILE_MAGIC
            self._map.seek(0)
            if self._stream:
                self._reader = pa.ipc.open_stream(self._map)
            else:
                self._reader = pa.ipc.open_file(self._map)
        except Exception as exc:
            self.close()
            raise _unreadable(path, "arrow", exc) from None
        self.schema = self._reader.schema

    def batches(self, start: int = 0, stop: int | None = None) -> Iterator:
        """Record batches [start, stop); a stream is read from its beginning (skipping costs only headers)."""
        try:
            if not self._stream:
                end = self._reader.num_record_batches if stop is None else stop
                for i in range(start, end):
                    yield self._reader.get_batch(i)
                return
            for i, batch in enumerate(self._reader):
                if stop is not None and i >= stop:
                    return
                if i >= start:
                    yield batch
        except Exception as exc:
            raise _unreadable(self.path, "arrow", exc) from None

    def close(self) -> None:
        mapped = getattr(self, "_map", None)
        if mapped is not None:
            mapped.close()


def arrow_pieces(file: InputFile, index: int, options: ReadOptions, target_bytes: int) -> list[Piece]:
    """Consecutive record batches grouped into pieces of about `target_bytes`; checks the text column."""
    reader = _ArrowReader(file.path)
    try:
        _check_column(file.path, reader.schema, options)
        pieces: list[Piece] = []
        start, size, count = 0, 0, 0
        for count, batch in enumerate(reader.batches(), start=1):
            size += batch.nbytes
            if size >= target_bytes:
                pieces.append(Piece(index, start, count, size))
                start, size = count, 0
        if start < count or not pieces:
            pieces.append(Piece(index, start, count, size))
        return pieces
    finally:
        reader.close()


def arrow_stream(file: InputFile, piece: Piece, options: ReadOptions) -> Generator[Record, None, int]:
    """The rows of a piece's record batches, `_ROWS` at a time."""
    reader = _ArrowReader(file.path)
    try:
        _check_column(file.path, reader.schema, options)
        column = reader.schema.get_field_index(_column(options))
        return (yield from _column_records(_sliced(reader.batches(piece.start, piece.stop), column, options),
                                           options))
    finally:
        reader.close()


def _sliced(batches: Iterator, column: int, options: ReadOptions) -> Iterator[list]:
    for batch in batches:
        yield from _bounded(batch.column(column), options)


# ---- rows as Python values, within bounds ---------------------------------------------------------------


@dataclass(frozen=True)
class _Oversized:
    """A cell over the bound for one record, in place of its value (never converted)."""

    problem: str


def _bounded(values, options: ReadOptions) -> Iterator[list]:
    """A column's cells as Python values, at most `_ROWS` and about `_BATCH_BYTES` at a time; a cell over the
    bound for one record (`ReadOptions.record_limit`; for chats also `MAX_CHAT_TURNS` messages) is an
    `_Oversized` instead, measured in arrow's memory and never converted."""
    sizes, turns = _cell_sizes(values, options.chat is not None)
    limit = options.record_limit
    start, count = 0, len(values)
    while start < count:
        stop, total = start, 0
        while (stop < count and stop - start < _ROWS and sizes[stop] <= limit and turns[stop] <= MAX_CHAT_TURNS
               and (stop == start or total + sizes[stop] <= _BATCH_BYTES)):
            total += int(sizes[stop])
            stop += 1
        if stop > start:
            yield values.slice(start, stop - start).to_pylist()
            start = stop
            continue
        if turns[start] > MAX_CHAT_TURNS:
            yield [_Oversized(f"a chat of {int(turns[start]):,} messages, more than {MAX_CHAT_TURNS:,} (the limit "
                              "for one chat)")]
        else:
            yield [_Oversized(too_long(0, "a chat" if options.chat is not None else "a cell", limit).problem)]
        start += 1


def _cell_sizes(values, chat: bool) -> tuple[np.ndarray, np.ndarray]:
    """The bytes of text in each cell (of a chat: in its messages' text fields) and, for chats, the number of
    messages (zeros otherwise)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    def text_bytes(array) -> np.ndarray:
        if not any(check(array.type) for check in (pa.types.is_string, pa.types.is_large_string,
                                                   pa.types.is_binary, pa.types.is_large_binary)):
            return np.zeros(len(array), dtype=np.int64)
        return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)

    if not chat:
        return text_bytes(values), np.zeros(len(values), dtype=np.int64)
    turns = values.value_lengths().fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    messages = values.flatten()  # the messages of these rows, in order (null rows have none)
    per_message = np.zeros(len(messages), dtype=np.int64)
    for child in messages.flatten():
        per_message += text_bytes(child)
    running = np.concatenate([[0], np.cumsum(per_message)])
    ends = np.cumsum(turns)
    return running[ends] - running[ends - turns], turns
