"""FASTA / FASTA.gz reader that refuses malformed input instead of guessing.

Accepted quirks (all seen in real exports): gzip detected by magic bytes whatever the file is called, CRLF line
endings, a UTF-8 byte-order mark, blank lines, trailing whitespace, lowercase (soft-masked) bases and any wrap width.
Everything else is a ``FastaError`` naming ``file:line`` (and ``:column`` for a bad character). With
``on_invalid="yield"`` a record with a character outside the alphabet is yielded with ``error`` set instead, so that
the caller can count and skip it (data_prep's default) or raise it (``--strict``).
"""
from __future__ import annotations

import gzip
import io
import zlib
from bisect import bisect_right
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, NamedTuple

import numpy as np
from isal import igzip
from isal.igzip_lib import IsalError

GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"
# Other containers a FASTA is often shipped in: name them rather than report their bytes as bad bases.
UNSUPPORTED_MAGIC = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"\x28\xb5\x2f\xfd": "zstd", b"PK\x03\x04": "zip"}


class FastaError(ValueError):
    """Malformed input; the message starts with ``path:line[:column]``. ``at``: where in the input order a scan
    part met it (its chunk, or the part itself: data_prep/scan.py): --workers reports the first."""

    def __init__(self, message: str, at: int | None = None):
        super().__init__(message)
        self.at = at


# What a damaged gzip stream raises while it is read (zlib's errors for gzip.open elsewhere, ISA-L's for igzip).
GZIP_ERRORS = (EOFError, gzip.BadGzipFile, zlib.error, IsalError)

# path -> the open input's on-disk byte position (compressed bytes for gzip): what progress bars measure.
_POSITIONS: dict[str, Callable[[], int]] = {}


def track_position(path: str | Path, tell: Callable[[], int]) -> None:
    """Make ``tell`` the source of ``input_position(path)`` (the reader that opened ``path`` last)."""
    _POSITIONS[str(path)] = tell


def input_position(path: str | Path) -> int:
    """Bytes of ``path`` (as stored on disk) read so far by its most recently opened reader; the file size once that
    reader is closed, 0 before it is opened."""
    tell = _POSITIONS.get(str(path))
    if tell is None:
        return 0
    try:
        return tell()
    except (ValueError, OSError):  # closed
        try:
            return Path(path).stat().st_size
        except OSError:
            return 0


class Record(NamedTuple):
    id: str  # first whitespace-separated token of the header
    description: str  # rest of the header ('' if none)
    seq: bytes  # residues as written (case kept, line breaks removed); UTF-8 text for text sources
    line: int  # 1-based line number of the header
    meta: dict | None = None  # source-specific fields stored in the sample's meta.json
    error: str | None = None  # 'path:line[:col]: why' when the record is invalid (skipped or, --strict, raised)
    reason: str | None = None  # filter reason counted for an invalid record, e.g. 'invalid_character'
    nbytes: int = 0  # uncompressed input bytes the record occupied (progress MB/s)
    length: int | None = None  # residues of a record longer than the job's bound, skipped unread (``seq`` empty)


def open_input(path: str | Path) -> BinaryIO:
    """Binary stream of the file's content, gunzipped if it starts with the gzip magic bytes (by ISA-L's igzip,
    the same stream as gzip.open at about twice its speed)."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(6)
    for magic, kind in UNSUPPORTED_MAGIC.items():
        if head.startswith(magic):
            raise FastaError(f"{path}: {kind}-compressed input is not supported (only gzip); decompress it first")
    if head.startswith(GZIP_MAGIC):
        gz = igzip.open(path, "rb")
        track_position(path, gz.fileobj.tell)  # the compressed file underneath
        f = io.BufferedReader(gz, buffer_size=1 << 20)
    else:
        f = open(path, "rb", buffering=1 << 20)
        track_position(path, f.tell)
    # Every supported format is text: a NUL byte in the first block means binary garbage (or an unsupported
    # container), reported as such rather than as a bad first character or a missing header.
    try:
        block = f.peek(1 << 16)[:1 << 16]
    except GZIP_ERRORS as e:
        f.close()
        raise FastaError(f"{path}: corrupt or truncated gzip data ({e})") from None
    if b"\x00" in block:
        f.close()
        at = block.index(b"\x00")
        raise FastaError(f"{path}: binary data (NUL byte at offset {at}), not a text file")
    return f


def numbered_lines(path: str | Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line without its LF) of a plain or gzipped file; gzip damage named with the file."""
    try:
        with open_input(path) as f:
            yield from enumerate((raw[:-1] if raw.endswith(b"\n") else raw for raw in f), 1)
    except GZIP_ERRORS as e:
        raise FastaError(f"{path}: corrupt or truncated gzip data ({e})") from None


def _bad_char_error(path: Path, record_id: str, chunks: list[bytes], starts: list[int], linenos: list[int],
                    pos: int) -> FastaError:
    k = bisect_right(starts, pos) - 1
    line, p = chunks[k], pos - starts[k]
    # Columns count characters, not bytes, so a stray UTF-8 character is reported where an editor shows it.
    col = len(line[:p].decode("utf-8", "replace")) + 1
    char = line[p:p + 4].decode("utf-8", "replace")[0]
    return FastaError(f"{path}:{linenos[k]}:{col}: character {char!r} is not in the tokenizer alphabet "
                      f"(record {record_id})")


def iter_fasta(path: str | Path, invalid_positions: Callable[[bytes], np.ndarray] | None = None,
               on_invalid: str = "raise", bound: int | None = None) -> Iterator[Record]:
    """Records of a FASTA file in file order.

    ``invalid_positions(seq)`` (e.g. ``NucleotideTokenizer.invalid_positions``) is applied to every record so that
    a character outside the alphabet is reported with its line and column rather than later by the encoder.
    ``bound``: a record of more residues stops being kept once it passes the bound and is yielded with ``length``
    (its residues) and an empty ``seq``, unchecked: the caller counts it as filtered (memory: the bound, not the
    record; a single line is still read whole).
    """
    path = Path(path)
    try:
        with open_input(path) as f:
            yield from _records(path, enumerate(f, 1), invalid_positions, on_invalid, bound)
    except GZIP_ERRORS as e:
        raise FastaError(f"{path}: corrupt or truncated gzip data ({e})") from None


def iter_fasta_text(path: Path, text: bytes, first_line: int,
                    invalid_positions: Callable[[bytes], np.ndarray] | None = None,
                    on_invalid: str = "raise") -> Iterator[Record]:
    """The records of ``text``, whole records of ``path`` starting at its line ``first_line``, exactly as
    iter_fasta reads them there (data_prep's batch reader hands it the records it does not take itself)."""
    return _records(path, enumerate(io.BytesIO(text), first_line), invalid_positions, on_invalid)


def _records(path: Path, lines, invalid_positions, on_invalid: str, bound: int | None = None) -> Iterator[Record]:
    """iter_fasta over ``lines``: (1-based line number, raw line with its line break)."""
    header: bytes | None = None
    hline = 0
    chunks: list[bytes] = []
    starts: list[int] = []  # offset of each chunk in the joined sequence
    linenos: list[int] = []
    nbytes = 0

    def finish() -> Record:
        text = header.decode("utf-8", "backslashreplace")
        parts = text.split(None, 1)
        if not parts:
            raise FastaError(f"{path}:{hline}: header has no record id")
        if bound is not None and offset > bound:  # its lines were dropped past the bound: only counted
            return Record(parts[0], parts[1].strip() if len(parts) > 1 else "", b"", hline, nbytes=nbytes,
                          length=offset)
        seq = b"".join(chunks)
        if invalid_positions is not None and seq:
            bad = invalid_positions(seq)
            if bad.size:
                err = _bad_char_error(path, parts[0], chunks, starts, linenos, int(bad[0]))
                if on_invalid == "raise":
                    raise err
                return Record(parts[0], parts[1].strip() if len(parts) > 1 else "", seq, hline,
                              error=str(err), reason="invalid_character", nbytes=nbytes)
        return Record(parts[0], parts[1].strip() if len(parts) > 1 else "", seq, hline, nbytes=nbytes)

    offset = 0
    for lineno, raw in lines:
        nbytes += len(raw)
        if lineno == 1:
            if raw.startswith(UTF8_BOM):
                raw = raw[len(UTF8_BOM):]
            elif raw.startswith((b"\xff\xfe", b"\xfe\xff")):
                raise FastaError(f"{path}:1: file is UTF-16 encoded; convert it to ASCII/UTF-8")
        line = raw.rstrip()  # drops \r\n, \n and trailing blanks
        if not line:
            continue
        if line[:1] == b">" and b"\r" in line:  # CR-only (classic Mac) line endings: the file reads as one line
            raise FastaError(f"{path}:{lineno}: a carriage return (\\r) inside a line: the file has CR-only line "
                             "endings; convert them to \\n (e.g. tr '\\r' '\\n' < IN > OUT)")
        if line[:1] == b">":
            if header is not None:
                yield finish()
            header, hline = line[1:], lineno
            chunks, starts, linenos, offset, nbytes = [], [], [], 0, len(raw)
        elif header is None:
            raise FastaError(f"{path}:{lineno}: sequence data before the first '>' header")
        else:
            if bound is None or offset + len(line) <= bound:
                chunks.append(line)
                starts.append(offset)
                linenos.append(lineno)
            elif chunks:  # past the bound: the record will be skipped, its lines need not be kept
                chunks, starts, linenos = [], [], []
            offset += len(line)
    if header is not None:
        yield finish()
