"""Pass 4 of the cluster join (data_prep/join.py): this job's clusters written in TSV order, each member's outcome
read from DuckDB's joined table in slot order."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from . import rule
from .batch import json_string
from .gather import gather
from .progress import Progress
from .rule import KEPT, NOT_IN_FASTA, REPLACED

ABSENT = 255  # status of a member without a FASTA record
SLOT_ROW = np.dtype([("slot", "<i8"), ("line", "<i8"), ("input", "<i4"), ("ntok", "<i4"), ("status", "u1")])


def numpy_view(column) -> np.ndarray:
    """A numeric Arrow column without nulls as a numpy view (pyarrow's to_numpy imports pandas, a third of a
    second)."""
    if hasattr(column, "combine_chunks"):
        column = column.combine_chunks()
    dtype = np.dtype(str(column.type))  # int64, int32, uint8: the names are numpy's too
    if not len(column):
        return np.zeros(0, dtype)
    return np.frombuffer(column.buffers()[1], dtype)[column.offset:column.offset + len(column)]


class Slots:
    """Pass 4's view of the joined table: the outcomes of a range of member slots, read from DuckDB in slot order
    (the clusters are written in TSV order, which is slot order)."""

    BATCH = 1 << 14

    def __init__(self, cmap):
        self.reader = cmap.spill.db().sql("SELECT slot, line, input, ntok, status, tokens, extra FROM joined "
                                          "ORDER BY slot").to_arrow_reader(self.BATCH)
        self.pending = None  # the rows read from DuckDB and not yet asked for

    def _upto(self, b: int):
        """The rows of slots below ``b`` not yet handed out (none of them is below the range asked before)."""
        import pyarrow as pa

        parts = []
        while True:
            if self.pending is None:
                try:
                    self.pending = self.reader.read_next_batch()
                except StopIteration:
                    break
            k = int(np.searchsorted(numpy_view(self.pending.column(0)), b))
            parts.append(self.pending.slice(0, k))
            if k < self.pending.num_rows:
                self.pending = self.pending.slice(k)
                break
            self.pending = None
        return pa.Table.from_batches(parts, self.reader.schema).combine_chunks()

    def range(self, a: int, b: int) -> tuple[np.ndarray, np.ndarray, dict]:
        """For slots a..b-1: the SLOT_ROW of each (status ABSENT: not found in the FASTA), the tokens of the kept
        ones one after the other, and {slot: (extra JSON, input, line)} of the dropped ones."""
        import pyarrow as pa

        t = self._upto(b)
        out = np.zeros(b - a, SLOT_ROW)
        out["status"] = ABSENT
        slots = numpy_view(t.column("slot"))
        for f in ("line", "input", "ntok", "status"):
            out[f][slots - a] = numpy_view(t.column(f))
        status = out["status"][slots - a]
        kept = (status == KEPT) | (status == REPLACED)
        tokens = t.column("tokens").combine_chunks()
        width = np.int64 if pa.types.is_large_binary(tokens.type) else np.int32
        offsets = np.frombuffer(tokens.buffers()[1], width)[tokens.offset:tokens.offset + len(tokens) + 1] \
            if len(tokens) else np.zeros(1, np.int64)
        data = np.frombuffer(tokens.buffers()[2], np.uint8) if len(tokens) else np.zeros(0, np.uint8)
        if kept.all():
            data = data[offsets[0]:offsets[-1]]
        else:
            data = gather(data, offsets[:-1][kept].astype(np.int64), np.diff(offsets)[kept].astype(np.int64))
        extras = {}
        for i in np.flatnonzero(~kept).tolist():
            extras[int(slots[i])] = (t.column("extra")[i].as_py(), int(out["input"][slots[i] - a]),
                                     int(out["line"][slots[i] - a]))
        return out, data, extras


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

    def write_clusters(self, bar: Progress) -> None:
        size = self.cmap.path.stat().st_size
        for index, names, members, lines, firsts, counts in self.cmap.own():
            # batches of about BATCH members (a cluster larger than that alone)
            cuts = np.unique(np.searchsorted(np.cumsum(counts), np.arange(self.BATCH, int(counts.sum()),
                                                                          self.BATCH)) + 1)
            for i, j in zip([0, *cuts.tolist()], [*cuts.tolist(), len(counts)]):
                if i < j:
                    self._batch(tuple(index[i:j].tolist()), names[i:j], members[i:j], lines[i:j].tolist(),
                                firsts[i:j].tolist(), counts[i:j])
            # the TSV's bytes, as far as its rows are written
            bar.update(size * (int(index[-1]) + 1) // self.cmap.clusters if len(index) else 0,
                       written=self.stats["clusters_kept"])

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
                # each cluster's member list as JSON: plain ids need no escapes (nor hold a line break), so one
                # join and one replace make them all
                listed = ('["' + '"]\n["'.join(members[prev:j]).replace(",", '","') + '"]').split("\n") if plain \
                    else [json.dumps(m.split(","), separators=(",", ":")) for m in members[prev:j]]
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
            if status == ABSENT:
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
