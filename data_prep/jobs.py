"""Writing a shard directory (one job or job I of N) and merging job manifests.

Nothing half-written is ever visible: a single job builds ``DIR.tmp-<pid>`` and renames it to ``DIR``; job I of N
shares ``DIR`` with the other jobs, so it builds in a hidden ``DIR/.manifest-job...tmp-<pid>/`` and moves its shards
into ``DIR`` at the end, its job manifest last (the manifest is what marks the job as finished).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tqdm import tqdm

from pipeline.data.tokenizer import VOCAB, NucleotideTokenizer

from . import Source

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


@dataclass
class Result:
    manifest: Manifest
    records_seen: int  # all records of all inputs (a job reads every record to keep the global index)
    location: Path  # manifest file written


def filter_reasons(min_length: int) -> dict[str, int]:
    return {"empty": 0, f"shorter_than_{min_length}": 0}


def summary(source: str, m: Manifest, location: Path, records_seen: int | None = None, job: str = "") -> str:
    read = sum(i["records"] for i in m.inputs)
    of = f" (of {records_seen} in the inputs)" if records_seen is not None and records_seen != read else ""
    reasons = ", ".join(f"{k}={v}" for k, v in m.filtered.items())
    return (f"data_prep {source}{job}: records read {read}{of}, written {m.total_samples}, "
            f"filtered {sum(m.filtered.values())} ({reasons}), tokens {m.total_tokens}, "
            f"shards {len(m.shards)} -> {location}")


def _build(source: Source, alphabet: str, inputs: list[Path], directory: Path, prefix: str,
           settings: Settings) -> tuple[Manifest, int]:
    tok = NucleotideTokenizer(alphabet)
    writer = None  # created at the first sample, so that a malformed first record fails without loading torch
    min_length, num_jobs, job_index = settings.min_length, settings.num_jobs, settings.job_index
    filtered = filter_reasons(min_length)
    short = f"shorter_than_{min_length}"
    counts = []
    index = 0  # global record index over all inputs: fixes which job owns a record and the sample key
    with tqdm(unit="rec", desc=source.name, file=sys.stderr, disable=not sys.stderr.isatty()) as bar:
        for path in inputs:
            mine = 0
            for rec in source.reader(path, tok.invalid_positions):
                i, index = index, index + 1
                bar.update()
                if i % num_jobs != job_index:
                    continue
                mine += 1
                if not rec.seq:
                    filtered["empty"] += 1
                elif len(rec.seq) < min_length:
                    filtered[short] += 1
                else:
                    if writer is None:
                        from pipeline.data.shards import ShardWriter
                        writer = ShardWriter(directory, prefix, settings.shard_size)
                    meta = {"id": rec.id, "description": rec.description, "source": source.name,
                            "length": len(rec.seq)}
                    writer.write(f"{i:012d}", tok.encode(rec.seq), meta)
            counts.append({"path": str(path), "records": mine})
    from pipeline.data.shards import Manifest

    shards = writer.close() if writer is not None else []
    tokenizer = {"name": "nucleotide", "vocab": list(VOCAB), "alphabet": alphabet}
    return Manifest(source=source.name, tokenizer=tokenizer, shards=shards, filtered=filtered, inputs=counts), index


def _looks_like_output(directory: Path) -> bool:
    return (directory / MANIFEST).is_file() or any(JOB_MANIFEST_RE.fullmatch(p.name) for p in directory.iterdir())


def run(source: Source, alphabet: str, inputs: list[Path], output: Path, settings: Settings = Settings(),
        overwrite: bool = False) -> Result:
    inputs = [Path(p).resolve() for p in inputs]
    for p in inputs:
        if not p.is_file():
            raise PrepError(f"input {p} does not exist or is not a file")
    if len(set(inputs)) != len(inputs):
        raise PrepError("an input file is given twice")
    output = Path(output).resolve()
    if output.exists() and not output.is_dir():
        raise PrepError(f"output {output} exists and is not a directory")
    if settings.num_jobs == 1:
        return _run_single(source, alphabet, inputs, output, settings, overwrite)
    return _run_job(source, alphabet, inputs, output, settings, overwrite)


def _run_single(source, alphabet, inputs, output: Path, settings: Settings, overwrite: bool) -> Result:
    nonempty = output.is_dir() and any(output.iterdir())
    if nonempty and not overwrite:
        raise PrepError(f"output directory {output} exists and is not empty (pass --overwrite to replace it)")
    if nonempty and not _looks_like_output(output):
        # --overwrite replaces the whole directory: refuse unless it is a previous data_prep output.
        raise PrepError(f"output directory {output} holds no manifest.json; not replacing a directory that "
                        "data_prep did not write")
    made = [p for p in reversed(output.parents) if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    tmp.mkdir()
    try:
        manifest, seen = _build(source, alphabet, inputs, tmp, source.name, settings)
        if not manifest.shards:
            raise PrepError(f"no records written: all {seen} records filtered {manifest.filtered}")
        from pipeline.data.shards import write_manifest
        write_manifest(tmp, manifest)
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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for p in reversed(made):  # parents this run created, innermost first
            try:
                p.rmdir()
            except OSError:
                break
        raise
    return Result(manifest, seen, output / MANIFEST)


def _run_job(source, alphabet, inputs, output: Path, settings: Settings, overwrite: bool) -> Result:
    num_jobs, job_index = settings.num_jobs, settings.job_index
    prefix = f"{source.name}-j{job_index:04d}"
    name = job_manifest_name(job_index, num_jobs)
    output.mkdir(parents=True, exist_ok=True)
    own = [output / name] + sorted(output.glob(f"{prefix}-*.tar"))
    stale = [p for p in own + [output / MANIFEST] if p.exists()]
    if stale and not overwrite:
        raise PrepError(f"output {output} already holds {', '.join(p.name for p in stale)} "
                        "(pass --overwrite to replace this job's files)")
    tmp = output / f".{name}.tmp-{os.getpid()}"
    tmp.mkdir()
    moved: list[Path] = []
    try:
        manifest, seen = _build(source, alphabet, inputs, tmp, prefix, settings)
        for p in stale:  # only this job's files, and the merged manifest they would make stale
            p.unlink(missing_ok=True)
        for s in manifest.shards:
            os.replace(tmp / s.path, output / s.path)
            moved.append(output / s.path)
        doc = manifest.to_json() | {"job": {"index": job_index, "count": num_jobs}}
        (tmp / name).write_text(json.dumps(doc, indent=1) + "\n")
        os.replace(tmp / name, output / name)
    except BaseException:
        for p in moved:
            p.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
    for i, d in enumerate(docs):
        for field in ("format", "source", "tokenizer"):
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
    inputs = [{"path": x["path"], "records": sum(d["inputs"][k]["records"] for d in docs)}
              for k, x in enumerate(first["inputs"])]
    manifest = Manifest(source=first["source"], tokenizer=first["tokenizer"], shards=shards, filtered=filtered,
                        inputs=inputs)
    return Result(manifest, sum(x["records"] for x in inputs), write_manifest(output, manifest))
