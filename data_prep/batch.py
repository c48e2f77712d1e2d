"""Batch reading of FASTA inputs for data_prep: whole chunks of records parsed, checked and tokenized at once.

The per-record path (data_prep/fasta.py iter_fasta, one Python iteration per line and several numpy calls per
record) ran at ~3 MB/s of gzipped input, far below ``gzip -dc``. Here the decompressed input is read in chunks of
whole records (data_prep/cut.py: ``CHUNK`` bytes, cut before a line that starts with '>'); per chunk the records are split with
``bytes.split``, their sequences joined into one buffer, validated with one ``bytes.translate`` over it, upper-cased
and tokenized with one ``bytes.translate`` each. Per record only the header is handled in Python.

What a record becomes is exactly what iter_fasta (+ the uniref source's header parsing) makes of it: a record the
batch path does not take as is -- a character outside the alphabet or whitespace inside the sequence, a header
without an id, a UniRef header of another shape than the two the template knows -- is handed over as the
``Record`` iter_fasta_text parses from its own lines (same errors, lines, columns), and the job treats it on its
per-record path. Chunks with a CR other than in CRLF line ends, and inputs that do not start with '>', are read
wholly on the per-record path. With ``--workers N`` the job's process reads and numbers the chunks and writes them
in input order; N pool processes parse them (``Reader``).
"""
from __future__ import annotations

import json
import re
from collections import deque
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import numpy as np

from .common import LOWERCASE
from .cut import LongRecord, chunks, is_gzip, starts_with_header
from .fasta import FastaError, Record, iter_fasta_text
from .pool import state as pool_state
from .ranges import headers
from .sources import Context, parse_uniref_header, uniref_record

if TYPE_CHECKING:
    from . import Source
    from .encode import Encoder
    from .settings import Settings

json_string = json.encoder.encode_basestring_ascii  # what json.dumps uses for str (ensure_ascii=True), in C


@dataclass
class Chunk:
    """Whole records of one input. Record j: header line ``line(j)``, id ``ids[j]``, tokens
    ``tokens[bounds[j]:bounds[j + 1]]`` (its sequence as written, line breaks removed, tokenized); ``tails[j]`` the JSON text of its meta after ``"length":N``
    (``,"description":...}`` or the UniRef fields), or None when ``metas[j]`` holds the meta dict instead; records
    in ``slow`` (position -> Record from iter_fasta_text, or the FastaError it raised) are for the per-record path and their entries here are
    placeholders (empty sequence)."""
    ids: list
    seq_text: bytes  # the records' sequence lines one after the other, line breaks kept
    tokens: bytes  # seq_text without line breaks, tokenized (upper-cased residues' ids; 0xff outside the alphabet)
    bounds: np.ndarray  # int64 [n + 1]
    tails: list
    metas: dict
    slow: dict
    text: bytes
    first_line: int
    header_starts: np.ndarray  # int64 [n]: offset of each record's '>' in text
    index: np.ndarray  # int64 [n]: global record index (over all inputs) of each record
    lines: np.ndarray  # int64 [n]: 1-based line number of each record's header
    total: int = 0  # records of the chunk, this job's and the others' (Reader jobs): the global index advances by it

    def __len__(self) -> int:
        return len(self.ids)

    def lowercase_cum(self) -> np.ndarray | None:
        """[len(tokens) + 1] int64: lowercase residues before each position of ``tokens`` (soft-masked residues,
        counted per record as cum[bounds[j + 1]] - cum[bounds[j]]); None when there is none (one SIMD max over the
        text first: no byte >= 'a', no lowercase; a line break is below 'a')."""
        text = np.frombuffer(self.seq_text, np.uint8)
        if not len(text) or int(text.max()) < ord("a"):
            return None
        lower = LOWERCASE[np.frombuffer(self.seq_text.replace(b"\n", b""), np.uint8)]
        if not lower.any():
            return None
        cum = np.zeros(len(lower) + 1, np.int64)
        np.cumsum(lower, out=cum[1:])
        return cum

    def line(self, j: int) -> int:
        """1-based line number of record j's header."""
        return int(self.lines[j])


# UniRef headers of the two shapes the shared data holds (parse_uniref_header reads any): the full header
# "<name> n=<n> Tax=<taxon> TaxID=<id> RepID=<id>", BioNeMo's "TaxID=<id> RepID=<id>" and its UniRef90 members'
# "ClusterName=<name> TaxID=<id> RepID=<id>", matched for all records of
# a chunk in one findall over the descriptions joined by NUL. A value may not hold '=' (so no other key can hide in
# it: every split point of parse_uniref_header's _FIELD_SPLIT is one of the template's), \s+ before a key is the
# whitespace run _FIELD_SPLIT removes, \s* after '=' what value.strip() removes; numbers are matched only as plain
# integers (or "<int>.0") of at most 15 digits, exact in the float that _number parses, leading zeros dropped as
# int() drops them. Any other description (the last alternative) goes to parse_uniref_header.
_NUM = r"\s*0*(\d{1,15})(?:\.0)?"
_VAL = r"\s*([^=\x00]*?)"
_UNIREF = re.compile(rf"(?:(?:([^=\x00]*?)\s+)?n={_NUM}\s+Tax={_VAL}\s+TaxID={_NUM}\s+RepID=\s*([^=\x00]*)"
                     rf"|TaxID={_NUM}\s+RepID=\s*([^=\x00]*)"
                     rf"|ClusterName={_VAL}\s+TaxID={_NUM}\s+RepID=\s*([^=\x00]*)|([^\x00]*))\x00")

# A header's record id as str.split() finds it (re's \s is str.split's whitespace): after blanks, up to the next blank
_ID = re.compile(r"^[^\S\n]*(\S*)", re.M)

_SHORT = re.compile(rf"(?<![^\x00])TaxID={_NUM}\s+RepID=\s*([ !#-<>-\[\]-~]*)\x00")


def uniref_tails(descs: list[str]) -> list[str | None]:
    """Per description (stripped, as the FASTA reader leaves it): the JSON text of parse_uniref_header's fields
    after "length" (``,"name":...,"repid":...}``), or None where parse_uniref_header must parse it."""
    joined = "\x00".join(descs)
    if joined.count("\x00") != len(descs) - 1:  # a NUL inside a description: all by parse_uniref_header
        return [None] * len(descs)
    # the common case, a chunk of BioNeMo headers ("TaxID=<id> RepID=<id>", the template's second shape) whose
    # RepIDs are printable ASCII without '"' or '\\' (encoded as they are): all tails by one findall, its matches
    # anchored at the start of a description (so n of them cover the n descriptions whole), and one %-operation
    short = _SHORT.findall(joined + "\x00")
    if len(short) == len(descs):
        return ((',"taxid":%s,"repid":"%s"}\n' * len(short)) % tuple(chain.from_iterable(short))).split("\n")[:-1]
    out = []
    for name, n, tax, taxid, repid, staxid, srepid, cname, ctaxid, crepid, other in _UNIREF.findall(joined + "\x00"):
        if n:
            head = f',"name":{json_string(name)}' if name else ""
            out.append(f'{head},"n":{n},"tax":{json_string(tax)},"taxid":{taxid},"repid":{json_string(repid)}}}')
        elif staxid:
            out.append(f',"taxid":{staxid},"repid":{json_string(srepid)}}}')
        elif ctaxid:
            out.append(f',"clustername":{json_string(cname)},"taxid":{ctaxid},"repid":{json_string(crepid)}}}')
        else:
            out.append("}" if not other else None)
    return out


class Reader:
    """Chunks of one FASTA input, parsed. ``tokens``: 256-byte table, byte as written -> token id of the
    upper-cased residue, 0xff for a byte outside the alphabet (the source's: for UniRef lowercase is accepted and
    upper-cased); ``invalid_positions``: the source reader's own check (for the per-record
    fallback); ``uniref``: the source parses UniRef headers into meta (``to_record`` completes a fallback record
    the way the source does), None: no meta at all (the chunks' ``tails`` are None; --clusters keeps ids only).
    ``texts``: (text, first line) of whole records (a job's byte range) instead of every chunk of the input.
    ``pool``: --workers (data_prep/pool.py): the chunks are parsed there, at most ``2 * N`` ahead, and handed out in
    input order."""

    def __init__(self, path: Path, tokens: bytes, invalid_positions: Callable | None, uniref: bool | None,
                 to_record: Callable[[Record], Record] = lambda r: r, first_index: int = 0,
                 jobs: tuple[int, int] = (1, 0), texts=None, bound: int | None = None, pool=None):
        self.path, self.uniref, self.to_record, self.bound = path, uniref, to_record, bound
        self.invalid_positions = invalid_positions
        self._tokens = tokens
        self.index = first_index  # global index (over all inputs) of the next record read
        self.start = first_index  # global index of the first record of the chunk last handed out
        self.texts, self.pool = texts, pool
        self.jobs = jobs  # (N, I): only records whose global index % N == I are parsed past their header line

    def __iter__(self) -> Iterator[Chunk | list]:
        """A Chunk per chunk of the input, or the list of its Records when the chunk is read record by record (a
        record longer than ``bound``, skipped unread by ``chunks``, is a list of one Record with its ``length``)."""
        ahead, window = deque(), 2 * self.pool.size if self.pool is not None else 0
        for item in self._items():
            ahead.append(item)
            if len(ahead) > window:
                yield self._done(*ahead.popleft())
        while ahead:
            yield self._done(*ahead.popleft())

    def _items(self):
        """(first global index, records or Chunk or the Future of a Chunk, text parsed in the pool) per chunk."""
        texts = self.texts if self.texts is not None else chunks(self.path, bound=self.bound)
        try:
            for text, first_line in texts:
                start = self.index
                if isinstance(text, LongRecord):
                    self.index += 1
                    yield start, [self.to_record(self._long(text))], None
                elif b"\r" in text and text.count(b"\r") != text.count(b"\r\n"):  # a CR that ends no CRLF
                    records = [self.to_record(r) for r in iter_fasta_text(self.path, text, first_line,
                                                                             self.invalid_positions, "yield")]
                    self.index += len(records)
                    yield start, records, None
                else:
                    text = text.replace(b"\r\n", b"\n") if b"\r" in text else text  # iter_fasta strips line ends
                    if self.pool is None:
                        chunk = self.parse(text, first_line, start)
                        self.index += chunk.total
                        yield start, chunk, None
                    else:  # numbered here (a '>' at a line start is a record), parsed in a worker
                        self.index += headers(text)
                        yield start, self.pool.submit(_parse, self.path, self.uniref, self.jobs, text, first_line,
                                                      start), text
        except (FastaError, OSError) as e:  # met while reading ahead: raised after the chunks before it
            yield self.index, e, None

    def _done(self, start: int, item, text: bytes | None):
        self.start = start
        if isinstance(item, Exception):
            raise item
        if text is None:
            return item
        chunk = self.pool.result(item)
        chunk.text = text  # not sent back: the parent has it
        return chunk

    def _long(self, skipped: LongRecord) -> Record:
        """The Record of a skipped record: id and description as iter_fasta reads them, no sequence, ``length``."""
        head = skipped.header.decode("utf-8", "backslashreplace").split(None, 1)
        if not head:  # as iter_fasta: an error in every job
            raise FastaError(f"{self.path}:{skipped.line}: header has no record id")
        return Record(head[0], head[1].strip() if len(head) > 1 else "", b"", skipped.line, nbytes=skipped.nbytes,
                      length=skipped.residues)

    def parse(self, text: bytes, first_line: int, first_index: int) -> Chunk:
        """The Chunk of ``text`` (whole records, starting with '>'; its first line ``first_line``, its first record
        global index ``first_index``). Reads nothing but its arguments and the Reader's settings: it runs in the
        job's process or in a --workers pool process (``_parse``)."""
        # records located with numpy over the whole chunk (text starts with '>'): header j is the line from its
        # '>' at header_starts[j] to the newline at ends[j], its sequence the text from ends[j] + 1 to the next
        # record's '>' with line breaks removed (what text.split(b"\n>") + partition(b"\n") per record gave)
        size = len(text)
        arr = np.frombuffer(text, np.uint8)
        nl = np.flatnonzero(arr == 10)
        after = nl + 1
        if len(after) and after[-1] == size:
            after = after[:-1]
        header_starts = np.concatenate(([0], after[arr[after] == 62])).astype(np.int64)
        total = len(header_starts)
        at = np.searchsorted(nl, header_starts)  # the first newline at or after each '>'
        ends = np.append(nl, size)[at]  # each header line's end (size: the last line without a newline)
        index = np.arange(first_index, first_index + total)
        nexts = np.append(header_starts[1:], size)  # where each record's text ends
        N, I = self.jobs
        if N > 1:  # another job's records cost their header check only
            first = (I - int(index[0])) % N
            firsts = arr[np.minimum(header_starts + 1, size - 1)]
            for j in np.flatnonzero(~((firsts >= 0x21) & (firsts <= 0x7E)) | (header_starts + 1 >= size)).tolist():
                # a header without a record id is an error in every job (iter_fasta raises it), checked exactly
                # unless the header's first byte is printable ASCII (then it holds an id)
                if j % N != first:
                    head = text[int(header_starts[j]) + 1:int(ends[j])].decode("utf-8", "backslashreplace")
                    if not head.split(None, 1):
                        line = first_line + text.count(b"\n", 0, int(header_starts[j]))
                        raise FastaError(f"{self.path}:{line}: header has no record id")
            header_starts, index, at = header_starts[first::N], index[first::N], at[first::N]
            ends, nexts = ends[first::N], nexts[first::N]
        n = len(header_starts)
        if n == 0:  # every record of the chunk is another job's
            return Chunk([], b"", b"", np.zeros(1, np.int64), [], {}, {}, text, first_line, header_starts, index,
                         first_line + at, total)
        hs, he, se = header_starts.tolist(), ends.tolist(), nexts.tolist()
        heads = b"\n".join([text[a + 1:b] for a, b in zip(hs, he)]).decode("utf-8", "backslashreplace")
        seq_text = b"".join([text[b + 1:c] for b, c in zip(he, se)])
        # sequence length: its text's bytes less its newlines (those from the header's end to the record's end)
        breaks = np.searchsorted(nl, nexts) - at - (ends < size)
        lengths = np.maximum(nexts - ends - 1, 0) - breaks
        # one pass: line breaks dropped, validation and tokenization (half the time of a replace, then translate)
        tokens = seq_text.translate(self._tokens, b"\n")
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=bounds[1:])
        if bounds[-1] != len(tokens):  # cannot happen: the lengths add up to the joined sequences
            raise FastaError(f"{self.path}:{first_line}: batch parse found {bounds[-1]} residues, joined "
                             f"{len(tokens)}")
        slow: dict[int, Record] = {}
        bad_seq = None
        if b"\xff" in tokens:  # some record holds a byte outside the alphabet (or a blank)
            cum = np.zeros(len(tokens) + 1, np.int64)
            np.cumsum(np.frombuffer(tokens, np.uint8) == 255, out=cum[1:])
            bad_seq = np.flatnonzero(cum[bounds[1:]] != cum[bounds[:-1]]).tolist()
        metas: dict[int, dict] = {}
        if self.uniref is None:  # ids only (--clusters): one match a header, "" where it has none
            split = ids = _ID.findall(heads)
            tails = [None] * n
        else:
            split = [h.split(None, 1) for h in heads.split("\n")]
            ids = [sp[0] if sp else "" for sp in split]
        if self.uniref:
            descs = [(sp[1].strip() if len(sp) > 1 else "") for sp in split]
            tails = uniref_tails(descs)
            for j, t in enumerate(tails):
                if t is None and split[j]:
                    metas[j] = parse_uniref_header(ids[j], descs[j])
        elif self.uniref is not None:
            descs = [(sp[1].strip() if len(sp) > 1 else "") for sp in split]
            tails = [f',"description":{d}}}' for d in map(json_string, descs)]
        for j, sp in enumerate(split):
            if not sp:  # no record id: the per-record path raises the error
                slow[j] = None
        for j in bad_seq or ():
            slow[j] = None
        chunk = Chunk(ids, seq_text, tokens, bounds, tails, metas, slow, text, first_line, header_starts, index,
                      first_line + at, total)
        for j in sorted(slow):
            end = text.find(b"\n>", int(header_starts[j])) + 1 or len(text)  # the next record's '>'

            try:
                recs = list(iter_fasta_text(self.path, text[header_starts[j]:end], chunk.line(j),
                                            self.invalid_positions, "yield"))
            except FastaError as e:  # raised by the job when it reaches the record, as iter_fasta would
                slow[j] = e
                continue
            if len(recs) != 1:  # cannot happen for the text of one header line and its sequence lines
                raise FastaError(f"{self.path}:{chunk.line(j)}: expected one record, parsed {len(recs)}")
            slow[j] = self.to_record(recs[0])
        chunk.slow = dict(sorted(slow.items()))
        return chunk


def _parse(path: Path, uniref: bool | None, jobs: tuple[int, int], text: bytes, line: int, first: int) -> Chunk:
    """Reader.parse in a --workers pool process (the reader's tables: the pool's state, BatchReader)."""
    b = pool_state()
    chunk = Reader(path, b.tokens, b.check, uniref, b.to_record, jobs=jobs).parse(text, line, first)
    seq = np.frombuffer(chunk.seq_text, np.uint8)
    if not len(seq) or int(seq.max()) < ord("a"):  # no lowercase: lowercase_cum() needs no seq_text either
        chunk.seq_text = b""
    chunk.text = b""  # the parent has it
    return chunk


class BatchReader:
    """data_prep/batch.py for this job: the FASTA sources' inputs read chunk by chunk, or None where the job needs
    the per-record path throughout (``batch_reader``)."""

    def __init__(self, source: Source, encoder: Encoder, ctx: Context):
        self.uniref = source.kind == "uniref"
        self.bound = ctx.bound  # records longer than it are skipped while read (cut.chunks)
        everything = bytes(range(256))
        check = ctx.invalid_positions
        if self.uniref:  # the uniref reader accepts lowercase and upper-cases it (iter_uniref)
            self.check = lambda seq: check(seq.upper())
            self.to_record = lambda rec: uniref_record(rec, ctx)
        else:
            self.check, self.to_record = check, (lambda rec: rec)
        bad = set(self.check(everything).tolist())
        table = bytearray(b"\xff" * 256)  # byte as written -> token id of the upper-cased residue; 0xff: invalid
        for c in range(256):
            if c not in bad:
                table[c] = int(encoder.encode(bytes([c]).upper())[0])
        self.tokens = bytes(table)

    def takes(self, path: Path) -> bool:
        return starts_with_header(path)


def batch_source(source: Source, settings: Settings, members) -> bool:
    """Whether every record of a job can take the batch path: a FASTA source (fasta, genome, rnacentral, uniref)
    without --dedup (a record's job and fate depend on all records before it), --window or --uniref90-members
    (per-record work either way). What the batch reader, the byte-range split and --workers ask."""
    return (source.kind in ("fasta", "uniref") and source.tokenizer in ("nucleotide", "protein")
            and not settings.dedup and settings.window is None and members is None)


def batch_reader(source: Source, encoder: Encoder, settings: Settings, ctx: Context) -> BatchReader | None:
    """The batch reader when every record of the job can take it (``batch_source``), else None."""
    if not batch_source(source, settings, ctx.members) or ctx.invalid_positions is None:
        return None
    return BatchReader(source, encoder, ctx)


def splits_bytes(source: Source, inputs: list[Path], settings: Settings, members) -> bool:
    """Whether job I of ``--num-jobs N`` reads only its byte range of the inputs (ranges.byte_ranges) rather than
    every record, keeping those whose index % N == I: batch-path jobs whose inputs are all plain FASTA (a gzip
    stream cannot be entered in the middle: its jobs each decompress all of it)."""
    return (settings.num_jobs > 1 and batch_source(source, settings, members)
            and all(not is_gzip(p) and starts_with_header(p) for p in inputs))
