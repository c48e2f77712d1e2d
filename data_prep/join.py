"""The join of ``--clusters`` (data_prep/clusters.py) on DuckDB: every member's fate in bounded memory.

1. TSV (data_prep/clusters.py ``load_clusters``): every member id and cluster name of the mapping, with this job's
   members' slots (a member's position among the job's members in TSV order), into a Parquet table (``Spill.tsv``);
   DuckDB finds the ids listed twice.
2. FASTA (``read_fasta``): the member FASTA parsed once, in bulk (data_prep/batch.py chunks), every record's outcome
   by the record rule (data_prep/rule.py) into a Parquet table (id, record number, input, line, outcome, tokens).
3. Join (``join``): DuckDB joins the job's members to their records into a table, from which the manifest's counts
   and checks are read.
4. Write (``Writer``): the TSV again, cluster by cluster in TSV order, each member's outcome read from the joined
   table ordered by slot.

The join, the ordering and their spill to disk are DuckDB's, under ``memory_limit`` (a share of the job's
``JOB_MEMORY``) with its temporary files in the spill folder under ``$TMPDIR`` (removed at the end, whatever the
end). A fed --workers run (data_prep/workers.py) shares one folder: each worker writes its records' table, waits for
the others (``Feed.wait_for_peers``) and joins them all.
"""
from __future__ import annotations

import heapq
import json
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from . import rule
from .batch import Chunk, Reader, starts_with_header
from .build import BatchReader
from .checks import DamageCheck, PrepError, sum_stats
from .cluster_write import Slots, Writer  # noqa: F401 -- pass 4, named here with the passes before it
from .common import LOWERCASE, input_fingerprint
from .fasta import Record, input_position, iter_fasta
from .gather import gather
from .progress import Progress
from .rule import FILTERED, KEPT, REPLACED, STRICT
from .sources import Context

JOB_MEMORY = 512 << 20  # what one --clusters job may hold; the join engine gets JOIN_SHARE of it, Python the rest
JOIN_SHARE = 0.25
OTHER, NAME = -1, -2  # slot of another job's member, of a cluster name (keyed with a \x01 prefix)


def memory_limit(jobs: int = 1) -> int:
    """DuckDB's memory_limit in bytes: its share of the job's budget (``jobs`` of a --workers run share one)."""
    return max(16 << 20, int(JOB_MEMORY * JOIN_SHARE) // max(jobs, 1))


class Spill:
    """The job's temporary folder (under $TMPDIR): the TSV's and the FASTA's tables and DuckDB's temporary files,
    removed by ``remove``. ``shared``: in a fed --workers run (data_prep/workers.py), the folder its parent made for
    all ``jobs`` workers and removes at the end: each job's files are named by its ``job`` index, and every job
    joins the FASTA tables of all of them (each worker read only the chunks its parent dealt it)."""

    def __init__(self, shared: Path | None = None, job: int = 0, jobs: int = 1):
        self.shared = shared is not None
        self.path = Path(shared) if self.shared else Path(tempfile.mkdtemp(prefix="data_prep-clusters-"))
        self.job, self.jobs = job, jobs
        tag = f"-j{job:04d}" if self.shared else ""
        self.tsv, self.fasta = self.path / f"tsv{tag}.parquet", self.path / f"fasta{tag}.parquet"
        self.temp = self.path / f"duckdb{tag}"
        self.fasta_all = [self.path / f"fasta-j{k:04d}.parquet" for k in range(jobs)] if self.shared else [self.fasta]
        self._db = None

    def db(self):
        """This job's DuckDB connection, made on first use: an in-memory database whose tables and operators spill
        to ``temp`` under the memory limit (a database file instead cost a third more time on the P3uc input)."""
        if self._db is None:
            import duckdb

            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            self._db = duckdb.connect(config={
                "memory_limit": f"{memory_limit(self.jobs if self.shared else 1)}B", "temp_directory": str(self.temp),
                "threads": max(1, cores // (self.jobs if self.shared else 1)), "preserve_insertion_order": False})
        return self._db

    def sql(self, query: str, *params):
        return self.db().execute(query, list(params) if params else None)

    def repeated(self) -> set[str]:
        """Ids (names with their \x01 prefix) that the TSV lists more than once."""
        rows = self.sql(f"SELECT id FROM read_parquet({_paths([self.tsv])}) GROUP BY id HAVING count(*) > 1")
        return {r[0] for r in rows.fetchall()}

    def remove(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if not self.shared:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        self.tsv.unlink(missing_ok=True)  # the FASTA table stays: the other workers may still be joining it
        shutil.rmtree(self.temp, ignore_errors=True)


def _paths(paths: list[Path]) -> str:
    """A list of file names as a DuckDB literal."""
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


# the columns of the TSV's and the FASTA's tables (pyarrow type names)
TSV_COLUMNS = {"id": "string", "slot": "int64"}
FASTA_COLUMNS = {"id": "string", "rec": "int64", "input": "int32", "line": "int64", "status": "uint8",
                 "lower": "int64", "ntok": "int64", "tokens": "large_binary", "extra": "string"}


class TableWriter:
    """A Parquet file of ``columns`` ({name: pyarrow type name}) written a batch of columns at a time."""

    def __init__(self, path: Path, columns: dict):
        self.path, self.columns, self.writer = path, columns, None

    def write(self, columns: dict) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([(k, getattr(pa, t)()) for k, t in self.columns.items()])
        table = pa.Table.from_arrays([_array(columns[k], t) for k, t in self.columns.items()], schema=schema)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, schema, compression="none")
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def _array(values, kind: str):
    """An Arrow array of type ``kind`` (a pyarrow type name) from its buffers: numbers from numpy, strings from a
    list of str or None (pyarrow's own conversions import pandas, a third of a second and 50 MB)."""
    import pyarrow as pa

    if isinstance(values, pa.Array):
        return values
    if kind == "string":  # a list of str or None
        enc = [b"" if v is None else v.encode() for v in values]
        offsets = np.zeros(len(enc) + 1, np.int32)
        np.cumsum(np.fromiter(map(len, enc), np.int32, len(enc)), out=offsets[1:])
        valid = np.fromiter((v is not None for v in values), bool, len(enc))
        mask = None if valid.all() else pa.py_buffer(np.packbits(valid, bitorder="little"))
        return pa.Array.from_buffers(pa.string(), len(enc), [mask, pa.py_buffer(offsets), pa.py_buffer(b"".join(enc))])
    data = np.ascontiguousarray(values, np.dtype(kind))
    return pa.Array.from_buffers(getattr(pa, kind)(), len(data), [None, pa.py_buffer(data)])


def binary(data: bytes | np.ndarray, sizes: np.ndarray):
    """An Arrow array of ``len(sizes)`` byte strings laid out one after the other in ``data``."""
    import pyarrow as pa

    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(sizes), [None, pa.py_buffer(offsets),
                                                                            pa.py_buffer(data)])


def _extra(verdict: rule.Verdict) -> str:
    """A dropped member's verdict as the table holds it: [reason, detail, characters, damage message]."""
    return json.dumps([verdict.reason, verdict.detail, dict(verdict.chars) if verdict.chars else None,
                       verdict.damage])


# ---------------------------------------------------------------------------------------- pass 2: the FASTA
class Outcomes:
    """What becomes of each FASTA record as a cluster member, decided by the record rule while it is read and
    written to the spill's FASTA table (lowercase upper-cased, --replace-invalid, --strict, the length filters)."""

    def __init__(self, encoder, settings, spill: Spill):
        self.encoder, self.s, self.spill = encoder, settings, spill
        self.out = TableWriter(spill.fasta, FASTA_COLUMNS)
        self.records = 0  # records read by this process
        self.first_record: str | None = None  # the first of them (a fed worker's: its first chunk's)

    def record(self, rec: Record, path: Path) -> tuple[int, bytes, str | None, int]:
        """(status, tokens, extra JSON, lowercase residues) of one record read on the per-record path."""
        s, encoder = self.s, self.encoder
        if rec.length is not None:  # longer than the bound: skipped unread (batch.chunks, fasta.iter_fasta)
            return FILTERED, b"", self.length_filter(rec.length, path, rec.line, rec.id), 0
        verdict, seq, replaced = rule.invalid(s, encoder, rec, rec.seq.upper(), path)
        if verdict is not None and verdict.status == STRICT:
            return STRICT, b"", json.dumps([verdict.damage]), 0
        if verdict is not None and verdict.status == FILTERED:
            return FILTERED, b"", _extra(verdict), 0
        drop = self.length_filter(len(seq), path, rec.line, rec.id)
        if drop is not None:
            return FILTERED, b"", drop, 0
        lower = int(LOWERCASE[np.frombuffer(rec.seq, np.uint8)].sum()) if rec.seq.upper() != rec.seq else 0
        tokens = encoder.encode(seq).tobytes()
        if replaced:
            return REPLACED, tokens, json.dumps(replaced), lower
        return KEPT, tokens, None, lower

    def length_filter(self, n: int, path: Path, line: int, rid: str) -> str | None:
        verdict = rule.length(self.s, n, rid, path, line, "member")
        return None if verdict is None else _extra(verdict)

    def records_of(self, recs: list[Record], path: Path, n_input: int, first: int) -> None:
        """Records read one by one (an input the batch reader does not take, or a chunk it hands over whole), the
        first of them global record ``first``."""
        out = [self.record(rec, path) for rec in recs]
        self._write([r.id for r in recs], np.arange(first, first + len(recs)), n_input,
                    np.array([r.line for r in recs], np.int64), np.array([o[0] for o in out], np.uint8),
                    np.array([o[3] for o in out], np.int64), b"".join(o[1] for o in out),
                    np.array([len(o[1]) for o in out], np.int64), [o[2] for o in out])

    def chunk(self, chunk: Chunk, path: Path, n_input: int) -> None:
        """A batch-reader chunk: its records' outcomes with a few numpy operations; the records it hands over
        (``slow``) and those the length filters drop, one by one."""
        n, bounds = len(chunk), chunk.bounds
        ntok = np.diff(bounds)
        newlines = np.flatnonzero(np.frombuffer(chunk.text, np.uint8) == 10)
        line = chunk.first_line + np.searchsorted(newlines, chunk.header_starts)
        cum = chunk.lowercase_cum()
        lower = cum[bounds[1:]] - cum[bounds[:-1]] if cum is not None else np.zeros(n, np.int64)
        status, extra = np.zeros(n, np.uint8), [None] * n
        starts = bounds[:-1].copy()  # of each record's tokens in tokens + aux
        aux, at = [], len(chunk.tokens)
        special = sorted(set(np.flatnonzero(rule.length_drops(self.s, ntok)).tolist()) | set(chunk.slow))
        for j in special:
            if j in chunk.slow:
                rec = chunk.slow[j]
                if isinstance(rec, Exception):
                    raise rec
                status[j], tokens, extra[j], lower[j] = self.record(rec, path)
            else:
                status[j], tokens, lower[j] = FILTERED, b"", 0
                extra[j] = self.length_filter(int(ntok[j]), path, int(line[j]), chunk.ids[j])
            ntok[j], starts[j] = len(tokens), at
            aux.append(tokens)
            at += len(tokens)
        data = chunk.tokens
        if special:  # tokens in record order (the records' in place, the others' from aux)
            data = gather(np.frombuffer(chunk.tokens + b"".join(aux), np.uint8), starts, ntok)
        self._write(chunk.ids, chunk.index, n_input, line, status, lower, data, ntok, extra)

    def _write(self, ids: list[str], rec: np.ndarray, n_input: int, line: np.ndarray, status: np.ndarray,
               lower: np.ndarray, data, ntok: np.ndarray, extra: list) -> None:
        if not len(ids):
            return
        if self.first_record is None:
            self.first_record = ids[0]
        self.records += len(ids)
        self.out.write({"id": ids, "rec": np.asarray(rec, np.int64), "input": np.full(len(ids), n_input, np.int32),
                        "line": np.asarray(line, np.int64), "status": status, "lower": np.asarray(lower, np.int64),
                        "ntok": np.asarray(ntok, np.int64), "tokens": binary(data, np.asarray(ntok, np.int64)),
                        "extra": extra})


def read_fasta(outcomes: Outcomes, encoder, inputs: list[Path], source, progress: tuple, feed=None) -> list[dict]:
    """Pass 2: every record of the member FASTA files into the spill (``feed``, a fed --workers job: the chunks
    its parent dealt it, each input starting with a header); returns each input's counts."""

    batch = BatchReader(source, encoder, Context(encoder.invalid_positions, bound=rule.read_bound(outcomes.s)))
    sizes = [p.stat().st_size for p in inputs]
    counts = []
    first = 0  # global record number of the input's first record
    try:
        with Progress(f"{source.name} members", sum(sizes), *progress) as bar:
            for n_input, path in enumerate(inputs):
                if feed is not None or starts_with_header(path):  # ids, no meta
                    texts = Reader(path, batch.tokens, batch.check, None, first_index=first,
                                   texts=None if feed is None else feed.texts(path), bound=batch.bound)
                else:  # a BOM, blank lines first: record by record, in batches
                    texts = _batches(iter_fasta(path, batch.check, on_invalid="yield", bound=batch.bound))
                end = first
                for part in texts:
                    if isinstance(part, Chunk):
                        outcomes.chunk(part, path, n_input)
                    else:  # a batch, or a chunk the Reader read record by record (starting at its ``start``)
                        at = texts.start if isinstance(texts, Reader) else end
                        outcomes.records_of(part, path, n_input, at)
                        end = at + len(part)
                    bar.update(sum(sizes[:n_input]) + input_position(path), records=outcomes.records)
                if isinstance(texts, Reader):
                    end = texts.index  # after the input's last record (fed: as the parent counted them)
                if end == first:
                    raise PrepError(f"{path}: no records in this input (empty after decompression?)")
                counts.append({"path": str(path), **input_fingerprint(path), "records": end - first,
                               "members": 0, "kept": 0, "residues": 0})
                first = end
            bar.update(sum(sizes), records=outcomes.records)
    finally:
        outcomes.out.close()
    return counts


def _batches(records, size: int = 4096):
    batch = []
    for rec in records:
        batch.append(rec)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


# ------------------------------------------------------------------------------------------ pass 3: the join
@dataclass
class Joined:
    members_found: int = 0
    lowercase: int = 0
    strict: tuple | None = None  # (record number, error) of the first member that --strict refuses
    repeat: tuple | None = None  # (record number, slot, input, line) of the first member record seen twice


def join(cmap, counts: list[dict], damage: DamageCheck, invalid_chars: Counter,
         replaced_stats: dict | None) -> Joined:
    """Pass 3: this job's members joined to their FASTA records by DuckDB into the table ``joined`` (slot, the
    record's place, outcome and tokens); the counts and checks of the manifest read from it (a member with two
    records is an error: ``repeat``)."""
    spill, got = cmap.spill, Joined()
    tables = [p for p in spill.fasta_all if p.exists()]
    fasta = f"read_parquet({_paths(tables)})" if tables else \
        "(SELECT ''::VARCHAR id, 0::BIGINT rec, 0 input, 0::BIGINT line, 0::UTINYINT status, 0::BIGINT lower, " \
        "0::BIGINT ntok, ''::BLOB tokens, ''::VARCHAR extra WHERE false)"
    spill.sql(f"CREATE TEMP TABLE joined AS SELECT t.slot, f.rec, f.input, f.line, f.status, f.lower, f.ntok, "
              f"f.tokens, f.extra FROM read_parquet({_paths([spill.tsv])}) t JOIN {fasta} f ON t.id = f.id "
              "WHERE t.slot >= 0")
    twice = "SELECT slot FROM joined GROUP BY slot HAVING count(*) > 1"
    if spill.sql(f"SELECT count(*) FROM ({twice})").fetchone()[0]:  # a member's second record: an error (build)
        got.repeat = spill.sql(f"SELECT rec, slot, input, line FROM joined WHERE slot IN ({twice}) QUALIFY "
                               "row_number() OVER (PARTITION BY slot ORDER BY rec) = 2 ORDER BY rec LIMIT 1"
                               ).fetchone()
        spill.sql("DELETE FROM joined WHERE rowid IN (SELECT rowid FROM joined QUALIFY row_number() OVER "
                  "(PARTITION BY slot ORDER BY rec) > 1)")
    kept = f"status IN ({KEPT}, {REPLACED})"
    per_input = spill.sql(f"SELECT input, count(*), count(*) FILTER ({kept}), coalesce(sum(ntok) FILTER ({kept}), 0), "
                          f"coalesce(sum(lower) FILTER ({kept}), 0) FROM joined GROUP BY input").fetchall()
    for n_input, members, kept_n, residues, lower in per_input:
        counts[n_input].update(members=members, kept=kept_n, residues=int(residues))
        got.members_found += members
        got.lowercase += int(lower)
    examples: list[tuple[int, str]] = []  # the damaged members first in FASTA order (a heap of -record, error)
    rows = spill.sql(f"SELECT rec, status, extra FROM joined WHERE status <> {KEPT} ORDER BY slot")
    while batch := rows.fetchmany(4096):
        for rec, status, extra in batch:
            extra = json.loads(extra)
            if status == REPLACED:
                replaced_stats["replaced_characters"] += sum(extra.values())
                replaced_stats["records_with_replacements"] += 1
                replaced_stats["replaced"] = sum_stats(replaced_stats["replaced"], extra)
            elif status == STRICT:
                got.strict = min(got.strict or (rec, extra[0]), (rec, extra[0]))
            else:
                reason, _, chars, error = extra
                if chars:
                    invalid_chars.update(chars)
                if error is not None:
                    damage.add(reason, None, Counter(chars) if chars else None)
                    heapq.heappush(examples, (-rec, error))
                    if len(examples) > damage.EXAMPLES:
                        heapq.heappop(examples)
    damage.examples = [e for _, e in sorted(examples, reverse=True)]
    return got
