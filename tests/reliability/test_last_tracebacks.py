"""Issue 49 case 5: tracebacks instead of one line. An ownership marker whose file list holds an object (TypeError);
a checkpoint directory reached through a symbolic link (OSError: Cannot call rmtree on a symbolic link, at the next
save); a manifest with a negative, huge or wrongly typed sample count (ValueError, a MemoryError allocating 6.94
EiB, TypeError): a manifest is now checked against a schema before anything is allocated; a deeply nested JSON
Lines record (RecursionError); a killed DataLoader worker (a torch traceback 4.1 s later): now one line naming the
worker and the shard it was reading, after the step is finished and checkpointed, and a non-zero exit.

Each case: one error line naming the file or key, a non-zero exit, no traceback (bad_input.py)."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bad_input import REPO, assert_one_line_error, run_cli
from conftest import TINY, launch_env, pretrain_cmd, read_jsonl, run_single


def test_a_marker_whose_file_list_holds_an_object_is_no_marker(tmp_path):
    out = tmp_path / "esm"
    first = run_cli(["tools/make_random_esm2.py", "--out", out])
    assert first.returncode == 0, first.stderr
    (out / ".written-by.json").write_text(json.dumps({"tool": "make_random_esm2.py", "files": [{"x": 1}]}))
    before = sorted(p.name for p in out.iterdir())
    r = run_cli(["tools/make_random_esm2.py", "--out", out, "--force"])
    assert_one_line_error(r, out, "was not written by make_random_esm2.py")
    assert sorted(p.name for p in out.iterdir()) == before


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("shards") / "rfam"
    r = run_cli(["-m", "data_prep", "rnacentral", "--input", REPO / "data" / "samples" /
                 "rfam_nrc_heldout_sample.fasta.gz", "--output", out, "--shard-size", "50", "--progress", "off"])
    assert r.returncode == 0, r.stderr
    return out


def dry_run(shard_dir, run_dir, *extra):
    return run_cli(["launchers/pretrain.py", "--ds_config", "ds_configs/zero2.json", "--dry-run",
                    *[a for o in [*TINY, f"data.train_shards={shard_dir}", f"run_dir={run_dir}", *extra]
                      for a in ("--set", o)]])


@pytest.mark.parametrize("value, want", [(-5, "shards[1].samples -5, expected an integer >= 0"),
                                         (2 ** 62, "shards[1].samples 4611686018427387904 is more than shard"),
                                         ("12", 'shards[1].samples "12", expected an integer >= 0'),
                                         (12.0, "shards[1].samples 12.0, expected an integer >= 0"),
                                         (True, "shards[1].samples true, expected an integer >= 0")],
                         ids=["negative", "huge", "string", "float", "bool"])
def test_a_manifest_with_a_bad_sample_count_is_one_line(shards, tmp_path, value, want):
    bad = tmp_path / "shards"
    shutil.copytree(shards, bad)
    manifest = json.loads((bad / "manifest.json").read_text())
    manifest["shards"][1]["samples"] = value
    (bad / "manifest.json").write_text(json.dumps(manifest))
    r = dry_run(bad, tmp_path / "run")
    assert_one_line_error(r, bad / "manifest.json", want)


def test_a_manifest_that_is_not_one_is_one_line(shards, tmp_path):
    for name, doc, want in [("list", [], "expected a JSON object, got list"),
                            ("unknown_key", {"shards": [{"path": "a", "samples": 1, "tokens": 1, "sha256": "0" * 64,
                                                         "size": 3}]}, "shards[0] has the unknown key 'size'"),
                            ("nested", None, "JSON nested too deeply")]:
        bad = tmp_path / name
        shutil.copytree(shards, bad)
        manifest = json.loads((bad / "manifest.json").read_text())
        text = "[" * 100_000 + "]" * 100_000 if doc is None else json.dumps(
            doc if isinstance(doc, list) else {**manifest, **doc})
        (bad / "manifest.json").write_text(text)
        assert_one_line_error(dry_run(bad, tmp_path / "run"), bad / "manifest.json", want)


def test_a_deeply_nested_json_lines_record_is_one_line(tmp_path):
    jsonl = tmp_path / "og2.jsonl"
    jsonl.write_text('{"text": "ACGTACGTACGT"}\n' + '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    r = run_cli(["-m", "data_prep", "opengenome2", "--input", jsonl, "--output", tmp_path / "out"])
    assert_one_line_error(r, f"{jsonl}:2:", "JSON nested too deeply")
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_directory_reached_through_a_link_is_refused_before_anything_starts(shards, tmp_path):
    """The checkpoints of a run are written, rotated and deleted inside its run_dir only (docs/checkpoints.md): a
    run whose checkpoints/ is a link elsewhere is refused in one line instead of writing there."""
    run = tmp_path / "run"
    (tmp_path / "elsewhere").mkdir()
    run.mkdir()
    (run / "checkpoints").symlink_to(tmp_path / "elsewhere")
    assert_one_line_error(dry_run(shards, run), run / "checkpoints", "a symbolic link (to ",
                          "never through a link")


@pytest.mark.slow  # a DeepSpeed training launch
def test_a_checkpoint_that_is_a_link_never_reaches_the_save(sample_shards, short_run, tmp_path):
    """The traceback at the next save: a checkpoint tag that is a link (here step 4, set aside by a link to a copy,
    latest back at step 2) was rmtree'd when the resumed run saved step 4 again."""
    ckpts = short_run / "checkpoints"
    shutil.move(ckpts / "step00000004", tmp_path / "step4")
    (ckpts / "step00000004").symlink_to(tmp_path / "step4")
    (ckpts / "latest").write_text("step00000002")
    r = run_single("ds_configs/zero2.json", [*TINY, f"data.train_shards={sample_shards}", f"run_dir={short_run}",
                                             "train.max_steps=4", "checkpoint.every_steps=2"], timeout=300)
    assert_one_line_error(r, ckpts / "step00000004", "a symbolic link (to ")
    assert (tmp_path / "step4" / "COMPLETE").is_file()  # what the link points to is untouched


@pytest.mark.slow  # a DeepSpeed training launch with two loader workers
def test_a_killed_loader_worker_is_one_line_after_a_checkpoint(sample_shards, tmp_path):
    run = tmp_path / "run"
    cmd = pretrain_cmd("ds_configs/zero2.json", [*TINY, f"data.train_shards={sample_shards}", f"run_dir={run}",
                                                 "train.max_steps=100000", "checkpoint.every_steps=100000",
                                                 "data.num_workers=2", "tracking.enabled=false"])
    proc = subprocess.Popen(cmd, cwd=REPO, env=launch_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not ((run / "metrics.jsonl").is_file() and len(read_jsonl(run / "metrics.jsonl")) >= 3):
            assert proc.poll() is None and time.time() < deadline, proc.communicate()
            time.sleep(0.1)
        me = psutil.Process(proc.pid)
        workers = [c for c in me.children() if c.cmdline() == me.cmdline()]  # the DataLoader's forks
        assert len(workers) == 2, [c.cmdline() for c in me.children()]
        killed_at = read_jsonl(run / "metrics.jsonl")[-1]["step"]
        os.kill(workers[1].pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = out + err
    assert proc.returncode == 1 and "Traceback" not in text, text[-3000:]
    errors = [ln for ln in err.splitlines() if "error:" in ln[:40]]
    assert len(errors) == 1, err[-3000:]
    step = read_jsonl(run / "metrics.jsonl")[-1]["step"]
    tag = f"step{step:08d}"
    assert step > killed_at and (run / "checkpoints" / "latest").read_text() == tag
    assert (run / "checkpoints" / tag / "COMPLETE").is_file()
    line = errors[0]
    assert f"data loader worker 1 of rank 0 (pid {workers[1].pid}) was killed by SIGKILL while reading " in line
    assert f"{sample_shards}/" in line and ".tar" in line and f"checkpoint {tag}" in line, line
