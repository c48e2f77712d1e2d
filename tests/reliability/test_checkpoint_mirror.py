"""checkpoint.mirror (pipeline/checkpoint/mirror.py, docs/checkpoints.md "A mirror in object storage") against the
loopback S3 server (tests/conftest.py):

- the upload order: every checkpoint prefix of the mirror holds its SHA256SUMS from its first object on, COMPLETE
  comes after every file and ``latest`` after COMPLETE; the mirror's rotation keeps the local rules (keep_last, the
  milestones, ``latest``), and deletes a checkpoint's COMPLETE before its files;
- a restore takes the newest complete mirrored checkpoint whose digests hold, and falls back past a damaged one;
- an upload that keeps failing is retried, then one warning line, and the next one goes on (and rotation clears the
  failed one's leftovers);
- a real 2-rank training with the mirror, its run directory deleted after step 4, resumed in another directory from
  the mirror: the uninterrupted run's losses, bit for bit (slow).
"""
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import TINY, losses, run_torchrun

from pipeline.checkpoint.layout import CHECKPOINT_FORMAT, COMPLETE, DIGESTS, LATEST, mark_complete, write_atomic
from pipeline.checkpoint.mirror import Mirror, restore
from pipeline.config import load_config
from pipeline.errors import ConfigError


def config(url: str, keep_last: int = 2, retries: int = 2):
    return SimpleNamespace(checkpoint=SimpleNamespace(mirror=url, keep_last=keep_last),
                           data=SimpleNamespace(fetch_retries=retries, fetch_backoff_s=0.01))


def fake_checkpoint(run_dir: Path, step: int, milestone: bool = False) -> Path:
    """A complete checkpoint as the Checkpointer leaves it (client state, a nested file, digests, COMPLETE,
    latest); its weights are bytes, not a torch archive (nothing here loads them)."""
    tag_dir = run_dir / "checkpoints" / f"step{step:08d}"
    (tag_dir / "zero").mkdir(parents=True)
    (tag_dir / "client_state.json").write_text(json.dumps({"format": CHECKPOINT_FORMAT, "step": step,
                                                           "milestone": milestone}))
    (tag_dir / "weights.bin").write_bytes(os.urandom(4096) + bytes([step]))
    (tag_dir / "zero" / "optim.bin").write_bytes(os.urandom(1024))
    mark_complete(tag_dir)
    write_atomic(run_dir / "checkpoints" / LATEST, tag_dir.name)
    return tag_dir


def objects(server, bucket: str, prefix: str) -> set:
    pages = server.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"][len(prefix):] for page in pages for o in page.get("Contents", [])}


def uploads(log: list, bucket: str, prefix: str) -> list:
    """The object writes and deletes under s3://bucket/prefix, in order: (method, name relative to the prefix)."""
    head = f"/{bucket}/{prefix}"
    return [(m, p[len(head):]) for m, p in log if m in ("PUT", "POST", "DELETE") and p.startswith(head)]


def check_order(events: list):
    """Each checkpoint's first write is its SHA256SUMS and its COMPLETE is written after every other file of it;
    ``latest`` names a checkpoint only after its COMPLETE; a deleted checkpoint loses COMPLETE first."""
    first, completed, deleted = {}, set(), set()
    for method, name in events:
        tag, _, rest = name.partition("/")
        if method == "DELETE":
            assert tag in deleted or rest == COMPLETE, f"{name} deleted before {tag}'s COMPLETE: {events}"
            deleted.add(tag)
        elif name == LATEST:
            continue
        else:
            first.setdefault(tag, rest)
            assert first[tag] == DIGESTS, f"{tag}'s first object is {first[tag]}, not {DIGESTS}: {events}"
            assert tag not in completed, f"{name} written after {tag}'s {COMPLETE}: {events}"
            if rest == COMPLETE:
                completed.add(tag)


def test_the_mirror_is_a_writable_url():
    assert load_config(None, ["checkpoint.mirror=s3://bucket/runs/a"]).checkpoint.mirror == "s3://bucket/runs/a"
    for bad in ("runs/mirror", "https://example.org/runs/a"):  # a path (no scheme); http is read-only in fsspec
        with pytest.raises(ConfigError, match=r"^checkpoint.mirror: a writable fsspec URL"):
            load_config(None, [f"checkpoint.mirror={bad}"])


def test_upload_order_rotation_and_restore_with_a_damaged_newest(s3, tmp_path):
    server, bucket = s3
    url = f"s3://{bucket}/run"
    run = tmp_path / "run"
    lines = []
    mirror = Mirror(config(url, keep_last=2), run, say=lambda *a, **k: lines.append(a[0]))
    for step in (2, 4, 6, 8):
        mirror.submit(fake_checkpoint(run, step, milestone=step == 4))
        mirror.wait()
    assert mirror.uploaded == ["step00000002", "step00000004", "step00000006", "step00000008"], lines
    names = objects(server, bucket, "run/")
    tags = {n.split("/")[0] for n in names if n != LATEST}
    assert tags == {"step00000004", "step00000006", "step00000008"}  # keep_last 2, and the milestone
    for t in tags:  # every file, its digests and its marker
        assert {n for n in names if n.startswith(t + "/")} == {f"{t}/{f}" for f in (
            "client_state.json", "weights.bin", "zero/optim.bin", DIGESTS, COMPLETE)}
    events = uploads(server.faults.log, bucket, "run/")
    check_order(events)
    assert ("DELETE", f"step00000002/{COMPLETE}") in events
    latest_writes = [i for i, e in enumerate(events) if e == ("PUT", LATEST)]
    assert latest_writes and latest_writes[-1] > events.index(("PUT", f"step00000008/{COMPLETE}"))

    # the node is gone: a new run dir takes the newest, byte for byte
    cfg = config(url)
    other = tmp_path / "elsewhere" / "run"
    assert restore(cfg, other, say=lambda *a, **k: lines.append(a[0])) == "step00000008"
    for f in (run / "checkpoints" / "step00000008").rglob("*"):
        if f.is_file():
            assert (other / "checkpoints" / "step00000008" / f.relative_to(run / "checkpoints" / "step00000008")
                    ).read_bytes() == f.read_bytes()
    assert (other / "checkpoints" / LATEST).read_text().strip() == "step00000008"
    assert restore(cfg, other) is None  # a run dir with its own complete checkpoint keeps it

    # bit rot in the mirror's newest: a note naming the file, and the previous one
    server.client().put_object(Bucket=bucket, Key="run/step00000008/weights.bin", Body=b"rotten")
    third, notes = tmp_path / "third", []
    assert restore(cfg, third, say=lambda *a, **k: notes.append(a[0])) == "step00000006"
    assert notes[0].startswith(f"note: checkpoint mirror: {url}/step00000008/weights.bin is damaged"), notes
    assert not list((third / "checkpoints").glob(".mirror-*")), "a rejected download is left behind"

    # a mirror that holds only damaged checkpoints: refused in one line, never a fresh start
    for t in ("step00000004", "step00000006"):
        server.client().delete_object(Bucket=bucket, Key=f"run/{t}/{DIGESTS}")
    with pytest.raises(ConfigError, match="every complete checkpoint in .* is damaged"):
        restore(cfg, tmp_path / "fourth", say=lambda *a, **k: None)


def test_a_failing_upload_is_retried_then_one_line_and_the_next_goes_on(s3, tmp_path):
    server, bucket = s3
    url = f"s3://{bucket}/run"
    run, lines = tmp_path / "run", []
    mirror = Mirror(config(url, keep_last=1, retries=2), run, say=lambda *a, **k: lines.append(a[0]))
    server.faults.fail(2, 503, match="/run/step00000002/weights")  # two 503s: retried, uploaded
    mirror.submit(fake_checkpoint(run, 2))
    mirror.wait()
    server.faults.fail(1000, 503, match="/run/step00000004/weights")  # every try fails
    mirror.submit(fake_checkpoint(run, 4))
    mirror.wait()
    assert mirror.uploaded == ["step00000002"]
    (line,) = mirror.failed
    assert line in lines and "\n" not in line
    assert line.startswith(f"warning: checkpoint mirror: step00000004 was not uploaded to {url} ({url}/step00000004/"
                           "weights.bin: cannot write it after 3 tries: "), line
    assert line.endswith(f"the mirror's {LATEST} still names step00000002; training goes on"), line
    names = objects(server, bucket, "run/")
    assert f"step00000004/{DIGESTS}" in names and f"step00000004/{COMPLETE}" not in names  # never complete
    assert server.client().get_object(Bucket=bucket, Key="run/latest")["Body"].read().strip() == b"step00000002"
    server.faults.reset()
    mirror.submit(fake_checkpoint(run, 6))
    mirror.wait()
    assert mirror.uploaded == ["step00000002", "step00000006"]
    assert {n.split("/")[0] for n in objects(server, bucket, "run/")} == {"step00000006", LATEST}  # leftovers gone
    assert restore(config(url), tmp_path / "new") == "step00000006"


RUN = TINY + ["checkpoint.every_steps=2", "tracking.enabled=false", "data.fetch_backoff_s=0.05",
              "data.fetch_retries=2", "optim.schedule_steps=6"]


@pytest.mark.slow  # three DeepSpeed launches
def test_a_run_whose_directory_is_deleted_resumes_from_the_mirror_to_the_same_losses(s3, sample_shards, tmp_path):
    """Three 2-rank launches: the uninterrupted 6 steps (mirrored too: the first checkpoint's upload fails for
    good, one warning line, exit 0; the last one's is retried through two 503s); 4 steps mirrored (synchronous
    saves), then their run directory deleted; the same
    run continued in another directory from the mirror to step 6."""
    server, bucket = s3
    data = f"data.train_shards={sample_shards}"
    server.faults.fail(1000, 503, match="/whole/step00000002/")  # fails for good
    server.faults.fail(2, 503, match="/whole/step00000006/")  # retried (step 4's upload may be skipped: it was
    # completed while step 2's was retrying, and step 6 came before its turn)
    whole = tmp_path / "whole"
    r = run_torchrun(2, "ds_configs/zero2.json", RUN + [data, f"run_dir={whole}", "train.max_steps=6",
                                                        "checkpoint.keep_last=1", f"checkpoint.mirror=s3://{bucket}/whole"],
                     timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert "Traceback" not in out, out[-3000:]
    failed = [ln for ln in out.splitlines() if "was not uploaded" in ln]
    assert len(failed) == 1 and "step00000002 was not uploaded" in failed[0], out[-3000:]
    assert "cannot write it after 3 tries" in failed[0] and "checkpoint mirror: step00000006 uploaded" in out
    assert {n.split("/")[0] for n in objects(server, bucket, "whole/")} == {"step00000006", LATEST}
    check_order(uploads(server.faults.log, bucket, "whole/"))
    want = losses(whole)
    assert sorted(want) == list(range(1, 7))

    first = tmp_path / "node1" / "run"
    r = run_torchrun(2, "ds_configs/zero2.json", RUN + [data, f"run_dir={first}", "train.max_steps=4",
                                                        "checkpoint.keep_last=2", f"checkpoint.mirror=s3://{bucket}/run",
                                                        "checkpoint.background=false"],  # uploads after sync saves too
                     timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [losses(first)[s] for s in range(1, 5)] == [want[s] for s in range(1, 5)]
    assert {n.split("/")[0] for n in objects(server, bucket, "run/")} == {"step00000002", "step00000004", LATEST}
    shutil.rmtree(first.parent)  # the node is gone

    second = tmp_path / "node2" / "run"
    r = run_torchrun(2, "ds_configs/zero2.json", RUN + [data, f"run_dir={second}", "train.max_steps=6",
                                                        "checkpoint.keep_last=2", f"checkpoint.mirror=s3://{bucket}/run"],
                     timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout + r.stderr
    assert f"restored checkpoint step00000004 from the mirror s3://{bucket}/run" in out, out[-3000:]
    got = losses(second)
    assert sorted(got) == [5, 6] and all(got[s] == want[s] for s in (5, 6)), (got, want)  # bit for bit
    check_order(uploads(server.faults.log, bucket, "run/"))
    assert {n.split("/")[0] for n in objects(server, bucket, "run/")} == {"step00000004", "step00000006", LATEST}
