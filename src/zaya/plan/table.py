"""The efficiency table: the GEMM and attention rates `zaya shapes` measured on one device in one dtype,
with the device figures its interpolation needs, kept as JSON (`~/.cache/zaya/shapes/local-<dtype>.json`
unless `$ZAYA_CACHE` or `$XDG_CACHE_HOME` say otherwise) and read by `zaya plan --device local`."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from zaya.errors import ZayaError
from zaya.owned import check_output, make_parent, write_output
from zaya.reading import parse_json, read_bytes
from zaya.schema import Fields, shown

FORMAT = "zaya-gemm-table"
FORMAT_VERSION = 1
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
OPS = ("dense", "grouped", "attention")


def dtype_name(dtype: torch.dtype) -> str:
    """"fp32", "bf16" or "fp16" for a torch dtype."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ZayaError(f"no GEMM table for dtype {dtype} (known: {', '.join(DTYPES)})")


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ZayaError(f"unknown dtype '{name}' (known: {', '.join(DTYPES)})")
    return DTYPES[name]


def cache_dir(environ: Mapping[str, str]) -> Path:
    """Where zaya keeps what it measured, by the environment: $ZAYA_CACHE, else $XDG_CACHE_HOME/zaya, else
    ~/.cache/zaya."""
    if environ.get("ZAYA_CACHE"):
        return Path(environ["ZAYA_CACHE"])
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zaya"


def default_table_path(dtype: str, cache: Path) -> Path:
    """Where `zaya shapes` writes the local device's table for `dtype` under the cache directory `cache`
    (`cache_dir`), and where the planner looks for it."""
    return Path(cache) / "shapes" / f"local-{dtype}.json"


def _element_size(dtype: str) -> int:
    return torch_dtype(dtype).itemsize


def gemm_flops(op: str, m: int, n: int, k: int, groups: int = 1, batch: int = 1) -> float:
    """FLOPs of one call: 2 m n k for a (grouped) GEMM; for attention (m = T, n = d, k = query heads) forward
    4 Hq d T (T + 1) / 2 per sequence and backward twice that, as in `zaya.model.flops`."""
    if op == "attention":
        return 3.0 * 4 * k * n * m * (m + 1) / 2 * batch
    return 2.0 * m * n * k


def gemm_bytes(op: str, m: int, n: int, k: int, groups: int, element_size: int, batch: int = 1) -> float:
    """Bytes one call must move at least: its operands and result (attention: q, k, v, out and their
    gradients, forward + backward)."""
    if op == "attention":
        return float(element_size) * batch * m * n * 6 * (k + groups)
    weights = groups * k * n if op == "grouped" else k * n
    return float(element_size) * (m * k + weights + m * n)



# ---- the table ------------------------------------------------------------------------------------------


@dataclass
class GemmRecord:
    """One measured shape (see `GemmShape` for what m, n, k and groups mean per op)."""

    op: str
    m: int
    n: int
    k: int
    groups: int
    dtype: str
    seconds: float  # median time of one call (attention: forward + backward)
    flops: float  # FLOPs of one call
    kind: str = ""  # the model's name for it ("attn_in", ...); informative only

    @property
    def rate(self) -> float:
        """FLOP/s."""
        return self.flops / self.seconds if self.seconds > 0 else 0.0

    def key(self) -> tuple:
        return (self.op, self.m, self.n, self.k, self.groups, self.dtype)


_NEIGHBOURS = 4


@dataclass
class EfficiencyTable:
    """Measured GEMM rates of one device in one dtype, and the device figures the interpolation needs.

    `gemm_rate` (and `attention_rate`) interpolate between the measurements like this, deterministically:
    1. an exact match (op, m, n, k, groups, dtype) returns its measured rate;
    2. otherwise every measured shape of the same op and dtype gets its roofline efficiency
       r = t_roof / t_measured, where t_roof = max(FLOPs / peak, bytes / memory_bandwidth) + op_overhead_s
       (attention: per sequence, without the overhead), so that r carries what the roofline does not
       explain (tile quantisation, misalignment, kernel choice);
    3. log r is averaged over the 4 measured shapes nearest in log2 space (coordinates: dense (m, n, k);
       grouped (m / groups, n, k, groups); attention (T, d, Hq, Hk)) with inverse-square-distance weights;
    4. the rate is r x FLOPs / t_roof of the queried shape, capped at the larger of the measured peak and
       the best neighbour.
    So a shape between measured ones gets an efficiency between theirs, and a shape far smaller than any
    measured falls off with its arithmetic intensity and the per-op overhead instead of keeping a large
    GEMM's rate. Without measurements of the op in that dtype, the other GEMM op's (or, last, the median of
    all) efficiencies stand in. Results are cached per query.
    """

    device: str  # torch device it was measured on ("cpu", "cuda")
    device_label: str  # CPU model name or GPU name
    dtype: str  # "fp32", "bf16"
    peak_flops: float  # measured practical peak in `dtype` (large square matmuls)
    memory_bandwidth: float  # measured bytes/s of a large elementwise op
    op_overhead_s: float  # measured seconds per tiny op dispatch
    records: list[GemmRecord]
    preset: str
    measured_at: str  # ISO date-time
    torch_version: str
    peaks: dict[str, float] = field(default_factory=dict)  # measured peaks by dtype, `dtype` and fp32 included
    memory_bytes: int = 0  # device memory (host RAM for the CPU)
    tokens: list[int] = field(default_factory=list)  # micro-batch token counts the sweep used
    seq_lens: list[int] = field(default_factory=list)  # sequence lengths of its attention shapes
    skipped: dict[str, int] = field(default_factory=dict)  # shapes not measured, by reason
    # the model's elementwise work against the bytes model, measured by running it (`zaya.plan.calibrate`);
    # 0: not measured (the bytes model as it is)
    elementwise_factor: float = 0.0
    optimizer_factor: float = 0.0
    _cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)
    _index: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    # ---- queries ----------------------------------------------------------------------------------

    def peak(self, dtype: str | None = None) -> float:
        dtype = dtype or self.dtype
        if dtype == self.dtype:
            return self.peak_flops
        return self.peaks.get(dtype, self.peak_flops)

    def gemm_rate(self, op: str, m: int, n: int, k: int, groups: int = 1, dtype: str | None = None) -> float:
        """FLOP/s of one GEMM of this shape (see the class docstring for the interpolation); `dtype`
        defaults to the table's (the router's GEMMs are measured in fp32 in every table)."""
        if op not in ("dense", "grouped"):
            raise ZayaError(f"unknown GEMM op '{op}' (known: dense, grouped; attention: attention_rate)")
        return self._rate(op, int(m), int(n), int(k), int(groups), dtype or self.dtype)

    def attention_rate(self, seq_len: int, head_dim: int, heads: int, kv_heads: int,
                       dtype: str | None = None) -> float:
        """FLOP/s of causal attention, forward + backward (FLOPs as in `zaya.model.flops`)."""
        return self._rate("attention", int(seq_len), int(head_dim), int(heads), int(kv_heads), dtype or self.dtype)

    def efficiency(self, op: str, m: int, n: int, k: int, groups: int = 1, dtype: str | None = None) -> float:
        """`gemm_rate` as a fraction of the measured peak of its dtype."""
        return self.gemm_rate(op, m, n, k, groups, dtype) / self.peak(dtype)

    def gemm_seconds(self, op: str, m: int, n: int, k: int, groups: int = 1, dtype: str | None = None) -> float:
        """Predicted seconds of one call."""
        return gemm_flops(op, m, n, k, groups) / self.gemm_rate(op, m, n, k, groups, dtype)

    def record(self, op: str, m: int, n: int, k: int, groups: int = 1, dtype: str | None = None) -> GemmRecord | None:
        """The measurement of exactly this shape, if there is one."""
        return self._exact().get((op, m, n, k, groups, dtype or self.dtype))

    # ---- interpolation ----------------------------------------------------------------------------

    def _exact(self) -> dict[tuple, GemmRecord]:
        if "exact" not in self._index:
            self._index["exact"] = {r.key(): r for r in self.records}
        return self._index["exact"]

    def _roof_seconds(self, op: str, m: int, n: int, k: int, groups: int, dtype: str) -> float:
        flops = gemm_flops(op, m, n, k, groups)
        moved = gemm_bytes(op, m, n, k, groups, _element_size(dtype))
        roof = max(flops / self.peak(dtype), moved / self.memory_bandwidth if self.memory_bandwidth > 0 else 0.0)
        return roof if op == "attention" else roof + self.op_overhead_s

    @staticmethod
    def _coords(op: str, m: int, n: int, k: int, groups: int) -> tuple[float, ...]:
        if op == "grouped":
            return (math.log2(max(m / groups, 1e-3)), math.log2(n), math.log2(k), math.log2(groups))
        if op == "attention":
            return (math.log2(m), math.log2(n), math.log2(k), math.log2(groups))
        return (math.log2(m), math.log2(n), math.log2(k))

    def _points(self, op: str, dtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(coordinates [P, C], log r [P], rate [P]) of the measurements of `op` in `dtype`."""
        key = ("points", op, dtype)
        if key not in self._index:
            coords, log_r, rates = [], [], []
            for r in self.records:
                if r.op != op or r.dtype != dtype or r.seconds <= 0:
                    continue
                roof = self._roof_seconds(op, r.m, r.n, r.k, r.groups, dtype)
                if op == "attention":  # the roofline is per sequence: a call holds flops / flops-per-sequence
                    roof *= r.flops / gemm_flops(op, r.m, r.n, r.k, r.groups)
                coords.append(self._coords(op, r.m, r.n, r.k, r.groups))
                log_r.append(math.log(roof / r.seconds))
                rates.append(r.rate)
            width = 3 if op == "dense" else 4
            self._index[key] = (np.array(coords, dtype=np.float64).reshape(-1, width), np.array(log_r),
                                np.array(rates))
        return self._index[key]

    def _rate(self, op: str, m: int, n: int, k: int, groups: int, dtype: str) -> float:
        key = (op, m, n, k, groups, dtype)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        if min(m, n, k, groups) <= 0:
            raise ZayaError(f"a {op} shape needs positive sizes, got m={m} n={n} k={k} groups={groups}")
        exact = self._exact().get(key)
        rate = exact.rate if exact is not None and exact.seconds > 0 else self._interpolate(op, m, n, k, groups, dtype)
        self._cache[key] = rate
        return rate

    def _interpolate(self, op: str, m: int, n: int, k: int, groups: int, dtype: str) -> float:
        coords, log_rs, rates = self._points(op, dtype)
        query = np.array(self._coords(op, m, n, k, groups))
        if not len(rates) and op != "attention":  # the other GEMM op's efficiencies, with this op's roofline
            coords, log_rs, rates = self._points("grouped" if op == "dense" else "dense", dtype)
            coords, query = coords[:, :3], query[:3]
        roof = self._roof_seconds(op, m, n, k, groups, dtype)
        flops = gemm_flops(op, m, n, k, groups)
        if not len(rates):
            every = np.concatenate([self._points(o, d)[1] for o in OPS for d in sorted({dtype, self.dtype})])
            log_r = float(np.median(every)) if len(every) else 0.0
            return min(math.exp(log_r) * flops / roof, self.peak(dtype))
        distance = ((coords - query) ** 2).sum(axis=1)
        nearest = np.argsort(distance, kind="stable")[:_NEIGHBOURS]
        d, near_log_r = distance[nearest], log_rs[nearest]
        same = d == 0.0  # the same coordinates (a grouped shape of the same rows per group): those alone
        weights = same.astype(np.float64) if same.any() else 1.0 / d
        log_r = float((weights * near_log_r).sum() / weights.sum())
        cap = max(self.peak(dtype), float(rates[nearest].max()))
        return min(math.exp(log_r) * flops / roof, cap)

    # ---- files ------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.name.startswith("_")}
        data["records"] = [dataclasses.asdict(r) for r in self.records]
        return {"format": FORMAT, "version": FORMAT_VERSION, **data}

    def save(self, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
        """Write the table as JSON, whole or not at all, parents created. An existing file is replaced only with
        `overwrite`, and never one that is not a regular file (`zaya.owned.write_output`)."""
        path = Path(path)
        check_output(path, overwrite)
        make_parent(path)
        write_output(path, json.dumps(self.to_dict(), indent=1) + "\n", overwrite)
        return path

    def save_cache(self, path: str | os.PathLike) -> Path:
        """Write the table where `zaya plan --device local` looks for it (`default_table_path`), replacing only a
        GEMM table zaya wrote there (`check_cache`)."""
        path = Path(path)
        check_cache(path)
        make_parent(path)
        check_cache(path)  # again, just before the write: something may have appeared there meanwhile
        write_output(path, json.dumps(self.to_dict(), indent=1) + "\n", overwrite=True)
        return path

    @classmethod
    def from_dict(cls, data: Any, source: str = "GEMM table") -> EfficiencyTable:
        """The table of a parsed file; a field missing, of the wrong type or out of range is one `ZayaError`
        naming `source` and the key."""
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ZayaError(f"{source}: not a zaya GEMM table (written by `zaya shapes`)")
        if data.get("version") != FORMAT_VERSION:
            raise ZayaError(f"{source}: GEMM table format version {shown(data.get('version'))}, this zaya reads "
                            f"version {FORMAT_VERSION}: rerun `zaya shapes`")
        doc = Fields(data, source)
        records = [_record(Fields(item, source, f"records.{i}"))
                   for i, item in enumerate(doc.list("records", max_len=MAX_RECORDS))]
        peaks = doc.dict("peaks", {}, of=(int, float))
        for name, value in peaks.items():
            if not 0 < value <= MAX_RATE:
                raise ZayaError(f"{source}: field 'peaks.{name}' must be a number in (0, {MAX_RATE:g}], got "
                                f"{shown(value)}")
        return cls(
            device=doc.str("device", max_len=256), device_label=doc.str("device_label", max_len=1024),
            dtype=doc.str("dtype", choices=tuple(DTYPES)), peak_flops=_positive(doc, "peak_flops", MAX_RATE),
            memory_bandwidth=_positive(doc, "memory_bandwidth", MAX_RATE),
            op_overhead_s=doc.float("op_overhead_s", lo=0.0, hi=1.0), records=records,
            preset=doc.str("preset", max_len=256), measured_at=doc.str("measured_at", max_len=64),
            torch_version=doc.str("torch_version", max_len=256), peaks={k: float(v) for k, v in peaks.items()},
            memory_bytes=doc.int("memory_bytes", 0, lo=0), tokens=_sizes(doc, "tokens"),
            seq_lens=_sizes(doc, "seq_lens"),
            skipped=doc.dict("skipped", {}, of=int),
            elementwise_factor=doc.float("elementwise_factor", 0.0, lo=0.0, hi=MAX_FACTOR),
            optimizer_factor=doc.float("optimizer_factor", 0.0, lo=0.0, hi=MAX_FACTOR),
        )

    @classmethod
    def load(cls, path: str | os.PathLike) -> EfficiencyTable:
        """Read a table `save` wrote (a regular file of at most 64 MiB, `zaya.reading`); a missing, garbled or
        outdated file raises `ZayaError` naming it."""
        path = Path(path)
        try:
            os.lstat(path)
        except FileNotFoundError:
            raise ZayaError(f"{path}: no such GEMM table: run `zaya shapes` first") from None
        except OSError:
            pass  # the read below names what is wrong (a loop of links, a name too long)
        # bytes, not text: a file that is not UTF-8 is "not valid JSON" like any other garbage
        return cls.from_dict(parse_json(read_bytes(path, TABLE_KIND, "a GEMM table"), path), source=str(path))


# ---- the file's fields ----------------------------------------------------------------------------------

TABLE_KIND = "manifest"  # `zaya.reading` cap: 64 MiB, a hundred times the largest sweep's table
MAX_RECORDS = 1 << 17  # a sweep of the largest preset measures a few thousand shapes
MAX_LIST = 1 << 10  # token counts and sequence lengths of a sweep
MAX_DIM = 1 << 32  # a GEMM's m, n, k or groups (a vocabulary, a micro-batch's tokens: 2**24 at most)
MAX_RATE = 1e30  # FLOP/s or bytes/s: far beyond any device, and finite through every product the planner forms
MAX_FACTOR = 1e6  # the elementwise factors: a device a million times slower than its bytes model is no device


def _positive(doc: Fields, name: str, hi: float) -> float:
    value = doc.float(name, lo=0.0, hi=hi)
    if value <= 0:
        raise ZayaError(f"{doc.source}: field '{doc.key(name)}' must be a number in (0, {hi:g}], got {shown(value)}")
    return value


def _sizes(doc: Fields, name: str) -> list[int]:
    values = doc.list(name, [], of=int, max_len=MAX_LIST)
    for i, value in enumerate(values):
        if not 1 <= value <= MAX_DIM:
            raise ZayaError(f"{doc.source}: field '{name}.{i}' must be an integer in 1..{MAX_DIM:,}, got {value:,}")
    return values


def _record(doc: Fields) -> GemmRecord:
    dims = {name: doc.int(name, lo=1, hi=MAX_DIM) for name in ("m", "n", "k", "groups")}
    # a call of a picosecond or less, or of FLOPs beyond 1e30, is no measurement: its rate would overflow
    return GemmRecord(op=doc.str("op", choices=OPS), **dims, dtype=doc.str("dtype", choices=tuple(DTYPES)),
                      seconds=doc.float("seconds", lo=1e-12, hi=1e6), flops=_positive(doc, "flops", 1e30),
                      kind=doc.str("kind", "", max_len=256))


def is_table_file(path: str | os.PathLike) -> bool:
    """Whether `path` is a regular file holding a GEMM table zaya wrote (of any version): one zaya may replace."""
    try:
        data = parse_json(read_bytes(path, TABLE_KIND, "a GEMM table", follow_links=False), path)
    except ZayaError:
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def check_cache(path: str | os.PathLike) -> None:
    """Refuse to write the cached table at `path` over anything but a GEMM table zaya wrote: a link, FIFO, device
    or directory is never replaced, and a regular file only if it parses as one of zaya's tables."""
    path = Path(path)
    check_output(path, overwrite=True)
    if os.path.lexists(path) and not is_table_file(path):
        raise ZayaError(f"{path}: exists and is not a GEMM table zaya wrote; refusing to replace it (move it "
                        "away, or give --out)")


