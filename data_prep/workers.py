"""``--workers N``: one data_prep run on N processes of this machine (a pool of forked processes, data_prep/pool.py).

For the FASTA sources on the batch reader (batch.batch_source) it is one job, this process's: it reads the
inputs and writes the shards in input order while the pool parses the chunks, so the output is a 1-process run's,
byte for byte. With --clusters it is one job too: the pool scans N shares of the member FASTA (data_prep/scan.py)
while this process reads the TSV, then joins and writes (the 1-process output). Otherwise (--dedup, --window,
--uniref90-members, the other sources) the pool runs jobs 0..N-1 of ``--num-jobs N``, each reading every input, and
``merge`` combines them."""
from __future__ import annotations

import shutil
import sys
from concurrent.futures import BrokenExecutor
from dataclasses import replace
from pathlib import Path

from pipeline.outputs import kept_note, publish_dir

from .batch import batch_source
from .checks import PrepError
from .common import TOOL, check_output_replaceable, manifest_files, output_lock
from .fasta import FastaError
from .jobs import run
from .merge import merge
from .pool import processes, state
from .settings import Job, Launch, Result


def run_workers(workers: int, job: Job, launch: Launch = Launch()) -> Result:
    """One data_prep run on ``workers`` processes of this machine (module docstring): one job with a pool, or the
    jobs of an array written into ``DIR.workers-partial``, merged and renamed to ``DIR`` (their shards
    ``SOURCE-jKKKK-*.tar`` and job manifests beside the merged manifest.json). A bad input stops every process and
    leaves nothing (the error a single process meets first); an interrupted run resumes."""
    settings, overwrite = job.settings, job.overwrite
    if settings.num_jobs != 1:
        raise PrepError(f"--workers {workers} runs the jobs of one machine itself: it excludes --num-jobs "
                        f"{settings.num_jobs}")
    if settings.stage is not None:
        raise PrepError(f"--workers {workers} runs both stages of --clusters itself: it excludes --stage "
                        f"{settings.stage}")
    output = Path(job.output).resolve()
    if output.exists() and not output.is_dir():
        raise PrepError(f"output {output} exists and is not a directory")
    check_output_replaceable(output, overwrite)  # refused before anything is made
    made = [p for p in reversed(output.parents) if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        # The output's one lock (common.output_lock), held from before anything is created or removed to the
        # rename: a second run of any mode is refused here and touches nothing of this run's staging directory.
        with output_lock(output, f"data_prep {job.source.name} --workers {workers}"):
            check_output_replaceable(output, overwrite)  # again, under the lock: what another run left meanwhile
            if job.clusters is not None or batch_source(job.source, settings, job.members):
                try:
                    return run(job, replace(launch, workers=workers, locked=False))
                except BrokenExecutor as e:  # a worker killed: DIR.partial is kept for the rerun
                    raise PrepError(f"--workers {workers}: {e}") from None
            return _jobs_then_merge(workers, replace(job, output=output), launch)
    except PrepError:  # a bad input or a refusal: nothing is kept, the folders made for the output included
        for p in reversed(made):
            try:
                p.rmdir()
            except OSError:
                break
        raise


def _job(k: int) -> tuple[int, str]:
    """Job ``k`` of the pool's jobs (``state()``: their arguments), in a worker: (status, its error line). (A worker
    ignores Ctrl-C: the parent stops the pool.)"""
    try:
        run(*state()[k])
    except (PrepError, FastaError, OSError, ValueError) as e:
        return 1, str(e)
    except BaseException as e:  # noqa: BLE001 -- reported by the parent, which owns the output
        return 2, f"{type(e).__name__}: {e}"
    return 0, ""


def _jobs_then_merge(workers: int, job: Job, launch: Launch) -> Result:
    """Jobs 0..N-1 of ``--num-jobs N`` in the pool, each reading every input, then ``merge``."""
    # Imported once here, before the fork, not in every worker: webdataset pulls in torch (~2 s). Not at the top of
    # the module: argument and output-directory mistakes are reported without waiting for it.
    import pipeline.data.shards  # noqa: F401

    output = job.output
    staging = output.with_name(f"{output.name}.workers-partial")
    staging.mkdir(exist_ok=True)
    quiet = replace(launch, progress=("off", launch.progress[1]), locked=False)  # one progress bar: job 0's
    jobs = [(replace(job, output=staging, overwrite=True, settings=replace(job.settings, num_jobs=workers,
                                                                           job_index=k)),
             replace(quiet, progress=launch.progress) if k == 0 else quiet) for k in range(workers)]
    _run_jobs(workers, jobs, staging)
    result = merge(staging)
    kept = publish_dir(staging, output, TOOL, manifest_files)  # marked as data_prep's; others' files carried over
    if kept:
        print(kept_note(kept, TOOL), file=sys.stderr)

    def moved(path: Path) -> Path:
        return output / path.relative_to(staging)
    located = {k: (m, moved(loc)) for k, (m, loc) in result.splits.items()} if result.splits else None
    return Result(result.manifest, result.records_seen, moved(result.location), located, result.val_fraction)


def _run_jobs(workers: int, jobs: list[tuple[Job, Launch]], staging: Path) -> None:
    """The jobs in the pool; a bad input is the lowest job's error: every job read every record and met the same
    first one."""
    with processes(workers, jobs) as pool:
        futures = [pool.submit(_job, k) for k in range(workers)]
        status = []
        for f in futures:
            try:
                status.append(pool.result(f))
            except BrokenExecutor as e:  # a worker ended: the jobs still running are stopped
                pool.stop()
                status += [(3, str(e))] * (workers - len(status))
                break
    bad = [msg for rc, msg in status if rc == 1]
    if bad:  # bad input: a rerun would fail the same way, so nothing is kept
        shutil.rmtree(staging, ignore_errors=True)
        raise PrepError(bad[0])
    failed = [(k, msg) for k, (rc, msg) in enumerate(status) if rc != 0]
    if failed:
        k, msg = failed[0]
        raise PrepError(f"worker {k} of {workers} failed: {msg}")
