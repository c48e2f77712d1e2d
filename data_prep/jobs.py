"""Writing a shard directory (one job or job I of N) and merging job manifests.

Nothing half-written is ever visible: a single job builds ``DIR.partial`` and renames it to ``DIR``; job I of N
shares ``DIR`` with the other jobs, so it builds in a hidden ``DIR/.jobIIII-of-NNNN.partial/`` and moves its shards
into ``DIR`` at the end, its job manifest last (the manifest is what marks the job as finished). The work directory
is resumable (``WorkDir``): each shard is renamed into place when whole and listed with its sha256 in
``progress.jsonl``; a rerun verifies them and continues after the last intact one.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from tqdm import tqdm

from pipeline.data.tokenizer import SEP_ID, SPM_NAME, VOCAB, NucleotideTokenizer

from . import Source
from .fasta import FastaError

if TYPE_CHECKING:
    from pipeline.data.shards import Manifest

# pipeline.data.shards is imported inside the functions that write: webdataset pulls in torch (~2 s), and argument
# or output-directory mistakes should be reported at once.
MANIFEST = "manifest.json"  # pipeline.data.shards.MANIFEST
JOB_MANIFEST_RE = re.compile(r"manifest-job(\d{4})-of-(\d{4})\.json")


class PrepError(Exception):
    """A user-facing error: bad arguments or an output directory in the way."""


def job_manifest_name(index: int, count: int) -> str:
    return f"manifest-job{index:04d}-of-{count:04d}.json"


@dataclass(frozen=True)
class Settings:
    shard_size: int = 10_000  # samples per shard
    min_length: int = 10  # shorter records are filtered (and counted)
    num_jobs: int = 1
    job_index: int = 0
    max_length: int | None = None  # longer records are filtered (never cropped)
    strict: bool = False  # the first invalid record is an error instead of a counted skip
    dedup: bool = False  # drop exact duplicate sequences (sha1 of the normalized sequence)


@dataclass
class Result:
    manifest: Manifest
    records_seen: int  # all records of all inputs (a job reads every record to keep the global index)
    location: Path  # manifest file written


def filter_reasons(min_length: int, max_length: int | None = None, dedup: bool = False) -> dict[str, int]:
    """The reasons every manifest lists (0 or not); invalid-record reasons are added when they occur."""
    out = {"empty": 0, f"shorter_than_{min_length}": 0}
    if max_length is not None:
        out[f"longer_than_{max_length}"] = 0
    if dedup:
        out["duplicate"] = 0
    return out


def summary(source: str, m: Manifest, location: Path, records_seen: int | None = None, job: str = "") -> str:
    if m.layout == "clusters":
        from .clusters import summary as cluster_summary
        return cluster_summary(m, location, job)
    read = sum(i["records"] for i in m.inputs)
    of = f" (of {records_seen} in the inputs)" if records_seen is not None and records_seen != read else ""
    reasons = ", ".join(f"{k}={v}" for k, v in m.filtered.items())
    return (f"data_prep {source}{job}: records read {read}{of}, written {m.total_samples}, "
            f"filtered {sum(m.filtered.values())} ({reasons}), tokens {m.total_tokens}, "
            f"shards {len(m.shards)} -> {location}")


# ------------------------------------------------------------------------------------------------------ tokenizers


class Encoder:
    """The source's tokenizer as the job needs it: alphabet check, bytes -> ids, manifest entry."""

    def __init__(self, source: Source, alphabet: str | None, spm: Path | None):
        self.kind, self.spm_path = source.tokenizer, None
        self.text = self.kind == "sentencepiece"
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
    doc = {"source": source.name, "tokenizer": encoder.entry, "settings": asdict(settings),
           "inputs": [stat(p) for p in inputs], "members": stat(members) if members else None}
    if clusters is not None:  # only then: fingerprints of sequence runs stay as they were
        doc["clusters"] = stat(clusters)
    return json.loads(json.dumps(doc))


class WorkDir:
    """``DIR.partial`` (or a job's hidden folder): finished shards + ``progress.jsonl`` (fingerprint, then one line
    per shard renamed into place). Locked while a run writes it, so two runs never share one."""

    PROGRESS = "progress.jsonl"
    LOCK = ".lock"

    def __init__(self, path: Path, fingerprint: dict, prefix: str):
        self.path, self.fingerprint, self.prefix = path, fingerprint, prefix
        path.mkdir(exist_ok=True)
        self._lock = open(path / self.LOCK, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise PrepError(f"{path} is being written by another data_prep run") from None
        self.completed = self._verify()
        self._progress = open(path / self.PROGRESS, "a")

    def _verify(self) -> list:
        """Shards of a previous run that are listed, in sequence and intact; everything else is removed."""
        from pipeline.data.shards import ShardInfo, sha256_file  # imported lazily for torch's sake
        done: list = []
        prog = self.path / self.PROGRESS
        lines = prog.read_text().splitlines() if prog.is_file() else []
        try:
            same = bool(lines) and json.loads(lines[0]).get("fingerprint") == self.fingerprint
        except ValueError:
            same = False
        if same:
            for line in lines[1:]:
                try:
                    info = ShardInfo(**json.loads(line))
                except (ValueError, TypeError):
                    break  # the line being appended when the run was killed
                p = self.path / info.path
                if info.path != f"{self.prefix}-{len(done):06d}.tar" or not p.is_file() or sha256_file(p) != info.sha256:
                    break
                done.append(info)
        elif lines:
            print(f"data_prep: {self.path}: left by a run with other inputs or options; starting afresh",
                  file=sys.stderr)
        keep = {s.path for s in done} | {self.LOCK}
        for p in self.path.iterdir():
            if p.name not in keep:
                shutil.rmtree(p) if p.is_dir() else p.unlink()
        tmp = prog.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(x) + "\n" for x in [{"fingerprint": self.fingerprint}]
                               + [asdict(s) for s in done]))
        os.replace(tmp, prog)
        if done:
            print(f"data_prep: resuming {self.path}: {len(done)} complete shards verified, continuing with "
                  f"shard {len(done)}", file=sys.stderr)
        return done

    def record(self, info) -> None:
        """Called once the shard is renamed into place; fsync'd so a crash never lists a shard that is not there."""
        self._progress.write(json.dumps(asdict(info)) + "\n")
        self._progress.flush()
        os.fsync(self._progress.fileno())
        if _SHARD_DELAY:
            time.sleep(_SHARD_DELAY)

    def finish(self) -> None:
        self._progress.close()
        (self.path / self.PROGRESS).unlink()
        (self.path / self.LOCK).unlink()
        self._lock.close()

    def release(self) -> None:
        self._progress.close()
        self._lock.close()


# ------------------------------------------------------------------------------------------------------------ build
def _build(source: Source, encoder: Encoder, inputs: list[Path], work: WorkDir, settings: Settings,
           members: dict | None) -> tuple[Manifest, int]:
    from .sources import Context

    ctx = Context(encoder.invalid_positions, {}, members)
    writer = None  # created at the first sample, so that a malformed first record fails without loading torch
    s = settings
    filtered = filter_reasons(s.min_length, s.max_length, s.dedup)
    short, long = f"shorter_than_{s.min_length}", f"longer_than_{s.max_length}"
    seen_hashes: set[bytes] = set()
    normalise = (lambda seq: seq) if encoder.text else bytes.upper  # residues are upper-cased; text is kept as is
    counts = []
    stats = {"records_kept": 0, "residues": 0, "lowercase_residues": 0}
    skip = sum(x.samples for x in work.completed)  # samples already in verified shards: counted, not rewritten
    written = 0
    index = 0  # global record index over all inputs: fixes the sample key (and the job without --dedup)
    with tqdm(unit="B", unit_scale=True, desc=source.name, file=sys.stderr,
              disable=not sys.stderr.isatty()) as bar:
        pending_bytes = 0
        for path in inputs:
            inp = {"path": str(path), "records": 0, "kept": 0, "residues": 0}
            any_record = False
            for rec in source.reader(path, ctx):
                any_record = True
                i, index = index, index + 1
                pending_bytes += rec.nbytes
                if index % 256 == 0:
                    bar.update(pending_bytes)
                    bar.set_postfix(records=index, refresh=False)
                    pending_bytes = 0
                if rec.error is not None and s.strict:
                    raise FastaError(rec.error)
                # With --dedup a record's job follows its hash, so every copy of a sequence meets in one job;
                # otherwise ownership is decided first and other jobs' records cost nothing more.
                seq = digest = None
                if s.dedup:
                    seq = normalise(rec.seq)
                    digest = hashlib.sha1(seq).digest()
                owner = int.from_bytes(digest[:8], "little") if digest is not None else i
                if owner % s.num_jobs != s.job_index:
                    continue
                if seq is None:
                    seq = normalise(rec.seq)
                inp["records"] += 1
                if rec.error is not None:
                    filtered[rec.reason] = filtered.get(rec.reason, 0) + 1
                    continue
                n = encoder.residues(seq)
                if n == 0:
                    filtered["empty"] += 1
                    continue
                if n < s.min_length:
                    filtered[short] += 1
                    continue
                if s.max_length is not None and n > s.max_length:
                    filtered[long] += 1
                    continue
                if digest is not None:
                    if digest in seen_hashes:
                        filtered["duplicate"] += 1
                        continue
                    seen_hashes.add(digest)
                if not encoder.text and seq != rec.seq:  # soft-masked (lowercase) residues present
                    stats["lowercase_residues"] += int(_LOWER[np.frombuffer(rec.seq, dtype=np.uint8)].sum())
                inp["kept"] += 1
                inp["residues"] += n
                written += 1
                if written <= skip:
                    continue  # already in a verified shard of the interrupted run
                if writer is None:
                    writer = _writer(work, settings, encoder)
                meta = {"id": rec.id, "source": source.name, "length": n}
                if rec.meta is None:
                    meta["description"] = rec.description
                else:
                    meta.update(rec.meta)
                writer.write(f"{i:012d}", encoder.encode(seq), meta)
            if not any_record:
                raise PrepError(f"{path}: no records in this input (empty after decompression?)")
            counts.append(inp)
            stats["records_kept"] += inp["kept"]
            stats["residues"] += inp["residues"]
        bar.update(pending_bytes)
    if written < skip:
        raise PrepError(f"{work.path}: the verified shards hold {skip} samples but this run produced {written}; "
                        "remove the directory and rerun")
    from pipeline.data.shards import Manifest

    if writer is None and work.completed:
        writer = _writer(work, settings, encoder)
    shards = writer.close() if writer is not None else []
    stats["input"] = ctx.stats  # reader counters over all records of the inputs (the same in every job)
    return Manifest(source=source.name, tokenizer=encoder.entry, shards=shards, filtered=filtered, inputs=counts,
                    stats=stats), index


def _writer(work: WorkDir, settings: Settings, encoder: Encoder, layout: str = "sequences"):
    from pipeline.data.shards import ShardWriter
    return ShardWriter(work.path, work.prefix, settings.shard_size, vocab_size=encoder.vocab_size,
                       completed=work.completed, on_close=work.record, layout=layout)


def _looks_like_output(directory: Path) -> bool:
    return (directory / MANIFEST).is_file() or any(JOB_MANIFEST_RE.fullmatch(p.name) for p in directory.iterdir())


def run(source: Source, alphabet: str | None, inputs: list[Path], output: Path, settings: Settings = Settings(),
        overwrite: bool = False, spm: Path | None = None, members: Path | None = None,
        clusters: Path | None = None) -> Result:
    """One data_prep job. ``clusters`` (uniref only): the UniRef50 -> UniRef90 mapping TSV; the inputs are then
    the member FASTA files and every sample is a cluster (data_prep/clusters.py)."""
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
    if settings.max_length is not None and settings.max_length < settings.min_length:
        raise PrepError(f"--max-length {settings.max_length} is below --min-length {settings.min_length}")
    encoder = Encoder(source, alphabet, spm)
    if clusters is not None:
        if source.name != "uniref":
            raise PrepError(f"--clusters is a uniref option, not {source.name}'s")
        if members is not None:
            raise PrepError("--clusters and --uniref90-members exclude each other: with --clusters the members are "
                            "the samples' sequences, not meta")
        if settings.dedup:
            raise PrepError("--dedup does not apply to --clusters: the samples are clusters, and a sequence that two "
                            "members share stays in each of their clusters")
        clusters = Path(clusters).resolve()
        if not clusters.is_file():
            raise PrepError(f"--clusters {clusters} does not exist or is not a file")
        if clusters in inputs:
            raise PrepError(f"{clusters} is given both as --input and as --clusters")
        from . import clusters as cl
        # Parsed and checked whole before any output exists: a bad TSV leaves nothing behind.
        cmap = cl.load_clusters(clusters, settings.num_jobs, settings.job_index)

        def build(work: WorkDir):
            skip = sum(x.samples for x in work.completed)
            return cl.build(encoder, inputs, cmap, settings, skip, lambda: _writer(work, settings, encoder,
                                                                                   "clusters"), source.name)
        fingerprint = _fingerprint(source, encoder, inputs, settings, None, clusters)
    else:
        member_map = None
        if members is not None:
            from .sources import load_members
            members = Path(members).resolve()
            member_map = load_members(members)

        def build(work: WorkDir):
            return _build(source, encoder, inputs, work, settings, member_map)
        fingerprint = _fingerprint(source, encoder, inputs, settings, members)
    if settings.num_jobs == 1:
        return _run_single(source, encoder, output, overwrite, build, fingerprint)
    return _run_job(source, encoder, output, settings, overwrite, build, fingerprint)


def _copy_model(encoder: Encoder, directory: Path) -> None:
    if encoder.spm_path is not None:
        tmp = directory / f".{SPM_NAME}.{os.getpid()}.tmp"  # per process: the jobs of an array share DIR
        shutil.copyfile(encoder.spm_path, tmp)
        os.replace(tmp, directory / SPM_NAME)


def _run_single(source, encoder, output: Path, overwrite: bool, build, fingerprint: dict) -> Result:
    nonempty = output.is_dir() and any(output.iterdir())
    if nonempty and not overwrite:
        raise PrepError(f"output directory {output} exists and is not empty (pass --overwrite to replace it)")
    if nonempty and not _looks_like_output(output):
        # --overwrite replaces the whole directory: refuse unless it is a previous data_prep output.
        raise PrepError(f"output directory {output} holds no manifest.json; not replacing a directory that "
                        "data_prep did not write")
    made = [p for p in reversed(output.parents) if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    fresh = not output.with_name(f"{output.name}.partial").exists()
    work = WorkDir(output.with_name(f"{output.name}.partial"), {**fingerprint, "prefix": source.name}, source.name)
    tmp = work.path
    try:
        manifest, seen = build(work)
        if not manifest.shards:
            if manifest.layout == "clusters":
                raise PrepError(f"no clusters written: all {manifest.stats['clusters']} clusters filtered "
                                f"{manifest.filtered} (members {manifest.stats['members_filtered']})")
            raise PrepError(f"no records written: all {seen} records filtered {manifest.filtered}")
        from pipeline.data.shards import write_manifest
        _copy_model(encoder, tmp)
        write_manifest(tmp, manifest)
        work.finish()  # only now: a failed manifest write leaves the resumable work directory intact
        if output.exists():
            old = output.with_name(f"{output.name}.old-{os.getpid()}")
            os.rename(output, old)
            try:
                os.rename(tmp, output)
            except BaseException:
                os.rename(old, output)
                raise
            shutil.rmtree(old)
        else:
            os.rename(tmp, output)
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
    return Result(manifest, seen, output / MANIFEST)


def _run_job(source, encoder, output: Path, settings: Settings, overwrite: bool, build, fingerprint: dict
             ) -> Result:
    num_jobs, job_index = settings.num_jobs, settings.job_index
    prefix = f"{source.name}-j{job_index:04d}"
    name = job_manifest_name(job_index, num_jobs)
    output.mkdir(parents=True, exist_ok=True)
    own = [output / name] + sorted(output.glob(f"{prefix}-*.tar"))
    stale = [p for p in own + [output / MANIFEST] if p.exists()]
    if stale and not overwrite:
        raise PrepError(f"output {output} already holds {', '.join(p.name for p in stale)} "
                        "(pass --overwrite to replace this job's files)")
    work = WorkDir(output / f".job{job_index:04d}-of-{num_jobs:04d}.partial", {**fingerprint, "prefix": prefix},
                   prefix)
    moved: list[Path] = []
    try:
        manifest, seen = build(work)
        for p in stale:  # only this job's files, and the merged manifest they would make stale
            p.unlink(missing_ok=True)
        for s in manifest.shards:
            os.replace(work.path / s.path, output / s.path)
            moved.append(output / s.path)
        _copy_model(encoder, output)
        doc = manifest.to_json() | {"job": {"index": job_index, "count": num_jobs}}
        (work.path / name).write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(work.path / name, output / name)
        work.finish()
        shutil.rmtree(work.path, ignore_errors=True)
    except (PrepError, FastaError, ValueError):
        work.release()
        for p in moved:
            p.unlink(missing_ok=True)
        shutil.rmtree(work.path, ignore_errors=True)
        raise
    except BaseException:
        work.release()
        raise
    return Result(manifest, seen, output / name)


def merge(output: Path) -> Result:
    """Combine the N job manifests of ``output`` into ``manifest.json``; every job must have finished."""
    output = Path(output).resolve()
    if not output.is_dir():
        raise PrepError(f"output directory {output} does not exist")
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
        for field in ("format", "source", "tokenizer", "layout"):
            if d[field] != first[field]:
                raise PrepError(f"{found[(i, n)].name}: {field} differs from job 0's")
        if [x["path"] for x in d["inputs"]] != [x["path"] for x in first["inputs"]]:
            raise PrepError(f"{found[(i, n)].name}: ran on different inputs than job 0")
    shards = [ShardInfo(**s) for d in docs for s in d["shards"]]
    for s in shards:
        if not (output / s.path).is_file():
            raise PrepError(f"{output}: shard {s.path} listed by a job manifest is missing")
    if not shards:
        raise PrepError(f"{output}: the jobs wrote no samples")
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
            for k, v in d.get("stats", {}).items():
                if k != "input":
                    stats[k] = stats.get(k, 0) + v
        # Reader counters (blank lines, tags, ...) are counted over all records of the inputs by every job alike.
        stats["input"] = first.get("stats", {}).get("input", {})
        seen = sum(x["records"] for x in inputs)
    manifest = Manifest(source=first["source"], tokenizer=first["tokenizer"], shards=shards, filtered=filtered,
                        inputs=inputs, stats=stats, layout=first["layout"])
    return Result(manifest, seen, write_manifest(output, manifest))
