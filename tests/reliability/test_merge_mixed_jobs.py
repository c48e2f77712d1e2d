"""Case 2: `data_prep merge` joined jobs that ran with different record-affecting options (job 0 plain, job 1 with
--dedup: of 2,107 records 526 were missing and 520 twice). Every job now records the options that decide its
records (data_prep/settings.py RECORD_OPTIONS) and merge refuses jobs that differ in any, naming the option, its values
and the jobs, and writes nothing. The list is checked against the job CLI itself, so a new option cannot be
forgotten."""
import shutil

import pytest

from conftest import SAMPLE_FASTA
from data_prep.__main__ import build_parser, main
from data_prep.settings import JOB_LOCAL_OPTIONS, RECORD_OPTIONS

# Each record option -> (the value job 1 runs with, the value job 0 runs with as the merge error prints it).
CASES = {"min_length": (["--min-length", "30"], 10, 30), "max_length": (["--max-length", "200"], None, 200),
         "dedup": (["--dedup"], False, True), "replace_invalid": (["--replace-invalid", "N"], None, "N"),
         "window": (["--window", "64"], None, 64), "stride": (["--window", "64", "--stride", "32"], None, 32),
         "window_tail": (["--window", "64", "--window-tail", "drop"], None, None),
         "val_fraction": (["--val-fraction", "0.2"], None, 0.2),
         "max_record_length": (["--max-record-length", "5000"], 1_000_000_000, 5000)}
OTHER_SOURCES = {"text_column": "babylm", "uniref90_members": "uniref", "clusters": "uniref"}


def job_cli_options() -> dict:
    """Every source subcommand -> the argparse dests of its options (the job CLI, read from the parser itself)."""
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return {name: {a.dest for a in p._actions if a.dest != "help"} for name, p in sub.choices.items()
            if name not in ("merge", "train-spm", "synthetic-hops", "upload")}


def test_every_job_option_is_compared_or_has_a_reason():
    per_source = job_cli_options()
    everything = set().union(*per_source.values())
    unknown = everything - set(RECORD_OPTIONS) - set(JOB_LOCAL_OPTIONS)
    assert not unknown, f"options merge neither compares nor explains: {sorted(unknown)}"
    assert set(RECORD_OPTIONS) | set(JOB_LOCAL_OPTIONS) <= everything  # no stale names
    assert set(CASES) | set(OTHER_SOURCES) == set(RECORD_OPTIONS)  # each compared option has a case below
    for option, source in OTHER_SOURCES.items():
        assert option in per_source[source]


@pytest.mark.parametrize("option", sorted(CASES))
def test_merge_refuses_jobs_with_different_record_options(tmp_path, capsys, option):
    extra, _, _ = CASES[option]
    base = ["rnacentral", "--input", str(SAMPLE_FASTA), "--output", str(tmp_path / "out"), "--num-jobs", "2"]
    job0 = [*base, "--job-index", "0"] + (["--window", "64"] if option in ("stride", "window_tail") else [])
    assert main(job0) == 0
    assert main([*base, "--job-index", "1", *extra]) == 0
    capsys.readouterr()
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["merge", "--output", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    flag = "--" + option.replace("_", "-")
    assert len(err) == 1 and err[0].startswith(f"data_prep: error: the jobs ran with different {flag} ("), err
    assert " in job 0; " in err[0] and " in job 1)" in err[0], err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing written


def test_merge_refuses_clusters_from_another_file(tmp_path, capsys):
    from data_prep.__main__ import main as prep
    from conftest import REPO

    fasta = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"
    tsv = REPO / "data" / "samples" / "uniref50_to_uniref90_sample.tsv"
    edited = tmp_path / "edited.tsv"
    shutil.copy(tsv, edited)
    base = ["uniref", "--input", str(fasta), "--output", str(tmp_path / "out"), "--num-jobs", "2"]
    assert prep([*base, "--job-index", "0", "--clusters", str(tsv)]) == 0
    assert prep([*base, "--job-index", "1", "--clusters", str(edited)]) == 0
    capsys.readouterr()
    assert prep(["merge", "--output", str(tmp_path / "out")]) == 1
    assert "the jobs ran with different --clusters (" in capsys.readouterr().err
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_jobs_with_the_same_options_still_merge(tmp_path, capsys):
    base = ["rnacentral", "--input", str(SAMPLE_FASTA), "--output", str(tmp_path / "out"), "--num-jobs", "2",
            "--dedup", "--min-length", "30"]
    for i in range(2):  # the job-local options may differ: shard size, progress
        assert main([*base, "--job-index", str(i), "--shard-size", str(100 + i)]) == 0
    assert main(["merge", "--output", str(tmp_path / "out")]) == 0
