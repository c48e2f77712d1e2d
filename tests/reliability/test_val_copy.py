"""Issue 49 case 6: a byte-identical copy of the training shards given as validation set gave no warning (only the
same path did). The run plan compares the manifests' content digests (each shard's sha256), not the paths: the
training and the dry run say, in one warning line, how many validation shards are training shards."""
from __future__ import annotations

import json
import shutil

from bad_input import REPO, run_cli
from conftest import TINY


def dry_run(shards, val, run_dir):
    return run_cli(["launchers/pretrain.py", "--ds_config", "ds_configs/zero2.json", "--dry-run",
                    *[a for o in [*TINY, f"data.train_shards={shards}", f"data.val_shards=[{val}]", "eval.every=2",
                                  f"run_dir={run_dir}"] for a in ("--set", o)]])


def warnings(r) -> list[str]:
    return [ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("warning: data.val_shards")]


def test_a_copy_of_the_training_shards_as_validation_is_said(tmp_path):
    train = tmp_path / "train"
    r = run_cli(["-m", "data_prep", "rnacentral", "--input", REPO / "data" / "samples" /
                 "rfam_nrc_heldout_sample.fasta.gz", "--output", train, "--shard-size", "50", "--progress", "off"])
    assert r.returncode == 0, r.stderr
    copy = tmp_path / "copy"
    shutil.copytree(train, copy)
    r = dry_run(train, copy, tmp_path / "run")
    assert r.returncode == 0, r.stderr
    assert warnings(r) == [f"warning: data.val_shards: 5 of the 5 shards of {copy} are shards of data.train_shards "
                           f"({train}) byte for byte (the same sha256 in both manifests, e.g. "
                           "rnacentral-000000.tar): validation would measure training data, not held-out data"], \
        r.stdout[-3000:]

    # one shard of the copy replaced by another data set's: still said, for the three that are the training's
    other = tmp_path / "other"
    r = run_cli(["-m", "data_prep", "rnacentral", "--input", REPO / "data" / "samples" /
                 "rfam_nrc_train_sample.fasta.gz", "--output", other, "--shard-size", "50", "--progress", "off"])
    manifest = json.loads((copy / "manifest.json").read_text())
    theirs = json.loads((other / "manifest.json").read_text())["shards"][0]
    shutil.copy(other / theirs["path"], copy / manifest["shards"][0]["path"])
    manifest["shards"][0] = {**theirs, "path": manifest["shards"][0]["path"]}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    r = dry_run(train, copy, tmp_path / "run")
    assert [w.split(" shards of ")[0] for w in warnings(r)] == ["warning: data.val_shards: 4 of the 5"], r.stdout[-3000:]

    # held-out data: no warning
    r = dry_run(train, other, tmp_path / "run")
    assert r.returncode == 0 and warnings(r) == [], r.stdout[-3000:]
