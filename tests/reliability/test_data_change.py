"""Campaign case 2: after ``data_prep --overwrite`` rebuilt the shard directory (6 shards instead of 4), the same
training command resumed and trained on without a note: the loader position of one data set was applied to another.
Now the checkpoint records the digest of each source's manifest.json, and a resume on other data is refused in one
line naming the manifest and both shard counts, unless --allow-data-change, which starts the new data from its
beginning and says so."""
import subprocess
import sys

import pytest

from conftest import REPO, SAMPLE_FASTA, TINY, pretrain_cmd, read_jsonl, run_single, running_until

pytestmark = pytest.mark.slow  # DeepSpeed training launches


def prep(out, shard_size, *extra):
    subprocess.run([sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE_FASTA), "--output",
                    str(out), "--shard-size", str(shard_size), *extra], cwd=REPO, check=True, capture_output=True)


def train(shards, run_dir, steps, *extra):
    return run_single("ds_configs/zero2.json", TINY + [
        f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", "checkpoint.every_steps=2"],
        list(extra), timeout=300)


def test_resume_on_rebuilt_data_is_refused_unless_allowed(tmp_path):
    shards, run = tmp_path / "shards", tmp_path / "run"
    prep(shards, 400)
    first = train(shards, run, 4)
    assert first.returncode == 0, first.stderr[-3000:]
    before = {p.name: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()}
    prep(shards, 250, "--overwrite")  # the same directory, rebuilt with more shards

    r = train(shards, run, 6)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    (line,) = [ln for ln in r.stderr.splitlines() if "error:" in ln]
    assert (f"data.train_shards: {shards / 'manifest.json'} is not the data checkpoint "
            f"{run / 'checkpoints' / 'step00000004'} trained on (") in line and "--allow-data-change" in line, line
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4]
    assert {p.name: p.read_bytes() for p in (run / "checkpoints").rglob("*") if p.is_file()} == before

    r = train(shards, run, 6, "--allow-data-change")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "--allow-data-change: the loader starts this data from its beginning" in r.stdout, r.stdout[-3000:]
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    # the new checkpoint records the new data: the same command resumes from it without the flag
    r = train(shards, run, 8)
    assert r.returncode == 0 and "is not the data" not in r.stdout + r.stderr, r.stderr[-3000:]


def test_shards_rewritten_during_training_are_named_as_such(tmp_path):
    """Campaign case: ``data_prep --overwrite`` over the shards of a running training was reported as a "truncated
    shard?". The run now names the rebuilt directory and the ways on, in one line."""
    shards, run = tmp_path / "shards", tmp_path / "run"
    prep(shards, 100)
    cmd = pretrain_cmd("ds_configs/zero2.json", TINY + [
        f"data.train_shards={shards}", f"run_dir={run}", "train.max_steps=2000", "data.mix_shards=1",
        "checkpoint.every_steps=1000", "tracking.enabled=false"])
    with running_until(cmd, r"step 2/") as (proc, lines, reader):
        prep(shards, 150, "--overwrite")  # 15 shards where there were 22: the next shard the run reads is another's
        assert proc.wait(240) == 2, "".join(lines[-40:])
        reader.join(30)
    out = "".join(lines)
    assert "Traceback" not in out and "truncated" not in out, out[-3000:]
    (line,) = [ln for ln in lines if "error:" in ln]
    assert line.rstrip().endswith(
        f"error: {shards}: the shard directory was rewritten while this run read it (its manifest.json changed since "
        "the run started). The loader's position means nothing in other data: restore the data, or resume with "
        "--allow-data-change to read the new data from its beginning"), line
