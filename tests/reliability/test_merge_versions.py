"""Campaign case 3: job manifests recorded only the input's path, so two array jobs that read different versions of
the file merged with exit 0 (1,114 records: half of each file). Now each job records the input's size and a sampled
sha256, and merge refuses jobs that read different versions, in one line naming the job and the file, writing
nothing."""
import gzip
import hashlib
import subprocess
import sys

from conftest import REPO, SAMPLE_FASTA


def data_prep(*args):
    return subprocess.run([sys.executable, "-m", "data_prep", *map(str, args)], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_merge_refuses_jobs_that_read_different_versions_of_an_input(tmp_path):
    records = gzip.open(SAMPLE_FASTA, "rt").read().split(">")[1:]
    fasta, out = tmp_path / "rna.fasta", tmp_path / "shards"
    fasta.write_text("".join(">" + r for r in records))
    job = ("rnacentral", "--input", fasta, "--output", out, "--num-jobs", 2)
    r = data_prep(*job, "--job-index", 0)
    assert r.returncode == 0, r.stderr
    fasta.write_text("".join(">" + r for r in records[: len(records) // 2]))  # the file replaced between the jobs
    r = data_prep(*job, "--job-index", 1)
    assert r.returncode == 0, r.stderr
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()}

    r = data_prep("merge", "--output", out)
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert f"manifest-job0001-of-0002.json: read another version of {fasta} than job 0 did (" in line, line
    assert "the file changed between the jobs" in line
    assert {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in out.iterdir()} == before
    assert not (out / "manifest.json").exists()
