"""UniRef50 clusters of UniRef90 members (``data_prep uniref --clusters TSV``): the ESM-2 sampling set as shards.

One sample per UniRef50 cluster, holding every UniRef90 member sequence of the cluster that survives the filters
(layout "clusters", pipeline/data/shards.py); the training loader draws one member per (seed, epoch, sample).

Inputs: the member FASTA(.gz) files (``--input``; ids are the FASTA record ids, headers otherwise unused) and the
mapping TSV (``--clusters``): an optional header ``UR50_cluster_name<TAB>mapped_id``, then one cluster a line,
``UniRef50_X<TAB>id,id,...``. The TSV's data row r (0-based) is the sample key ``f"{r:012d}"`` and, with
``--num-jobs N``, belongs to job r % N: the split is by cluster, and a cluster's members always meet in one job.

Bad input is one FastaError naming ``file:line`` before anything is written: a line without exactly two
tab-separated fields, an empty or blank-containing cluster name or member id, a cluster listed twice, a member listed
twice (in two clusters or in one), a header line after the first line, a member record found twice in the FASTA.
Everything else that is not written is counted (see ``build``).

Memory does not grow with the corpus: every member meets its FASTA record in DuckDB's join, which spills to disk
under a memory limit (data_prep/join.py, whose docstring gives the four passes); this module parses and checks the
TSV (pass 1 and the re-read of pass 4) and runs the passes (``build``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checks import DamageCheck, PrepError
from .cluster_write import Writer
from .common import TSV_HEADER, input_fingerprint
from .fasta import GZIP_ERRORS, FastaError, input_position, numbered_lines, open_input
from .join import NAME, OTHER, TSV_COLUMNS, Spill, TableWriter, join, offsets
from .scan import load_parts, part_name, scan, scan_fingerprint
from .progress import Progress
from .rule import ALL_MEMBERS_FILTERED, NO_MEMBER_IN_FASTA, member_reasons

@dataclass
class ClusterMap:
    """The TSV's counts (every job parses all of it) and this job's share, whose members wait in the spill's TSV
    table."""

    path: Path
    num_jobs: int
    job_index: int
    spill: Spill
    clusters: int  # data rows of the whole file
    members: int  # member ids of the whole file
    blank_lines: int
    own_clusters: int
    own_members: int
    first_member: str | None  # this job's first member id (named when none is found in the FASTA)

    def own(self):
        """RowBlocks of this job's clusters in TSV order, with ``firsts``: the first slot of each (pass 1 checked
        every row). ``first_row`` is then the block's first row of the file, and row r is row ``rows[r]``."""
        slot = 0
        for b in _row_blocks(self.path):
            sel = np.flatnonzero((b.first_row + np.arange(len(b.names))) % self.num_jobs == self.job_index)
            counts = b.counts[sel]
            firsts = slot + np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
            slot += int(counts.sum())
            yield (b.first_row + sel, [b.names[i] for i in sel.tolist()], [b.members[i] for i in sel.tolist()],
                   b.lines[sel], firsts, counts)


def _parse_row(path: Path, lineno: int, parts: list[str]) -> tuple[str, list[str]]:
    if len(parts) != 2:
        raise FastaError(f"{path}:{lineno}: expected 'UniRef50 cluster<TAB>member,member,...' (2 tab-separated "
                         f"fields), got {len(parts)} field{'s' if len(parts) != 1 else ''}")
    name, mapped = parts
    if not name or len(name.split()) != 1 or name.strip() != name:
        raise FastaError(f"{path}:{lineno}: cluster name {name!r} is empty or contains blanks")
    members = mapped.split(",")
    for k, m in enumerate(members):
        if not m or len(m.split()) != 1 or m.strip() != m:
            raise FastaError(f"{path}:{lineno}: member {k + 1} of cluster {name} ({m!r}) is empty or contains "
                             "blanks (ids are comma-separated without spaces)")
    return name, members


def _rows(path: Path):
    """(line, fields) of the data rows, after the optional header; blank lines yield None."""
    first = [True]
    for lineno, line in numbered_lines(path):
        parts = _row(path, lineno, line, first)
        if parts != []:
            yield lineno, parts


@dataclass
class RowBlock:
    """Consecutive data rows of the TSV: row r of the block is data row ``first_row + r`` of the file."""
    first_row: int
    names: list  # cluster names
    members: list  # the members as written, "a,b,..."
    lines: np.ndarray  # int64: 1-based line of each row
    counts: np.ndarray  # int64: members of each row
    blank: int  # blank lines among the block's lines


_HEADER = "\t".join(TSV_HEADER).encode() + b"\n"
_BLANKS = np.zeros(256, bool)  # blanks other than \t and \n that str.split() splits on (ASCII)
_BLANKS[[0x20, 0x0d, 0x0b, 0x0c, 0x1c, 0x1d, 0x1e, 0x1f]] = True
_EMPTY_FIELDS = (b"\n\n", b"\n\t", b"\t\n", b"\t,", b",,", b",\n")  # and a repeated header: line by line


def _plain(text: bytes) -> bool:
    """Whether ``text`` can take _parse_block's fast path: ASCII, no blank but \t and \n, no empty field."""
    return (text.isascii() and not text.startswith((b"\t", b"\n")) and not any(e in text for e in _EMPTY_FIELDS)
            and _HEADER[:-1] not in text and not _BLANKS[np.frombuffer(text, np.uint8)].any())


def _row_blocks(path: Path, size: int = 1 << 20):
    """The TSV's data rows in RowBlocks of about ``size`` bytes: a block of plain rows (ASCII, one tab a line, no
    blank line, no empty field) parsed by a few str and numpy operations over the whole block; any other block
    line by line, with the checks and errors of ``_rows`` and ``_parse_row``."""
    first, line, row, carry = [True], 1, 0, b""
    try:
        with open_input(path) as f:
            while True:
                block = f.read(size)
                buf = carry + block
                cut = buf.rfind(b"\n") + 1 if block else len(buf)
                if block and cut == 0:
                    carry = buf
                    continue
                text, carry = buf[:cut], buf[cut:]
                if text:
                    out = _parse_block(path, text if text.endswith(b"\n") else text + b"\n", line, row, first)
                    line += text.count(b"\n")
                    row += len(out.names)
                    yield out
                if not block:
                    return
    except GZIP_ERRORS as e:
        raise FastaError(f"{path}: corrupt or truncated gzip data ({e})") from None


def _parse_block(path: Path, text: bytes, first_line: int, first_row: int, first: list) -> RowBlock:
    """The rows of ``text`` (whole lines, the last ending with a newline) from line ``first_line``; ``first``:
    [whether no data or header line came before], updated."""
    if first[0] and text.startswith(_HEADER):
        text, first_line = text[len(_HEADER):], first_line + 1
        first[0] = False
    if not text:
        return RowBlock(first_row, [], [], np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    arr = np.frombuffer(text, np.uint8)
    if _plain(text):
        nl, tab = np.flatnonzero(arr == 10), np.flatnonzero(arr == 9)
        if len(tab) == len(nl) and (np.searchsorted(tab, nl) == np.arange(1, len(nl) + 1)).all():
            # one tab in every line: name<TAB>members, no field empty (_UNUSUAL), no blank inside one
            fields = text.decode("ascii").replace("\n", "\t").split("\t")[:-1]
            counts = np.diff(np.searchsorted(np.flatnonzero(arr == 44), np.concatenate([[0], nl]))) + 1
            first[0] = False
            return RowBlock(first_row, fields[0::2], fields[1::2], first_line + np.arange(len(nl)), counts, 0)
    names, members, lines, counts, blank = [], [], [], [], 0
    for k, raw in enumerate(text[:-1].split(b"\n")):
        lineno = first_line + k
        parts = _row(path, lineno, raw, first)
        if parts is None:
            blank += 1
        elif parts:
            name, ids = _parse_row(path, lineno, parts)
            names.append(name)
            members.append(",".join(ids))
            lines.append(lineno)
            counts.append(len(ids))
    return RowBlock(first_row, names, members, np.array(lines, np.int64), np.array(counts, np.int64), blank)


def _row(path: Path, lineno: int, line: bytes, first: list) -> list | None:
    """One line's fields: None for a blank line, [] for the header."""
    if line.endswith(b"\r"):
        line = line[:-1]
    if not line.strip():
        return None
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FastaError(f"{path}:{lineno}: invalid UTF-8 byte {line[e.start]:#04x}") from None
    parts = text.split("\t")
    if tuple(parts) == TSV_HEADER:
        if not first[0]:  # two TSVs concatenated: the header would become a cluster named UR50_cluster_name
            raise FastaError(f"{path}:{lineno}: header line {TSV_HEADER[0]}<TAB>{TSV_HEADER[1]} repeated "
                             "after the first line (concatenated files?)")
        first[0] = False
        return []
    first[0] = False
    return parts


def load_clusters(path: Path, spill: Spill, num_jobs: int = 1, job_index: int = 0,
                  progress: tuple = ("auto", 60.0)) -> ClusterMap:
    """Parse and check the whole mapping TSV (pass 1 of data_prep/join.py): every id into the spill's TSV table,
    job ``job_index``'s members with their slots; an id listed twice is an error naming both lines."""
    out = TableWriter(spill.tsv, TSV_COLUMNS)
    n_clusters = n_members = blank = own_clusters = own_members = 0
    first_member = None
    try:
        with Progress(f"{path.name} (clusters TSV)", path.stat().st_size, *progress) as bar:
            for b in _row_blocks(path):
                blank += b.blank
                own = (b.first_row + np.arange(len(b.names))) % num_jobs == job_index
                member_own = np.repeat(own, b.counts)
                ids = ",".join(b.members).split(",") if b.members else []
                slots = np.where(member_own, own_members + np.cumsum(member_own) - 1, OTHER)
                if first_member is None and own.any():
                    first_member = ids[int(np.argmax(member_own))]
                out.write({"id": ids + ["\x01" + n for n in b.names],
                           "slot": np.concatenate([slots, np.full(len(b.names), NAME)]).astype(np.int64)})
                n_clusters += len(b.names)
                n_members += len(ids)
                own_clusters += int(own.sum())
                own_members += int(member_own.sum())
                bar.update(input_position(path), clusters=n_clusters, members=n_members)
    finally:
        out.close()
    if n_clusters == 0:
        raise FastaError(f"{path}: no cluster rows (expected 'UniRef50 cluster<TAB>member,member,...' lines)")
    repeated = spill.repeated()
    if repeated:
        _name_repeat(path, repeated)
    return ClusterMap(path, num_jobs, job_index, spill, n_clusters, n_members, blank, own_clusters, own_members,
                      first_member)


def _name_repeat(path: Path, repeated: set[str]) -> None:
    """Second pass over the TSV for the ids listed more than once: raise at the first repeat, in line order."""
    seen_cluster: dict[str, int] = {}
    seen_member: dict[str, tuple[str, int]] = {}
    for lineno, parts in _rows(path):
        if parts is None:
            continue
        name, members = _parse_row(path, lineno, parts)
        if "\x01" + name in repeated:
            if name in seen_cluster:
                raise FastaError(f"{path}:{lineno}: cluster {name} is listed again (first at line "
                                 f"{seen_cluster[name]})")
            seen_cluster[name] = lineno
        for m in members:
            if m in repeated:
                if m in seen_member:
                    other, at = seen_member[m]
                    where = f"twice in cluster {name}" if at == lineno else \
                        f"in cluster {name} and in cluster {other} (line {at})"
                    raise FastaError(f"{path}:{lineno}: member {m} is listed {where}; a UniRef90 member belongs "
                                     "to one UniRef50 cluster")
                seen_member[m] = (name, lineno)


def _member(cmap: ClusterMap, slot: int) -> str:
    for _, _, members, _, firsts, counts in cmap.own():
        for m, first, count in zip(members, firsts.tolist(), counts.tolist()):
            if first <= slot < first + count:
                return m.split(",")[slot - first]
    return "?"



def build_clusters(encoder, inputs: list[Path], cmap: ClusterMap, settings, splits: dict, source=None,
                   progress: tuple = ("auto", 60.0), scanned: Path | None = None) -> tuple[dict, int]:
    """Read the member FASTA files, then write this job's clusters in TSV order; returns ({"": manifest}, FASTA
    records). ``splits``: data_prep.workdir.open_splits (one, ""; --val-fraction is refused with --clusters).
    ``scanned``: the folder of the scan parts of an array's scan stage (data_prep/scan.py; all of them must be
    there); None: this job scans the whole FASTA itself, into its spill.

    Filtered and counted (nothing is dropped silently), each member and cluster not written also listed in
    ``filtered.tsv`` (id, reason, input, line, detail naming the cluster):

    * a member listed but absent from every FASTA input: ``stats.members_filtered.not_in_fasta`` (named in the
      cluster's meta ``dropped``);
    * a member record with a character outside the ESM alphabet (``invalid_character``; ``--strict`` makes it an
      error naming file:line:column; ``--replace-invalid X`` writes such characters as X instead, counted in
      ``stats.replaced``), empty, shorter than ``--min-length`` or longer than ``--max-length``: dropped from its
      cluster, counted under ``stats.members_filtered`` and named in meta ``dropped``;
    * a cluster left without members: ``filtered.no_member_in_fasta`` (every member absent from the FASTA) or
      ``filtered.all_members_filtered`` (some found, none kept);
    * FASTA records in no cluster: ``stats.records_in_no_cluster`` (= ``fasta_records - members_found``; a job
      cannot tell another job's members from none, so its manifest holds null and ``merge`` computes it).

    Errors: no member of this job's clusters found in the FASTA at all (the TSV and the FASTA do not belong
    together); more than ``--max-filtered-fraction`` of the members found dropped as invalid or empty.
    Clusters already in the verified shards of an interrupted run are counted and not rewritten.
    """
    s = settings
    sp = splits[""]
    source_name = source.name if source is not None else "uniref"
    members_filtered = member_reasons(s.min_length, s.max_length)
    damage = DamageCheck(s, "members")
    replaced_stats = {"replacement": s.replace_invalid, "replaced_characters": 0, "records_with_replacements": 0,
                      "replaced": {}} if s.replace_invalid is not None else None
    invalid_chars: Counter = Counter()
    try:
        if scanned is None:
            parts = [(cmap.spill.path / f"{part_name(0, 1)}.parquet",
                      scan(encoder, inputs, s, source, cmap.spill.path, 0, 1, progress))]
        else:
            parts = load_parts(scanned, scan_fingerprint(encoder, inputs, s))
        counts, records, first_record = _fasta_counts(inputs, [m for _, m in parts])
        got = join(cmap, parts, inputs, counts, damage, invalid_chars, replaced_stats)
        # the error a reader in FASTA order meets first: a member --strict refuses, or a member's second record
        if got.strict and not (got.repeat and got.repeat[0] < got.strict[0]):
            raise FastaError(got.strict[1])
        if got.repeat:
            _, slot, n_input, line = got.repeat
            raise FastaError(f"{inputs[n_input]}:{line}: record {_member(cmap, slot)} appears a second time in the "
                             "FASTA input; as a cluster member it must be unique")
        members_found = got.members_found
        if cmap.own_members and members_found == 0:
            raise PrepError(f"{cmap.path}: none of the {cmap.own_members} member ids of "
                            f"{'the' if s.num_jobs == 1 else 'this job' + chr(39) + 's'} clusters is a record id of "
                            f"the FASTA inputs (first member {cmap.first_member!r}, first FASTA record "
                            f"{first_record!r}); do the TSV and the FASTA belong together?")
        damage.check(members_found, False)

        filtered = {NO_MEMBER_IN_FASTA: 0, ALL_MEMBERS_FILTERED: 0}
        stats = {"clusters": cmap.own_clusters, "clusters_kept": 0, "members_listed": cmap.own_members,
                 "members_kept": 0, "residues": 0, "lowercase_residues": got.lowercase,
                 "members_filtered": members_filtered, "fasta_records": records, "members_found": members_found}
        if replaced_stats is not None:
            stats.update(replaced_stats)
        with Progress(f"{source_name} clusters", cmap.path.stat().st_size, *progress) as bar:
            Writer(cmap, sp, inputs, stats, filtered, members_filtered, source_name).write_clusters(bar)
            bar.update(cmap.path.stat().st_size, written=stats["clusters_kept"])
        shards = sp.close()
    except (PrepError, FastaError, ValueError):
        sp.abort()
        raise
    # With one job every member is this job's, so a record it did not match is in no cluster at all.
    stats["records_in_no_cluster"] = records - stats["members_found"] if s.num_jobs == 1 else None
    stats["mapping"] = {"path": str(cmap.path), "clusters": cmap.clusters, "members": cmap.members,
                        "blank_lines": cmap.blank_lines}
    if invalid_chars:
        stats["invalid_characters"] = dict(invalid_chars.most_common())
    listed = sp.dropped.finish()
    if listed is not None:
        stats["filtered_list"] = listed.name
    from pipeline.data.shards import Manifest  # torch's import time: see data_prep/workdir.py
    return {"": Manifest(source=source_name, tokenizer=encoder.entry, shards=shards, filtered=filtered,
                         inputs=counts, stats=stats, layout="clusters")}, records


def _fasta_counts(inputs: list[Path], markers: list[dict]) -> tuple[list[dict], int, str | None]:
    """Each input's counts for the manifest, the FASTA's records and its first record id, from the scan parts."""
    counts = []
    for i, path in enumerate(inputs):
        n = sum(m["inputs"][i]["records"] for m in markers)
        if n == 0:
            raise PrepError(f"{path}: no records in this input (empty after decompression?)")
        counts.append({"path": str(path), **input_fingerprint(path), "records": n, "members": 0, "kept": 0,
                       "residues": 0})
    off = offsets(markers)
    firsts = [(m["first"][0], off[(m["part"], m["first"][0])][0] + m["first"][1], m["first"][2])
              for m in markers if m["first"] is not None]
    return counts, sum(c["records"] for c in counts), min(firsts)[2] if firsts else None
