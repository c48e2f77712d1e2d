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
Everything else that is not written is counted (see ``build_clusters``).

Memory does not grow with the corpus: the TSV is read into DuckDB (pass 1: ``load_clusters``) and every member meets
its FASTA record in DuckDB's join, which spills to disk under a memory limit (data_prep/join.py, whose docstring
gives the four passes); this module reads and checks the TSV and runs the passes (``build_clusters``).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checks import DamageCheck, PrepError
from .cluster_write import Writer, numpy_view
from .common import TSV_HEADER, input_fingerprint
from .cut import is_gzip
from .fasta import GZIP_ERRORS, FastaError, input_position, numbered_lines, open_input
from .join import NAME, OTHER, Spill, arrow_array, join, offsets, sql_list
from .scan import load_parts, scan_fingerprint
from .progress import Progress
from .rule import ALL_MEMBERS_FILTERED, NO_MEMBER_IN_FASTA, member_reasons

@dataclass
class ClusterMap:
    """The TSV's counts (every job parses all of it) and this job's share, whose rows and members wait in the
    spill's DuckDB tables (``load_clusters``)."""

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

    BATCH = 1 << 14  # rows read at a time by ``own``

    def own(self):
        """This job's clusters in TSV order, a batch of rows at a time: (data row of the file, cluster name,
        members "a,b,...", line, first slot, member count), the numbers as int64 arrays."""
        # A cursor of its own: pass 4 reads the joined table meanwhile (one open result per connection). The table
        # lies in row order (load_clusters): read as it lies, without a second sort beside the joined table's (the
        # setting is the database's; every query after the join has its ORDER BY).
        db = self.spill.db().cursor()
        try:
            db.execute("SET preserve_insertion_order = true")
            last = -1
            for b in db.sql("SELECT row, name, members, line, first, n FROM own").to_arrow_reader(self.BATCH):
                rows = numpy_view(b.column(0))
                if len(rows) and (rows[0] <= last or (np.diff(rows) <= 0).any()):  # cannot happen: DuckDB's order
                    raise RuntimeError(f"{self.path}: the database returned the TSV rows out of order")
                last = int(rows[-1]) if len(rows) else last
                yield (rows, b.column(1).to_pylist(), b.column(2).to_pylist(), numpy_view(b.column(3)),
                       numpy_view(b.column(4)), numpy_view(b.column(5)))
        finally:
            db.close()


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


ROWS = "CREATE TABLE rows (row BIGINT, line BIGINT, name VARCHAR, members VARCHAR)"
# A row the line-by-line reader would refuse or read otherwise (with bytes _plain_lines allows): a field empty, an
# empty member id, or the header again.
_UNUSUAL = (f"name IS NULL OR members IS NULL OR starts_with(members, ',') OR ends_with(members, ',') OR "
            f"contains(members, ',,') OR (name = '{TSV_HEADER[0]}' AND members = '{TSV_HEADER[1]}')")
_PLAIN = bytes(range(0x21, 0x7f)) + b"\t\n"  # the bytes of a plain TSV: printable ASCII, tabs and line breaks


def _read_fast(path: Path, spill: Spill) -> bool:
    """The TSV into the table ``rows`` by DuckDB's CSV reader (parallel, out of core), when every line is a plain
    row: two tab-separated fields of printable ASCII, no blank line. False, with nothing left in the database,
    for any other file: the line-by-line reader then reads it, with its errors naming the line."""
    with open_input(path) as f:  # refuses bzip2, binary data
        head = f.readline()
    header = head.rstrip(b"\n") == "\t".join(TSV_HEADER).encode()
    lines = _plain_lines(path)
    if lines < 0:
        return False
    import duckdb

    db = spill.db()
    try:
        with spill.ordered():  # rowid = data row, in file order
            db.execute(f"CREATE TABLE raw AS SELECT * FROM read_csv({sql_list([path])}, delim = '\t', quote = '', "
                       f"escape = '', new_line = '\\n', header = {str(header).lower()}, auto_detect = false, "
                       f"strict_mode = true, compression = '{'gzip' if is_gzip(path) else 'none'}', columns = "
                       "{'name': 'VARCHAR', 'members': 'VARCHAR'})")
        rows, unusual = db.execute(f"SELECT count(*), count(*) FILTER ({_UNUSUAL}) FROM raw").fetchone()
        plain = unusual == 0 and rows + header == lines  # DuckDB skips blank lines: none may be there
        if plain:
            db.execute(f"CREATE TABLE rows AS SELECT rowid::BIGINT AS row, (rowid + {1 + header})::BIGINT AS line, "
                       "name, members FROM raw")
    # a line of one or three fields, a line longer than DuckDB's limit
    except (duckdb.InvalidInputException, duckdb.IOException, duckdb.ConversionException):
        plain = False
    finally:
        db.execute("DROP TABLE IF EXISTS raw")
    return plain


def _plain_lines(path: Path) -> int:
    """Lines of the (decompressed) file, a last line without its line break included; -1 when it holds a byte other
    than printable ASCII, a tab or a line break (a blank, a CR, a control character, UTF-8), or is damaged gzip."""
    n, last = 0, b"\n"
    try:
        with open_input(path) as f:
            while block := f.read(1 << 22):
                if block.translate(None, _PLAIN):
                    return -1
                n, last = n + block.count(b"\n"), block[-1:]
    except GZIP_ERRORS:
        return -1
    return n + (last != b"\n")


def _read_lines(path: Path, spill: Spill, bar: Progress) -> int:
    """The TSV into the table ``rows`` line by line, each row checked (``_parse_row``); returns its blank lines."""
    import pyarrow as pa

    db = spill.db()
    db.execute(ROWS)
    batch, blank, row = [], 0, 0

    def flush():
        if batch:
            columns = zip(("row", "line", "name", "members"), zip(*batch), ("int64", "int64", "string", "string"))
            db.from_arrow(pa.table({k: arrow_array(list(v), t) for k, v, t in columns})).insert_into("rows")
            batch.clear()
            bar.update(input_position(path), clusters=row)
    for lineno, parts in _rows(path):
        if parts is None:
            blank += 1
            continue
        name, members = _parse_row(path, lineno, parts)
        batch.append((row, lineno, name, ",".join(members)))
        row += 1
        if len(batch) == ClusterMap.BATCH:
            flush()
    flush()
    return blank


def load_clusters(path: Path, spill: Spill, num_jobs: int = 1, job_index: int = 0,
                  progress: tuple = ("auto", 60.0)) -> ClusterMap:
    """Parse and check the whole mapping TSV (pass 1 of data_prep/join.py) into the spill's database: ``rows`` (every
    data row with its line), ``own`` (this job's rows, row % N == I, with the slot of their first member) and
    ``tsv`` (every member id and cluster name; this job's members with their slots, the others' OTHER and the
    names NAME); an id listed twice is an error naming both lines."""
    blank = 0
    with Progress(f"{path.name} (clusters TSV)", path.stat().st_size, *progress) as bar:
        if not _read_fast(path, spill):
            blank = _read_lines(path, spill, bar)
        bar.update(path.stat().st_size)
    db = spill.db()
    n_clusters, n_members = db.execute("SELECT count(*), coalesce(sum(len(string_split(members, ','))), 0) FROM rows"
                                       ).fetchone()
    if n_clusters == 0:
        raise FastaError(f"{path}: no cluster rows (expected 'UniRef50 cluster<TAB>member,member,...' lines)")
    with spill.ordered():  # in row order, as ClusterMap.own reads it
        db.execute(f"CREATE TABLE own AS SELECT *, (sum(n) OVER (ORDER BY row) - n)::BIGINT AS first FROM (SELECT "
                   f"*, len(string_split(members, ','))::BIGINT AS n FROM rows WHERE row % {num_jobs} = {job_index}) "
                   "ORDER BY row")
    db.execute(f"CREATE TABLE tsv AS SELECT unnest(string_split(members, ',')) AS id, unnest(range(first, first + "
               f"n)) AS slot FROM own UNION ALL SELECT unnest(string_split(members, ',')), {OTHER} FROM rows WHERE "
               f"row % {num_jobs} <> {job_index} UNION ALL SELECT chr(1) || name, {NAME} FROM rows")
    own_clusters, own_members, first_member = db.execute(
        "SELECT count(*), coalesce(sum(n), 0), arg_min(string_split(members, ',')[1], row) FROM own").fetchone()
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
    return cmap.spill.db().execute("SELECT string_split(members, ',')[? - first + 1] FROM own WHERE first <= ? AND "
                                   "? < first + n", [slot, slot, slot]).fetchone()[0]


def build_clusters(encoder, inputs: list[Path], cmap: ClusterMap, settings, splits: dict, scanned: Path,
                   source=None, progress: tuple = ("auto", 60.0)) -> tuple[dict, int]:
    """Join this job's clusters to the member FASTA's scan parts, then write them in TSV order; returns ({"":
    manifest}, FASTA records). ``splits``: data_prep.workdir.open_splits (one, ""; --val-fraction is refused with
    --clusters). ``scanned``: the folder of the scan parts (data_prep/scan.py; all of them must be there): the
    job's own (``Scans``) or an array's scan stage.

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
