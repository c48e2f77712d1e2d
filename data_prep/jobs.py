"""Writing a shard directory (one job or job I of N) and merging job manifests.

Nothing half-written is ever visible: a single job builds ``DIR.partial`` and renames it to ``DIR``; job I of N
shares ``DIR`` with the other jobs, so it builds in a hidden ``DIR/.jobIIII-of-NNNN.partial/`` and moves its shards
into ``DIR`` at the end, its job manifest last (the manifest is what marks the job as finished). The work directory
is resumable (``WorkDir``): each shard is renamed into place when whole and listed with its sha256 in
``progress.jsonl``; a rerun verifies them and continues after the last intact one.

With ``--val-fraction F`` the output is two shard directories, ``DIR/train`` and ``DIR/val``, each complete (its
shards, ``manifest.json``, ``filtered.tsv``, the sentencepiece model), plus ``DIR/split.json``; the work directory
holds both (``train/`` and ``val/`` inside it), resumed split by split. A record goes to val when the first 8 bytes
of sha256(record id), read as a little-endian integer, are below F * 2**64: the split depends on the id alone (not on
the order of the records, the number of jobs or the other options), and every window of a record shares it.

Every record not written is listed in ``filtered.tsv`` (columns ``id reason input line detail``, one header line)
beside the manifest that counts it; the file exists only when something was filtered. A job of N writes
``filtered-jobIIII-of-NNNN.tsv`` and ``merge`` concatenates them into ``filtered.tsv``.
"""
from __future__ import annotations

import fcntl
import gc
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline.data.tokenizer import SEP_ID, SPM_NAME, VOCAB, NucleotideTokenizer

from . import Source
from .fasta import FastaError, input_position
from .checks import DamageCheck, PrepError, sum_stats  # noqa: F401 - PrepError is imported from here
from .progress import Progress

if TYPE_CHECKING:
    from pipeline.data.shards import Manifest

# pipeline.data.shards is imported inside the functions that write: webdataset pulls in torch (~2 s), and argument
# or output-directory mistakes should be reported at once.
MANIFEST = "manifest.json"  # pipeline.data.shards.MANIFEST
SHARD_FORMAT = "bioseq-wds/2"  # pipeline.data.shards.FORMAT: shards of blocks of samples
BLOCK_SAMPLES = 2048  # pipeline.data.shards.BLOCK_SAMPLES
JOB_MANIFEST_RE = re.compile(r"manifest-job(\d{4})-of-(\d{4})\.json")
FILTERED = "filtered.tsv"  # data_prep.checks.FILTERED
FILTERED_HEADER = ("id", "reason", "input", "line", "detail")
SPLIT_FILE = "split.json"
SPLITS = ("train", "val")
TAILS = ("short", "align", "drop")


def job_manifest_name(index: int, count: int) -> str:
    return f"manifest-job{index:04d}-of-{count:04d}.json"


def job_filtered_name(index: int, count: int) -> str:
    return f"filtered-job{index:04d}-of-{count:04d}.tsv"


@dataclass(frozen=True)
class Settings:
    shard_size: int = 10_000  # samples per shard
    min_length: int = 10  # shorter records are filtered (and counted)
    num_jobs: int = 1
    job_index: int = 0
    max_length: int | None = None  # longer records are filtered (never cropped)
    strict: bool = False  # the first invalid record is an error instead of a counted skip
    dedup: bool = False  # drop exact duplicate sequences (sha1 of the normalized sequence)
    # Above this fraction of the records dropped as damaged (invalid characters / UTF-8 / tags, empty) the job fails.
    max_filtered_fraction: float = 0.01
    replace_invalid: str | None = None  # characters outside the alphabet become this one (counted) instead
    window: int | None = None  # tile records into windows of this many positions
    stride: int | None = None  # step between window starts (default: window)
    window_tail: str = "short"  # the window that reaches the record's end: short | align | drop
    val_fraction: float | None = None  # records whose id hashes below it go to DIR/val


# Settings added after the first resumable release: left out of the fingerprint at their defaults, so that a work
# directory left by an older version resumes; max_filtered_fraction never fixes shard bytes, so never in it.
_NEW_SETTINGS = {"replace_invalid": None, "window": None, "stride": None, "window_tail": "short",
                 "val_fraction": None}


def _settings_doc(settings: Settings) -> dict:
    d = asdict(settings)
    d.pop("max_filtered_fraction")
    if settings.window is None:
        d.pop("window_tail")
    return {k: v for k, v in d.items() if k not in _NEW_SETTINGS or v != _NEW_SETTINGS[k]}


# The options of a source's job CLI (argparse dests) that decide which records a job writes or what they hold. Each
# job records them in its manifest and merge refuses jobs that differ in any (a resubmitted array job with an edited
# command line). Every other option is in JOB_LOCAL_OPTIONS with the reason it may differ between jobs;
# tests/data_prep/test_merge_options.py checks that the two cover the CLI, so a new option cannot be forgotten.
RECORD_OPTIONS = ("min_length", "max_length", "dedup", "replace_invalid", "window", "stride", "window_tail",
                  "val_fraction", "text_column", "uniref90_members", "clusters")
JOB_LOCAL_OPTIONS = {
    "input": "merge compares the jobs' input lists itself",
    "alphabet": "decides the tokenizer, which merge compares itself",
    "spm": "decides the tokenizer, which merge compares itself",
    "output": "where the job writes",
    "shard_size": "how the records are packed into tar files, not which",
    "strict": "fails the job instead of skipping an invalid record: a job that finished wrote the same records",
    "max_filtered_fraction": "fails the job or not: a job that finished wrote the same records",
    "workers": "runs jobs in one command: its jobs share every option",
    "num_jobs": "merge compares the job count itself",
    "job_index": "the job's share of the records",
    "overwrite": "whether the job may replace its own earlier files",
    "progress": "what the job prints",
    "progress_interval": "what the job prints",
}


def record_options(settings: Settings, text_column: str | None = None, members: Path | None = None,
                   clusters: Path | None = None) -> dict:
    """RECORD_OPTIONS of a job as its CLI flags -> JSON values (paths as given, resolved)."""
    values = {**asdict(settings), "text_column": text_column,
              "uniref90_members": str(Path(members).resolve()) if members else None,
              "clusters": str(Path(clusters).resolve()) if clusters else None}
    return {"--" + name.replace("_", "-"): values[name] for name in RECORD_OPTIONS}


def split_of(record_id: str, val_fraction: float | None) -> str:
    """'' without a split, else 'val' or 'train' by sha256 of the record id (see the module docstring)."""
    if val_fraction is None:
        return ""
    h = int.from_bytes(hashlib.sha256(record_id.encode("utf-8", "surrogateescape")).digest()[:8], "little")
    return "val" if h < val_fraction * 2.0 ** 64 else "train"


@dataclass
class Result:
    manifest: Manifest  # the only manifest, or train's with --val-fraction
    records_seen: int  # all records of all inputs (a job reads every record to keep the global index)
    location: Path  # manifest file written
    splits: dict | None = None  # --val-fraction: {"train": (Manifest, path), "val": (Manifest, path)}
    val_fraction: float | None = None


def filter_reasons(min_length: int, max_length: int | None = None, dedup: bool = False) -> dict[str, int]:
    """The reasons every manifest lists (0 or not); invalid-record reasons are added when they occur."""
    out = {"empty": 0, f"shorter_than_{min_length}": 0}
    if max_length is not None:
        out[f"longer_than_{max_length}"] = 0
    if dedup:
        out["duplicate"] = 0
    return out


def chosen_filters(settings: Settings) -> set[str]:
    """Filter reasons the user asked for (length limits, dedup): not counted against --max-filtered-fraction."""
    out = {f"shorter_than_{settings.min_length}", "duplicate"}
    if settings.max_length is not None:
        out.add(f"longer_than_{settings.max_length}")
    return out


def damaged_count(filtered: dict, settings: Settings) -> int:
    """Records dropped because the data could not be used as it is (invalid characters, UTF-8 or tags; empty)."""
    chosen = chosen_filters(settings)
    return sum(v for k, v in filtered.items() if k not in chosen)


def _describe(m: Manifest, location: Path, with_list: bool = True) -> str:
    """'written N[ (windows)], filtered F (reasons)[, replaced ...], tokens T, shards S -> location[; list]'."""
    st = m.stats
    reasons = ", ".join(f"{k}={v}" for k, v in m.filtered.items())
    out = f"written {m.total_samples}"
    w = st.get("windows")
    if w is not None:
        cfg = st["windowing"]
        tails = {"short": "short_tails", "align": "aligned_tails", "drop": "dropped_tails"}[cfg["tail"]]
        out += (f" (windows of {w['records']} records: --window {cfg['window']} --stride {cfg['stride']}, "
                f"{w[tails]} {cfg['tail']} tails, {w['records_shorter_than_window']} records shorter than a window")
        if cfg["tail"] == "drop":
            out += f", {w['tail_residues_dropped']} tail residues dropped"
        out += ")"
    out += f", filtered {sum(m.filtered.values())} ({reasons})"
    if "replaced_characters" in st:
        chars = ", ".join(f"{k!r}={v}" for k, v in st.get("replaced", {}).items())
        out += (f", replaced {st['replaced_characters']} characters by {st['replacement']!r} in "
                f"{st['records_with_replacements']} records" + (f" ({chars})" if chars else ""))
    out += f", tokens {m.total_tokens}, shards {len(m.shards)} -> {location}"
    if with_list and st.get("filtered_list"):
        out += f"; dropped records listed in {location.parent / st['filtered_list']}"
    return out


def summary(source: str, m: Manifest, location: Path, records_seen: int | None = None, job: str = "") -> str:
    if m.layout == "clusters":
        from .clusters import summary as cluster_summary
        return cluster_summary(m, location, job)
    read = sum(i["records"] for i in m.inputs)
    of = f" (of {records_seen} in the inputs)" if records_seen is not None and records_seen != read else ""
    return f"data_prep {source}{job}: records read {read}{of}, {_describe(m, location)}"


def split_summary(source: str, result: Result, job: str = "") -> str:
    """One line for a train/val run: the records read, then each split's samples, filters and manifest path."""
    parts = []
    read = 0
    for name in SPLITS:
        m, loc = result.splits[name]
        read += sum(i["records"] for i in m.inputs)
        if m.layout == "clusters":
            st = m.stats
            parts.append(f"{name}: clusters {st['clusters']}, written {m.total_samples}, tokens {m.total_tokens}, "
                         f"shards {len(m.shards)} -> {loc}")
        else:
            parts.append(f"{name}: {_describe(m, loc)}")
    seen = result.records_seen
    of = f" (of {seen} in the inputs)" if seen is not None and seen != read else ""
    unit = "clusters" if result.manifest.layout == "clusters" else "records"
    head = (f"data_prep {source}{job}: {unit} read {read}{of}, split by record-id hash "
            f"(--val-fraction {result.val_fraction}) into {result.location.parent.parent}/{{train,val}}")
    return "; ".join([head] + parts)


# ------------------------------------------------------------------------------------------------------ tokenizers


class Encoder:
    """The source's tokenizer as the job needs it: alphabet check, bytes -> ids, manifest entry."""

    def __init__(self, source: Source, alphabet: str | None, spm: Path | None):
        self.kind, self.spm_path = source.tokenizer, None
        self.text = self.kind == "sentencepiece"
        # OpenGenome2's '#' (contig split) is valid there, written as <sep>: never replaced
        self.sep_char = source.name == "opengenome2"
        if self.kind == "nucleotide":
            tok = NucleotideTokenizer(alphabet)
            self.invalid_positions, self._encode, self.vocab_size = tok.invalid_positions, tok.encode, tok.vocab_size
            self.entry = {"name": "nucleotide", "vocab": list(VOCAB), "alphabet": alphabet}
        elif self.kind == "protein":
            from pipeline.data.protein_tokenizer import ProteinTokenizer
            tok = ProteinTokenizer()
            self.invalid_positions, self._encode, self.vocab_size = tok.invalid_positions, tok.encode, tok.vocab_size
            self.entry = {"name": "esm", "vocab": list(tok.vocab)}
        else:
            from .spm import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SpmEncoder
            if spm is None:
                raise PrepError(f"{source.name} needs --spm MODEL (train one with `python -m data_prep train-spm`)")
            enc = SpmEncoder(spm)
            self.spm_path, self.invalid_positions, self._encode = enc.model, None, enc.encode
            self.vocab_size = enc.vocab_size
            self.entry = {"name": "sentencepiece", "model": SPM_NAME, "sha256": enc.sha256,
                          "vocab_size": enc.vocab_size, "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID,
                          "unk_id": UNK_ID}

    def encode(self, seq: bytes) -> np.ndarray:
        if not self.text and b"#" in seq:  # OpenGenome2 contig split -> one <sep>
            ids = self._encode(seq.replace(b"#", b"N"))
            ids[np.frombuffer(seq, dtype=np.uint8) == ord("#")] = SEP_ID
            return ids
        return self._encode(seq)

    def residues(self, seq: bytes) -> int:
        return len(seq.decode("utf-8")) if self.text else len(seq) - seq.count(b"#")

    def bad_positions(self, seq: bytes) -> np.ndarray:
        """Positions of ``seq`` (normalized) outside the alphabet, as the source's reader judged them."""
        return self.invalid_positions(seq.replace(b"#", b"N") if self.sep_char else seq)

    def check_replacement(self, char: str) -> str:
        """The --replace-invalid character, upper-cased, if it is a residue of this alphabet."""
        name = {"nucleotide": "nucleotide", "protein": "ESM amino-acid"}.get(self.kind)
        if self.text:
            raise PrepError("--replace-invalid applies to nucleotide and protein sources, not to text")
        c = char.upper()
        if len(c) != 1 or not c.isascii() or c == "#" or self.invalid_positions(c.encode()).size:
            raise PrepError(f"--replace-invalid {char!r} is not one residue of the {name} alphabet "
                            "(e.g. N for nucleotides, X for proteins)")
        return c

    def replace(self, seq: bytes, char: str) -> tuple[bytes, dict]:
        """``seq`` with every character outside the alphabet replaced by ``char``; {character: count}."""
        bad = self.bad_positions(seq)
        if not bad.size:
            return seq, {}
        arr = np.frombuffer(seq, dtype=np.uint8)
        if int(arr.max()) < 128:
            values, counts = np.unique(arr[bad], return_counts=True)
            out = arr.copy()
            out[bad] = ord(char)
            return out.tobytes(), {chr(v): int(c) for v, c in zip(values.tolist(), counts.tolist())}
        # non-ASCII: one replacement per character (not per UTF-8 byte)
        found: Counter = Counter()
        chars = []
        for ch in seq.decode("utf-8", "replace"):
            if not ch.isascii() or self.bad_positions(ch.encode()).size:
                found[ch] += 1
                chars.append(char)
            else:
                chars.append(ch)
        return "".join(chars).encode("ascii"), dict(found)

    def bad_characters(self, seq: bytes) -> Counter:
        """{character: count} of the characters outside the alphabet (for the manifest and the error)."""
        bad = self.bad_positions(seq)
        if not bad.size:
            return Counter()
        arr = np.frombuffer(seq, dtype=np.uint8)
        if int(arr.max()) < 128:
            values, counts = np.unique(arr[bad], return_counts=True)
            return Counter({chr(v): int(c) for v, c in zip(values.tolist(), counts.tolist())})
        return Counter(ch for ch in seq.decode("utf-8", "replace")
                       if not ch.isascii() or self.bad_positions(ch.encode()).size)


# Seconds to pause after each shard: lets the crash-resume test SIGKILL a run at a known point (tests only).
_SHARD_DELAY = float(os.environ.get("DATA_PREP_TEST_SHARD_DELAY", "0") or 0)
_LOWER = np.zeros(256, dtype=bool)
_LOWER[ord("a"):ord("z") + 1] = True


# ----------------------------------------------------------------------------------------------- resumable work dir
def _fingerprint(source: Source, encoder: Encoder, inputs: list[Path], settings: Settings, members: Path | None,
                 clusters: Path | None = None) -> dict:
    """Everything that fixes the shard bytes but the shard prefix, which the caller adds: a partial run is only
    resumed by the same command on the same files."""
    def stat(p: Path):
        st = p.stat()
        return [str(p), st.st_size, st.st_mtime_ns]
    # shard_format: a work directory left with shards of another format restarts rather than mix the two
    doc = {"source": source.name, "tokenizer": encoder.entry, "settings": _settings_doc(settings),
           "shard_format": SHARD_FORMAT,
           "inputs": [stat(p) for p in inputs], "members": stat(members) if members else None}
    if clusters is not None:  # only then: fingerprints of sequence runs stay as they were
        doc["clusters"] = stat(clusters)
    return json.loads(json.dumps(doc))


class WorkDir:
    """``DIR.partial`` (or a job's hidden folder): finished shards + ``progress.jsonl`` (fingerprint, then one line
    per shard renamed into place). Locked while a run writes it, so two runs never share one.

    ``splits``: ``("",)`` keeps the shards at the top; ``("train", "val")`` in one subfolder each, the progress lines
    then naming their split. Each split is verified and resumed on its own."""

    PROGRESS = "progress.jsonl"
    LOCK = ".lock"

    def __init__(self, path: Path, fingerprint: dict, prefix: str, splits: tuple = ("",)):
        self.path, self.fingerprint, self.prefix, self.splits = path, fingerprint, prefix, tuple(splits)
        path.mkdir(exist_ok=True)
        # The lock file names its holder. flock is released by the kernel when the holder dies, so a lock that is
        # held belongs to a live process; a free one that names a process left by a killed run is taken over.
        self._lock = open(path / self.LOCK, "a+")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.seek(0)
            holder = self._lock.read().strip()
            self._lock.close()
            raise PrepError(f"{path} is being written by another data_prep run"
                            + (f" ({holder})" if holder else "")) from None
        self._lock.seek(0)
        earlier = self._lock.read().strip()
        if earlier:
            print(f"data_prep: {path}: taking over the work left by {earlier}, which is no longer running",
                  file=sys.stderr)
        self._lock.seek(0)
        self._lock.truncate()
        self._lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
        self._lock.flush()
        self.done = self._verify()
        self._progress = open(path / self.PROGRESS, "a")

    @property
    def completed(self) -> list:
        """The verified shards of the only split (no --val-fraction)."""
        return self.done[""]

    def directory(self, split: str) -> Path:
        return self.path / split if split else self.path

    def _verify(self) -> dict:
        """Shards of a previous run that are listed, in sequence and intact; everything else is removed."""
        from pipeline.data.shards import ShardInfo, sha256_file  # imported lazily for torch's sake
        done: dict[str, list] = {s: [] for s in self.splits}
        prog = self.path / self.PROGRESS
        lines = prog.read_text().splitlines() if prog.is_file() else []
        try:
            same = bool(lines) and json.loads(lines[0]).get("fingerprint") == self.fingerprint
        except ValueError:
            same = False
        if same:
            broken: set[str] = set()
            for line in lines[1:]:
                try:
                    doc = json.loads(line)
                    split = doc.pop("split", "")
                    info = ShardInfo(**doc)
                except (ValueError, TypeError, AttributeError):
                    break  # the line being appended when the run was killed
                if split not in done or split in broken:
                    continue
                p = self.directory(split) / info.path
                if info.path != f"{self.prefix}-{len(done[split]):06d}.tar" or not p.is_file() \
                        or sha256_file(p) != info.sha256:
                    broken.add(split)  # this split regenerates from here; the other one keeps its shards
                    continue
                done[split].append(info)
        elif lines:
            print(f"data_prep: {self.path}: left by a run with other inputs or options; starting afresh",
                  file=sys.stderr)
        keep = {self.LOCK} | {s.path for s in done.get("", [])}
        for p in self.path.iterdir():
            if p.name in done and p.name and p.is_dir():
                inner = {s.path for s in done[p.name]}
                for q in p.iterdir():
                    if q.name not in inner:
                        shutil.rmtree(q) if q.is_dir() else q.unlink()
            elif p.name not in keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        for s in self.splits:
            self.directory(s).mkdir(exist_ok=True)
        tmp = prog.with_suffix(".tmp")
        rows = [{"fingerprint": self.fingerprint}]
        for s in self.splits:
            rows += [({"split": s} if s else {}) | asdict(info) for info in done[s]]
        tmp.write_text("".join(json.dumps(x) + "\n" for x in rows))
        os.replace(tmp, prog)
        total = sum(len(v) for v in done.values())
        if total and self.splits == ("",):
            print(f"data_prep: resuming {self.path}: {total} complete shards verified, continuing with "
                  f"shard {total}", file=sys.stderr)
        elif total:
            each = ", ".join(f"{s} {len(done[s])}" for s in self.splits)
            print(f"data_prep: resuming {self.path}: {total} complete shards verified ({each}), continuing after "
                  "them", file=sys.stderr)
        return done

    def record(self, info, split: str = "") -> None:
        """Called once the shard is renamed into place. Flushed, not fsync'd: a killed process loses nothing (the page
        cache keeps it), and after a power loss a line that outlived its shard's data fails the sha256 check of
        ``_verify``, which regenerates from that shard. (An fsync per shard cost ~5 ms each: it made ext4 commit the
        shard's data too, 20% of a run at 2000-record shards.)"""
        doc = ({"split": split} if split else {}) | asdict(info)
        self._progress.write(json.dumps(doc) + "\n")
        self._progress.flush()
        if _SHARD_DELAY:
            time.sleep(_SHARD_DELAY)

    def finish(self) -> None:
        self._progress.close()
        (self.path / self.PROGRESS).unlink()
        (self.path / self.LOCK).unlink()
        self._lock.close()

    def release(self) -> None:
        self._progress.close()
        self._lock.truncate(0)  # a clean exit: nobody to take over from
        self._lock.close()


class FilteredList:
    """``filtered.tsv`` being written: one row per record not written (``FILTERED_HEADER``), streamed to a
    temporary file in the work directory and renamed at the end (a rerun after a crash writes it afresh)."""

    def __init__(self, directory: Path, name: str = FILTERED):
        self.path = directory / name
        self._tmp = directory / f".{name}.tmp"
        self._f = None
        self.rows = 0

    @staticmethod
    def _clean(value) -> str:
        return str(value).replace("\t", " ").replace("\r", " ").replace("\n", " ")

    def add(self, record_id: str, reason: str, path, line, detail: str = "") -> None:
        if self._f is None:
            self._f = open(self._tmp, "w", encoding="utf-8", errors="backslashreplace")
            self._f.write("\t".join(FILTERED_HEADER) + "\n")
        self._f.write("\t".join(map(self._clean, (record_id, reason, path, line, detail))) + "\n")
        self.rows += 1

    def finish(self) -> Path | None:
        """The list's final path, or None when nothing was filtered (no file then)."""
        if self._f is None:
            return None
        self._f.close()
        self._f = None
        os.replace(self._tmp, self.path)
        return self.path

    def discard(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        self._tmp.unlink(missing_ok=True)


def _detail(error: str, path: Path) -> str:
    """A reader's error without its leading 'path:' (the list has an input column)."""
    prefix = f"{path}:"
    return error[len(prefix):] if error.startswith(prefix) else error


def window_spans(n: int, window: int, stride: int, tail: str) -> tuple[list[tuple[int, int]], str]:
    """[start, end) spans of the windows of a record of ``n`` positions, and what its tail was.

    Starts are 0, S, 2S, ...; the last window is the first that reaches the record's end. When it would be shorter
    than L, ``tail`` decides: ``short`` keeps it short ([kS, n)), ``align`` moves it back to end at the record's
    end ([n - L, n), full length, overlapping its neighbour more), ``drop`` leaves it out (those residues are lost,
    counted). A record of at most L positions is one window, the whole record, whatever ``tail`` says.
    Kinds: 'whole' (n <= L), 'exact' (the windows end at n), or the tail policy."""
    if n <= window:
        return [(0, n)], "whole"
    spans = []
    start = 0
    while start + window < n:
        spans.append((start, start + window))
        start += stride
    if start + window == n:
        spans.append((start, n))
        return spans, "exact"
    if tail == "short":
        spans.append((start, n))
    elif tail == "align":
        spans.append((n - window, n))
    return spans, tail


class _Split:
    """One output shard set being written: ``""`` (the only one) or train / val."""

    def __init__(self, name: str, work: WorkDir, settings: Settings, encoder: Encoder, filtered_name: str,
                 layout: str = "sequences"):
        self.name, self.work, self.settings, self.encoder, self.layout = name, work, settings, encoder, layout
        self.directory = work.directory(name)
        self.completed = work.done[name]
        self.skip = sum(x.samples for x in self.completed)  # samples already in verified shards: not rewritten
        self.written = 0
        self.writer = None
        self.dropped = FilteredList(self.directory, filtered_name)

    def open_writer(self):
        """The writer, created at the first sample, so that a malformed first record fails without loading torch."""
        if self.writer is None:
            from pipeline.data.shards import ShardWriter
            work, name = self.work, self.name
            on_close = work.record if not name else (lambda info: work.record(info, name))
            self.writer = ShardWriter(self.directory, work.prefix, self.settings.shard_size,
                                      vocab_size=self.encoder.vocab_size, completed=self.completed,
                                      on_close=on_close, layout=self.layout, block_samples=BLOCK_SAMPLES)
        return self.writer

    def write(self, key: str, tokens, meta: dict, offsets=None) -> None:
        self.written += 1
        if self.written <= self.skip:
            return  # already in a verified shard of the interrupted run
        self.open_writer().write(key, tokens, meta, *(() if offsets is None else (offsets,)))

    def extend(self, keys: list, tokens: np.ndarray, bounds: np.ndarray, metas: list) -> None:
        """Several samples (ShardWriter.extend), those already in verified shards skipped as in ``write``."""
        n = len(keys)
        skip = min(n, max(0, self.skip - self.written))
        self.written += n
        if skip == n:
            return
        if skip:
            keys, metas, tokens, bounds = keys[skip:], metas[skip:], tokens[bounds[skip]:], bounds[skip:] - bounds[skip]
        self.open_writer().extend(keys, tokens, bounds, metas)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()
        self.dropped.discard()

    def close(self) -> list:
        if self.written < self.skip:
            raise PrepError(f"{self.directory}: the verified shards hold {self.skip} samples but this run produced "
                            f"{self.written}; remove the work directory and rerun")
        if self.writer is None and self.completed:
            self.open_writer()
        return self.writer.close() if self.writer is not None else []


def open_splits(work: WorkDir, settings: Settings, encoder: Encoder, layout: str = "sequences") -> dict:
    """name -> _Split for the run's shard sets."""
    name = FILTERED if settings.num_jobs == 1 else job_filtered_name(settings.job_index, settings.num_jobs)
    return {s: _Split(s, work, settings, encoder, name, layout) for s in work.splits}


# ------------------------------------------------------------------------------------------------------------ build
def _input_sizes(inputs: list[Path]) -> list[int]:
    return [p.stat().st_size for p in inputs]


def _build(source: Source, encoder: Encoder, inputs: list[Path], work: WorkDir, settings: Settings,
           members: dict | None, progress: tuple = ("auto", 60.0), text_column: str | None = None
           ) -> tuple[dict, int]:
    """Read every record of the inputs and write this job's samples; returns ({split: Manifest}, records seen)."""
    from .sources import Context

    ctx = Context(encoder.invalid_positions, {}, members, text_column)
    s = settings
    splits = open_splits(work, s, encoder)
    base_filtered = filter_reasons(s.min_length, s.max_length, s.dedup)
    filtered = {k: dict(base_filtered) for k in splits}
    short, long = f"shorter_than_{s.min_length}", f"longer_than_{s.max_length}"
    seen_hashes: dict[bytes, str] = {}  # sha1 of a kept sequence -> its record id (named for the duplicates)
    normalise = (lambda seq: seq) if encoder.text else bytes.upper  # residues are upper-cased; text is kept as is
    counts = {k: [] for k in splits}
    stats = {k: {"records_kept": 0, "residues": 0, "lowercase_residues": 0} for k in splits}
    if s.replace_invalid is not None:
        for st in stats.values():
            st.update({"replacement": s.replace_invalid, "replaced_characters": 0, "records_with_replacements": 0,
                       "replaced": {}})
    if s.window is not None:
        for st in stats.values():
            st["windowing"] = {"window": s.window, "stride": s.stride, "tail": s.window_tail}
            st["windows"] = {"records": 0, "samples": 0, "records_shorter_than_window": 0, "exact_ends": 0,
                             "short_tails": 0, "aligned_tails": 0, "dropped_tails": 0, "tail_residues_dropped": 0,
                             "residues_written": 0}
    invalid_chars = {k: Counter() for k in splits}
    damage = DamageCheck(s)
    index = 0  # global record index over all inputs: fixes the sample key (and the job without --dedup)
    read = 0  # records of this job
    sizes = _input_sizes(inputs)
    mode, interval = progress
    next_update = 0.0
    fast = _batch_reader(source, encoder, settings, ctx)
    own = (s.num_jobs, s.job_index)  # (N, I): the job owns the records whose global index % N == I

    def one(rec, i: int, path: Path, inp: dict) -> None:
        """Record ``i`` (global index) of ``path`` on the per-record path."""
        nonlocal read
        replaceable = rec.error is not None and rec.reason == "invalid_character" \
            and s.replace_invalid is not None
        if rec.error is not None and s.strict and not replaceable:
            raise FastaError(rec.error)
        # With --dedup a record's job follows its hash, so every copy of a sequence meets in one job;
        # otherwise ownership is decided first and other jobs' records cost nothing more.
        seq = digest = replaced = None
        if s.dedup:
            seq = normalise(rec.seq)
            if replaceable:
                seq, replaced = encoder.replace(seq, s.replace_invalid)
            digest = hashlib.sha1(seq).digest()
        owner = int.from_bytes(digest[:8], "little") if digest is not None else i
        if owner % own[0] != own[1]:
            return
        if seq is None:
            seq = normalise(rec.seq)
            if replaceable:
                seq, replaced = encoder.replace(seq, s.replace_invalid)
        name = split_of(rec.id, s.val_fraction)
        sp, st, filt = splits[name], stats[name], filtered[name]
        read += 1
        inp[name]["records"] += 1
        if rec.error is not None and not replaceable:
            filt[rec.reason] = filt.get(rec.reason, 0) + 1
            chars = encoder.bad_characters(seq) if rec.reason == "invalid_character" else None
            if chars:
                invalid_chars[name].update(chars)
            damage.add(rec.reason, rec.error, chars)
            sp.dropped.add(rec.id, rec.reason, path, rec.line, _detail(rec.error, path))
            return
        n = encoder.residues(seq)
        reason = detail = None
        if n == 0:
            reason = "empty"
            damage.add("empty", f"{path}:{rec.line}: record {rec.id} has no sequence")
        elif n < s.min_length:
            reason, detail = short, f"{n} residues"
        elif s.max_length is not None and n > s.max_length:
            reason, detail = long, f"{n} residues"
        elif digest is not None:
            first = seen_hashes.get(digest)
            if first is not None:
                reason, detail = "duplicate", f"same sequence as {first}"
            else:
                seen_hashes[digest] = rec.id
        if reason is not None:
            filt[reason] += 1
            sp.dropped.add(rec.id, reason, path, rec.line, detail or "")
            return
        if not encoder.text and normalise(rec.seq) != rec.seq:  # soft-masked (lowercase) residues present
            st["lowercase_residues"] += int(_LOWER[np.frombuffer(rec.seq, dtype=np.uint8)].sum())
        if replaced:
            st["replaced_characters"] += sum(replaced.values())
            st["records_with_replacements"] += 1
            for c, k in replaced.items():
                st["replaced"][c] = st["replaced"].get(c, 0) + k
        inp[name]["kept"] += 1
        inp[name]["residues"] += n
        meta = {"id": rec.id, "source": source.name, "length": n}
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
        _write_windows(sp, st["windows"], key, rec.id, seq, meta, encoder, s)

    def progress_update(path: Path, done_before: int) -> None:
        bar.update(done_before + input_position(path), records=index, written=sum(x.written for x in splits.values()),
                   filtered=sum(sum(f.values()) for f in filtered.values()))
        damage.poll(read)

    # The records, lists and strings made here hold no reference cycles; with the collector on, a process that
    # imported torch (the bench, a notebook) spends a quarter of the run in collections that find nothing.
    collecting = gc.isenabled()
    gc.disable()
    try:
        with Progress(source.name, sum(sizes), mode, interval) as bar:
            for n_input, path in enumerate(inputs):
                inp = {k: {"path": str(path), "records": 0, "kept": 0, "residues": 0} for k in splits}
                done_before = sum(sizes[:n_input])
                any_record = False
                own = (s.num_jobs, s.job_index)
                if fast is not None and fast.takes(path):
                    # --strict: another job's invalid record is an error here too, so every record is parsed
                    jobs = (1, 0) if s.strict else own
                    if _FEED is not None:  # a --workers process: the parent's chunks, every record of them ours
                        own = jobs = (1, 0)
                    start = index
                    reader = fast.read(path, index, jobs)
                    for chunk in reader:
                        index = reader.start  # the chunk's first global index (fed chunks skip the others')
                        if isinstance(chunk, list):  # read record by record
                            for rec in chunk:
                                i, index = index, index + 1
                                one(rec, i, path, inp)
                        else:
                            # not "read += _batch(...)": one() counts the records it reads into read meanwhile
                            fast_read = _batch(chunk, path, inp, one, splits, stats, filtered, damage, s,
                                               fast, source.name, own)
                            read += fast_read
                        progress_update(path, done_before)
                    index = reader.index  # after the input's last record (fed: as the parent counted them)
                    any_record = index > start
                else:
                    for rec in source.reader(path, ctx):
                        any_record = True
                        i, index = index, index + 1
                        if index % 256 == 0 or time.monotonic() >= next_update:
                            next_update = time.monotonic() + 0.25
                            progress_update(path, done_before)
                        one(rec, i, path, inp)
                if not any_record:
                    raise PrepError(f"{path}: no records in this input (empty after decompression?)")
                for k in splits:
                    counts[k].append(inp[k])
                    stats[k]["records_kept"] += inp[k]["kept"]
                    stats[k]["residues"] += inp[k]["residues"]
            bar.update(sum(sizes), records=index, written=sum(x.written for x in splits.values()),
                       filtered=sum(sum(f.values()) for f in filtered.values()))
        damage.check(read, encoder.kind == "nucleotide")
    except (PrepError, FastaError, ValueError):
        for sp in splits.values():  # bad input: nothing of this run is kept
            sp.abort()
        raise
    finally:
        if collecting:
            gc.enable()
    from pipeline.data.shards import Manifest

    out = {}
    for k, sp in splits.items():
        shards = sp.close()
        stats[k]["input"] = ctx.stats  # reader counters over all records of the inputs (the same in every job)
        if invalid_chars[k]:
            stats[k]["invalid_characters"] = dict(invalid_chars[k].most_common())
        if s.val_fraction is not None:
            stats[k]["split"] = {"name": k, "val_fraction": s.val_fraction, "by": "sha256(record id)"}
        listed = sp.dropped.finish()
        if listed is not None:
            stats[k]["filtered_list"] = listed.name
        out[k] = Manifest(source=source.name, tokenizer=encoder.entry, shards=shards, filtered=filtered[k],
                          inputs=counts[k], stats=stats[k])
    return out, index


class _BatchReader:
    """data_prep/batch.py for this job: the FASTA sources' inputs read chunk by chunk, or None where the job needs
    the per-record path throughout (``_batch_reader``)."""

    def __init__(self, source: Source, encoder: Encoder, ctx):
        from .sources import iter_uniref, uniref_record
        self.uniref = source.reader is iter_uniref
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
        from .batch import starts_with_header
        return starts_with_header(path)

    def read(self, path: Path, first_index: int, jobs: tuple[int, int]):
        from .batch import Reader
        return Reader(path, self.tokens, self.check, self.uniref, self.to_record, first_index, jobs,
                      None if _FEED is None else _FEED.texts(path))


def _batch_reader(source: Source, encoder: Encoder, settings: Settings, ctx) -> _BatchReader | None:
    """The batch reader when every record of the job can take it: a FASTA source (fasta, genome, rnacentral,
    uniref) without --dedup (a record's job and fate depend on all records before it), --window or
    --uniref90-members (per-record work either way)."""
    from .sources import iter_fasta_source, iter_uniref
    if source.reader not in (iter_fasta_source, iter_uniref) or encoder.kind not in ("nucleotide", "protein"):
        return None
    if settings.dedup or settings.window is not None or ctx.members is not None or ctx.invalid_positions is None:
        return None
    return _BatchReader(source, encoder, ctx)


def _batch(chunk, path: Path, inp: dict, one, splits: dict, stats: dict, filtered: dict,
           damage: DamageCheck, s: Settings, reader: _BatchReader, source_name: str, own: tuple) -> int:
    """Write the records of one batch chunk (global indices chunk.index) as the per-record path would: the same
    samples, keys, meta, filter counts and rows, statistics and split; records the chunk hands over (``slow``) go
    through ``one`` in their place in the order. Returns the records of this job read here (the rest: ``one``)."""
    from .batch import _enc

    n = len(chunk)
    bounds = chunk.bounds
    tokens_all = np.frombuffer(chunk.tokens, np.uint8)
    lower_cum = None
    # soft-masked residues, counted per kept record (no byte >= 'a': no lowercase; one SIMD pass, unlike isupper)
    seq_bytes = np.frombuffer(chunk.seq, np.uint8)
    if len(seq_bytes) and int(seq_bytes.max()) >= ord("a") and _LOWER[seq_bytes].any():
        lower_cum = np.zeros(len(chunk.seq) + 1, np.int64)
        np.cumsum(_LOWER[np.frombuffer(chunk.seq, np.uint8)], out=lower_cum[1:])
    src = _enc(source_name)
    meta_format = '{"id":%s,"source":' + src.replace("%", "%%") + ',"length":%d%s\n'
    short, long = f"shorter_than_{s.min_length}", f"longer_than_{s.max_length}"
    read = 0

    def run(lo: int, hi: int) -> int:
        js = np.arange(lo, hi)
        if own[0] > 1:  # the Reader left out the other jobs' records unless --strict
            js = js[chunk.index[js] % own[0] == own[1]]
        if not len(js):
            return 0
        lengths = bounds[js + 1] - bounds[js]
        names = [""] * len(js) if s.val_fraction is None else [split_of(chunk.ids[j], s.val_fraction)
                                                                 for j in js.tolist()]
        drop = lengths < max(s.min_length, 1)
        if s.max_length is not None:
            drop |= lengths > s.max_length
        for k in np.flatnonzero(drop).tolist():  # in record order, across splits, as the per-record path
            j, m, name = int(js[k]), int(lengths[k]), names[k]
            rid, line = chunk.ids[j], chunk.line(j)
            if m == 0:
                reason, detail = "empty", ""
                damage.add("empty", f"{path}:{line}: record {rid} has no sequence")
            elif m < s.min_length:
                reason, detail = short, f"{m} residues"
            else:
                reason, detail = long, f"{m} residues"
            filtered[name][reason] += 1
            splits[name].dropped.add(rid, reason, path, line, detail)
        groups = {"": np.ones(len(js), bool)} if s.val_fraction is None else \
            {name: np.array([x == name for x in names]) for name in splits}
        for name, mask in groups.items():
            inp[name]["records"] += int(mask.sum())
            keep = mask & ~drop
            kept, klen = js[keep], lengths[keep]
            if not len(kept):
                continue
            st, ip = stats[name], inp[name]
            if lower_cum is not None:
                st["lowercase_residues"] += int((lower_cum[bounds[kept + 1]] - lower_cum[bounds[kept]]).sum())
            ip["kept"] += len(kept)
            ip["residues"] += int(klen.sum())
            js_kept = kept.tolist()
            # the keys f"{i:012d}", formatted by one %-operation (half the time of one format call per key)
            keys = (("%012d\n" * len(kept)) % tuple(chunk.index[kept].tolist())).split("\n")[:-1]
            ids, tails = chunk.ids, chunk.tails
            # json.dumps({"id", "source", "length", ...}) of the per-record path, as text: id and tail are encoded
            # with json's own string encoder (batch.py), the tail being the meta after "length"
            # all of them by one %-operation over a repeated format (no JSON text holds a raw newline)
            k0, k1 = js_kept[0], js_kept[-1] + 1
            if k1 - k0 == len(js_kept):  # the kept records are adjacent (the rule)
                kid, ktail = ids[k0:k1], tails[k0:k1]
            else:
                kid, ktail = [ids[j] for j in js_kept], [tails[j] for j in js_kept]
            flat = [None] * (3 * len(js_kept))
            flat[0::3], flat[1::3], flat[2::3] = map(_enc, kid), klen.tolist(), ktail
            metas = ((meta_format * len(js_kept)) % tuple(flat)).split("\n")[:-1]
            if chunk.metas:
                for k, j in enumerate(js_kept):
                    if tails[j] is None:
                        metas[k] = json.dumps({"id": ids[j], "source": source_name, "length": int(klen[k])}
                                              | chunk.metas[j], separators=(",", ":"))
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
            splits[name].extend(keys, tokens, kb, metas)
        return len(js)

    prev = 0
    for j in list(chunk.slow) + [n]:
        if prev < j:
            read += run(prev, j)
        if j < n:
            rec = chunk.slow[j]
            if isinstance(rec, Exception):
                raise rec
            one(rec, int(chunk.index[j]), path, inp)
        prev = j + 1
    return read


def _write_windows(sp: _Split, w: dict, key: str, rid: str, seq: bytes, meta: dict, encoder: Encoder,
                   s: Settings) -> None:
    """The windows of one kept record as samples ``<key>_<k>``, ids ``<record id>:<start>-<end>`` (0-based,
    end exclusive, in positions of the normalized sequence)."""
    spans, kind = window_spans(len(seq), s.window, s.stride, s.window_tail)
    w["records"] += 1
    if kind == "whole":
        w["records_shorter_than_window"] += len(seq) < s.window
    elif kind == "exact":
        w["exact_ends"] += 1
    else:
        w[{"short": "short_tails", "align": "aligned_tails", "drop": "dropped_tails"}[kind]] += 1
        if kind == "drop":
            w["tail_residues_dropped"] += encoder.residues(seq[spans[-1][1]:])
    tokens = None
    for k, (a, b) in enumerate(spans):
        n = encoder.residues(seq[a:b]) if b"#" in seq else b - a
        w["samples"] += 1
        w["residues_written"] += n
        if sp.written + 1 <= sp.skip:
            sp.written += 1
            continue
        if tokens is None:
            tokens = encoder.encode(seq)
        sp.write(f"{key}_{k:06d}", tokens[a:b], meta | {"id": f"{rid}:{a}-{b}", "record": rid, "start": a,
                                                          "end": b, "length": n})


def _looks_like_output(directory: Path) -> bool:
    if (directory / MANIFEST).is_file() or (directory / SPLIT_FILE).is_file():
        return True
    if any(JOB_MANIFEST_RE.fullmatch(p.name) for p in directory.iterdir()):
        return True
    return any((directory / s).is_dir() and ((directory / s / MANIFEST).is_file() or any(
        JOB_MANIFEST_RE.fullmatch(p.name) for p in (directory / s).iterdir())) for s in SPLITS)


def check_settings(source: Source, encoder: Encoder, settings: Settings) -> Settings:
    """Option combinations that cannot work, refused before anything is read; returns the settings completed
    (--stride defaults to --window, --replace-invalid upper-cased)."""
    s = settings
    if s.max_length is not None and s.max_length < s.min_length:
        raise PrepError(f"--max-length {s.max_length} is below --min-length {s.min_length}")
    if not 0.0 <= s.max_filtered_fraction <= 1.0:
        raise PrepError(f"--max-filtered-fraction {s.max_filtered_fraction} is outside [0, 1]")
    if s.val_fraction is not None and not 0.0 < s.val_fraction < 1.0:
        raise PrepError(f"--val-fraction {s.val_fraction} is outside (0, 1) (e.g. 0.01 puts 1% of the records, "
                        "by record id, into DIR/val)")
    if s.window_tail not in TAILS:
        raise PrepError(f"--window-tail {s.window_tail!r}, expected one of {', '.join(TAILS)}")
    changes: dict = {}
    if s.replace_invalid is not None:
        changes["replace_invalid"] = encoder.check_replacement(s.replace_invalid)
    if s.window is None:
        if s.stride is not None:
            raise PrepError(f"--stride {s.stride} needs --window L (the window length)")
        if s.window_tail != "short":
            raise PrepError(f"--window-tail {s.window_tail} needs --window L")
    else:
        if encoder.text:
            raise PrepError("--window applies to sequence sources, not to text")
        if s.window < 1:
            raise PrepError(f"--window {s.window} must be >= 1")
        stride = s.window if s.stride is None else s.stride
        if stride < 1:
            raise PrepError(f"--stride {stride} must be >= 1")
        if stride > s.window:
            raise PrepError(f"--stride {stride} is larger than --window {s.window}: the {stride - s.window} "
                            "positions between two windows would be lost (use a stride <= the window)")
        changes["stride"] = stride
    if changes:
        from dataclasses import replace
        s = replace(s, **changes)
    return s


def run(source: Source, alphabet: str | None, inputs: list[Path], output: Path, settings: Settings = Settings(),
        overwrite: bool = False, spm: Path | None = None, members: Path | None = None,
        clusters: Path | None = None, progress: tuple = ("auto", 60.0), text_column: str | None = None) -> Result:
    """One data_prep job. ``clusters`` (uniref only): the UniRef50 -> UniRef90 mapping TSV; the inputs are then
    the member FASTA files and every sample is a cluster (data_prep/clusters.py). ``progress``: (mode, seconds),
    data_prep/progress.py. ``text_column``: babylm, the column of .csv inputs."""
    inputs = [Path(p).resolve() for p in inputs]
    if source.expand is not None:
        inputs = source.expand(inputs)
    for p in inputs:
        if not p.is_file():
            raise PrepError(f"input {p} does not exist or is not a file")
        if p.stat().st_size == 0:
            raise PrepError(f"input {p} is empty")
    if len(set(inputs)) != len(inputs):
        raise PrepError("an input file is given twice")
    output = Path(output).resolve()
    if output.exists() and not output.is_dir():
        raise PrepError(f"output {output} exists and is not a directory")
    for p in output.parents:
        if p.exists() and not p.is_dir():
            raise PrepError(f"output {output}: {p} exists and is not a directory")
    if output in inputs or any(output in p.parents for p in inputs):
        raise PrepError(f"output {output} would hold an input; choose another directory")
    if source.tokenizer == "sentencepiece":
        from .sources import check_text_inputs
        check_text_inputs(inputs, text_column)
    elif text_column is not None:
        raise PrepError(f"--text-column applies to babylm (.csv text), not to {source.name}")
    encoder = Encoder(source, alphabet, spm)
    settings = check_settings(source, encoder, settings)
    if clusters is not None:
        if source.name != "uniref":
            raise PrepError(f"--clusters is a uniref option, not {source.name}'s")
        if members is not None:
            raise PrepError("--clusters and --uniref90-members exclude each other: with --clusters the members are "
                            "the samples' sequences, not meta")
        if settings.dedup:
            raise PrepError("--dedup does not apply to --clusters: the samples are clusters, and a sequence that two "
                            "members share stays in each of their clusters")
        if settings.window is not None:
            raise PrepError("--window does not apply to --clusters: a sample is a whole cluster of proteins")
        if settings.val_fraction is not None:
            raise PrepError("--val-fraction is not supported with --clusters yet: split the clusters TSV into a "
                            "train and a validation TSV and run one job on each")
        clusters = Path(clusters).resolve()
        if not clusters.is_file():
            raise PrepError(f"--clusters {clusters} does not exist or is not a file")
        if clusters in inputs:
            raise PrepError(f"{clusters} is given both as --input and as --clusters")
        from . import clusters as cl
        # Parsed and checked whole before any output exists: a bad TSV leaves nothing behind.
        cmap = cl.load_clusters(clusters, settings.num_jobs, settings.job_index, progress)

        def build(work: WorkDir):
            return cl.build(encoder, inputs, cmap, settings, open_splits(work, settings, encoder, "clusters"),
                            source.name, progress)
        fingerprint = _fingerprint(source, encoder, inputs, settings, None, clusters)
    else:
        member_map = None
        if members is not None:
            from .sources import load_members
            members = Path(members).resolve()
            if not members.is_file():
                raise PrepError(f"--uniref90-members {members} does not exist or is not a file")
            member_map = load_members(members)

        def build(work: WorkDir):
            manifests, seen = _build(source, encoder, inputs, work, settings, member_map, progress, text_column)
            if member_map is not None and not any(m.stats["input"].get("with_members") for m in manifests.values()):
                first = next(iter(member_map))
                raise PrepError(f"--uniref90-members {members}: none of its {len(member_map)} UniRef50 ids is a "
                                f"record id of the inputs (first id {first!r}); is it the members file of these "
                                "inputs?")
            return manifests, seen
        fingerprint = _fingerprint(source, encoder, inputs, settings, members)
    splits = SPLITS if settings.val_fraction is not None else ("",)
    if _FEED is not None:  # a fed --workers job holds other records than job I of N: never resumed as one
        from . import batch
        fingerprint = {**fingerprint, "fed_chunk": batch.CHUNK}
    if settings.num_jobs == 1:
        return _run_single(source, encoder, output, overwrite, build, fingerprint, splits, settings)
    options = record_options(settings, text_column, members, clusters)
    return _run_job(source, encoder, output, settings, overwrite, build, fingerprint, splits, options)


def _copy_model(encoder: Encoder, directory: Path) -> None:
    if encoder.spm_path is not None:
        tmp = directory / f".{SPM_NAME}.{os.getpid()}.tmp"  # per process: the jobs of an array share DIR
        shutil.copyfile(encoder.spm_path, tmp)
        os.replace(tmp, directory / SPM_NAME)


def _no_samples(manifest: Manifest, seen: int, split: str, settings: Settings) -> PrepError:
    if split:
        read = sum(i["records"] for i in manifest.inputs)
        unit = "clusters" if manifest.layout == "clusters" else "records"
        why = (f"none of the {seen} {unit} hashed into it" if read == 0 else
               f"the {read} of {seen} {unit} hashed into it were all filtered {manifest.filtered}")
        return PrepError(f"--val-fraction {settings.val_fraction}: the {split} split holds no samples ({why}); "
                         "too few records for this fraction")
    if manifest.layout == "clusters":
        return PrepError(f"no clusters written: all {manifest.stats['clusters']} clusters filtered "
                         f"{manifest.filtered} (members {manifest.stats['members_filtered']})")
    return PrepError(f"no records written: all {seen} records filtered {manifest.filtered}")


def _split_doc(manifests: dict, settings: Settings, source: str) -> dict:
    return {"source": source, "val_fraction": settings.val_fraction,
            "by": "sha256(record id)[:8] as a little-endian integer < val_fraction * 2**64 -> val",
            "splits": {k: {"manifest": f"{k}/{MANIFEST}", "samples": m.total_samples, "tokens": m.total_tokens,
                           "records": sum(i["records"] for i in m.inputs)} for k, m in manifests.items()}}


def _check_output_replaceable(output: Path, overwrite: bool) -> None:
    """--overwrite replaces the whole directory: refuse a non-empty one without it, one data_prep did not write, and
    a mount point (the finished output is renamed into place: found now, not after the work)."""
    from pipeline.outputs import OutputDirError, check_output_dir

    try:
        check_output_dir(output, force=overwrite, owned=_looks_like_output, what="a data_prep output",
                         tool="data_prep", flag="--overwrite")
    except OutputDirError as e:
        raise PrepError(str(e)) from None


def _replace_dir(new: Path, output: Path) -> None:
    from pipeline.outputs import replace_dir

    replace_dir(new, output)


def _write_json(path: Path, doc: dict) -> None:
    from pipeline.outputs import write_atomic
    write_atomic(path, json.dumps(doc, indent=1) + "\n")


def _run_single(source, encoder, output: Path, overwrite: bool, build, fingerprint: dict, splits: tuple = ("",),
                settings: Settings = Settings()) -> Result:
    _check_output_replaceable(output, overwrite)
    made = [p for p in reversed(output.parents) if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    fresh = not output.with_name(f"{output.name}.partial").exists()
    work = WorkDir(output.with_name(f"{output.name}.partial"), {**fingerprint, "prefix": source.name}, source.name,
                   splits)
    tmp = work.path
    try:
        manifests, seen = build(work)
        for name, manifest in manifests.items():
            if not manifest.shards:
                raise _no_samples(manifest, seen, name, settings)
        from pipeline.data.shards import write_manifest
        for name, manifest in manifests.items():
            _copy_model(encoder, work.directory(name))
            write_manifest(work.directory(name), manifest)
        if splits != ("",):
            _write_json(tmp / SPLIT_FILE, _split_doc(manifests, settings, source.name))
        work.finish()  # only now: a failed manifest write leaves the resumable work directory intact
        _replace_dir(tmp, output)
    except (PrepError, FastaError, ValueError):
        # Bad input: a rerun would fail the same way, so nothing is kept (not even finished shards).
        work.release()
        shutil.rmtree(tmp, ignore_errors=True)
        for p in reversed(made if fresh else []):  # parents this run created, innermost first
            try:
                p.rmdir()
            except OSError:
                break
        raise
    except BaseException:
        # Ctrl-C, SIGTERM (preemption), a full disk: finished shards stay in DIR.partial for the rerun to resume.
        work.release()
        raise
    if splits == ("",):
        return Result(manifests[""], seen, output / MANIFEST)
    located = {k: (m, output / k / MANIFEST) for k, m in manifests.items()}
    return Result(manifests["train"], seen, output / "train" / MANIFEST, located, settings.val_fraction)


def _run_job(source, encoder, output: Path, settings: Settings, overwrite: bool, build, fingerprint: dict,
             splits: tuple = ("",), options: dict | None = None) -> Result:
    num_jobs, job_index = settings.num_jobs, settings.job_index
    prefix = f"{source.name}-j{job_index:04d}"
    name = job_manifest_name(job_index, num_jobs)
    listed = job_filtered_name(job_index, num_jobs)
    made = not output.exists()
    output.mkdir(parents=True, exist_ok=True)
    targets = {s: (output / s if s else output) for s in splits}
    stale = []
    for d in targets.values():
        own = [d / name, d / listed] + sorted(d.glob(f"{prefix}-*.tar"))
        stale += [p for p in own + [d / MANIFEST, d / FILTERED] if p.exists()]
    if splits != ("",) and (output / SPLIT_FILE).exists():
        stale.append(output / SPLIT_FILE)
    if stale and not overwrite:
        raise PrepError(f"output {output} already holds {', '.join(str(p.relative_to(output)) for p in stale)} "
                        "(pass --overwrite to replace this job's files)")
    work = WorkDir(output / f".job{job_index:04d}-of-{num_jobs:04d}.partial", {**fingerprint, "prefix": prefix},
                   prefix, splits)
    moved: list[Path] = []
    try:
        manifests, seen = build(work)
        for p in stale:  # only this job's files, and the merged manifest / list they would make stale
            p.unlink(missing_ok=True)
        for s, manifest in manifests.items():
            d = targets[s]
            d.mkdir(exist_ok=True)
            for info in manifest.shards:
                os.replace(work.directory(s) / info.path, d / info.path)
                moved.append(d / info.path)
            if manifest.stats.get("filtered_list"):
                os.replace(work.directory(s) / listed, d / listed)
                moved.append(d / listed)
            _copy_model(encoder, d)
        for s, manifest in manifests.items():  # the job manifests last: they mark the job as finished
            doc = manifest.to_json() | {"job": {"index": job_index, "count": num_jobs, "options": options}}
            (work.directory(s) / name).write_text(json.dumps(doc, indent=1) + "\n")
            os.replace(work.directory(s) / name, targets[s] / name)
            moved.append(targets[s] / name)
        work.finish()
        shutil.rmtree(work.path, ignore_errors=True)
    except (PrepError, FastaError, ValueError):
        work.release()
        for p in moved:
            p.unlink(missing_ok=True)
        shutil.rmtree(work.path, ignore_errors=True)
        if made:
            for d in list(targets.values())[::-1] + [output]:
                try:
                    d.rmdir()
                except OSError:
                    pass
        raise
    except BaseException:
        work.release()
        raise
    if splits == ("",):
        return Result(manifests[""], seen, output / name)
    located = {k: (m, targets[k] / name) for k, m in manifests.items()}
    return Result(manifests["train"], seen, targets["train"] / name, located, settings.val_fraction)


def merge(output: Path) -> Result:
    """Combine the N job manifests of ``output`` into ``manifest.json`` (with --val-fraction: those of
    ``output/train`` and ``output/val``, and ``split.json``); every job must have finished. Everything is checked
    before anything is written."""
    output = Path(output).resolve()
    if not output.is_dir():
        raise PrepError(f"output directory {output} does not exist")
    has_jobs = any(JOB_MANIFEST_RE.fullmatch(p.name) for p in output.iterdir())
    split_dirs = [output / s for s in SPLITS if (output / s).is_dir()]
    if has_jobs and split_dirs:  # some jobs ran with --val-fraction (train/, val/), others without
        jobs = {where: sorted(int(m[1]) for p in where.iterdir() if (m := JOB_MANIFEST_RE.fullmatch(p.name)))
                for where in (output, *split_dirs)}
        without, with_ = jobs[output], sorted(set().union(*(jobs[d] for d in split_dirs)))
        raise PrepError(f"the jobs ran with different --val-fraction (none in {_jobs(without)}; a fraction in "
                        f"{_jobs(with_)}){MIXED_JOBS}")
    if has_jobs or not split_dirs:
        return _merge_dir(output)()
    if len(split_dirs) != len(SPLITS):
        other = "val" if split_dirs[0].name == "train" else "train"
        raise PrepError(f"{output}: holds {split_dirs[0].name}/ but not {other}/; a --val-fraction run writes both")
    pending = {d.name: _merge_dir(d) for d in split_dirs}  # all checked before either is written
    results = {k: write() for k, write in pending.items()}
    fraction = results["train"].manifest.stats.get("split", {}).get("val_fraction")
    _write_json(output / SPLIT_FILE, _split_doc({k: r.manifest for k, r in results.items()},
                                                Settings(val_fraction=fraction), results["train"].manifest.source))
    located = {k: (r.manifest, r.location) for k, r in results.items()}
    seen = sum(r.records_seen for r in results.values())
    return Result(results["train"].manifest, seen, results["train"].location, located, fraction)


def _check_same_options(docs: list[dict], names: list[str]) -> None:
    """Refuse jobs that ran with different RECORD_OPTIONS, naming the option, its values and the jobs."""
    options = [d.get("job", {}).get("options") for d in docs]
    if all(o is None for o in options):  # every job manifest predates the record (nothing to compare)
        return
    for name, o in zip(names, options):
        if o is None:
            raise PrepError(f"{name} does not record its options (written by an older data_prep); rerun that job "
                            "with the others' command line before merging")
    for flag in options[0]:
        by_value: dict[str, list[int]] = {}
        for i, o in enumerate(options):
            by_value.setdefault(json.dumps(o.get(flag)), []).append(i)
        if len(by_value) > 1:
            groups = "; ".join(f"{json.loads(v)!r} in {_jobs(js)}" for v, js in by_value.items())
            raise PrepError(f"the jobs ran with different {flag} ({groups}){MIXED_JOBS}")


MIXED_JOBS = ": their records would not add up to one run's; rerun the odd jobs with the same options (--overwrite) " \
    "before merging"


def _jobs(indices: list[int]) -> str:
    return f"job{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def _merge_dir(output: Path):
    """Check the job manifests of one shard directory; returns the function that writes the merged manifest (and
    the merged filtered.tsv) and returns the Result."""
    found = {}
    for p in output.iterdir():
        m = JOB_MANIFEST_RE.fullmatch(p.name)
        if m:
            found[(int(m[1]), int(m[2]))] = p
    if not found:
        raise PrepError(f"{output}: no manifest-jobIIII-of-NNNN.json to merge")
    counts = {n for _, n in found}
    if len(counts) != 1:
        raise PrepError(f"{output}: job manifests from runs with different --num-jobs {sorted(counts)}; "
                        "remove the stale ones")
    n = counts.pop()
    missing = [i for i in range(n) if (i, n) not in found]
    if missing:
        raise PrepError(f"{output}: job {missing[0]} of {n} has not finished ({job_manifest_name(missing[0], n)} "
                        f"missing{f'; {len(missing)} jobs missing' if len(missing) > 1 else ''})")
    from pipeline.data.shards import Manifest, ShardInfo, write_manifest

    docs = []
    for i in range(n):
        path = found[(i, n)]
        try:
            docs.append(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise PrepError(f"{path}: not valid JSON ({e})") from None
    first = docs[0]
    for d in docs:
        d.setdefault("layout", "sequences")  # job manifests written before layouts existed
    for i, d in enumerate(docs):
        for key in ("format", "source", "tokenizer", "layout"):
            if d[key] != first[key]:
                raise PrepError(f"{found[(i, n)].name}: {key} differs from job 0's")
        if [x["path"] for x in d["inputs"]] != [x["path"] for x in first["inputs"]]:
            raise PrepError(f"{found[(i, n)].name}: ran on different inputs than job 0")
    _check_same_options(docs, [found[(i, n)].name for i in range(n)])
    shards = [ShardInfo(**s) for d in docs for s in d["shards"]]
    for s in shards:
        if not (output / s.path).is_file():
            raise PrepError(f"{output}: shard {s.path} listed by a job manifest is missing")
    if not shards:
        split = first.get("stats", {}).get("split")
        raise PrepError(f"{output}: the jobs wrote no samples" + (
            f" into the {split['name']} split (--val-fraction {split['val_fraction']} too small for the data?)"
            if split else ""))
    filtered: dict[str, int] = {}
    for d in docs:
        for k, v in d["filtered"].items():
            filtered[k] = filtered.get(k, 0) + v
    if first["layout"] == "clusters":
        from .clusters import merge_stats
        # Every cluster job reads every FASTA record: record counts are whole-input, member counts per job.
        inputs, stats = merge_stats(docs, [found[(i, n)].name for i in range(n)])
        seen = stats["fasta_records"]
    else:
        inputs = [{"path": x["path"], **{c: sum(d["inputs"][k].get(c, 0) for d in docs)
                                          for c in ("records", "kept", "residues")}}
                  for k, x in enumerate(first["inputs"])]
        stats = {}
        for d in docs:
            stats = sum_stats(stats, {k: v for k, v in d.get("stats", {}).items()
                                       if k not in ("input", "filtered_list")})
        # Reader counters (blank lines, tags, ...) are counted over all records of the inputs by every job alike.
        stats["input"] = first.get("stats", {}).get("input", {})
        seen = sum(x["records"] for x in inputs)
    lists = [output / d["stats"]["filtered_list"] for d in docs if d.get("stats", {}).get("filtered_list")]
    stats.pop("filtered_list", None)
    for p in lists:
        if not p.is_file():
            raise PrepError(f"{output}: {p.name}, listed by a job manifest, is missing")
    if lists:
        stats["filtered_list"] = FILTERED
    manifest = Manifest(source=first["source"], tokenizer=first["tokenizer"], shards=shards, filtered=filtered,
                        inputs=inputs, stats=stats, layout=first["layout"])

    def write() -> Result:
        if lists:
            tmp = output / f".{FILTERED}.tmp"
            with open(tmp, "wb") as f:
                f.write(("\t".join(FILTERED_HEADER) + "\n").encode())
                for p in lists:
                    with open(p, "rb") as src:
                        src.readline()  # its header
                        shutil.copyfileobj(src, f)
            os.replace(tmp, output / FILTERED)
        return Result(manifest, seen, write_manifest(output, manifest))
    return write


# ---------------------------------------------------------------------------------------------------- --workers N
_FEED = None  # in a --workers process that the parent feeds: its Feed (set in the forked child only)
FEED_DEPTH = 2  # chunks queued per worker: bounds the parent's lead (memory: workers x depth x CHUNK)


class _Aborted(Exception):
    """The --workers parent stopped feeding (another worker's error, or its own while reading)."""


class Feed:
    """What the --workers parent sends one worker: for each input the batch reader takes, that worker's chunks of
    whole records (chunk c of all inputs goes to worker c % N) as ("chunk", path, c, text, first line, index of its
    first record within the input, compressed bytes read so far), then ("end", path, records of the input, chunks
    cut so far) to every worker; ("abort",) stops it. ``rank``: where an error of this worker falls in the input
    order (the chunk being handled; between chunks after an input's end), so that the parent reports the error a
    single process would have met first."""

    def __init__(self, queue, failed):
        self.queue, self.failed, self.rank = queue, failed, -1.0  # failed: an Event every worker sets on an error

    def texts(self, path: Path) -> "_FedInput":
        return _FedInput(self, str(path))


class _FedInput:
    def __init__(self, feed: Feed, path: str):
        self.feed, self.path, self.end = feed, path, None

    def __iter__(self):
        from .fasta import _POSITIONS
        while True:
            msg = self.feed.queue.get()
            if msg[0] == "abort":
                raise _Aborted()
            if msg[1] != self.path:  # cannot happen: parent and workers walk the same inputs
                raise RuntimeError(f"--workers: fed {msg[1]} while reading {self.path}")
            if msg[0] == "end":
                self.end, self.feed.rank = msg[2], msg[3] - 0.5
                return
            _, _, number, text, line, first, position = msg
            self.feed.rank = float(number)
            _POSITIONS[self.path] = lambda: position  # the progress bar's bytes: what the parent has read
            yield text, line, first


def _fed(source: Source, settings: Settings, kwargs: dict) -> bool:
    """Whether a --workers run is fed by the parent: the jobs would take the batch reader (_batch_reader)."""
    from .sources import iter_fasta_source, iter_uniref
    return (source.reader in (iter_fasta_source, iter_uniref) and source.tokenizer in ("nucleotide", "protein")
            and not settings.dedup and settings.window is None and kwargs.get("members") is None
            and kwargs.get("clusters") is None)


def _headers(text: bytes) -> int:
    """Lines of ``text`` that start with '>' (text.count(b"\\n>") + 1 for a text that starts with '>', in a third of
    its time: '>' is rare, so the bytes before the few of them are checked)."""
    a = np.frombuffer(text, np.uint8)
    at = np.flatnonzero(a == 62)
    return int(np.count_nonzero(a[at[at > 0] - 1] == 10)) + int(text[:1] == b">")


def _feed_inputs(inputs: list[Path], feeds: list, procs: list, failed) -> None:
    """The parent's side of a fed --workers run: every input the batch reader takes is decompressed here, once, and
    cut into chunks of whole records (batch.chunks) dealt round-robin to the workers. Raises _Aborted when a worker
    has failed (``failed`` set, or it died; its report says why)."""
    import queue as queue_mod

    from . import batch

    def put(q, msg):
        while True:
            try:
                q.put(msg, timeout=0.05)
                return
            except queue_mod.Full:
                if failed.is_set() or any(p.exitcode not in (None, 0) for p in procs):
                    raise _Aborted() from None

    n, number = len(feeds), 0
    for path in inputs:
        if not batch.starts_with_header(path):
            continue  # read by every worker itself, record by record (jobs of N)
        key, first = str(path), 0
        for text, line in batch.chunks(path, batch.CHUNK):
            put(feeds[number % n], ("chunk", key, number, text, line, first, input_position(path)))
            first += _headers(text)
            number += 1
        for q in feeds:
            put(q, ("end", key, first, number))


def _die_with_parent(parent: int) -> None:
    """SIGTERM this worker when the process that forked it dies (SIGKILL of the main process, an OOM kill): an
    orphan would wait on its feed pipe for good and hold its work directory's lock. Linux: the kernel's parent-death
    signal; elsewhere a thread that watches the parent pid."""
    import ctypes

    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError
    except (OSError, AttributeError):
        import threading

        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGTERM)


def _worker(queue, index: int, kwargs: dict, feed: Feed | None = None, parent: int = 0) -> None:
    """Job ``index`` of a --workers run, in a forked process: its exit status, first error line and the error's rank
    (Feed.rank; -1 unfed) to the parent."""
    global _FEED
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    _die_with_parent(parent)
    _FEED = feed

    def rank():
        if feed is not None:
            feed.failed.set()  # the parent stops feeding
            return feed.rank
        return -1.0
    try:
        run(**kwargs)
    except (PrepError, FastaError, OSError, ValueError) as e:
        queue.put((index, 1, str(e), rank()))
        return
    except _Aborted:
        queue.put((index, 3, "stopped by the parent", float("inf")))
        return
    except KeyboardInterrupt:
        queue.put((index, 130, "interrupted", rank()))
        return
    except BaseException as e:  # noqa: BLE001 -- reported by the parent, which owns the output
        queue.put((index, 2, f"{type(e).__name__}: {e}", rank()))
        return
    queue.put((index, 0, "", 0.0))


def run_workers(workers: int, source: Source, alphabet: str | None, inputs: list[Path], output: Path,
                settings: Settings = Settings(), overwrite: bool = False, **kwargs) -> Result:
    """One data_prep run on ``workers`` processes of this machine: N = workers jobs in forked processes, written
    into ``DIR.workers-partial``, merged (``merge``) and renamed to ``DIR``: the output is the merged shard directory
    of the N jobs (their shards ``SOURCE-jKKKK-*.tar`` and job manifests beside the merged manifest.json).

    Fed (FASTA sources on the batch reader: no --dedup, --window, --uniref90-members, --clusters): this process
    decompresses each input once and deals its chunks of whole records (batch.CHUNK bytes) round-robin to the
    workers (bounded queues, ``Feed``), which parse, filter, tokenize and write them. The records (keys = global
    record indices, tokens, meta), filter counts and statistics are those of a 1-process run; the merged manifest
    lists job 0's shards (chunks 0, N, 2N, ...) then job 1's, and so on, so the sample order is fixed by N and
    batch.CHUNK; filtered.tsv holds the same rows, grouped the same way. A bad input is reported as the error a
    single process meets first. Otherwise each job k is exactly ``--num-jobs N --job-index k`` (every process reads
    every input). A bad input stops every job and leaves nothing; an interrupted run resumes each job's work."""
    import multiprocessing

    if settings.num_jobs != 1:
        raise PrepError(f"--workers {workers} runs the jobs of one machine itself: it excludes --num-jobs "
                        f"{settings.num_jobs}")
    output = Path(output).resolve()
    if output.exists() and not output.is_dir():
        raise PrepError(f"output {output} exists and is not a directory")
    _check_output_replaceable(output, overwrite)
    from dataclasses import replace
    import pipeline.data.shards  # noqa: F401,I001 -- imported once here, not in every worker

    staging = output.with_name(f"{output.name}.workers-partial")
    made = [p for p in reversed(staging.parents) if not p.exists()]
    staging.mkdir(parents=True, exist_ok=True)
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    progress = kwargs.pop("progress", ("auto", 60.0))
    fed = _fed(source, settings, kwargs)
    stop = ctx.Event()
    feeds = [Feed(ctx.Queue(FEED_DEPTH), stop) for _ in range(workers)] if fed else [None] * workers
    procs = []
    for k in range(workers):
        job = dict(kwargs, source=source, alphabet=alphabet, inputs=inputs, output=staging,
                   settings=replace(settings, num_jobs=workers, job_index=k), overwrite=True,
                   progress=progress if k == 0 else ("off", progress[1]))  # one progress bar: job 0's
        procs.append(ctx.Process(target=_worker, args=(queue, k, job, feeds[k], os.getpid()), daemon=False))
    reader_error = None  # (rank, message) of a bad input met by this process while feeding
    gc.freeze()  # the parent's objects out of the collector: a worker's collections do not copy their pages
    try:
        for p in procs:
            p.start()
        if fed:
            paths = [Path(p).resolve() for p in inputs]
            paths = source.expand(paths) if source.expand is not None else paths
            try:
                if all(p.is_file() for p in paths):  # else the workers report it, before they read
                    _feed_inputs(paths, [f.queue for f in feeds], procs, stop)
            except (_Aborted, FastaError, OSError) as e:
                if not isinstance(e, _Aborted):
                    reader_error = str(e)
                for f, p in zip(feeds, procs):
                    f.queue.cancel_join_thread()  # a stopped worker may leave chunks unread
                    while p.is_alive():
                        try:
                            f.queue.put(("abort",), timeout=0.05)
                            break
                        except Exception:  # noqa: BLE001 -- queue.Full: the worker is still busy
                            continue
        for p in procs:
            p.join()
    except BaseException:
        for f in feeds:
            if f is not None:
                f.queue.cancel_join_thread()  # chunks left unsent must not block this process's exit
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join()
        raise
    finally:
        gc.unfreeze()
    reports = []
    while not queue.empty():
        reports.append(queue.get())
    reports.sort()
    status = {k: (rc, msg, rank) for k, rc, msg, rank in reports}
    failed = [(k, status.get(k, (p.exitcode or 1, f"worker {k} exited with status {p.exitcode}", 0.0))[:2])
              for k, p in enumerate(procs) if status.get(k, (1, ""))[0] != 0]
    if reader_error is not None:
        failed.append((workers, (1, reader_error)))
    if failed:
        # the error a single process meets first: the lowest rank (an error while reading ranks after the chunks
        # already dealt)
        ranks = {k: status[k][2] if k in status else 0.0 for k, _ in failed}
        ranks[workers] = float("inf")
        bad = sorted(((ranks[k], k), rc, msg) for k, (rc, msg) in failed if rc == 1)
        bad = [(k, rc, msg) for (_, k), rc, msg in bad]
        if bad:  # bad input: a rerun would fail the same way, so nothing is kept
            shutil.rmtree(staging, ignore_errors=True)
            for p in reversed(made):
                try:
                    p.rmdir()
                except OSError:
                    break
            raise PrepError(bad[0][2])
        if any(rc == 130 for _, (rc, _) in failed):
            raise KeyboardInterrupt
        k, (rc, msg) = min(failed, key=lambda f: f[1][0] == 3)  # not one the parent stopped, if any
        raise PrepError(f"worker {k} of {workers} failed: {msg}")
    result = merge(staging)
    _replace_dir(staging, output)

    def moved(path: Path) -> Path:
        return output / path.relative_to(staging)
    located = {k: (m, moved(loc)) for k, (m, loc) in result.splits.items()} if result.splits else None
    return Result(result.manifest, result.records_seen, moved(result.location), located, result.val_fraction)
