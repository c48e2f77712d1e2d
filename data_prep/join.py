"""The join of ``--clusters`` (data_prep/clusters.py) on disk: every member's fate in bounded memory.

Memory does not grow with the corpus: the FASTA is read in bulk (data_prep/batch.py, 4 MB chunks) and every
member's fate is a join of two streams that do not share an order (FASTA order and TSV order), done as a hash
join on disk (a Grace join; ``Spill``):

1. TSV pass (data_prep/clusters.py ``load_clusters``): each member id and cluster name -> a 128-bit key (two 64-bit ``hash``es) and,
   for this job's members, its slot (its position among the job's members in TSV order), appended to one of B
   bucket files by key. Per bucket: repeated keys -> the ids listed twice (named by a second pass).
2. FASTA pass (``read_fasta``): every record's outcome (tokens, or why it is dropped) with its key, into the B FASTA buckets.
3. Join (``join``), bucket by bucket: the job's members meet their records; each found member's outcome is appended to one
   of B slot buckets by slot range; the counts and checks of the manifest are made here.
4. Write (``Writer``): the TSV again, cluster by cluster in TSV order, each member's outcome read from the slot
   buckets in order.

B is the inputs' size (gzip counted x5) over ``BUCKET_BYTES``, so a bucket holds at most about BUCKET_BYTES of
tokens at any corpus size. The spill lives in a temporary folder under ``$TMPDIR`` (removed at the end, whatever
the end): about twice the members' tokens plus 64 bytes per member id, for the length of the job. A 128-bit key is
what identifies an id (a collision of two of 10^9 ids: about 10^-21).
"""
from __future__ import annotations

import heapq
import json
import math
import resource
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .batch import Chunk, Reader, is_gzip, json_string, starts_with_header
from .build import BatchReader
from .checks import DamageCheck, PrepError, sum_stats
from .common import LOWERCASE, input_fingerprint
from .fasta import Record, input_position, iter_fasta
from .progress import Progress
from . import rule
from .rule import FILTERED, KEPT, NOT_IN_FASTA, REPLACED, STRICT
from .sources import Context

BUCKET_BYTES = 8 << 20  # input bytes per bucket: what one step of the join holds in memory (tokens about as much)
MAX_BUCKETS = 4096  # files open at once (ulimit -n is raised to it); beyond 32 GB of input buckets grow instead
FLUSH = 1 << 16  # ids collected before the TSV pass writes them to the buckets

# key (k1, k2) of an id; in the TSV buckets with the slot: >= 0 this job's member, OTHER another job's, NAME a
# cluster name (keyed with a \x01 prefix, so a name never meets a member id)
TSV_ROW = np.dtype([("k1", "<u8"), ("k2", "<u8"), ("slot", "<i8")])
OTHER, NAME = -1, -2
# a FASTA record's outcome: its key, place (global record number, input, line) and payload (ntok tokens, then
# nextra bytes of JSON: KEPT none, REPLACED {char: count}, FILTERED [reason, detail, chars, damage message],
# STRICT [error])
FASTA_ROW = np.dtype([("k1", "<u8"), ("k2", "<u8"), ("rec", "<i8"), ("line", "<i8"), ("input", "<i4"),
                      ("ntok", "<i4"), ("nextra", "<i4"), ("lower", "<i4"), ("status", "u1")])
SLOT_ROW = np.dtype([("slot", "<i8"), ("line", "<i8"), ("input", "<i4"), ("ntok", "<i4"), ("nextra", "<i4"),
                     ("status", "u1")])


def _extra(verdict: rule.Verdict) -> bytes:
    """A dropped member's verdict as the spill holds it: [reason, detail, characters, damage message]."""
    return json.dumps([verdict.reason, verdict.detail, dict(verdict.chars) if verdict.chars else None,
                       verdict.damage]).encode()


def keys(ids: list[str], prefix: str = "") -> tuple[np.ndarray, np.ndarray]:
    """(k1, k2) uint64 of each id: two hashes of this process (the spill never outlives it; the workers of a fed
    --workers run are forked from one process, so they share its hash seed and each other's keys)."""
    if prefix:
        ids = [prefix + i for i in ids]
    k1 = np.fromiter(map(hash, ids), np.int64, len(ids)).view(np.uint64)
    k2 = np.fromiter(map(hash, [i + "\x00" for i in ids]), np.int64, len(ids)).view(np.uint64)
    return k1, k2


def bucket_count(paths: list[Path]) -> int:
    size = sum(p.stat().st_size * (5 if is_gzip(p) else 1) for p in paths)
    return min(MAX_BUCKETS, max(1, math.ceil(size / BUCKET_BYTES)))


class Spill:
    """The job's temporary folder of bucket files (under $TMPDIR), removed by ``remove``. ``shared``: in a fed
    --workers run (data_prep/workers.py), the folder its parent made for all ``jobs`` workers and removes at the
    end: each job's files are named by its ``job`` index, and every job joins the FASTA buckets of all of them
    (each worker read only the chunks its parent dealt it)."""

    def __init__(self, buckets: int, shared: Path | None = None, job: int = 0, jobs: int = 1):
        self.shared = shared is not None
        self.path = Path(shared) if self.shared else Path(tempfile.mkdtemp(prefix="data_prep-clusters-"))
        self.buckets, self.job, self.jobs = buckets, job, jobs
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        need = buckets + 256  # one bucket set open at a time, and the job's own files
        if soft != resource.RLIM_INFINITY and soft < need:
            if hard != resource.RLIM_INFINITY and hard < need:
                raise PrepError(f"--clusters needs {need} open files for its {buckets} buckets and the limit is "
                                f"{hard} (ulimit -n); raise it")
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))

    def files(self, name: str, job: int | None = None) -> list[Path]:
        """This job's (or ``job``'s) bucket files of kind ``name``, one per bucket."""
        tag = f"-j{self.job if job is None else job:04d}" if self.shared else ""
        return [self.path / f"{name}{tag}-{b:05d}.bin" for b in range(self.buckets)]

    def fasta_buckets(self) -> list[list[Path]]:
        """Per bucket, the FASTA bucket files the join reads: this job's, or in a shared folder every job's."""
        jobs = range(self.jobs) if self.shared else [None]
        return [list(paths) for paths in zip(*(self.files("fasta", k) for k in jobs))]

    def remove(self) -> None:
        if not self.shared:
            shutil.rmtree(self.path, ignore_errors=True)
            return
        for name in ("tsv", "slot"):  # the FASTA buckets stay: the other workers may still be joining them
            for p in self.files(name):
                p.unlink(missing_ok=True)


class BlockWriter:
    """One set of bucket files, each a run of blocks: (rows, data bytes) as int64 pair, rows, data."""

    def __init__(self, paths: list[Path]):
        self.files = [open(p, "wb") for p in paths]

    def write(self, rows: np.ndarray, data: np.ndarray, bucket: np.ndarray, sizes: np.ndarray) -> None:
        """Rows (and their data: ``sizes`` bytes each, in row order) to their ``bucket``s."""
        order = np.argsort(bucket, kind="stable")
        rows, bucket, sizes = rows[order], bucket[order], sizes[order]
        data = gather(data, _starts(order, sizes, len(order)), sizes)
        cuts = np.searchsorted(bucket, np.arange(len(self.files) + 1))
        ends = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum(sizes, out=ends[1:])
        for b in np.flatnonzero(np.diff(cuts)).tolist():
            i, j = int(cuts[b]), int(cuts[b + 1])
            d = data[ends[i]:ends[j]]
            f = self.files[b]
            f.write(np.array([j - i, len(d)], np.int64).tobytes())
            f.write(rows[i:j].tobytes())
            f.write(d.tobytes())

    def close(self) -> None:
        for f in self.files:
            f.close()


def _starts(order: np.ndarray, sizes_sorted: np.ndarray, n: int) -> np.ndarray:
    """Start of each sorted row's data in the unsorted data (rows laid out in their original order)."""
    sizes = np.empty(n, np.int64)
    sizes[order] = sizes_sorted
    starts = np.zeros(n, np.int64)
    np.cumsum(sizes[:-1], out=starts[1:])
    return starts[order]


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


def read_bucket(paths: list[Path], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """read_blocks of several files, one after the other (the data of each row found by its start as before)."""
    if len(paths) == 1:
        return read_blocks(paths[0], dtype)
    parts = [read_blocks(p, dtype) for p in paths]
    offsets = np.cumsum([0] + [len(data) for _, data, _ in parts[:-1]])
    return (np.concatenate([rows for rows, _, _ in parts]), np.concatenate([data for _, data, _ in parts]),
            np.concatenate([starts + o for (_, _, starts), o in zip(parts, offsets.tolist())]))


def read_blocks(path: Path, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(rows, data, start of each row's data) of one bucket file."""
    raw = np.fromfile(path, np.uint8)
    rows, datas, pos = [], [], 0
    while pos < len(raw):
        n, m = (int(x) for x in raw[pos:pos + 16].view(np.int64))
        pos += 16
        rows.append(raw[pos:pos + n * dtype.itemsize].view(dtype))
        pos += n * dtype.itemsize
        datas.append(raw[pos:pos + m])
        pos += m
    rows = np.concatenate(rows) if rows else np.zeros(0, dtype)
    data = np.concatenate(datas) if datas else np.zeros(0, np.uint8)
    starts = np.zeros(len(rows), np.int64)
    if len(rows) and "ntok" in dtype.names:
        np.cumsum((rows["ntok"] + rows["nextra"]).astype(np.int64)[:-1], out=starts[1:])
    return rows, data, starts


@dataclass
# ---------------------------------------------------------------------------------------- pass 2: the FASTA
class Outcomes:
    """What becomes of each FASTA record as a cluster member, decided while it is read and written to the spill's
    ``fasta-*`` buckets; the same decisions as a member on the per-record path made (lowercase upper-cased,
    --replace-invalid, --strict, the length filters)."""

    def __init__(self, encoder, settings, spill: Spill):
        self.encoder, self.s, self.spill = encoder, settings, spill
        self.out = BlockWriter(spill.files("fasta"))
        self.records = 0  # records read by this process
        self.first_record: str | None = None  # the first of them (a fed worker's: its first chunk's)

    def record(self, rec: Record, path: Path, n_input: int) -> tuple[int, bytes, bytes, int]:
        """(status, tokens, extra JSON, lowercase residues) of one record read on the per-record path: the record
        rule's verdict (data_prep/rule.py)."""
        s, encoder = self.s, self.encoder
        if rec.length is not None:  # longer than the bound: skipped unread (batch.chunks, fasta.iter_fasta)
            return FILTERED, b"", self.length_filter(rec.length, path, rec.line, rec.id), 0
        verdict, seq, replaced = rule.invalid(s, encoder, rec, rec.seq.upper(), path)
        if verdict is not None and verdict.status == STRICT:
            return STRICT, b"", json.dumps([verdict.damage]).encode(), 0
        if verdict is not None and verdict.status == FILTERED:
            return FILTERED, b"", _extra(verdict), 0
        drop = self.length_filter(len(seq), path, rec.line, rec.id)
        if drop is not None:
            return FILTERED, b"", drop, 0
        lower = int(LOWERCASE[np.frombuffer(rec.seq, np.uint8)].sum()) if rec.seq.upper() != rec.seq else 0
        tokens = encoder.encode(seq).tobytes()
        if replaced:
            return REPLACED, tokens, json.dumps(replaced).encode(), lower
        return KEPT, tokens, b"", lower

    def length_filter(self, n: int, path: Path, line: int, rid: str) -> bytes | None:
        verdict = rule.length(self.s, n, rid, path, line, "member")
        return None if verdict is None else _extra(verdict)

    def records_of(self, recs: list[Record], path: Path, n_input: int, first: int) -> None:
        """Records read one by one (an input the batch reader does not take, or a chunk it hands over whole), the
        first of them global record ``first``."""
        rows = np.zeros(len(recs), FASTA_ROW)
        parts = []
        for k, rec in enumerate(recs):
            status, tokens, extra, lower = self.record(rec, path, n_input)
            rows[k]["status"], rows[k]["ntok"], rows[k]["nextra"], rows[k]["lower"] = \
                status, len(tokens), len(extra), lower
            rows[k]["line"] = rec.line
            parts += [tokens, extra]
        self._write(rows, [r.id for r in recs], np.frombuffer(b"".join(parts), np.uint8), n_input,
                    np.arange(first, first + len(recs)))

    def chunk(self, chunk: Chunk, path: Path, n_input: int) -> None:
        """A batch-reader chunk: its records' outcomes with a few numpy operations; the records it hands over
        (``slow``) and those the length filters drop, one by one."""
        n = len(chunk)
        bounds = chunk.bounds
        rows = np.zeros(n, FASTA_ROW)
        ntok = np.diff(bounds)
        rows["ntok"] = ntok
        newlines = np.flatnonzero(np.frombuffer(chunk.text, np.uint8) == 10)
        rows["line"] = chunk.first_line + np.searchsorted(newlines, chunk.header_starts)
        cum = chunk.lowercase_cum()
        if cum is not None:  # soft-masked residues, counted per record
            rows["lower"] = cum[bounds[1:]] - cum[bounds[:-1]]
        starts = bounds[:-1].copy()  # of each record's payload in tokens + aux
        aux, at = [], len(chunk.tokens)
        drop = rule.length_drops(self.s, ntok)
        special = sorted(set(np.flatnonzero(drop).tolist()) | set(chunk.slow))
        for j in special:
            if j in chunk.slow:
                rec = chunk.slow[j]
                if isinstance(rec, Exception):
                    raise rec
                status, tokens, extra, lower = self.record(rec, path, n_input)
            else:
                status, tokens, extra, lower = FILTERED, b"", self.length_filter(
                    int(ntok[j]), path, int(rows["line"][j]), chunk.ids[j]), 0
            rows[j]["status"], rows[j]["ntok"], rows[j]["nextra"], rows[j]["lower"] = \
                status, len(tokens), len(extra), lower
            starts[j] = at
            aux += [tokens, extra]
            at += len(tokens) + len(extra)
        data = np.frombuffer(chunk.tokens + b"".join(aux), np.uint8)
        if special:  # payloads in record order (the records' tokens in place, the others' from aux)
            data = gather(data, starts, (rows["ntok"] + rows["nextra"]).astype(np.int64))
        self._write(rows, chunk.ids, data, n_input, chunk.index)

    def _write(self, rows: np.ndarray, ids: list[str], data: np.ndarray, n_input: int, rec: np.ndarray) -> None:
        if not len(rows):
            return
        if self.first_record is None:
            self.first_record = ids[0]
        rows["k1"], rows["k2"] = keys(ids)
        rows["rec"] = rec
        rows["input"] = n_input
        self.records += len(rows)
        self.out.write(rows, data, rows["k2"] % self.spill.buckets, (rows["ntok"] + rows["nextra"]).astype(np.int64))


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
    """Pass 3: bucket by bucket, this job's members matched to their FASTA records (equal keys; a member with two
    records is an error), their outcomes counted and appended to the ``slot-*`` buckets by slot range."""
    spill, own = cmap.spill, max(cmap.own_members, 1)
    out = BlockWriter(spill.files("slot"))
    got = Joined()
    examples: list[tuple[int, str]] = []  # the damaged members first in FASTA order (a heap of -record, error)
    per_input = np.zeros((3, len(counts)), np.int64)  # members, kept, residues
    try:
        for tsv_file, fasta_files in zip(spill.files("tsv"), spill.fasta_buckets()):
            t = read_blocks(tsv_file, TSV_ROW)[0]
            t = t[t["slot"] >= 0]
            rows, data, starts = read_bucket(fasta_files, FASTA_ROW)
            if not len(t) or not len(rows):
                continue
            order = np.lexsort((rows["rec"], rows["k1"]))
            k1 = rows["k1"][order]
            lo, hi = np.searchsorted(k1, t["k1"], "left"), np.searchsorted(k1, t["k1"], "right")
            one = hi - lo == 1
            fi = order[lo[one]]
            ok = rows["k2"][fi] == t["k2"][one]
            slot, fi = t["slot"][one][ok], fi[ok]
            many = np.flatnonzero(hi - lo > 1)
            if len(many):  # a key met twice in the FASTA (or a 64-bit collision): resolved on k2, one by one
                more_slot, more_fi = [], []
                for i in many.tolist():
                    cand = [int(x) for x in order[lo[i]:hi[i]] if rows["k2"][x] == t["k2"][i]]
                    if cand:
                        more_slot.append(int(t["slot"][i]))
                        more_fi.append(cand[0])
                    if len(cand) > 1:
                        r = rows[cand[1]]
                        second = (int(r["rec"]), int(t["slot"][i]), int(r["input"]), int(r["line"]))
                        got.repeat = min(got.repeat or second, second)
                slot = np.concatenate([slot, np.array(more_slot, np.int64)])
                fi = np.concatenate([fi, np.array(more_fi, np.int64)])
            if not len(fi):
                continue
            m = rows[fi]
            got.members_found += len(fi)
            kept = (m["status"] == KEPT) | (m["status"] == REPLACED)
            per_input[0] += np.bincount(m["input"], minlength=len(counts))
            per_input[1] += np.bincount(m["input"][kept], minlength=len(counts))
            per_input[2] += np.bincount(m["input"][kept], weights=m["ntok"][kept], minlength=len(counts)).astype(
                np.int64)
            got.lowercase += int(m["lower"][kept].sum())
            for k in np.flatnonzero(m["status"] != KEPT).tolist():
                r, a = m[k], int(starts[fi[k]] + m["ntok"][k])
                extra = json.loads(data[a:a + int(r["nextra"])].tobytes())
                if r["status"] == REPLACED:
                    replaced_stats["replaced_characters"] += sum(extra.values())
                    replaced_stats["records_with_replacements"] += 1
                    replaced_stats["replaced"] = sum_stats(replaced_stats["replaced"], extra)
                elif r["status"] == STRICT:
                    got.strict = min(got.strict or (int(r["rec"]), extra[0]), (int(r["rec"]), extra[0]))
                else:
                    reason, _, chars, error = extra
                    if chars:
                        invalid_chars.update(chars)
                    if error is not None:
                        damage.add(reason, None, Counter(chars) if chars else None)
                        heapq.heappush(examples, (-int(r["rec"]), error))
                        if len(examples) > damage.EXAMPLES:
                            heapq.heappop(examples)
            sizes = (m["ntok"] + m["nextra"]).astype(np.int64)
            payload = gather(data, starts[fi], sizes)
            srows = np.zeros(len(fi), SLOT_ROW)
            for f in ("line", "input", "ntok", "nextra", "status"):
                srows[f] = m[f]
            srows["slot"] = slot
            out.write(srows, payload, slot * spill.buckets // own, sizes)
    finally:
        out.close()
    damage.examples = [e for _, e in sorted(examples, reverse=True)]
    for c, (members, kept, residues) in zip(counts, per_input.T.tolist()):
        c.update(members=members, kept=kept, residues=residues)
    return got


# ---------------------------------------------------------------------------------------- pass 4: the write
class Slots:
    """Pass 4's view of the ``slot-*`` buckets: the outcomes of a range of member slots, read bucket by bucket in
    slot order (the clusters are written in TSV order, which is slot order)."""

    def __init__(self, cmap):
        self.files, self.own = cmap.spill.files("slot"), max(cmap.own_members, 1)
        self.loaded: dict[int, tuple] = {}

    def _bucket(self, b: int) -> tuple:
        if b not in self.loaded:
            for old in [k for k in self.loaded if k < b]:
                del self.loaded[old]  # the clusters before these slots are written
            rows, data, starts = read_blocks(self.files[b], SLOT_ROW)
            order = np.argsort(rows["slot"], kind="stable")
            self.loaded[b] = (rows[order], data, starts[order])
        return self.loaded[b]

    def range(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """For slots a..b-1: the SLOT_ROW of each (status 255: not found in the FASTA), the tokens of the kept
        ones one after the other, and {slot: (extra JSON, input, line)} of the dropped ones."""
        out = np.zeros(b - a, SLOT_ROW)
        out["status"] = 255
        pieces, extras = [], {}
        for k in range(a * len(self.files) // self.own, (b - 1) * len(self.files) // self.own + 1):
            rows, data, starts = self._bucket(k)
            lo, hi = np.searchsorted(rows["slot"], [a, b])
            rows, starts = rows[lo:hi], starts[lo:hi]
            out[rows["slot"] - a] = rows
            view = memoryview(data)
            kept = (rows["status"] == KEPT) | (rows["status"] == REPLACED)
            pieces += [view[x:x + n] for x, n in zip(starts[kept].tolist(), rows["ntok"][kept].tolist())]
            for i in np.flatnonzero(~kept).tolist():
                x, n = int(starts[i] + rows["ntok"][i]), int(rows["nextra"][i])
                extras[int(rows["slot"][i])] = (bytes(view[x:x + n]), int(rows["input"][i]), int(rows["line"][i]))
        return out, np.frombuffer(b"".join(pieces), np.uint8), extras


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
            if status == 255:
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
