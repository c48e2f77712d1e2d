"""Issue 49 case 2: ``data_prep --overwrite`` deleted a user's file (notes.txt) beside the shards when the output's
ownership marker (.written-by.json) was invalid JSON, and in every output written before markers existed (every
shard directory users already have). convert_checkpoint.py refuses unmarked folders; data_prep must be as careful:
without a valid marker it replaces only the files a manifest in that folder names and keeps the rest, with a note.

Real data_prep runs through the command line (tests/reliability/bad_input.py's prewarmed runner)."""
from __future__ import annotations

import json

import pytest

from bad_input import REPO, run_cli

FASTA = REPO / "data" / "samples" / "rfam_nrc_heldout_sample.fasta.gz"


def prep(out, *extra):
    return run_cli(["-m", "data_prep", "rnacentral", "--input", FASTA, "--output", out, "--shard-size", "50",
                    "--progress", "off", *extra])


def unmarked(out):
    (out / ".written-by.json").unlink()  # an output of data_prep from before markers


def invalid_json(out):
    (out / ".written-by.json").write_text('{"tool": "data_prep", "files": [')


def not_a_file_list(out):
    (out / ".written-by.json").write_text(json.dumps({"tool": "data_prep", "files": [{"path": "notes.txt"}]}))


@pytest.mark.parametrize("damage", [unmarked, invalid_json, not_a_file_list], ids=lambda f: f.__name__)
def test_overwrite_without_a_valid_marker_keeps_what_no_manifest_names(tmp_path, damage):
    out = tmp_path / "shards"
    first = prep(out)
    assert first.returncode == 0, first.stderr
    shards = sorted(p.name for p in out.glob("*.tar"))
    assert len(shards) > 1
    (out / "notes.txt").write_text("which sample this was\n")
    (out / "analysis").mkdir()
    (out / "analysis" / "lengths.csv").write_text("id,length\n")
    damage(out)

    # a second run with other settings: fewer, larger shards, so a shard of the first run is named by no manifest
    # of the second and only the old manifest's word made it data_prep's
    r = prep(out, "--overwrite", "--shard-size", "1000")
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert (out / "notes.txt").read_text() == "which sample this was\n"
    assert (out / "analysis" / "lengths.csv").read_text() == "id,length\n"
    notes = [ln for ln in r.stderr.splitlines() if ln.startswith("note:")]
    assert notes == ["note: kept 2 files that data_prep did not write: analysis/lengths.csv, notes.txt (results in "
                     "them describe the replaced weights)"], r.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    listed = {s["path"] for s in manifest["shards"]}
    assert sorted(p.name for p in out.glob("*.tar")) == sorted(listed) != shards  # the old shards were replaced
    marker = json.loads((out / ".written-by.json").read_text())
    assert "notes.txt" not in marker["files"] and set(marker["files"]) >= listed | {"manifest.json"}


def test_a_manifest_naming_files_outside_its_folder_deletes_nothing_there(tmp_path):
    """The manifest rule reads names from a file anyone can edit: a name outside the folder is ignored."""
    out = tmp_path / "shards"
    assert prep(out).returncode == 0
    unmarked(out)
    (tmp_path / "precious.txt").write_text("outside\n")
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["shards"].append({"path": "../precious.txt", "samples": 1, "tokens": 1, "sha256": "0" * 64})
    (out / "manifest.json").write_text(json.dumps(manifest))
    r = prep(out, "--overwrite")
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "precious.txt").read_text() == "outside\n"
