"""Readers for the real on-disk formats beyond plain FASTA: OpenGenome2 JSONL, UniRef FASTA, BabyLM text.

A reader is ``reader(path, ctx) -> Iterator[Record]`` in file order. ``ctx.invalid_positions(seq)`` is the tokenizer's
alphabet check, ``ctx.stats`` a dict of counters the reader adds its normalizations to (they end up in the
manifest's ``stats``), ``ctx.members`` the optional UniRef50 -> UniRef90 member map. Structural damage (bad JSON, a
JSON object without ``text``, a truncated gzip, binary data) raises ``FastaError`` naming ``file:line``; a record
whose characters fall outside the alphabet is yielded with ``error``/``reason`` set, so the job can count and skip
it or (``--strict``) raise it.
"""
from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .common import TSV_HEADER
from .fasta import GZIP_ERRORS, UTF8_BOM, FastaError, Record, iter_fasta, numbered_lines, open_input


@dataclass
class Context:
    invalid_positions: Callable[[bytes], np.ndarray] | None = None
    stats: dict = field(default_factory=dict)
    members: dict | None = None  # UniRef50 id -> [UniRef90 ids]
    text_column: str | None = None  # babylm: the column of .csv inputs that holds the text (--text-column)
    bound: int | None = None  # FASTA: a longer record is skipped while read (rule.read_bound), never built

    def count(self, key: str, n: int = 1):
        self.stats[key] = self.stats.get(key, 0) + n


def _bad_char(path: Path, line: int, record_id: str, seq: bytes, pos: int) -> str:
    char = seq[pos:pos + 4].decode("utf-8", "replace")[0]
    return (f"{path}:{line}: character {char!r} at sequence position {pos + 1} is not in the tokenizer alphabet "
            f"(record {record_id})")


# ---------------------------------------------------------------------------------------------------- OpenGenome2
TAG_RE = re.compile(r"\|([^|]*)\|")


def iter_opengenome2(path: Path, ctx: Context) -> Iterator[Record]:
    """OpenGenome2 JSON Lines: one ``{"text": ..., ["record": id]}`` object per line.

    Policies (counters in the manifest's ``stats``):
    * ``|d__...;s__...|`` phylogenetic tags are removed from the sequence; the first is kept as meta ``taxonomy``
      (further, different tags as ``taxonomy_extra``); ``taxonomy_tags`` counts them. A lone ``|`` makes the record
      invalid (reason ``unterminated_taxonomy_tag``).
    * ``@`` (splice-window marker) is dropped: it carries no base; ``splice_markers_dropped`` counts them.
    * ``#`` (contig split) stays in the sequence and is written as one ``<sep>`` token; ``contig_splits`` counts
      them. Residue counts and length filters exclude it.
    * lowercase (soft-masked repeat) bases are upper-cased by the job (``lowercase_residues``): the nucleotide
      vocabulary has one token per base; the soft-mask is not kept.
    * any other character (whitespace, non-ASCII, digits) makes the record invalid (``invalid_character``).
    * record id: the ``record`` field when present, else ``<file name>:<line>``.
    """
    for lineno, line in numbered_lines(path):
        nbytes = len(line) + 1
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.strip():
            ctx.count("blank_lines")
            continue
        try:
            obj = json.loads(line)
        except (ValueError, UnicodeDecodeError) as e:
            raise FastaError(f"{path}:{lineno}: not a JSON object ({e})") from None
        except RecursionError:  # [[[[... past the parser's depth: no record is nested like that
            raise FastaError(f"{path}:{lineno}: not an OpenGenome2 record (JSON nested too deeply to parse)") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise FastaError(f"{path}:{lineno}: JSON line has no 'text' field (OpenGenome2 JSONL expected)")
        text = obj["text"]
        if not isinstance(text, str):
            raise FastaError(f"{path}:{lineno}: 'text' is a {type(text).__name__}, expected a string")
        rid = str(obj["record"]) if obj.get("record") is not None else f"{path.name}:{lineno}"
        meta: dict = {"line": lineno}
        if "|" in text:
            tags = TAG_RE.findall(text)
            text = TAG_RE.sub("", text)
            if "|" in text:
                yield Record(rid, "", text.encode("utf-8"), lineno, meta,
                             f"{path}:{lineno}: unterminated '|' taxonomy tag (record {rid})",
                             "unterminated_taxonomy_tag", nbytes)
                continue
            if tags:
                ctx.count("taxonomy_tags", len(tags))
                meta["taxonomy"] = tags[0]
                extra = [t for t in dict.fromkeys(tags[1:]) if t != tags[0]]
                if extra:
                    meta["taxonomy_extra"] = extra
        if "@" in text:
            ctx.count("splice_markers_dropped", text.count("@"))
            text = text.replace("@", "")
        seq = text.encode("utf-8")
        if b"#" in seq:
            ctx.count("contig_splits", seq.count(b"#"))
        if ctx.invalid_positions is not None and seq:
            bad = ctx.invalid_positions(seq.replace(b"#", b"N"))
            if bad.size:
                yield Record(rid, "", seq, lineno, meta, _bad_char(path, lineno, rid, seq, int(bad[0])),
                             "invalid_character", nbytes)
                continue
        yield Record(rid, "", seq, lineno, meta, nbytes=nbytes)


# ---------------------------------------------------------------------------------------------------------- UniRef
_FIELD_SPLIT = re.compile(r"\s+(?=(?:n|Tax|TaxID|RepID|ClusterName)=)")


def _number(text: str):
    """'10493' -> 10493, '67581.0' (BioNeMo export) -> 67581, anything else unchanged."""
    try:
        v = float(text)
    except ValueError:
        return text
    return int(v) if v.is_integer() else text


def parse_uniref_header(record_id: str, description: str) -> dict:
    """Header fields as meta: id, name, n, tax, taxid, repid (absent fields omitted).

    ``>UniRef50_Q6GZX4 Putative transcription factor 001R n=74 Tax=Ranavirus TaxID=10493 RepID=001R_FRG3G`` and the
    simplified BioNeMo form ``>UniRef50_A0A007 TaxID=67581.0 RepID=A0A007_STRVD``. ``Tax=`` may contain spaces.
    """
    meta: dict = {"id": record_id}
    parts = _FIELD_SPLIT.split(description) if description else []
    if parts and not re.match(r"(?:n|Tax|TaxID|RepID|ClusterName)=", parts[0]):
        meta["name"] = parts.pop(0)
    for part in parts:
        key, _, value = part.partition("=")
        value = value.strip()
        if key == "n":
            meta["n"] = _number(value)
        elif key == "TaxID":
            meta["taxid"] = _number(value)
        else:
            meta[key.lower()] = value
    return meta


def iter_uniref(path: Path, ctx: Context) -> Iterator[Record]:
    """UniRef50/90 FASTA. Header fields parsed into meta; lowercase residues are upper-cased by the job (ESM is
    case-sensitive); ``members`` (UniRef90 ids of the cluster) added when ``--uniref90-members`` maps the id."""
    check = ctx.invalid_positions

    def upper_check(seq: bytes) -> np.ndarray:
        return check(seq.upper())

    for rec in iter_fasta(path, upper_check if check is not None else None, on_invalid="yield", bound=ctx.bound):
        yield uniref_record(rec, ctx)


def uniref_record(rec: Record, ctx: Context) -> Record:
    """A FASTA record of a UniRef file with its meta (header fields, members): iter_uniref's per-record step."""
    meta = parse_uniref_header(rec.id, rec.description)
    if ctx.members is not None:
        members = ctx.members.get(rec.id)
        if members is not None:
            meta["members"] = members
            ctx.count("with_members")
    return rec._replace(meta=meta)


def load_members(path: Path) -> dict[str, list[str]]:
    """UniRef50 id -> UniRef90 member ids from a TSV ``UniRef50_X<TAB>UniRef90_A,UniRef90_B``.

    The mapping TSV's header ``UR50_cluster_name<TAB>mapped_id`` (data_prep/clusters.py, the form the ESM-2 sampling
    set ships in) is recognized on the first line and skipped; repeated later (two files concatenated) it is an
    error, as is a line without two tab-separated fields or a file without any row. Held in memory (about 100 bytes
    per member id): the full UniRef50 map needs tens of GB, so cluster-aware runs over all of UniRef50 should use one
    members file per input split.
    """

    out: dict[str, list[str]] = {}
    first = True
    for lineno, line in numbered_lines(path):
        text = line.decode("utf-8", "replace").rstrip("\r")
        if not text.strip() or text.startswith("#"):
            continue
        parts = text.split("\t")
        if tuple(parts) == TSV_HEADER:
            if not first:
                raise FastaError(f"{path}:{lineno}: header line {TSV_HEADER[0]}<TAB>{TSV_HEADER[1]} repeated after "
                                 "the first line (concatenated files?)")
            first = False
            continue
        first = False
        if len(parts) != 2 or not parts[0]:
            raise FastaError(f"{path}:{lineno}: expected 'UniRef50 id<TAB>member,member,...'")
        out[parts[0]] = [m for m in parts[1].split(",") if m]
    if not out:
        raise FastaError(f"{path}: no 'UniRef50 id<TAB>member,member,...' rows")
    return out


# ---------------------------------------------------------------------------------------------------------- BabyLM
def expand_text_inputs(paths: list[Path]) -> list[Path]:
    """Directories become their ``*.train`` files (sorted, so the record order is fixed); files stay."""
    out: list[Path] = []
    for p in paths:
        if p.is_dir():
            found = sorted(q for q in p.glob("*.train") if q.is_file())
            if not found:
                raise FastaError(f"{p}: directory holds no *.train files")
            out.extend(found)
        else:
            out.append(p)
    return out


def is_csv(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith(".csv") or name.endswith(".csv.gz")


def _columns_shown(cols: list[str]) -> str:
    return ", ".join(cols[:12]) + (", ..." if len(cols) > 12 else "")


def csv_columns(path: Path) -> list[str]:
    """The header row of a CSV input (plain or gzip; BOM removed)."""
    try:
        with io.TextIOWrapper(open_input(path), encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
            header = next(csv.reader(f), None)
    except GZIP_ERRORS as e:
        raise FastaError(f"{path}: corrupt or truncated gzip data ({e})") from None
    except csv.Error as e:
        raise FastaError(f"{path}:1: not a CSV header ({e})") from None
    if not header:
        raise FastaError(f"{path}:1: no CSV header row")
    return header


def check_text_inputs(paths: list[Path], text_column: str | None) -> None:
    """Before anything is written: a .csv input needs ``--text-column`` naming one of its header's columns (its
    lines are CSV rows, not utterances), and ``--text-column`` needs a .csv input."""
    csvs = [p for p in paths if is_csv(p)]
    if text_column is None:
        if csvs:
            raise FastaError(f"{csvs[0]}: a CSV file, not one utterance a line: pass --text-column NAME to read one "
                             f"of its columns ({_columns_shown(csv_columns(csvs[0]))})")
        return
    if not csvs:
        raise FastaError(f"--text-column {text_column} applies to .csv inputs, and none of the inputs is a .csv")
    for p in csvs:
        cols = csv_columns(p)
        if text_column not in cols:
            raise FastaError(f"{p}:1: --text-column {text_column!r} is not a column of the header "
                             f"({_columns_shown(cols)})")


def iter_csv_column(path: Path, ctx: Context) -> Iterator[Record]:
    """One column (``ctx.text_column``) of a CSV file, read with the csv module (quoted commas and line breaks
    inside cells handled), each non-blank cell one record with id ``<name>:<line of the row>``. Policies: a BOM is
    removed; blank cells are skipped (``blank_cells``); a line break inside a cell becomes a space
    (``cells_with_line_breaks``), since a record is one line of text; invalid UTF-8 makes the record invalid
    (``invalid_utf8``). A row with fewer fields than the header, or malformed quoting, is an error naming
    ``file:line``. meta ``domain`` is the file name up to its first dot."""
    domain = path.name.split(".")[0]
    column = ctx.text_column
    reader = None
    try:
        with io.TextIOWrapper(open_input(path), encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, None) or []
            if column not in header:
                raise FastaError(f"{path}:1: --text-column {column!r} is not a column of the header "
                                 f"({_columns_shown(header)})")
            k = header.index(column)
            start = reader.line_num + 1
            for row in reader:
                lineno, start = start, reader.line_num + 1
                if not row:
                    continue
                if len(row) <= k:
                    raise FastaError(f"{path}:{lineno}: row has {len(row)} fields, the header {len(header)} "
                                     f"(no {column!r} value)")
                text = row[k]
                if not text.strip():
                    ctx.count("blank_cells")
                    continue
                if "\n" in text or "\r" in text:
                    ctx.count("cells_with_line_breaks")
                    text = " ".join(text.splitlines())
                rid = f"{domain}:{lineno}"
                raw = text.encode("utf-8", "surrogateescape")
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    yield Record(rid, "", raw, lineno, {"domain": domain},
                                 f"{path}:{lineno}: invalid UTF-8 in column {column!r} (character {e.start + 1})",
                                 "invalid_utf8", len(raw) + 1)
                    continue
                yield Record(rid, "", raw, lineno, {"domain": domain}, nbytes=len(raw) + 1)
    except GZIP_ERRORS as e:
        raise FastaError(f"{path}: corrupt or truncated gzip data ({e})") from None
    except csv.Error as e:
        raise FastaError(f"{path}:{reader.line_num if reader is not None else 1}: malformed CSV ({e})") from None


def iter_text_lines(path: Path, ctx: Context) -> Iterator[Record]:
    """BabyLM ``*.train``: one utterance / sentence per line, each line one record (a ``.csv`` input: one column of
    it, ``iter_csv_column``; refused without ``--text-column``).

    Policies: a UTF-8 BOM (at the start of a file or of a line, as left by concatenated files) is removed
    (``bom_stripped``); CRLF endings lose the CR (``crlf_lines``); blank lines are skipped (``blank_lines``); all
    other text is kept verbatim, CHILDES speaker codes (``*MOT:\\t``), tabs and ``= = =`` headers included. Invalid
    UTF-8 makes the line invalid (``invalid_utf8``). meta ``domain`` is the file stem (``childes``, ``switchboard``).
    """
    if is_csv(path):
        if ctx.text_column is None:
            check_text_inputs([path], None)  # raises, naming the columns
        yield from iter_csv_column(path, ctx)
        return
    domain = path.stem
    for lineno, line in numbered_lines(path):
        nbytes = len(line) + 1
        if line.startswith(UTF8_BOM):
            line = line[len(UTF8_BOM):]
            ctx.count("bom_stripped")
        if line.endswith(b"\r"):
            line = line[:-1]
            ctx.count("crlf_lines")
        if not line.strip():
            ctx.count("blank_lines")
            continue
        rid = f"{domain}:{lineno}"
        try:
            line.decode("utf-8")
        except UnicodeDecodeError as e:
            col = len(line[:e.start].decode("utf-8", "replace")) + 1
            yield Record(rid, "", line, lineno, {"domain": domain},
                         f"{path}:{lineno}:{col}: invalid UTF-8 byte {line[e.start]:#04x}", "invalid_utf8", nbytes)
            continue
        yield Record(rid, "", line, lineno, {"domain": domain}, nbytes=nbytes)


def iter_fasta_source(path: Path, ctx: Context) -> Iterator[Record]:
    """Nucleotide FASTA (genomes, RNAcentral): records as written; the job upper-cases and counts lowercase."""
    return iter_fasta(path, ctx.invalid_positions, on_invalid="yield", bound=ctx.bound)
