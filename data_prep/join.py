"""The join of ``--clusters`` (data_prep/clusters.py) on DuckDB: every member's fate in bounded memory.

1. TSV (data_prep/clusters.py ``load_clusters``): DuckDB reads the mapping (its CSV reader; line by line, with
   Python's checks, when a line is not a plain row) into the table ``rows``, this job's rows into ``own``, and every
   member id and cluster name into ``tsv``, this job's members with their slots (a member's position among the
   job's members in TSV order); DuckDB finds the ids listed twice.
2. FASTA (data_prep/scan.py): the member FASTA parsed once, in bulk, every record's outcome by the record rule
   (data_prep/rule.py) into one Parquet table per scan part (id, record number, input, line, outcome, tokens).
3. Join (``join``): DuckDB joins the job's members to their records in every part into a table, from which the
   manifest's counts and checks are read.
4. Write (data_prep/cluster_write.py): ``own`` cluster by cluster in TSV order, each member's outcome read from
   the joined table ordered by slot.

The join, the ordering and their spill to disk are DuckDB's, under ``memory_limit`` (a share of the job's
``JOB_MEMORY``) with its temporary files in the job's spill folder under ``$TMPDIR`` (removed at the end, whatever
the end).
"""
from __future__ import annotations

import contextlib
import heapq
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .checks import DamageCheck, sum_stats
from .rule import FILTERED, KEPT, REPLACED, STRICT

JOB_MEMORY = 512 << 20  # what one --clusters job may hold; the join engine gets JOIN_SHARE of it, Python the rest
JOIN_SHARE = 0.25
OTHER, NAME = -1, -2  # slot of another job's member, of a cluster name (keyed with a \x01 prefix)


def memory_limit() -> int:
    """DuckDB's memory_limit in bytes: its share of the job's budget."""
    return max(16 << 20, int(JOB_MEMORY * JOIN_SHARE))


class Spill:
    """The job's temporary folder (under $TMPDIR): the FASTA's table when the job scans it itself, and the
    database's spill files; removed by ``remove``."""

    def __init__(self):
        self.path = Path(tempfile.mkdtemp(prefix="data_prep-clusters-"))
        self.temp = self.path / "duckdb"
        self._db = None

    def db(self):
        """This job's DuckDB connection, made on first use: an in-memory database whose tables and operators spill
        to ``temp`` under the memory limit (a database file instead cost a third more time on the P3uc input)."""
        if self._db is None:
            import duckdb

            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
            self._db = duckdb.connect(config={"memory_limit": f"{memory_limit()}B", "temp_directory": str(self.temp),
                                              "threads": cores, "preserve_insertion_order": False})
        return self._db

    @contextlib.contextmanager
    def ordered(self):
        """Tables written in the order of their rows meanwhile (DuckDB's preserve_insertion_order, a setting of the
        database); off otherwise, for the join, whose tables are read by ORDER BY."""
        self.sql("SET preserve_insertion_order = true")
        try:
            yield
        finally:
            self.sql("SET preserve_insertion_order = false")

    def sql(self, query: str, *params):
        return self.db().execute(query, list(params) if params else None)

    def repeated(self) -> set[str]:
        """Ids (names with their \x01 prefix) that the TSV lists more than once."""
        rows = self.sql("SELECT id FROM tsv GROUP BY id HAVING count(*) > 1")
        return {r[0] for r in rows.fetchall()}

    def remove(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        shutil.rmtree(self.path, ignore_errors=True)


def sql_list(paths: list[Path]) -> str:
    """A list of file names as a DuckDB literal."""
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


class TableWriter:
    """A Parquet file of ``columns`` ({name: pyarrow type name}) written a batch of columns at a time."""

    def __init__(self, path: Path, columns: dict):
        self.path, self.columns, self.writer = path, columns, None

    def write(self, columns: dict) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        schema = pa.schema([(k, getattr(pa, t)()) for k, t in self.columns.items()])
        table = pa.Table.from_arrays([arrow_array(columns[k], t) for k, t in self.columns.items()], schema=schema)
        if self.writer is None:
            # ids are unique and tokens read whole: dictionaries and min/max statistics would be work for nothing
            self.writer = pq.ParquetWriter(self.path, schema, compression="none", use_dictionary=False,
                                           write_statistics=False)
        self.writer.write_table(table)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def arrow_array(values, kind: str):
    """An Arrow array of type ``kind`` (a pyarrow type name) from its buffers: numbers from numpy, strings from a
    list of str or None (pyarrow's own conversions import pandas, a third of a second and 50 MB)."""
    import pyarrow as pa

    if isinstance(values, pa.Array):
        return values
    if kind == "string":  # a list of str or None
        n, nulls = len(values), values.count(None)
        if nulls == n:
            return pa.nulls(n, pa.string())
        text = values if not nulls else ["" if v is None else v for v in values]
        data = "".join(text).encode()
        sizes = np.fromiter(map(len, text), np.int32, n)
        if len(data) != int(sizes.sum()):  # non-ASCII text: the sizes in bytes, string by string
            sizes = np.fromiter((len(v.encode()) for v in text), np.int32, n)
        offsets = np.zeros(n + 1, np.int32)
        np.cumsum(sizes, out=offsets[1:])
        mask = None if not nulls else pa.py_buffer(np.packbits(np.fromiter((v is not None for v in values), bool, n),
                                                               bitorder="little"))
        return pa.Array.from_buffers(pa.string(), n, [mask, pa.py_buffer(offsets), pa.py_buffer(data)])
    data = np.ascontiguousarray(values, np.dtype(kind))
    return pa.Array.from_buffers(getattr(pa, kind)(), len(data), [None, pa.py_buffer(data)])


def binary(data: bytes | np.ndarray, sizes: np.ndarray):
    """An Arrow array of ``len(sizes)`` byte strings laid out one after the other in ``data``."""
    import pyarrow as pa

    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(sizes), [None, pa.py_buffer(offsets),
                                                                            pa.py_buffer(data)])


# ------------------------------------------------------------------------------------------ pass 3: the join
# ------------------------------------------------------------------------------------- the scan parts, joined
def offsets(markers: list[dict]) -> dict[tuple[int, int], tuple[int, int]]:
    """(part, input) -> (records, lines) before that part's first record of that input: zero for chunk parts
    (their numbers are the input's); for byte-range parts the records of all earlier inputs and of the earlier
    parts of this input, and the lines of the earlier parts of this input."""
    out = {}
    n_inputs = len(markers[0]["inputs"])
    totals = [sum(m["inputs"][i]["records"] for m in markers) for i in range(n_inputs)]
    for m in markers:
        for i in range(n_inputs):
            if not m["local"]:
                out[(m["part"], i)] = (0, 0)
                continue
            earlier = [x for x in markers if x["part"] < m["part"]]
            out[(m["part"], i)] = (sum(totals[:i]) + sum(x["inputs"][i]["records"] for x in earlier),
                                   sum(x["inputs"][i]["lines"] for x in earlier))
    return out


def shift_lines(text: str | None, path: str, lines: int) -> str | None:
    """A message stored by a byte-range part with its line numbers made the input's: ``path:LINE...`` (an error)
    or ``LINE:...`` (a filtered.tsv detail) with ``lines`` added to LINE."""
    if not text or not lines:
        return text
    prefix = f"{path}:"
    head = prefix if text.startswith(prefix) else ""
    m = re.match(r"(\d+)(?=:)", text[len(head):])
    if m is None:
        return text
    return f"{head}{int(m[1]) + lines}{text[len(head) + m.end():]}"


@dataclass
class Joined:
    members_found: int = 0
    lowercase: int = 0
    strict: tuple | None = None  # (record number, error) of the first member that --strict refuses
    repeat: tuple | None = None  # (record number, slot, input, line) of the first member record seen twice


def join(cmap, parts: list[tuple[Path, dict]], inputs: list[Path], counts: list[dict], damage: DamageCheck,
         invalid_chars: Counter, replaced_stats: dict | None) -> Joined:
    """Pass 3: this job's members joined to their FASTA records in the scan parts (table, marker) by DuckDB into
    the table ``joined`` (slot, the record's place, outcome and tokens), each part's record and line numbers made
    the input's (scan.offsets, scan.shift_lines); the counts and checks of the manifest read from it (a member with
    two records is an error: ``repeat``)."""
    spill, got = cmap.spill, Joined()
    shifts = [[str(table), i, *off] for (part, i), off in offsets([m for _, m in parts]).items()
              for table, m in parts if m["part"] == part]
    fasta = f"read_parquet({sql_list([t for t, _ in parts])}, filename = true) f"
    if any(rec or line for _, _, rec, line in shifts):  # byte-range parts: numbered from their own starts
        spill.sql("CREATE TEMP TABLE offs (file VARCHAR, input INTEGER, rec_off BIGINT, line_off BIGINT)")
        spill.db().executemany("INSERT INTO offs VALUES (?, ?, ?, ?)", shifts)
        fasta += " JOIN offs o ON o.file = f.filename AND o.input = f.input"
        rec, line, shift = "f.rec + o.rec_off", "f.line + o.line_off", "o.line_off"
    else:
        rec, line, shift = "f.rec", "f.line", "0"
    spill.sql(f"CREATE TEMP TABLE joined AS SELECT t.slot, {rec} AS rec, f.input, {line} AS line, f.status, "
              f"f.lower, f.ntok, f.tokens, f.extra, {shift} AS shift FROM tsv t "
              f"JOIN {fasta} ON t.id = f.id WHERE t.slot >= 0")
    twice = "SELECT slot FROM joined GROUP BY slot HAVING count(*) > 1"
    if spill.sql(f"SELECT count(*) FROM ({twice})").fetchone()[0]:  # a member's second record: an error (build)
        got.repeat = spill.sql(f"SELECT rec, slot, input, line FROM joined WHERE slot IN ({twice}) QUALIFY "
                               "row_number() OVER (PARTITION BY slot ORDER BY rec) = 2 ORDER BY rec LIMIT 1"
                               ).fetchone()
        spill.sql("DELETE FROM joined WHERE rowid IN (SELECT rowid FROM joined QUALIFY row_number() OVER "
                  "(PARTITION BY slot ORDER BY rec) > 1)")
    shifted = spill.sql(f"SELECT slot, input, shift, status, extra FROM joined WHERE shift > 0 AND status IN "
                        f"({FILTERED}, {STRICT})").fetchall()
    if shifted:  # a byte-range part's messages, their lines counted from its start (data_prep/scan.py)
        fixed = []
        for slot, n_input, shift, status, extra in shifted:
            path, doc = str(inputs[n_input]), json.loads(extra)
            doc = [shift_lines(doc[0], path, shift)] if status == STRICT else \
                [doc[0], shift_lines(doc[1], path, shift), doc[2], shift_lines(doc[3], path, shift)]
            fixed.append([slot, json.dumps(doc)])
        spill.sql("CREATE TEMP TABLE fixed (slot BIGINT, extra VARCHAR)")
        spill.db().executemany("INSERT INTO fixed VALUES (?, ?)", fixed)
        spill.sql("UPDATE joined SET extra = fixed.extra FROM fixed WHERE joined.slot = fixed.slot")
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
