"""launchers/slurm/data_prep.sbatch and data_prep_merge.sbatch, run by bash with the variables SLURM gives an array's
tasks (no scheduler): the tasks of a 3-task array and then the merge give the records and counts of one data_prep
job, a missing task fails the merge, a rerun of that task alone completes it, and a script run outside the array
it expects is refused in one line."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SAMPLE_FASTA
from pipeline.data.shard_reader import read_shard
from pipeline.data.shards import load_manifest

ARRAY = REPO / "launchers" / "slurm" / "data_prep.sbatch"
MERGE = REPO / "launchers" / "slurm" / "data_prep_merge.sbatch"
N = 3
# The command of the documentation's example, small: 2107 records into shards of 300.
PREP = ["rnacentral", "--input", str(SAMPLE_FASTA), "--shard-size", "300"]


def slurm_env(**slurm) -> dict:
    """This environment without any SLURM_ variable of the machine running the tests, plus ``slurm`` (SLURM_ prefix
    left out), the interpreter running the tests, and the repository as the submit directory."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "DATA_PREP_NUM_JOBS"}
    env.update({f"SLURM_{k}": str(v) for k, v in slurm.items()}, PYTHON=sys.executable, SLURM_SUBMIT_DIR=str(REPO))
    return env


def task_env(index: int, tasks=range(N), **extra) -> dict:
    """What an array task sees: task ``index`` of an array of the indices ``tasks``; ``extra``: SLURM_ variables
    to override (SLURM prefix left out), and DATA_PREP_NUM_JOBS."""
    env = slurm_env(**{**dict(JOB_ID=5000 + index, ARRAY_JOB_ID=4999, ARRAY_TASK_ID=index, ARRAY_TASK_COUNT=len(tasks),
                               ARRAY_TASK_MIN=min(tasks), ARRAY_TASK_MAX=max(tasks), ARRAY_TASK_STEP=1),
                            **{k: v for k, v in extra.items() if k != "DATA_PREP_NUM_JOBS"}})
    if "DATA_PREP_NUM_JOBS" in extra:
        env["DATA_PREP_NUM_JOBS"] = str(extra["DATA_PREP_NUM_JOBS"])
    return env


def run_tasks(output: Path, envs: list[dict], prep: list = PREP) -> list[subprocess.CompletedProcess]:
    """The array's tasks at once, as SLURM would start them, each `bash data_prep.sbatch <the command>`."""
    cmd = ["bash", str(ARRAY), *prep, "--output", str(output)]
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for env in envs]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    return out


def merge(output: Path, **slurm) -> subprocess.CompletedProcess:
    """The dependent job: bash data_prep_merge.sbatch --output DIR in a plain (non-array) job."""
    return subprocess.run(["bash", str(MERGE), "--output", str(output)], cwd=REPO,
                          env=slurm_env(JOB_ID=6000, **slurm), capture_output=True, text=True, timeout=300)


def records(directory: Path) -> dict[str, tuple[bytes, dict]]:
    """key (the record's global index) -> (tokens, meta) over the shards the manifest lists."""
    out = {}
    for s in load_manifest(directory).shards:
        for key, tokens, meta in read_shard(directory / s.path, s.samples):
            assert key not in out
            out[key] = (tokens.tobytes(), meta)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-job output (`python -m data_prep` itself) and the output of the array's 3 tasks, not merged."""
    root = tmp_path_factory.mktemp("slurm_data_prep")
    one = subprocess.Popen([sys.executable, "-m", "data_prep", *PREP, "--output", str(root / "one")], cwd=REPO,
                           env=slurm_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tasks = run_tasks(root / "array", [task_env(i) for i in range(N)])
    _, stderr = one.communicate(timeout=300)
    assert one.returncode == 0, stderr
    return root, tasks


def test_scripts_parse():
    for script in (ARRAY, MERGE):
        subprocess.run(["bash", "-n", str(script)], check=True)


def assert_one_job_output(merged: Path, one: Path):
    assert records(merged) == records(one)  # every record, its tokens and meta, under the same key
    m, o = load_manifest(merged), load_manifest(one)
    assert (m.total_samples, m.total_tokens, m.filtered) == (o.total_samples, o.total_tokens, o.filtered)
    assert [(i["records"], i["kept"]) for i in m.inputs] == [(i["records"], i["kept"]) for i in o.inputs]
    assert (m.source, m.tokenizer, m.layout) == (o.source, o.tokenizer, o.layout)


def test_array_then_merge_is_one_job(runs, tmp_path):
    root, tasks = runs
    for i, t in enumerate(tasks):
        assert t.returncode == 0, t.stderr
        assert f"array job 4999 task {i}: data_prep job {i} of {N}" in t.stdout
        assert f"data_prep rnacentral job {i}/{N}: records read" in t.stdout
    out = tmp_path / "array"
    shutil.copytree(root / "array", out)
    assert sorted(p.name for p in out.glob("manifest*.json")) == [f"manifest-job{i:04d}-of-{N:04d}.json"
                                                                   for i in range(N)]
    p = merge(out)
    assert p.returncode == 0, p.stderr
    assert "data_prep rnacentral merge: records read 2107, written 2107" in p.stdout
    assert_one_job_output(out, root / "one")


def test_array_on_plain_fasta_reads_a_byte_range_per_task(runs, tmp_path):
    """The same records decompressed: each task parses about a third of the bytes (data_prep/ranges.py
    byte_ranges), and the array then the merge still give the one-job output."""
    import gzip

    from data_prep.ranges import byte_ranges

    root, _ = runs
    plain = tmp_path / "rfam.fa"
    plain.write_bytes(gzip.decompress(SAMPLE_FASTA.read_bytes()))
    shares = [sum(r.hi - r.lo for r in byte_ranges([plain], N, i)) for i in range(N)]
    assert sum(shares) == plain.stat().st_size and max(shares) < 0.45 * plain.stat().st_size
    prep = ["rnacentral", "--input", str(plain), "--shard-size", "300"]
    for t in run_tasks(tmp_path / "array", [task_env(i) for i in range(N)], prep):
        assert t.returncode == 0, t.stderr
    p = merge(tmp_path / "array")
    assert p.returncode == 0, p.stderr
    assert_one_job_output(tmp_path / "array", root / "one")


def test_missing_task_fails_the_merge_and_its_rerun_completes_it(runs, tmp_path):
    root, _ = runs
    out = tmp_path / "array"
    shutil.copytree(root / "array", out)
    gone = [*out.glob("rnacentral-j0001-*.tar"), *out.glob(f"*-job0001-of-{N:04d}.*")]
    assert gone
    for p in gone:  # task 1 never ran: none of its shards, no job manifest
        p.unlink()
    p = merge(out)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines() == [f"data_prep: error: {out}: job 1 of {N} has not finished "
                                             f"(manifest-job0001-of-{N:04d}.json missing)"]
    assert not (out / "manifest.json").exists()
    # The documented rerun: DATA_PREP_NUM_JOBS=3 sbatch --array=1 ... (the array alone would say 1 job)
    [rerun] = run_tasks(out, [task_env(1, tasks=[1], DATA_PREP_NUM_JOBS=N)])
    assert rerun.returncode == 0, rerun.stderr
    assert f"task 1: data_prep job 1 of {N}" in rerun.stdout
    p = merge(out)
    assert p.returncode == 0, p.stderr
    assert_one_job_output(out, root / "one")


REFUSED = {
    "not an array": (slurm_env(JOB_ID=7), [], "not a job array task (no SLURM_ARRAY_TASK_ID)"),
    "array from 1": (task_env(1, tasks=[1, 2]), [], "the array (2 tasks, 1-2, step 1) is not 0-(N-1) without gaps"),
    "array with a step": (task_env(0, tasks=[0, 6], ARRAY_TASK_COUNT=4, ARRAY_TASK_STEP=2), [],
                          "the array (4 tasks, 0-6, step 2) is not 0-(N-1) without gaps"),
    "array with gaps": (task_env(0, tasks=[0, 5], ARRAY_TASK_COUNT=3), [], "(3 tasks, 0-5, step 1) is not 0-(N-1)"),
    "--num-jobs by hand": (task_env(0), ["--num-jobs", "3"], "--num-jobs: the array sets --num-jobs and --job-index"),
    "--job-index= by hand": (task_env(0), ["--job-index=0"], "--job-index=0: the array sets --num-jobs"),
    "abbreviated --num-jobs": (task_env(0), ["--num", "3"], "--num: the array sets --num-jobs"),
    "a task past DATA_PREP_NUM_JOBS": (task_env(2, DATA_PREP_NUM_JOBS=2), [],
                                       "array task 2 is not a job of DATA_PREP_NUM_JOBS=2 (0-1)"),
}


@pytest.mark.parametrize("case", REFUSED, ids=list(REFUSED))
def test_array_script_refuses(case, tmp_path):
    """One line, exit 2, before data_prep starts: nothing is written."""
    env, extra, message = REFUSED[case]
    p = subprocess.run(["bash", str(ARRAY), *PREP, "--output", str(tmp_path / "out"), *extra], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    [line] = p.stderr.strip().splitlines()
    assert line.startswith("data_prep.sbatch: error: ") and message in line, line
    assert not (tmp_path / "out").exists() and not p.stdout


def test_merge_is_not_an_array_task(tmp_path):
    p = subprocess.run(["bash", str(ARRAY), "merge", "--output", str(tmp_path)], cwd=REPO, env=task_env(0),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "merge runs once, after the array" in p.stderr
    p = merge(tmp_path, ARRAY_TASK_ID=0, ARRAY_TASK_MIN=0, ARRAY_TASK_MAX=1)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "the merge runs once, not as an array" in p.stderr
