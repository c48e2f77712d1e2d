"""``run``: one data_prep job writing a shard directory (one job, or job I of N of an array that ``merge``,
data_prep/merge.py, combines), from the checks of its arguments to the finished output.

Nothing half-written is ever visible: a single job builds ``DIR.partial`` and renames it to ``DIR``; job I of N
shares ``DIR`` with the other jobs, so it builds in a hidden ``DIR/.jobIIII-of-NNNN.partial/`` and moves its shards
into ``DIR`` at the end, its job manifest last (the manifest is what marks the job as finished). The work directory
is resumable (``WorkDir``, data_prep/workdir.py): each shard is renamed into place when whole and listed with its
sha256 in ``progress.jsonl``; a rerun verifies them and continues after the last intact one.

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

import json
import os
import shutil
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.data.tokenizer import SPM_NAME
from pipeline.outputs import kept_note, publish_dir

from .build import build_sequences
from .batch import splits_bytes
from .checks import PrepError
from .clusters import build_clusters
from .clusters import load_clusters
from .common import (FILTERED, MANIFEST, SPLIT_FILE, SPLITS, TOOL, check_output_replaceable, job_filtered_name,
                     job_manifest_name, manifest_files, output_lock, split_doc, write_json)
from .encode import Encoder
from .fasta import FastaError
from .join import Spill
from .scan import Scans, scan_folder, scan_stage
from .settings import Job, Launch, Result, Settings, check_settings, record_options
from .sources import check_text_inputs, load_members
from .workdir import WorkDir, fingerprint, open_splits

if TYPE_CHECKING:
    from pipeline.data.shards import Manifest


def run(job: Job, launch: Launch = Launch()) -> Result:
    """One data_prep job (``Job``: what it reads and writes; ``Launch``: how it runs), its arguments checked before
    anything is written."""
    inputs = [Path(p).resolve() for p in job.inputs]
    if job.source.expand is not None:
        inputs = job.source.expand(inputs)
    for p in inputs:
        if not p.is_file():
            raise PrepError(f"input {p} does not exist or is not a file")
        if p.stat().st_size == 0:
            raise PrepError(f"input {p} is empty")
    if len(set(inputs)) != len(inputs):
        raise PrepError("an input file is given twice")
    output = Path(job.output).resolve()
    if output.exists() and not output.is_dir():
        raise PrepError(f"output {output} exists and is not a directory")
    for p in output.parents:
        if p.exists() and not p.is_dir():
            raise PrepError(f"output {output}: {p} exists and is not a directory")
    if output in inputs or any(output in p.parents for p in inputs):
        raise PrepError(f"output {output} would hold an input; choose another directory")
    job = replace(job, inputs=tuple(inputs), output=output)
    if not launch.locked:
        return _run(job, launch)
    s = job.settings
    made = [p for p in reversed(output.parents) if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)  # where the lock lives
    what = f"data_prep {job.source.name}" + (f" job {s.job_index} of {s.num_jobs}" if s.num_jobs > 1 else "")
    try:
        with output_lock(output, what, shared=s.num_jobs > 1):
            return _run(job, launch)
    except BaseException:
        for p in reversed(made):  # folders this run made, innermost first, where it left nothing (rmdir: empty only)
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _run(job: Job, launch: Launch) -> Result:
    """``run`` once the arguments are checked (and the output locked)."""
    source, inputs, output, progress = job.source, list(job.inputs), job.output, launch.progress
    members, clusters, text_column = job.members, job.clusters, job.text_column
    if source.tokenizer == "sentencepiece":
        check_text_inputs(inputs, text_column)
    elif text_column is not None:
        raise PrepError(f"--text-column applies to babylm (.csv text), not to {source.name}")
    encoder = Encoder(source, job.alphabet, job.spm)
    settings = check_settings(source, encoder, job.settings)
    spill = scans = None
    if settings.stage is not None and clusters is None:
        raise PrepError(f"--stage {settings.stage} is a stage of a --clusters array (scan the member FASTA, then "
                        "build the clusters); without --clusters a job has one stage")
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
        if settings.stage == "scan":  # the FASTA share of this job, no TSV (data_prep/scan.py)
            marker, path = scan_stage(encoder, inputs, output, settings, job.overwrite, source, progress)
            return Result(None, sum(x["records"] for x in marker["inputs"]), path)
        # Parsed and checked whole before any output exists: a bad TSV leaves nothing behind. The spill (the
        # tables and DuckDB's files of join.py, under $TMPDIR) is removed however the job ends. A thread (--workers:
        # a pool) scans the member FASTA into it meanwhile, unless the array's scan stage did (--stage build).
        spill = Spill()
        try:
            scans = Scans(encoder, inputs, settings, source, spill.path, launch.workers, progress) \
                if settings.stage is None else None
            cmap = load_clusters(clusters, spill, settings.num_jobs, settings.job_index, progress)
        except BaseException:
            if scans is not None:
                scans.close()
            spill.remove()
            raise

        def fill(work: WorkDir):
            scanned = scans.wait() if scans is not None else scan_folder(output, settings)
            return build_clusters(encoder, inputs, cmap, settings, open_splits(work, settings, encoder, "clusters"),
                                  scanned, source, progress)
        work_fingerprint = fingerprint(source, encoder, inputs, settings, None, clusters)
    else:
        member_map = None
        if members is not None:
            members = Path(members).resolve()
            if not members.is_file():
                raise PrepError(f"--uniref90-members {members} does not exist or is not a file")
            member_map = load_members(members)

        def fill(work: WorkDir):
            manifests, seen = build_sequences(source, encoder, inputs, work, settings, member_map, progress,
                                              text_column, launch.workers)
            if member_map is not None and not any(m.stats["input"].get("with_members") for m in manifests.values()):
                first = next(iter(member_map))
                raise PrepError(f"--uniref90-members {members}: none of its {len(member_map)} UniRef50 ids is a "
                                f"record id of the inputs (first id {first!r}); is it the members file of these "
                                "inputs?")
            return manifests, seen
        work_fingerprint = fingerprint(source, encoder, inputs, settings, members)
        if splits_bytes(source, inputs, settings, members):
            work_fingerprint["split"] = "bytes"  # other records than job I of N by record index: never mixed
    splits = SPLITS if settings.val_fraction is not None else ("",)
    try:
        if settings.num_jobs == 1:
            return _run_single(source, encoder, output, job.overwrite, fill, work_fingerprint, splits, settings)
        options = record_options(settings, text_column, members, clusters)
        return _run_job(source, encoder, output, settings, job.overwrite, fill, work_fingerprint, splits, options)
    finally:
        if scans is not None:
            scans.close()
        if spill is not None:
            spill.remove()


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


def _run_single(source, encoder, output: Path, overwrite: bool, fill, fingerprint: dict, splits: tuple = ("",),
                settings: Settings = Settings()) -> Result:
    check_output_replaceable(output, overwrite)
    made = [p for p in reversed(output.parents) if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    fresh = not output.with_name(f"{output.name}.partial").exists()
    work = WorkDir(output.with_name(f"{output.name}.partial"), {**fingerprint, "prefix": source.name}, source.name,
                   splits)
    tmp = work.path
    try:
        manifests, seen = fill(work)
        for name, manifest in manifests.items():
            if not manifest.shards:
                raise _no_samples(manifest, seen, name, settings)
        # loaded by now (the build wrote shards); imported here so that this module stays free of torch
        from pipeline.data.shards import write_manifest
        for name, manifest in manifests.items():
            _copy_model(encoder, work.directory(name))
            write_manifest(work.directory(name), manifest)
        if splits != ("",):
            write_json(tmp / SPLIT_FILE, split_doc(manifests, settings.val_fraction, source.name))
        work.finish()  # only now: a failed manifest write leaves the resumable work directory intact
        kept = publish_dir(tmp, output, TOOL, manifest_files)  # marked as data_prep's; what it did not write is kept
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
    if kept:
        print(kept_note(kept, TOOL), file=sys.stderr)
    if splits == ("",):
        return Result(manifests[""], seen, output / MANIFEST)
    located = {k: (m, output / k / MANIFEST) for k, m in manifests.items()}
    return Result(manifests["train"], seen, output / "train" / MANIFEST, located, settings.val_fraction)


def _run_job(source, encoder, output: Path, settings: Settings, overwrite: bool, fill, fingerprint: dict,
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
        manifests, seen = fill(work)
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
