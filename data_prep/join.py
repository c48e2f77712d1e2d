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
from .batch import Chunk, Reader, json_string, starts_with_header
from .build import BatchReader
from .checks import DamageCheck, PrepError, sum_stats
from .common import LOWERCASE, input_fingerprint
from .fasta import Record, input_position, iter_fasta
from .progress import Progress
from .rule import FILTERED, KEPT, NOT_IN_FASTA, REPLACED, STRICT
from .sources import Context

JOB_MEMORY = 512 << 20  # what one --clusters job may hold; the join engine gets JOIN_SHARE of it, Python the rest
JOIN_SHARE = 0.25
OTHER, NAME = -1, -2  # slot of another job's member, of a cluster name (keyed with a \x01 prefix)
ABSENT = 255  # status of a member without a FASTA record
SLOT_ROW = np.dtype([("slot", "<i8"), ("line", "<i8"), ("input", "<i4"), ("ntok", "<i4"), ("status", "u1")])


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
        """This job's DuckDB connection (an in-memory database that spills to ``temp``), made on first use."""
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
        table = pa.table(columns, schema=schema)
        if self.writer is None:
            self.writer = pq.ParquetWriter(self.path, schema, compression="none")
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def binary(data: bytes | np.ndarray, sizes: np.ndarray):
    """An Arrow array of ``len(sizes)`` byte strings laid out one after the other in ``data``."""
    import pyarrow as pa

    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(sizes), [None, pa.py_buffer(offsets),
                                                                            pa.py_buffer(data)])


def gather(data: np.ndarray, starts: np.ndarray, sizes: np.ndarray, group: int = 8192) -> np.ndarray:
    """data[starts[0]:starts[0]+sizes[0]] + data[starts[1]:...] + ...: joins of views, ``group`` rows at a time (a
    fancy index would take 8 bytes per byte, one view per row 200 bytes per row)."""
    total = int(sizes.sum())
    out = np.empty(total, np.uint8)
    if total == 0:
        return out
    view, at = memoryview(data), 0
    starts, sizes = starts.tolist(), sizes.tolist()
    for i in range(0, len(sizes), group):
        part = b"".join([view[a:a + n] for a, n in zip(starts[i:i + group], sizes[i:i + group])])
        out[at:at + len(part)] = np.frombuffer(part, np.uint8)
        at += len(part)
    return out


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


# ---------------------------------------------------------------------------------------- pass 4: the write
class Slots:
    """Pass 4's view of the joined table: the outcomes of a range of member slots, read from DuckDB in slot order
    (the clusters are written in TSV order, which is slot order)."""

    BATCH = 1 << 14

    def __init__(self, cmap):
        self.reader = cmap.spill.db().sql("SELECT slot, line, input, ntok, status, tokens, extra FROM joined "
                                          "ORDER BY slot").to_arrow_reader(self.BATCH)
        self.pending = None  # the rows read from DuckDB and not yet asked for

    def _upto(self, b: int):
        """The rows of slots below ``b`` not yet handed out (none of them is below the range asked before)."""
        import pyarrow as pa

        parts = []
        while True:
            if self.pending is None:
                try:
                    self.pending = self.reader.read_next_batch()
                except StopIteration:
                    break
            k = int(np.searchsorted(self.pending.column(0).to_numpy(), b))
            parts.append(self.pending.slice(0, k))
            if k < self.pending.num_rows:
                self.pending = self.pending.slice(k)
                break
            self.pending = None
        return pa.Table.from_batches(parts, self.reader.schema).combine_chunks()

    def range(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """For slots a..b-1: the SLOT_ROW of each (status ABSENT: not found in the FASTA), the tokens of the kept
        ones one after the other, and {slot: (extra JSON, input, line)} of the dropped ones."""
        import pyarrow as pa

        t = self._upto(b)
        out = np.zeros(b - a, SLOT_ROW)
        out["status"] = ABSENT
        slots = t.column("slot").to_numpy()
        for f in ("line", "input", "ntok", "status"):
            out[f][slots - a] = t.column(f).to_numpy()
        status = t.column("status").to_numpy()
        kept = (status == KEPT) | (status == REPLACED)
        tokens = t.column("tokens").filter(kept).combine_chunks()
        width = np.int64 if pa.types.is_large_binary(tokens.type) else np.int32
        offsets = np.frombuffer(tokens.buffers()[1], width)[tokens.offset:tokens.offset + len(tokens) + 1]
        data = np.frombuffer(tokens.buffers()[2], np.uint8)[offsets[0]:offsets[-1]] if len(tokens) else \
            np.zeros(0, np.uint8)
        extras = {}
        for i in np.flatnonzero(~kept).tolist():
            extras[int(slots[i])] = (t.column("extra")[i].as_py(), int(out["input"][slots[i] - a]),
                                     int(out["line"][slots[i] - a]))
        return out, data, extras


_ESCAPED = np.ones(256, bool)  # the bytes json.dumps escapes in a string (ensure_ascii): all but printable ASCII
_ESCAPED[0x20:0x7f] = False
_ESCAPED[[ord('"'), ord("\\")]] = True


class Writer:
    """Pass 4: this job's clusters in TSV order, a batch of about BATCH members at a time. The clusters whose
    members were all kept (the rule) are written with one ShardSet.extend per run of them, their meta JSON made
    by one %-operation; the others one by one, naming what was dropped."""

    BATCH = 1 << 14

    def __init__(self, cmap, sp, inputs: list[Path], stats: dict, filtered: dict,
                 members_filtered: dict, source_name: str):
        self.cmap, self.sp, self.inputs, self.slots = cmap, sp, inputs, Slots(cmap)
        self.stats, self.filtered, self.members_filtered, self.source = stats, filtered, members_filtered, source_name
        self.meta_format = ('{"id":%s,"source":' + json_string(source_name).replace("%", "%%")
                            + ',"length":%d,"members":%s,"listed":%d}\n')

    def run(self, bar: Progress) -> None:
        for index, names, members, lines, firsts, counts in self.cmap.own():
            # batches of about BATCH members (a cluster larger than that alone)
            cuts = np.unique(np.searchsorted(np.cumsum(counts), np.arange(self.BATCH, int(counts.sum()),
                                                                          self.BATCH)) + 1)
            for i, j in zip([0, *cuts.tolist()], [*cuts.tolist(), len(counts)]):
                if i < j:
                    self._batch(tuple(index[i:j].tolist()), names[i:j], members[i:j], lines[i:j].tolist(),
                                firsts[i:j].tolist(), counts[i:j])
            bar.update(input_position(self.cmap.path), written=self.stats["clusters_kept"])

    def _batch(self, index: tuple, names: list, members: list, lines: list, firsts: list, counts: np.ndarray
               ) -> None:
        a = firsts[0]
        rows, tokens, extras = self.slots.range(a, firsts[-1] + int(counts[-1]))
        starts = np.zeros(len(counts), np.int64)
        np.cumsum(counts[:-1], out=starts[1:])
        kept = (rows["status"] == KEPT) | (rows["status"] == REPLACED)
        lengths = np.where(kept, rows["ntok"], 0).astype(np.int64)
        kept_n = np.add.reduceat(kept.astype(np.int64), starts)
        size = np.add.reduceat(lengths, starts)  # tokens of each cluster
        bounds = np.zeros(len(counts) + 1, np.int64)  # of each cluster's tokens in ``tokens``
        np.cumsum(size, out=bounds[1:])
        kb = np.zeros(len(counts) + 1, np.int64)  # of each cluster's kept members in ``member_lengths``
        np.cumsum(kept_n, out=kb[1:])
        member_lengths = rows["ntok"][kept].astype(np.int64)
        st = self.stats
        st["clusters_kept"] += int(np.count_nonzero(kept_n))
        st["members_kept"] += int(kept_n.sum())
        st["residues"] += int(size.sum())
        joined = "".join(members)
        plain = joined.isascii() and not _ESCAPED[np.frombuffer(joined.encode("ascii"), np.uint8)].any()
        prev = 0
        for j in np.flatnonzero(kept_n != counts).tolist() + [len(counts)]:
            if prev < j:  # clusters prev..j-1, every member kept
                listed = [f'["{m.replace(",", chr(34) + "," + chr(34))}"]' if plain else
                          json.dumps(m.split(","), separators=(",", ":")) for m in members[prev:j]]
                flat = [None] * (4 * (j - prev))
                flat[0::4], flat[1::4] = map(json_string, names[prev:j]), size[prev:j].tolist()
                flat[2::4], flat[3::4] = listed, counts[prev:j].tolist()
                metas = ((self.meta_format * (j - prev)) % tuple(flat)).split("\n")[:-1]
                keys = (("%012d\n" * (j - prev)) % index[prev:j]).split("\n")[:-1]
                self.sp.extend(keys, tokens[bounds[prev]:bounds[j]], bounds[prev:j + 1] - bounds[prev], metas,
                               member_lengths[kb[prev]:kb[j]])
            if j < len(counts):
                self._one(index[j], names[j], members[j], lines[j], firsts[j], a, rows, extras,
                          tokens[bounds[j]:bounds[j + 1]], member_lengths[kb[j]:kb[j + 1]])
            prev = j + 1

    def _one(self, index: int, name: str, members: str, line: int, first: int, a: int, rows: np.ndarray,
             extras: dict, tokens: np.ndarray, member_lengths: np.ndarray) -> None:
        """A cluster with members dropped (its slots first.., rows[first - a:]): each named in filtered.tsv and
        meta ``dropped``."""
        sp, kept, dropped = self.sp, [], {}
        for k, m in enumerate(members.split(",")):
            status = int(rows["status"][first - a + k])
            if status in (KEPT, REPLACED):
                kept.append(m)
                continue
            if status == ABSENT:
                reason = NOT_IN_FASTA
                sp.dropped.add(m, reason, self.cmap.path, line, rule.member_detail(name))
            else:
                extra, n_input, at_line = extras[first + k]
                reason, detail = json.loads(extra)[:2]
                sp.dropped.add(m, reason, self.inputs[n_input], at_line, rule.member_detail(name, detail))
            self.members_filtered[reason] = self.members_filtered.get(reason, 0) + 1
            dropped[m] = reason
        if not kept:
            reason = rule.cluster_reason(dropped)
            self.filtered[reason] += 1
            sp.dropped.add(name, reason, self.cmap.path, line, f"cluster of {len(dropped)} members")
            return
        offsets = np.zeros(len(kept) + 1, np.int64)
        np.cumsum(member_lengths, out=offsets[1:])
        meta = {"id": name, "source": self.source, "length": int(offsets[-1]), "members": kept,
                "listed": len(kept) + len(dropped), "dropped": dropped}
        sp.write(f"{index:012d}", tokens, meta, offsets)
