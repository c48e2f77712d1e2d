"""The decompressed input cut into chunks of whole records (``chunks``), a block read ahead in a thread: the text
the batch reader parses (data_prep/batch.py) and a scan part reads (data_prep/scan.py). A record too long to build
is skipped while it is read (``LongRecord``), in bounded memory and time linear in its length."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from .fasta import GZIP_ERRORS, GZIP_MAGIC, FastaError, open_input, track_position
from .ranges import ByteRange

CHUNK = 1 << 22  # decompressed bytes read at a time; a record longer than this makes its chunk longer


def starts_with_header(path: Path) -> bool:
    """Whether the input's first byte is '>' (else it is read record by record: BOM, blank lines, garbage)."""
    with open_input(path) as f:
        return f.peek(1)[:1] == b">"


SPILL_AT = 4 * CHUNK  # a record read past this many bytes goes to a temporary file until its end (or its skip)
HEADER_MAX = 1 << 16  # bytes of a skipped record's header kept (its id and description for filtered.tsv)


@dataclass(frozen=True)
class LongRecord:
    """A record longer than the job's bound, skipped while it was read (``chunks``): never built, never held whole
    in memory. ``header``: its header line without the '>' (at most HEADER_MAX bytes); ``line``: the line number of
    its '>'; ``residues``: the bytes of its sequence lines but line breaks and CRs (so a trailing blank counts);
    ``nbytes``: the bytes it took in the input."""
    header: bytes
    line: int
    residues: int
    nbytes: int
    lines: int = 0  # the line breaks it held (a byte-range scan part counts its lines: data_prep/scan.py)


class _Tail:
    """The record ``chunks`` is reading once it outgrew SPILL_AT bytes: its text in a temporary file (in $TMPDIR,
    gone when closed) while it may still be kept, then only counted once it is longer than the bound. Each byte is
    looked at once, so a record is read in time linear in its length, and memory holds one block of it."""

    def __init__(self, line: int, bound: int | None):
        import tempfile

        self.line, self.bound = line, bound
        self.header, self.header_done = b"", False
        self.residues = self.newlines = self.nbytes = 0
        self.file = tempfile.TemporaryFile(prefix="data_prep-record-")

    def add(self, piece: bytes) -> None:
        self.nbytes += len(piece)
        self.newlines += piece.count(b"\n")
        body = piece
        if not self.header_done:
            end = piece.find(b"\n")
            head = piece if end < 0 else piece[:end]
            if len(self.header) < HEADER_MAX + 1:
                self.header += head[:HEADER_MAX + 1 - len(self.header)]
            self.header_done, body = end >= 0, b"" if end < 0 else piece[end + 1:]
        self.residues += len(body) - body.count(b"\n") - body.count(b"\r")
        if self.file is not None:
            if self.too_long():  # from here on the record is only counted
                self.file.close()
                self.file = None
            else:
                self.file.write(piece)

    def too_long(self) -> bool:
        # a header past HEADER_MAX without its line end is no record header: skipped with the record it opens
        return (self.bound is not None and self.residues > self.bound) or (
            not self.header_done and len(self.header) > HEADER_MAX)

    def finish(self) -> bytes | LongRecord:
        """The record's text (read back from the file), or a LongRecord when it was too long."""
        if self.file is None:
            head = self.header[1:HEADER_MAX + 1].rstrip(b"\r")  # without the '>'
            return LongRecord(head, self.line, self.residues, self.nbytes, self.newlines)
        self.file.seek(0)
        text = self.file.read()
        self.file.close()
        return text


def chunks(path: Path, size: int | None = None, byte_range: ByteRange | None = None, bound: int | None = None,
           spill_at: int = SPILL_AT) -> Iterator[tuple[bytes | LongRecord, int]]:
    """(text, line number of its first line): the input cut before lines that start with '>'. The next block is
    read (decompressed: ISA-L leaves the GIL) in a thread while the caller works on this one. ``byte_range``: only
    those bytes of the plain file (a job's share, ranges.byte_ranges), its lines numbered as the file's.

    Linear in the input: each block is searched once for a record start, and the text since the last one is kept
    as a list of blocks, joined once when it is handed out (rebuilding and searching the growing text on every
    block made one long record cost the square of its length: a 2 GiB record in a 2 MB gzip ran past 240 s). A
    record that outgrows ``spill_at`` bytes is read on into a temporary file (``_Tail``), and handed out whole once
    it ends when it holds at most ``bound`` residues; a longer one is skipped as it is read, counted and handed out
    as a ``LongRecord`` in place of its text (memory: a block). ``size``: bytes read at a time (default CHUNK)."""
    from concurrent.futures import ThreadPoolExecutor

    size = size or CHUNK  # read when called: a test sets CHUNK small
    if byte_range is None:
        f, left, line = open_input(path), None, 1
    else:
        f, left, line = open(path, "rb", buffering=0), byte_range.hi - byte_range.lo, byte_range.first_line
        f.seek(byte_range.lo)
        track_position(path, lambda: f.tell() - byte_range.lo)  # progress: the bytes of the range read

    def read() -> bytes:
        return f.read(size if left is None else min(size, left))

    def newlines(text: bytes) -> int:
        return int(np.count_nonzero(np.frombuffer(text, np.uint8) == 10))  # text.count(b"\n"), SIMD

    parts: list[bytes] = []  # the text since the last cut (whole records, then the start of one), block by block
    pending = 0  # its bytes
    tail: _Tail | None = None  # the record being read past spill_at
    with f, ThreadPoolExecutor(1, "data_prep-read") as ahead:
        pending_read = ahead.submit(read)
        ends_line = False  # whether the text before ``block`` ends with a line break
        while True:
            try:
                block = pending_read.result()
            except GZIP_ERRORS as e:
                if tail is not None and tail.file is not None:
                    tail.file.close()
                raise FastaError(f"{path}: corrupt or truncated gzip data ({e})") from None
            if left is not None:
                left -= len(block)
            more = bool(block) and (left is None or left > 0)
            if more:
                pending_read = ahead.submit(read)
            if tail is not None:  # the long record ends at the first record start
                end = 0 if ends_line and block[:1] == b">" else block.find(b"\n>") + 1 or None
                tail.add(block if end is None else block[:end])
                if end is None and more:
                    ends_line = block[-1:] == b"\n"
                    continue
                done, tail = tail, None
                yield done.finish(), done.line
                line += done.newlines
                block = b"" if end is None else block[end:]  # (None: the input ended inside the record)
                ends_line = False
                if not block and not more:
                    return
            if not more:
                text = b"".join([*parts, block])
                if text:
                    yield text, line
                return
            cut = block.rfind(b"\n>")
            if cut >= 0 or (ends_line and block[:1] == b">"):
                text = b"".join([*parts, block[:cut + 1]])  # cut -1: the block itself starts the next record
                parts, pending = [block[cut + 1:]], len(block) - cut - 1
                if text:
                    yield text, line
                    line += newlines(text)
            else:
                parts.append(block)
                pending += len(block)
            ends_line = block[-1:] == b"\n"
            if pending > spill_at:  # no record starts after its first byte: the text since the cut is one record
                tail = _Tail(line, bound)
                for part in parts:
                    tail.add(part)
                parts, pending = [], 0


def is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == GZIP_MAGIC
