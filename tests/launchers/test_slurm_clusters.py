"""UniRef50 clusters across machines: launchers/slurm/data_prep_clusters.sh submits scan -> build -> merge with
afterok dependencies, and those three stages, run by bash as SLURM would run their array tasks (no scheduler), give
the one-job output record for record while the member FASTA's bytes are parsed once between the scan tasks."""
import gzip
import json
import subprocess
from pathlib import Path

import pytest

from conftest import REPO
from data_prep.__main__ import main
from launchers.test_slurm_data_prep import MERGE, merge, run_tasks, task_env
from pipeline.data.shard_reader import read_clusters

CHAIN = REPO / "launchers" / "slurm" / "data_prep_clusters.sh"
SAMPLES = REPO / "data" / "samples"
N = 3


def cluster_content(d: Path) -> tuple:
    """(records by key, manifest counts, filtered.tsv rows sorted) of a cluster shard directory."""
    m = json.loads((d / "manifest.json").read_text())
    recs = {k: ([t.tolist() for t in v], meta) for s in m["shards"] for k, v, meta in
            read_clusters(d / s["path"], s["samples"])}
    rows = (d / "filtered.tsv").read_text().splitlines()
    counts = {k: m[k] for k in ("filtered", "layout", "source", "tokenizer")}
    counts["inputs"] = [{k: v for k, v in i.items() if k != "path"} for i in m["inputs"]]
    counts["stats"] = {k: v for k, v in m["stats"].items() if k != "mapping"}
    return recs, counts, rows[:1] + sorted(rows[1:])


@pytest.fixture(scope="module")
def members(tmp_path_factory) -> Path:
    """The shipped member sample as plain FASTA (byte ranges apply), with a record holding a character outside the
    alphabet and one too short in the last third, where a scan part numbers its lines from its own start."""
    recs = gzip.decompress((SAMPLES / "uniref90_clusters_sample.fasta.gz").read_bytes()).decode().split("\n>")
    k = len(recs) * 5 // 6
    head, *seq = recs[k].split("\n")
    recs[k] = head + "\n" + "\n".join(seq).replace("A", "J", 1)
    recs[k + 3] = recs[k + 3].split("\n")[0] + "\nMKVLA"
    path = tmp_path_factory.mktemp("members") / "members.fa"
    path.write_text("\n>".join(recs).rstrip("\n") + "\n")
    return path


def prep(members: Path) -> list[str]:
    return ["uniref", "--input", str(members), "--clusters", str(SAMPLES / "uniref50_to_uniref90_sample.tsv"),
            "--min-length", "30", "--max-filtered-fraction", "1", "--shard-size", "60"]


def test_chain_submits_three_stages_with_afterok(tmp_path):
    log = tmp_path / "sbatch.log"
    fake = tmp_path / "sbatch"
    fake.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\necho $((700 + $(wc -l < {log})))\n')
    fake.chmod(0o755)
    p = subprocess.run(["bash", str(CHAIN), "4", "uniref", "--input", "m.fa", "--clusters", "c.tsv", "--output",
                        "out"], cwd=REPO, env={"PATH": "/usr/bin:/bin", "SBATCH": str(fake)}, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    scan, build, merge_ = log.read_text().splitlines()
    assert scan.startswith("--parsable --array=0-3 ") and scan.endswith("--output out --stage scan")
    assert build.startswith("--parsable --array=0-3 --dependency=afterok:701 ") and build.endswith("--stage build")
    assert merge_ == f"--parsable --dependency=afterok:702 {MERGE} --output out"
    assert "scan array 701, build array 702 (afterok), merge 703 (afterok)" in p.stdout
    bad = subprocess.run(["bash", str(CHAIN), "4", "uniref", "--input", "m.fa", "--output", "out"], cwd=REPO,
                         env={"PATH": "/usr/bin:/bin", "SBATCH": str(fake)}, capture_output=True, text=True)
    assert bad.returncode == 2 and "no --clusters TSV" in bad.stderr


def test_scan_build_merge_is_one_job_and_reads_the_fasta_once(members, tmp_path):
    assert main([*prep(members), "--output", str(tmp_path / "one"), "--progress", "off"]) == 0
    out = tmp_path / "array"
    for stage in ("scan", "build"):
        for i, t in enumerate(run_tasks(out, [task_env(i) for i in range(N)], prep(members) + ["--stage", stage])):
            assert t.returncode == 0, t.stderr
    parts = sorted((out / f".scan-of-{N:04d}").glob("part-*.json"))
    markers = [json.loads(p.read_text()) for p in parts]
    # the FASTA's bytes, parsed once: the parts' ranges lie end to end over the whole file
    ranges = sorted(tuple(m["ranges"]["0"]) for m in markers)
    assert ranges[0][0] == 0 and ranges[-1][1] == members.stat().st_size
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert sum(m["inputs"][0]["bytes"] for m in markers) == members.stat().st_size
    assert all(m["inputs"][0]["records"] > 0 for m in markers)
    p = merge(out)
    assert p.returncode == 0, p.stderr
    assert not (out / f".scan-of-{N:04d}").exists()  # used up by the merge
    got, want = cluster_content(out), cluster_content(tmp_path / "one")
    assert got == want
    # the damage in the last part is reported at the input's lines, as the one job reports it
    assert any("invalid_character" in r and "J" in r for r in got[2])


def test_a_build_refuses_a_missing_scan_part(members, tmp_path):
    out = tmp_path / "array"
    for i, t in enumerate(run_tasks(out, [task_env(i) for i in (0, 2)], prep(members) + ["--stage", "scan"])):
        assert t.returncode == 0, t.stderr
    (build,) = run_tasks(out, [task_env(1)], prep(members) + ["--stage", "build"])
    assert build.returncode == 1
    assert f"scan part 1 of {N} has not finished (2 of {N} done)" in build.stderr
