"""Batch reading of FASTA inputs for data_prep: whole chunks of records parsed, checked and tokenized at once.

The per-record path (data_prep/fasta.py iter_fasta, one Python iteration per line and several numpy calls per
record) ran at ~3 MB/s of gzipped input, far below ``gzip -dc``. Here the decompressed input is read in chunks of
whole records (``CHUNK`` bytes, cut before a line that starts with '>'); per chunk the records are split with
``bytes.split``, their sequences joined into one buffer, validated with one ``bytes.translate`` over it, upper-cased
and tokenized with one ``bytes.translate`` each. Per record only the header is handled in Python.

What a record becomes is exactly what iter_fasta (+ the uniref source's header parsing) makes of it: a record the
batch path does not take as is -- a character outside the alphabet or whitespace inside the sequence, a header
without an id, a UniRef header of another shape than the two the template knows -- is handed over as the
``Record`` iter_fasta_text parses from its own lines (same errors, lines, columns), and the job treats it on its
per-record path. Chunks with a CR other than in CRLF line ends, and inputs that do not start with '>', are read
wholly on the per-record path.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .fasta import FastaError, Record, iter_fasta_text, open_input

CHUNK = 1 << 22  # decompressed bytes read at a time; a record longer than this makes its chunk longer
_enc = json.encoder.encode_basestring_ascii  # what json.dumps uses for str (ensure_ascii=True), in C


@dataclass
class Chunk:
    """Whole records of one input. Record j: header line ``line(j)``, id ``ids[j]``, sequence (as written, line
    breaks removed) ``seq[bounds[j]:bounds[j + 1]]``; ``tails[j]`` the JSON text of its meta after ``"length":N``
    (``,"description":...}`` or the UniRef fields), or None when ``metas[j]`` holds the meta dict instead; records
    in ``slow`` (position -> Record from iter_fasta_text, or the FastaError it raised) are for the per-record path and their entries here are
    placeholders (empty sequence)."""
    ids: list
    seq: bytes
    bounds: np.ndarray  # int64 [n + 1]
    tails: list
    metas: dict
    slow: dict
    text: bytes
    first_line: int
    header_starts: np.ndarray  # int64 [n]: offset of each record's '>' in text
    _newlines: np.ndarray | None = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.ids)

    def line(self, j: int) -> int:
        """1-based line number of record j's header."""
        if self._newlines is None:
            self._newlines = np.flatnonzero(np.frombuffer(self.text, np.uint8) == 10)
        return self.first_line + int(np.searchsorted(self._newlines, self.header_starts[j]))


def starts_with_header(path: Path) -> bool:
    """Whether the input's first byte is '>' (else it is read record by record: BOM, blank lines, garbage)."""
    with open_input(path) as f:
        return f.peek(1)[:1] == b">"


def chunks(path: Path, size: int = CHUNK) -> Iterator[tuple[bytes, int]]:
    """(text, line number of its first line): the input cut before lines that start with '>'."""
    line, carry = 1, b""
    with open_input(path) as f:
        while True:
            block = f.read(size)
            buf = carry + block if carry else block
            if not block:
                if buf:
                    yield buf, line
                return
            cut = buf.rfind(b"\n>")
            if cut < 0:
                carry = buf
                continue
            text, carry = buf[:cut + 1], buf[cut + 1:]
            yield text, line
            line += text.count(b"\n")


# UniRef headers of the two shapes the shared data holds (parse_uniref_header reads any): the full header
# "<name> n=<n> Tax=<taxon> TaxID=<id> RepID=<id>" and BioNeMo's "TaxID=<id> RepID=<id>". Only descriptions with
# exactly as many '=' as the shape has fields are matched, so no other key can hide in a value; numbers are taken
# as parse_uniref_header's _number would take them only when they are plain integers (or "<int>.0") of at most 15
# digits (exact in a float); anything else goes to parse_uniref_header.
_FULL = re.compile(r"(?:(.*?)\s+)?n=(.*?)\s+Tax=(.*?)\s+TaxID=(.*?)\s+RepID=(.*)", re.S)
_SIMPLE = re.compile(r"TaxID=(.*?)\s+RepID=(.*)", re.S)
_INT = re.compile(r"(\d{1,15})(?:\.0)?")
_KEYLIKE = re.compile(r"(?:n|Tax|TaxID|RepID|ClusterName)=")


def _int_json(text: str) -> str | None:
    m = _INT.fullmatch(text)
    return str(int(m.group(1))) if m else None


def uniref_tail(desc: str) -> str | None:
    """The JSON text of parse_uniref_header's fields after "length" (``,"name":...,"repid":...}``) for a header of
    one of the two known shapes, else None."""
    eq = desc.count("=")
    if eq == 4:
        m = _FULL.fullmatch(desc)
        if m is None:
            return None
        name, n, tax, taxid, repid = m.groups()
        n, taxid = _int_json(n.strip()), _int_json(taxid.strip())
        if n is None or taxid is None:
            return None
        head = ""
        if name is not None:
            if _KEYLIKE.match(name):
                return None
            head = f',"name":{_enc(name)}'
        return f'{head},"n":{n},"tax":{_enc(tax.strip())},"taxid":{taxid},"repid":{_enc(repid.strip())}}}'
    if eq == 2:
        m = _SIMPLE.fullmatch(desc)
        if m is None:
            return None
        taxid = _int_json(m.group(1).strip())
        if taxid is None:
            return None
        return f',"taxid":{taxid},"repid":{_enc(m.group(2).strip())}}}'
    return None


class Reader:
    """Chunks of one FASTA input, parsed. ``valid``: the bytes a sequence may hold as written (the alphabet; for
    UniRef also its lowercase); ``invalid_positions``: the source reader's own check (for the per-record
    fallback); ``uniref``: the source parses UniRef headers into meta (``to_record`` completes a fallback record
    the way the source does)."""

    def __init__(self, path: Path, valid: bytes, invalid_positions: Callable | None, uniref: bool,
                 to_record: Callable[[Record], Record] = lambda r: r):
        self.path, self.uniref, self.to_record = path, uniref, to_record
        self.invalid_positions = invalid_positions
        self._valid = valid

    def __iter__(self) -> Iterator[Chunk | list]:
        """A Chunk per chunk of the input, or the list of its Records when the chunk is read record by record."""
        for text, first_line in chunks(self.path):
            if b"\r" in text:
                if text.count(b"\r") != text.count(b"\r\n"):  # a CR that is not a CRLF line end
                    yield [self.to_record(r) for r in iter_fasta_text(self.path, text, first_line,
                                                                      self.invalid_positions, "yield")]
                    continue
                text = text.replace(b"\r\n", b"\n")  # iter_fasta strips line ends: the same records
            yield self._parse(text, first_line)

    def _parse(self, text: bytes, first_line: int) -> Chunk:
        pieces = text.split(b"\n>")  # record texts without their '>'; text starts with '>'
        pieces[0] = pieces[0][1:]
        n = len(pieces)
        sizes = np.fromiter(map(len, pieces), np.int64, n)
        header_starts = np.zeros(n, np.int64)
        np.cumsum(sizes[:-1] + 2, out=header_starts[1:])
        parts = [p.partition(b"\n") for p in pieces]
        seqs = [p[2].replace(b"\n", b"") for p in parts]
        heads = b"\n".join([p[0] for p in parts]).decode("utf-8", "backslashreplace").split("\n")
        seq = b"".join(seqs)
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(np.fromiter(map(len, seqs), np.int64, n), out=bounds[1:])
        slow: dict[int, Record] = {}
        bad_seq = None
        if seq.translate(None, self._valid):  # some record holds a byte outside the alphabet (or a blank)
            table = np.ones(256, np.int64)
            table[np.frombuffer(self._valid, np.uint8)] = 0
            cum = np.zeros(len(seq) + 1, np.int64)
            np.cumsum(table[np.frombuffer(seq, np.uint8)], out=cum[1:])
            bad_seq = np.flatnonzero(cum[bounds[1:]] != cum[bounds[:-1]]).tolist()
        split = [h.split(None, 1) for h in heads]
        ids = [sp[0] if sp else "" for sp in split]
        descs = [(sp[1].strip() if len(sp) > 1 else "") for sp in split]
        metas: dict[int, dict] = {}
        if self.uniref:
            tails = [(uniref_tail(d) if d else "}") for d in descs]
            for j, t in enumerate(tails):
                if t is None and split[j]:
                    from .sources import parse_uniref_header
                    metas[j] = parse_uniref_header(ids[j], descs[j])
        else:
            tails = [f',"description":{_enc(d)}}}' for d in descs]
        for j, sp in enumerate(split):
            if not sp:  # no record id: the per-record path raises the error
                slow[j] = None
        for j in bad_seq or ():
            slow[j] = None
        chunk = Chunk(ids, seq, bounds, tails, metas, slow, text, first_line, header_starts)
        for j in sorted(slow):
            end = header_starts[j + 1] if j + 1 < n else len(text)
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
