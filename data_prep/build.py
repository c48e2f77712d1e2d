"""The build of a sequence job (every source but ``--clusters``, data_prep/clusters.py): read every record of the
inputs in order, keep this job's, filter, normalize, tokenize and write them as samples into the work directory's
shard sets, counting every decision for the manifest.

Two paths give the same bytes: the per-record path (``SequenceBuild.record``, any source) and, for the FASTA sources
without per-record work, the batch path (data_prep/batch.py: chunks of records parsed and written at once,
``SequenceBuild.write_chunk``), which hands the records it cannot take to the per-record path in their place.
"""
from __future__ import annotations

import gc
import hashlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .batch import Reader, batch_reader, json_string, splits_bytes
from .cut import chunks
from .checks import DamageCheck, PrepError
from .common import LOWERCASE, input_fingerprint, split_of
from .fasta import FastaError, input_position
from .pool import processes
from .progress import Progress
from .ranges import ByteRange, byte_ranges
from . import rule
from .settings import Settings
from .windows import write_windows
from .sources import Context
from .workdir import WorkDir, open_splits

if TYPE_CHECKING:
    from . import Source
    from .encode import Encoder

class SequenceBuild:
    """One job's pass over its inputs. The state it carries from record to record (all of it here, none in
    closures): the shard set, filter counts, statistics and invalid characters per split, the per-input counts,
    the dedup hashes, the damage check, the global record index and the records of this job read so far."""

    def __init__(self, source: Source, encoder: Encoder, inputs: list[Path], work: WorkDir, settings: Settings,
                 members: dict | None, progress: tuple = ("auto", 60.0), text_column: str | None = None):
        s = self.settings = settings
        self.source, self.encoder, self.inputs, self.progress = source, encoder, inputs, progress
        self.ctx = Context(encoder.invalid_positions, {}, members, text_column, rule.read_bound(s))
        self.splits = open_splits(work, s, encoder)
        base_filtered = rule.filter_reasons(s.min_length, s.max_length, s.dedup)
        self.filtered = {k: dict(base_filtered) for k in self.splits}
        self.seen_hashes: dict[bytes, str] = {}  # sha1 of a kept sequence -> its record id (named for duplicates)
        self.counts: dict[str, list] = {k: [] for k in self.splits}  # per split: each input's counts
        self.stats = {k: self._new_stats() for k in self.splits}
        self.invalid_chars = {k: Counter() for k in self.splits}
        self.damage = DamageCheck(s)
        self.index = 0  # global record index over all inputs: fixes the sample key (and the job without --dedup)
        self.read = 0  # records of this job
        self.sizes = [p.stat().st_size for p in inputs]
        self.fast = batch_reader(source, encoder, s, self.ctx)
        # (N, I): the job owns the records whose global index % N == I; set again for each input
        self.own = (s.num_jobs, s.job_index)
        # plain inputs: this job's byte ranges, by input (None: every job reads every record, see splits_bytes)
        self.ranges = {r.input: r for r in byte_ranges(inputs, s.num_jobs, s.job_index)} \
            if self.fast is not None and splits_bytes(source, inputs, s, members) else None
        self.pool = None  # --workers: the processes that parse the batch reader's chunks (``build_sequences``)
        self.bar: Progress | None = None
        self._next_update = 0.0  # when the per-record path next updates the progress bar
        # the meta.json of a batch-path sample, {"id", "source", "length", ...} as json.dumps writes it
        self._meta_format = '{"id":%s,"source":' + json_string(source.name).replace("%", "%%") + ',"length":%d%s\n'

    def _new_stats(self) -> dict:
        s = self.settings
        st = {"records_kept": 0, "residues": 0, "lowercase_residues": 0}
        if s.replace_invalid is not None:
            st.update({"replacement": s.replace_invalid, "replaced_characters": 0, "records_with_replacements": 0,
                       "replaced": {}})
        if s.window is not None:
            st["windowing"] = {"window": s.window, "stride": s.stride, "tail": s.window_tail}
            st["windows"] = {"records": 0, "samples": 0, "records_shorter_than_window": 0, "exact_ends": 0,
                             "short_tails": 0, "aligned_tails": 0, "dropped_tails": 0, "tail_residues_dropped": 0,
                             "residues_written": 0}
        return st

    def normalise(self, seq: bytes) -> bytes:
        """Residues are upper-cased; text is kept as it is."""
        return seq if self.encoder.text else seq.upper()

    # ---------------------------------------------------------------------------------------------------- the pass
    def read_inputs(self) -> tuple[dict, int]:
        """Read every record of the inputs and write this job's samples; returns ({split: Manifest}, records
        seen)."""
        # The records, lists and strings made here hold no reference cycles; with the collector on, a process that
        # imported torch (the bench, a notebook) spends a quarter of the run in collections that find nothing.
        collecting = gc.isenabled()
        gc.disable()
        try:
            mode, interval = self.progress
            if self.ranges is not None:  # the bar counts this job's bytes
                self.sizes = [r.hi - r.lo if (r := self.ranges.get(k)) else 0 for k in range(len(self.inputs))]
            with Progress(self.source.name, sum(self.sizes), mode, interval) as self.bar:
                for n_input, path in enumerate(self.inputs):
                    self._read_input(n_input, path)
                self.bar.update(sum(self.sizes), records=self.index, **self._progress_counts())
            self.damage.check(self.read, self.encoder.kind == "nucleotide")
        except (PrepError, FastaError, ValueError):
            for sp in self.splits.values():  # bad input: nothing of this run is kept
                sp.abort()
            raise
        finally:
            self.bar = None
            if collecting:
                gc.enable()
        # records seen: of all inputs (every record is numbered), or only this job's byte ranges
        return self._manifests(), (self.read if self.ranges is not None else self.index)

    def _read_input(self, n_input: int, path: Path) -> None:
        s = self.settings
        fp = input_fingerprint(path)  # merge refuses jobs that read different versions of an input
        inp = {k: {"path": str(path), **fp, "records": 0, "kept": 0, "residues": 0} for k in self.splits}
        done_before = sum(self.sizes[:n_input])
        self.own = (s.num_jobs, s.job_index)
        if self.ranges is not None:  # another job's bytes, or a range of them: whole records, at least one
            any_record = n_input not in self.ranges or self._read_batches(path, inp, done_before,
                                                                          self.ranges[n_input])
        elif self.fast is not None and self.fast.takes(path):
            any_record = self._read_batches(path, inp, done_before)
        else:
            any_record = self._read_records(path, inp, done_before)
        if not any_record:
            raise PrepError(f"{path}: no records in this input (empty after decompression?)")
        for k in self.splits:
            self.counts[k].append(inp[k])
            self.stats[k]["records_kept"] += inp[k]["kept"]
            self.stats[k]["residues"] += inp[k]["residues"]

    def _read_batches(self, path: Path, inp: dict, done_before: int, byte_range: ByteRange | None = None) -> bool:
        """The input (or ``byte_range`` of it) on the batch path; whether it held a record."""
        s = self.settings
        # --strict: another job's invalid record is an error here too, so every record is parsed
        jobs = (1, 0) if s.strict else self.own
        if byte_range is not None:  # this job's bytes: all ours
            self.own = jobs = (1, 0)
        if byte_range is not None and byte_range.first_index is not None:
            self.index = byte_range.first_index
        start = self.index
        f, texts = self.fast, None if byte_range is None else chunks(path, None, byte_range, self.fast.bound)
        reader = Reader(path, f.tokens, f.check, f.uniref, f.to_record, self.index, jobs, texts, f.bound, self.pool)
        for chunk in reader:
            self.index = reader.start  # the chunk's first global index
            if isinstance(chunk, list):  # read record by record
                for rec in chunk:
                    i, self.index = self.index, self.index + 1
                    self.record(rec, i, path, inp)
            else:
                # not "self.read += self.write_chunk(...)": record() counts the records it reads into self.read
                # meanwhile, and += would add to the value read before the call
                chunk_read = self.write_chunk(chunk, path, inp)
                self.read += chunk_read
            self._show_progress(path, done_before)
        self.index = reader.index  # after the input's last record
        return self.index > start

    def _read_records(self, path: Path, inp: dict, done_before: int) -> bool:
        """The input on the per-record path; whether it held a record."""
        any_record = False
        for rec in self.source.reader(path, self.ctx):
            any_record = True
            i, self.index = self.index, self.index + 1
            if self.index % 256 == 0 or time.monotonic() >= self._next_update:
                self._next_update = time.monotonic() + 0.25
                self._show_progress(path, done_before)
            self.record(rec, i, path, inp)
        return any_record

    def _progress_counts(self) -> dict:
        return {"written": sum(x.written for x in self.splits.values()),
                "filtered": sum(sum(f.values()) for f in self.filtered.values())}

    def _show_progress(self, path: Path, done_before: int) -> None:
        self.bar.update(done_before + input_position(path), records=self.index, **self._progress_counts())
        self.damage.poll(self.read)

    # ------------------------------------------------------------------------------------------ per-record path
    def record(self, rec, i: int, path: Path, inp: dict) -> None:
        """Record ``i`` (global index) of ``path`` on the per-record path."""
        s, encoder = self.settings, self.encoder
        # The rule (data_prep/rule.py) on an invalid record first: --strict refuses it in whichever job reads it.
        # With --dedup a record's job follows its hash, so every copy of a sequence meets in one job;
        # otherwise ownership is decided first and other jobs' records cost nothing more.
        seq = digest = replaced = verdict = None
        if rec.error is not None or s.dedup:
            verdict, seq, replaced = rule.invalid(s, encoder, rec, self.normalise(rec.seq), path)
            if verdict is not None and verdict.status == rule.STRICT:
                raise FastaError(verdict.damage)
            if s.dedup:
                digest = hashlib.sha1(seq).digest()
        owner = int.from_bytes(digest[:8], "little") if digest is not None else i
        if owner % self.own[0] != self.own[1]:
            return
        if seq is None:
            seq = self.normalise(rec.seq)
        name = split_of(rec.id, s.val_fraction)
        sp, st = self.splits[name], self.stats[name]
        self.read += 1
        inp[name]["records"] += 1
        if verdict is None or verdict.status != rule.FILTERED:
            n = encoder.residues(seq) if rec.length is None else rec.length  # length: skipped unread, too long
            verdict = rule.length(s, n, rec.id, path, rec.line)
            if verdict is None and digest is not None:
                first = self.seen_hashes.get(digest)
                if first is not None:
                    verdict = rule.Verdict(rule.FILTERED, rule.DUPLICATE, f"same sequence as {first}")
                else:
                    self.seen_hashes[digest] = rec.id
        if verdict is not None:
            self._drop(name, rec.id, verdict, path, rec.line)
            return
        if not encoder.text and self.normalise(rec.seq) != rec.seq:  # soft-masked (lowercase) residues present
            st["lowercase_residues"] += int(LOWERCASE[np.frombuffer(rec.seq, dtype=np.uint8)].sum())
        if replaced:
            st["replaced_characters"] += sum(replaced.values())
            st["records_with_replacements"] += 1
            for c, k in replaced.items():
                st["replaced"][c] = st["replaced"].get(c, 0) + k
        inp[name]["kept"] += 1
        inp[name]["residues"] += n
        meta = {"id": rec.id, "source": self.source.name, "length": n}
        if rec.meta is None:
            meta["description"] = rec.description
        else:
            meta.update(rec.meta)
        key = f"{i:012d}"
        if s.window is None:
            if sp.written + 1 <= sp.skip:
                sp.written += 1  # in a verified shard already: not encoded again
                return
            sp.write(key, encoder.encode(seq), meta)
            return
        write_windows(sp, st["windows"], key, rec.id, seq, meta, s, encoder)

    def _drop(self, name: str, rid: str, verdict: rule.Verdict, path: Path, line: int) -> None:
        """A record the rule drops: counted under its reason (and as damage), listed in filtered.tsv."""
        filt = self.filtered[name]
        filt[verdict.reason] = filt.get(verdict.reason, 0) + 1  # longer_than_<--max-record-length>: once it occurs
        if verdict.chars:
            self.invalid_chars[name].update(verdict.chars)
        if verdict.damage is not None:
            self.damage.add(verdict.reason, verdict.damage, verdict.chars)
        self.splits[name].dropped.add(rid, verdict.reason, path, line, verdict.detail)

    # ------------------------------------------------------------------------------------------------ batch path
    def write_chunk(self, chunk, path: Path, inp: dict) -> int:
        """Write the records of one batch chunk (global indices chunk.index) as the per-record path would: the same
        samples, keys, meta, filter counts and rows, statistics and split; records the chunk hands over (``slow``)
        go through ``record`` in their place in the order. Returns the records of this job read here (the rest:
        ``record``)."""
        n = len(chunk)
        tokens_all = np.frombuffer(chunk.tokens, np.uint8)
        lower_cum = chunk.lowercase_cum()  # soft-masked residues, counted per kept record
        read = 0
        prev = 0
        for j in list(chunk.slow) + [n]:
            if prev < j:
                read += self._write_run(chunk, prev, j, path, inp, tokens_all, lower_cum)
            if j < n:
                rec = chunk.slow[j]
                if isinstance(rec, Exception):
                    raise rec
                self.record(rec, int(chunk.index[j]), path, inp)
            prev = j + 1
        return read

    def _write_run(self, chunk, lo: int, hi: int, path: Path, inp: dict, tokens_all: np.ndarray,
                   lower_cum: np.ndarray | None) -> int:
        """Records ``lo:hi`` of ``chunk``, none of them handed over: this job's, filtered and written split by split
        with one extend each. Returns how many were this job's."""
        s, own, bounds = self.settings, self.own, chunk.bounds
        js = np.arange(lo, hi)
        if own[0] > 1:  # the Reader left out the other jobs' records unless --strict
            js = js[chunk.index[js] % own[0] == own[1]]
        if not len(js):
            return 0
        lengths = bounds[js + 1] - bounds[js]
        names = [""] * len(js) if s.val_fraction is None else [split_of(chunk.ids[j], s.val_fraction)
                                                                 for j in js.tolist()]
        drop = rule.length_drops(s, lengths)
        for k in np.flatnonzero(drop).tolist():  # in record order, across splits, as the per-record path
            j = int(js[k])
            self._drop(names[k], chunk.ids[j], rule.length(s, int(lengths[k]), chunk.ids[j], path, chunk.line(j)),
                       path, chunk.line(j))
        groups = {"": np.ones(len(js), bool)} if s.val_fraction is None else \
            {name: np.array([x == name for x in names]) for name in self.splits}
        for name, mask in groups.items():
            inp[name]["records"] += int(mask.sum())
            keep = mask & ~drop
            kept, klen = js[keep], lengths[keep]
            if not len(kept):
                continue
            st, ip = self.stats[name], inp[name]
            if lower_cum is not None:
                st["lowercase_residues"] += int((lower_cum[bounds[kept + 1]] - lower_cum[bounds[kept]]).sum())
            ip["kept"] += len(kept)
            ip["residues"] += int(klen.sum())
            keys = self._keys(chunk, kept)
            metas = self._metas(chunk, kept.tolist(), klen)
            a, b = int(bounds[kept[0]]), int(bounds[kept[-1] + 1])
            if int(klen.sum()) == b - a:  # the kept records are adjacent: one slice
                tokens = tokens_all[a:b]
            else:
                sel = np.zeros(len(tokens_all) + 1, np.int64)
                np.add.at(sel, bounds[kept], 1)
                np.add.at(sel, bounds[kept + 1], -1)
                tokens = tokens_all[np.cumsum(sel[:-1]) > 0]
            kb = np.zeros(len(kept) + 1, np.int64)
            np.cumsum(klen, out=kb[1:])
            self.splits[name].extend(keys, tokens, kb, metas)
        return len(js)

    @staticmethod
    def _keys(chunk, kept: np.ndarray) -> list[str]:
        """The keys f"{i:012d}", formatted by one %-operation (half the time of one format call per key)."""
        return (("%012d\n" * len(kept)) % tuple(chunk.index[kept].tolist())).split("\n")[:-1]

    def _metas(self, chunk, js_kept: list[int], klen: np.ndarray) -> list[str]:
        """json.dumps({"id", "source", "length", ...}) of the per-record path, as text: id and tail are encoded
        with json's own string encoder (batch.py), the tail being the meta after "length"; all of them by one
        %-operation over a repeated format (no JSON text holds a raw newline)."""
        ids, tails = chunk.ids, chunk.tails
        k0, k1 = js_kept[0], js_kept[-1] + 1
        if k1 - k0 == len(js_kept):  # the kept records are adjacent (the rule)
            kid, ktail = ids[k0:k1], tails[k0:k1]
        else:
            kid, ktail = [ids[j] for j in js_kept], [tails[j] for j in js_kept]
        flat = [None] * (3 * len(js_kept))
        flat[0::3], flat[1::3], flat[2::3] = map(json_string, kid), klen.tolist(), ktail
        metas = ((self._meta_format * len(js_kept)) % tuple(flat)).split("\n")[:-1]
        if chunk.metas:
            for k, j in enumerate(js_kept):
                if tails[j] is None:
                    metas[k] = json.dumps({"id": ids[j], "source": self.source.name, "length": int(klen[k])}
                                          | chunk.metas[j], separators=(",", ":"))
        return metas

    # ------------------------------------------------------------------------------------------------- the end
    def _manifests(self) -> dict:
        # the shard writer's module: webdataset pulls in torch, not imported before a sample is written
        from pipeline.data.shards import Manifest

        s, out = self.settings, {}
        for k, sp in self.splits.items():
            shards = sp.close()
            st = self.stats[k]
            st["input"] = self.ctx.stats  # reader counters over all records of the inputs (the same in every job)
            if self.invalid_chars[k]:
                st["invalid_characters"] = dict(self.invalid_chars[k].most_common())
            if s.val_fraction is not None:
                st["split"] = {"name": k, "val_fraction": s.val_fraction, "by": "sha256(record id)"}
            listed = sp.dropped.finish()
            if listed is not None:
                st["filtered_list"] = listed.name
            out[k] = Manifest(source=self.source.name, tokenizer=self.encoder.entry, shards=shards,
                              filtered=self.filtered[k], inputs=self.counts[k], stats=st)
        return out


def build_sequences(source: Source, encoder: Encoder, inputs: list[Path], work: WorkDir, settings: Settings,
                    members: dict | None, progress: tuple = ("auto", 60.0), text_column: str | None = None,
                    workers: int = 1) -> tuple[dict, int]:
    """Read every record of the inputs and write this job's samples; returns ({split: Manifest}, records seen).
    ``workers`` > 1: the batch reader's chunks are parsed by that many processes (data_prep/pool.py), the
    records written here in input order: the output of one process."""
    job = SequenceBuild(source, encoder, inputs, work, settings, members, progress, text_column)
    if workers < 2 or job.fast is None:
        return job.read_inputs()
    for sp in job.splits.values():  # the pool takes the other cores
        sp.threaded = False
    with processes(workers, job.fast) as job.pool:
        return job.read_inputs()
