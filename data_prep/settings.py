"""A job's settings: the options that fix its records (and the fingerprint and record of them), the checks of
their combinations, the run's result and the one-line summaries printed at the end."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .checks import PrepError
from .common import SPLITS, TAILS

if TYPE_CHECKING:
    from pipeline.data.shards import Manifest

    from . import Source
    from .encode import Encoder


MAX_RECORD_LENGTH = 1_000_000_000  # Settings.max_record_length's default, residues


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
    # A longer record is counted as filtered (longer_than_N) and skipped while read, never built (a gzip bomb: one
    # 2 GiB record in 2 MB). Four times the longest human chromosome (249 Mb) and above every chromosome of the
    # usual reference genomes (wheat 3B: 0.83 Gb); the giant chromosomes of some conifers, onion, axolotl and
    # lungfish are longer and need it raised.
    max_record_length: int = MAX_RECORD_LENGTH
    stage: str | None = None  # --clusters arrays: "scan" (a share of the member FASTA) or "build" (data_prep/scan.py)

    @classmethod
    def from_args(cls, args) -> Settings:
        """The settings of a job's command line: each field from the argparse option of its name (an option the
        source does not have keeps its default)."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


@dataclass(frozen=True)
class Job:
    """One data_prep job: its source, inputs and output and the settings its records follow. ``alphabet``: the
    nucleotide alphabet (the source's, or --alphabet); ``spm``: babylm's sentencepiece model; ``members``: uniref's
    --uniref90-members TSV; ``clusters``: uniref's UniRef50 -> UniRef90 mapping TSV, the inputs being then the
    member FASTA files and every sample a cluster (data_prep/clusters.py); ``text_column``: babylm's column of
    .csv inputs."""
    source: Source
    inputs: tuple
    output: Path
    settings: Settings = Settings()
    alphabet: str | None = None
    overwrite: bool = False
    spm: Path | None = None
    members: Path | None = None
    clusters: Path | None = None
    text_column: str | None = None


@dataclass(frozen=True)
class Launch:
    """How a job runs, whatever its records: ``progress`` (mode, seconds: data_prep/progress.py); ``workers``: N > 1
    parses the batch reader's chunks on N processes (data_prep/pool.py; the output is the same); ``locked``: the job
    takes its output's lock (common.output_lock: exclusive, or shared by the jobs of an array), False under
    --workers, whose process holds the lock of the real output itself."""
    progress: tuple = ("auto", 60.0)
    workers: int = 1
    locked: bool = True


# Settings added after the first resumable release: left out of the fingerprint at their defaults, so that a work
# directory left by an older version resumes; max_filtered_fraction never fixes shard bytes, so never in it.
_NEW_SETTINGS = {"replace_invalid": None, "window": None, "stride": None, "window_tail": "short",
                 "val_fraction": None, "max_record_length": MAX_RECORD_LENGTH,
                 "stage": None}


def settings_doc(settings: Settings) -> dict:
    """The settings that fix the shard bytes, as the work directory's fingerprint holds them."""
    d = asdict(settings)
    d.pop("max_filtered_fraction")
    if settings.window is None:
        d.pop("window_tail")
    return {k: v for k, v in d.items() if k not in _NEW_SETTINGS or v != _NEW_SETTINGS[k]}


# The options of a source's job CLI (argparse dests) that decide which records a job writes or what they hold. Each
# job records them in its manifest and merge refuses jobs that differ in any (a resubmitted array job with an edited
# command line). Every other option is in JOB_LOCAL_OPTIONS with the reason it may differ between jobs;
# tests/reliability/test_merge_mixed_jobs.py checks that the two cover the CLI, so a new option cannot be forgotten.
RECORD_OPTIONS = ("min_length", "max_length", "max_record_length", "dedup", "replace_invalid", "window", "stride",
                  "window_tail", "val_fraction", "text_column", "uniref90_members", "clusters")
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
    "stage": "which stage of a --clusters array the job runs: the scan parts and the builds share every option",
}


def record_options(settings: Settings, text_column: str | None = None, members: Path | None = None,
                   clusters: Path | None = None) -> dict:
    """RECORD_OPTIONS of a job as its CLI flags -> JSON values (paths as given, resolved)."""
    values = {**asdict(settings), "text_column": text_column,
              "uniref90_members": str(Path(members).resolve()) if members else None,
              "clusters": str(Path(clusters).resolve()) if clusters else None}
    return {"--" + name.replace("_", "-"): values[name] for name in RECORD_OPTIONS}


@dataclass
class Result:
    manifest: Manifest  # the only manifest, or train's with --val-fraction
    records_seen: int  # all records of all inputs (a job reads every record to keep the global index), or of the
    # job's byte ranges (batch.splits_bytes)
    location: Path  # manifest file written
    splits: dict | None = None  # --val-fraction: {"train": (Manifest, path), "val": (Manifest, path)}
    val_fraction: float | None = None


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
        s = replace(s, **changes)
    return s


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


def cluster_summary(m: Manifest, location: Path, job: str = "") -> str:
    """The line of a --clusters job (data_prep/clusters.py)."""
    st = m.stats
    members = ", ".join(f"{k}={v}" for k, v in st["members_filtered"].items())
    clusters = ", ".join(f"{k}={v}" for k, v in m.filtered.items())
    none = st.get("records_in_no_cluster")
    return (f"data_prep {m.source}{job}: clusters {st['clusters']}, written {m.total_samples}, filtered "
            f"{sum(m.filtered.values())} ({clusters}); members listed {st['members_listed']}, kept "
            f"{st['members_kept']}, filtered {sum(st['members_filtered'].values())} ({members}); FASTA records "
            f"{st['fasta_records']}, in no cluster {'(computed by merge)' if none is None else none}"
            + (f"; replaced {st['replaced_characters']} characters by {st['replacement']!r} in "
               f"{st['records_with_replacements']} members" if "replaced_characters" in st else "")
            + f"; tokens {m.total_tokens}, shards {len(m.shards)} -> {location}"
            + (f"; dropped members and clusters listed in {location.parent / st['filtered_list']}"
               if st.get("filtered_list") else ""))


def summary(source: str, m: Manifest, location: Path, records_seen: int | None = None, job: str = "") -> str:
    if m.layout == "clusters":
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
