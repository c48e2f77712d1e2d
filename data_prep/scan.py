"""Pass 2 of ``--clusters`` (data_prep/join.py): the member FASTA parsed once into Parquet, a part at a time.

A *scan part* k of N is a share of the FASTA that no other part parses, written as one table (``part-KKKK-of-NNNN
.parquet``) and a marker (``.json``, written last: the part is done). The build (data_prep/clusters.py) joins its
clusters against every part. One part of one is the whole input: a single job, or an array job that scans for itself.

* **Byte ranges** (every input plain FASTA that starts with '>'): part k starts at the first record at or after
  k/N of the inputs' bytes laid end to end and ends where part k + 1 starts, so the parts read the FASTA once between
  them (plus the few bytes each looks past its cut for a record start). A part cannot know how many records and
  lines lie before it without reading them, so it numbers both from its own start (``local``); the build adds each
  part's offsets, which the markers of the parts before it give (``offsets``), and shifts the line numbers of the
  messages it stored (``shift_lines``: each starts with ``path:LINE`` or, a filtered.tsv detail, ``LINE:``).
* **Chunks** (gzip cannot be entered in the middle; also inputs that do not start with '>'): part k parses the
  chunks c with c % N == k (cut.chunks, numbered over all inputs), decompressing the whole stream and counting
  the other parts' records and lines as it passes them, so its numbers are the input's. An input that does not
  start with '>' is read whole, record by record, by part 0.
"""
from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import rule
from .batch import BatchReader, Chunk, Reader
from .cut import LongRecord, chunks, is_gzip, starts_with_header
from .checks import PrepError
from .common import LOWERCASE, input_fingerprint, write_json
from .fasta import FastaError, Record, input_position, iter_fasta
from .gather import gather
from .join import TableWriter, binary, shift_lines
from .pool import Pool, state as pool_state
from .progress import Progress, Stopped
from .ranges import ByteRange, count_records, headers, share
from .rule import FILTERED, KEPT, REPLACED, STRICT
from .sources import Context

FASTA_COLUMNS = {"id": "string", "rec": "int64", "input": "int32", "line": "int64", "status": "uint8",
                 "lower": "int64", "ntok": "int64", "tokens": "large_binary", "extra": "string"}


def part_name(part: int, parts: int) -> str:
    return f"part-{part:04d}-of-{parts:04d}"


def byte_parts(paths: list[Path], parts: int) -> bool:
    """Whether the parts are byte ranges (every input plain and starting with a header) rather than chunks."""
    return parts > 1 and all(not is_gzip(p) and starts_with_header(p) for p in paths)


def part_ranges(paths: list[Path], parts: int, part: int) -> dict[int, ByteRange]:
    """Part ``part``'s byte ranges, by input: the inputs laid end to end, cut at k/N of their bytes moved on to the
    next record start. Lines are numbered from the range's start (``first_line`` 1)."""
    total = sum(p.stat().st_size for p in paths)
    return {r.input: r for r in share(paths, lambda k: total * k // parts, part)}


class Counted:
    """(text, first line) of a byte range (cut.chunks), counting its line breaks: the build numbers the next
    part's lines after them."""

    def __init__(self, path: Path, byte_range: ByteRange, bound: int):
        self.path, self.range, self.bound, self.lines = path, byte_range, bound, 0

    def __iter__(self):
        for text, line in chunks(self.path, None, self.range, self.bound):
            self.lines += text.lines if isinstance(text, LongRecord) else text.count(b"\n")
            yield text, line


class Stripe:
    """(text, first line, index of its first record in the input) of this part's chunks of one input (chunk c of
    all inputs is part c % N's); the others' records are counted, not parsed. ``end``: the input's records, once
    read."""

    def __init__(self, path: Path, parts: int, part: int, number: int, bound: int):
        self.path, self.parts, self.part, self.number, self.bound, self.end = path, parts, part, number, bound, None

    def __iter__(self):
        first = 0
        for text, line in chunks(self.path, bound=self.bound):
            if self.number % self.parts == self.part:
                yield text, line, first
            first += 1 if isinstance(text, LongRecord) else headers(text)
            self.number += 1
        self.end = first


def _extra(verdict: rule.Verdict) -> str:
    """A dropped member's verdict as the table holds it: [reason, detail, characters, damage message]."""
    return json.dumps([verdict.reason, verdict.detail, dict(verdict.chars) if verdict.chars else None,
                       verdict.damage])


class Outcomes:
    """What becomes of each FASTA record as a cluster member, decided by the record rule while it is read and
    written to the part's table (lowercase upper-cased, --replace-invalid, --strict, the length filters)."""

    def __init__(self, encoder, settings, table: Path):
        self.encoder, self.s = encoder, settings
        self.out = TableWriter(table, FASTA_COLUMNS)
        self.records = 0  # records of this part
        self.first: tuple | None = None  # (input, rec, id) of its first record

    def record(self, rec: Record, path: Path) -> tuple[int, bytes, str | None, int]:
        """(status, tokens, extra JSON, lowercase residues) of one record read on the per-record path."""
        s, encoder = self.s, self.encoder
        if rec.length is not None:  # longer than the bound: skipped unread (cut.chunks, fasta.iter_fasta)
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
        first of them record ``first``."""
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
        line = chunk.lines
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
        if self.first is None:
            self.first = (n_input, int(rec[0]), ids[0])
        self.records += len(ids)
        self.out.write({"id": ids, "rec": np.asarray(rec, np.int64), "input": np.full(len(ids), n_input, np.int32),
                        "line": np.asarray(line, np.int64), "status": status, "lower": np.asarray(lower, np.int64),
                        "ntok": np.asarray(ntok, np.int64), "tokens": binary(data, np.asarray(ntok, np.int64)),
                        "extra": extra})


def scan_fingerprint(encoder, inputs: list[Path], settings) -> dict:
    """What a part's records depend on: the inputs' versions, the tokenizer and the options of the rule. A build
    refuses parts made with another one."""
    s = settings
    return {"inputs": [{"path": str(p), **input_fingerprint(p)} for p in inputs], "tokenizer": encoder.entry,
            "rule": {"min_length": s.min_length, "max_length": s.max_length, "strict": s.strict,
                     "max_record_length": s.max_record_length, "replace_invalid": s.replace_invalid}}


def scan(encoder, inputs: list[Path], settings, source, folder: Path, part: int = 0, parts: int = 1,
         progress: tuple = ("auto", 60.0), stop: threading.Event | None = None) -> dict:
    """Scan part ``part`` of ``parts`` of the member FASTA files into ``folder``; returns its marker (also written
    as ``folder/part-KKKK-of-NNNN.json``, last). ``stop``: set by the job when the scan is of no more use (a scan
    in a thread: ``Scans``); the scan then ends at its next chunk (progress.Stopped)."""
    name = part_name(part, parts)
    batch = BatchReader(source, encoder, Context(encoder.invalid_positions, bound=rule.read_bound(settings)))
    local = byte_parts(inputs, parts)
    shares = part_ranges(inputs, parts, part) if local else {}
    outcomes = Outcomes(encoder, settings, folder / f"{name}.parquet")
    counts, first, number = [], 0, 0  # number: chunks so far (Stripe)
    sizes = [(r.hi - r.lo) if (r := shares.get(i)) else 0 for i in range(len(inputs))] if local else \
        [p.stat().st_size for p in inputs]
    try:
        with Progress(f"{source.name} members" + (f" (scan part {part} of {parts})" if parts > 1 else ""),
                      sum(sizes), *progress, stop=stop) as bar:
            for n_input, path in enumerate(inputs):
                before = outcomes.records
                if local and n_input not in shares:  # another part's bytes
                    counts.append({"records": 0, "lines": 0, "bytes": 0})
                    continue
                if local:
                    texts, base = Counted(path, shares[n_input], batch.bound), 0
                elif starts_with_header(path):
                    texts, base = (Stripe(path, parts, part, number, batch.bound) if parts > 1 else None), first
                else:  # a BOM, blank lines first: record by record (part 0 keeps them, the others count them)
                    texts, base = "records", first
                end = _read_input(outcomes, batch, path, n_input, texts, base, part, bar, sum(sizes[:n_input]),
                                  shares.get(n_input))
                if isinstance(texts, Stripe):
                    number = texts.number
                counts.append({"records": outcomes.records - before,
                               "lines": texts.lines if isinstance(texts, Counted) else None,
                               "bytes": sizes[n_input] if local else None})
                first = end
            bar.update(sum(sizes), records=outcomes.records)
    finally:
        outcomes.out.close()
    marker = {"part": part, "parts": parts, "local": local, "inputs": counts, "first": outcomes.first,
              "fingerprint": scan_fingerprint(encoder, inputs, settings),
              "ranges": {str(i): [r.lo, r.hi] for i, r in shares.items()}}
    if outcomes.records == 0:  # an empty table: DuckDB needs its columns all the same
        outcomes.out.write({k: ([] if t == "string" else np.zeros(0, np.int64)) for k, t in FASTA_COLUMNS.items()
                            if k != "tokens"} | {"tokens": binary(b"", np.zeros(0, np.int64))})
        outcomes.out.close()
    write_json(folder / f"{name}.json", marker)
    return marker


def _read_input(outcomes: Outcomes, batch: BatchReader, path: Path, n_input: int, texts, base: int, part: int,
                bar: Progress, done_before: int, byte_range: ByteRange | None) -> int:
    """One input's records of this part into the table; returns the record number after the input's last."""
    if texts == "records":
        end = base
        for recs in _batches(iter_fasta(path, batch.check, on_invalid="yield", bound=batch.bound)):
            if part == 0:
                outcomes.records_of(recs, path, n_input, end)
            end += len(recs)
            bar.update(done_before + input_position(path), records=outcomes.records)
        return end

    def readers():  # a Reader over the part's texts, or one per own chunk of a Stripe (its first record numbered)
        if not isinstance(texts, Stripe):
            yield Reader(path, batch.tokens, batch.check, None, first_index=base, texts=texts, bound=batch.bound)
            return
        for text, line, first in texts:
            yield Reader(path, batch.tokens, batch.check, None, first_index=base + first, texts=[(text, line)],
                         bound=batch.bound)
    end = base
    try:
        for reader in readers():
            for piece in reader:
                if isinstance(piece, Chunk):
                    outcomes.chunk(piece, path, n_input)
                else:  # a chunk the Reader read record by record (starting at its ``start``)
                    outcomes.records_of(piece, path, n_input, reader.start)
                bar.update(done_before + input_position(path), records=outcomes.records)
            end = reader.index
    except FastaError as e:  # ``at``: the chunk (a Stripe) or the part (byte ranges, in input order) it was met in
        if byte_range is None or byte_range.lo == 0:
            raise FastaError(str(e), at=texts.number if isinstance(texts, Stripe) else part) from None
        # numbered from the range's start: the lines before it are counted now (only on this error)
        raise FastaError(shift_lines(str(e), str(path), count_records(path, byte_range.lo)[1]), at=part) from None
    return base + texts.end if isinstance(texts, Stripe) else end


def _batches(records, size: int = 4096):
    batch = []
    for rec in records:
        batch.append(rec)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def load_parts(folder: Path, fingerprint: dict) -> list[tuple[Path, dict]]:
    """The scan parts of ``folder`` (table, marker), checked: all N of them done, made of these inputs with these
    options."""
    markers = sorted(folder.glob("part-*-of-*.json")) if folder.is_dir() else []
    if not markers:
        raise PrepError(f"{folder}: no scan part; run the scan stage (--stage scan) of every job first")
    docs = [json.loads(p.read_text()) for p in markers]
    n = docs[0]["parts"]
    done = {d["part"] for d in docs if d["parts"] == n}
    missing = [k for k in range(n) if k not in done]
    if missing or len(docs) != n:
        raise PrepError(f"{folder}: scan part {missing[0] if missing else '?'} of {n} has not finished "
                        f"({len(done)} of {n} done); run its scan stage (--stage scan --job-index "
                        f"{missing[0] if missing else '?'}) before the build")
    for p, d in zip(markers, docs):
        if d["fingerprint"] != fingerprint:
            raise PrepError(f"{p}: this scan part was made from other inputs or with other options "
                            "(--min-length, --max-length, --strict, --replace-invalid, ...) than this build; rerun "
                            "the scan stage with the build's command line (--overwrite)")
    return [(p.with_suffix(".parquet"), d) for p, d in sorted(zip(markers, docs), key=lambda x: x[1]["part"])]


def scan_folder(output: Path, settings) -> Path:
    """Where the scan stage of an array of N jobs writes its N parts: a hidden folder of the output, removed by
    ``merge``."""
    return output / f".scan-of-{settings.num_jobs:04d}"


def scan_stage(encoder, inputs: list[Path], output: Path, settings, overwrite: bool, source,
               progress: tuple) -> tuple[dict, Path]:
    """``--stage scan``: scan part I of N (job I of ``--num-jobs N``) into ``scan_folder``; returns its marker and
    where it is. A part already done with the same inputs and options is kept (a rerun of the array resumes)."""
    folder = scan_folder(output, settings)
    folder.mkdir(parents=True, exist_ok=True)
    name = part_name(settings.job_index, settings.num_jobs)
    marker = folder / f"{name}.json"
    if marker.exists() and not overwrite:
        doc = json.loads(marker.read_text())
        if doc["fingerprint"] != scan_fingerprint(encoder, inputs, settings):
            raise PrepError(f"{marker}: a scan part made from other inputs or with other options is there (pass "
                            "--overwrite to replace it)")
        return doc, marker
    marker.unlink(missing_ok=True)
    try:
        return scan(encoder, inputs, settings, source, folder, settings.job_index, settings.num_jobs,
                    progress), marker
    except (PrepError, FastaError, ValueError):  # bad input: nothing of this part is left
        (folder / f"{name}.parquet").unlink(missing_ok=True)
        raise


class Scans:
    """The scan of a --clusters job, started at once so that the job reads the TSV meanwhile; then one build joins
    the parts, and the output is the same. With one worker a thread scans the whole FASTA (the TSV is DuckDB's,
    outside the GIL); ``--workers N``: N scan parts on a pool of N processes (data_prep/pool.py), made before this
    process starts any thread (a fork copies none)."""

    def __init__(self, encoder, inputs: list[Path], settings, source, folder: Path, workers: int, progress: tuple):
        self.folder = folder
        state = (encoder, inputs, settings, source, folder, progress)
        if workers == 1:
            self.stop = threading.Event()
            self.pool = ThreadPoolExecutor(1, "data_prep-scan")
            self.futures = [self.pool.submit(_scan_part, 0, 1, state + (self.stop,))]
        else:
            self.stop = None
            self.pool = Pool(workers, state + (None,))
            self.futures = [self.pool.submit(_scan_part, k, workers) for k in range(workers)]

    def wait(self) -> Path:
        """The folder once every part is done; a bad input is the error met first in the input order (the lowest
        ``at``: data_prep/scan.py numbers chunks and parts in input order)."""
        results = [f.result() if self.stop is not None else self.pool.result(f) for f in self.futures]
        errors = sorted(e for e in results if e is not None)
        if errors:
            _, _, _, message, prep = errors[0]
            raise PrepError(message) if prep else FastaError(message)
        return self.folder

    def close(self) -> None:
        if self.stop is not None:  # the thread ends at its next chunk
            self.stop.set()
            self.pool.shutdown(wait=True)
        elif all(f.done() for f in self.futures):
            self.pool.shutdown(wait=True)
        else:  # an error before the wait: the parts still being scanned are of no use
            self.pool.stop()


def _scan_part(part: int, parts: int, state: tuple | None = None) -> tuple | None:
    """Scan part ``part`` in a pool process (``state``: the pool's) or a thread; None, or its error as (no position,
    position, part, message, whether a PrepError)."""
    encoder, inputs, settings, source, folder, progress, stop = state or pool_state()
    try:
        scan(encoder, inputs, settings, source, folder, part, parts, progress if part == 0 else ("off", progress[1]),
             stop)
    except Stopped:
        return None
    except (PrepError, FastaError, ValueError) as e:
        at = getattr(e, "at", None)
        return at is None, at or 0, part, str(e), isinstance(e, PrepError)
    return None
