"""Today's outputs kept as the reference: the shipped samples (data/samples) and, where ../shared/data exists, the
shared UniRef50/90 files, through the plain, ``--workers 2``, ``--clusters`` (and ``--clusters --workers 2``) paths
must give the same bytes as when the reference was taken: every shard's sha256, the manifest (input and output
paths written as placeholders) and ``filtered.tsv``.

The reference is small digests in ``reference_outputs.json`` beside this file. After a change that is meant to
change the outputs, ``DATA_PREP_REFERENCE=write pytest tests/data_prep/test_reference_outputs.py`` takes it again
(and the diff of the JSON file says which outputs changed).
"""
import hashlib
import json
import os
from pathlib import Path

import pytest

from data_prep.__main__ import main

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "data" / "samples"
SHARED = REPO.parent / "shared" / "data" / "protein"
REFERENCE = Path(__file__).with_name("reference_outputs.json")

# name -> (needs the shared files, arguments); {S}: data/samples, {P}: ../shared/data/protein
CASES = {
    "uniref_plain": (False, ["uniref", "--input", "{S}/uniref90_heldout_sample.fasta.gz", "--min-length", "60",
                             "--max-length", "700"]),
    "uniref_workers2": (False, ["uniref", "--input", "{S}/uniref90_heldout_sample.fasta.gz", "--min-length", "60",
                                "--max-length", "700", "--workers", "2"]),
    "rnacentral_plain": (False, ["rnacentral", "--input", "{S}/rfam_nrc_train_sample.fasta.gz", "--min-length",
                                 "60", "--max-length", "200", "--shard-size", "200"]),
    "rnacentral_workers2": (False, ["rnacentral", "--input", "{S}/rfam_nrc_train_sample.fasta.gz", "--min-length",
                                    "60", "--max-length", "200", "--shard-size", "200", "--workers", "2"]),
    "clusters": (False, ["uniref", "--input", "{S}/uniref90_clusters_sample.fasta.gz", "--clusters",
                         "{S}/uniref50_to_uniref90_sample.tsv", "--min-length", "120", "--max-length", "900",
                         "--shard-size", "150"]),
    "clusters_workers2": (False, ["uniref", "--input", "{S}/uniref90_clusters_sample.fasta.gz", "--clusters",
                                  "{S}/uniref50_to_uniref90_sample.tsv", "--min-length", "120", "--max-length",
                                  "900", "--shard-size", "150", "--workers", "2"]),
    "shared_uniref50_plain": (True, ["uniref", "--input", "{P}/uniref50_202104_esm2_train_5000.fasta",
                                     "--min-length", "40", "--max-length", "1000"]),
    "shared_uniref50_workers2": (True, ["uniref", "--input", "{P}/uniref50_202104_esm2_train_5000.fasta",
                                        "--min-length", "40", "--max-length", "1000", "--workers", "2"]),
    "shared_clusters": (True, ["uniref", "--input", "{P}/uniref90_202104_members_of_ur50_first2500.fasta",
                               "--clusters", "{P}/uniref50_to_uniref90_mapping_first2500.tsv", "--min-length", "60",
                               "--max-length", "1000"]),
    "shared_clusters_workers2": (True, ["uniref", "--input", "{P}/uniref90_202104_members_of_ur50_first2500.fasta",
                                        "--clusters", "{P}/uniref50_to_uniref90_mapping_first2500.tsv",
                                        "--min-length", "60", "--max-length", "1000", "--workers", "2"]),
}

# --workers on the batch reader (FASTA sources without --dedup/--window/--uniref90-members) is one job whose chunks a
# pool parses, and with --clusters one job whose member FASTA a pool scans: its output is the 1-process run's, byte
# for byte.
SAME_AS = {"uniref_workers2": "uniref_plain", "rnacentral_workers2": "rnacentral_plain",
           "shared_uniref50_workers2": "shared_uniref50_plain", "clusters_workers2": "clusters",
           "shared_clusters_workers2": "shared_clusters"}


def _placeholders(text: str, out: Path) -> str:
    for path, name in ((out, "{OUT}"), (SHARED, "{P}"), (SAMPLES, "{S}"), (REPO, "{REPO}")):
        text = text.replace(str(path), name).replace(str(path.resolve()), name)
    return text


def digests(out: Path) -> dict:
    """sha256 of every file of an output directory, the manifest and filtered.tsv with paths as placeholders."""
    got = {}
    for p in sorted(out.rglob("*")):
        if not p.is_file() or p.name == ".written-by.json":  # the ownership marker: a pid and a time
            continue
        rel = str(p.relative_to(out))
        data = p.read_bytes()
        if p.suffix in (".json", ".tsv"):
            data = _placeholders(data.decode(), out).encode()
        got[rel] = hashlib.sha256(data).hexdigest()
    return got


def _run(name: str, tmp_path: Path) -> dict:
    shared, args = CASES[name]
    if shared and not SHARED.is_dir():
        pytest.skip("needs ../shared/data (the real UniRef files)")
    out = tmp_path / name
    argv = [a.replace("{S}", str(SAMPLES)).replace("{P}", str(SHARED)) for a in args]
    assert main(argv + ["--output", str(out), "--progress", "off"]) == 0
    return digests(out)


@pytest.mark.parametrize("name", sorted(CASES))
def test_outputs_equal_the_reference(name, tmp_path):
    got = _run(name, tmp_path)
    if os.environ.get("DATA_PREP_REFERENCE") == "write":
        ref = json.loads(REFERENCE.read_text()) if REFERENCE.exists() else {}
        ref[name] = got
        REFERENCE.write_text(json.dumps(dict(sorted(ref.items())), indent=1) + "\n")
        return
    ref = json.loads(REFERENCE.read_text())
    assert got == ref[name], f"{name}: outputs differ from the reference taken before the refactor"
    if name in SAME_AS:
        assert got == ref[SAME_AS[name]], f"{name}: outputs differ from {SAME_AS[name]}'s"


def test_every_case_drops_records():
    """The reference is worth keeping: every case drops records (its filtered.tsv is compared too), and every case
    of CASES has a reference."""
    ref = json.loads(REFERENCE.read_text())
    assert sorted(ref) == sorted(CASES)
    for name, files in ref.items():
        assert "filtered.tsv" in files, name
