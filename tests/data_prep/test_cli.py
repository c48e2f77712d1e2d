"""End-to-end `python -m data_prep` runs (subprocesses) on the repo's real Rfam sample.

The shared RNAcentral set (T and U records) is covered in-process by test_fasta.py.

Every run that writes imports torch through webdataset (~2 s), so the `runs` fixture starts all runs at once, in two
waves (the second needs the first's output), and the tests inspect the results.
"""
import gzip
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.data.shard_reader import read_shard
from pipeline.data.shards import load_manifest, sha256_file
from pipeline.data.tokenizer import VOCAB, NucleotideTokenizer

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"
RNA = NucleotideTokenizer("rna")
MIN_LENGTH = 80


def command(*args):
    return [sys.executable, "-m", "data_prep", *map(str, args)]


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(command(*args), cwd=REPO, capture_output=True, text=True, timeout=300)


def cli_parallel(runs: dict[str, tuple]) -> dict[str, subprocess.CompletedProcess]:
    procs = {k: subprocess.Popen(command(*a), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, a in runs.items()}
    out = {}
    for k, p in procs.items():
        stdout, stderr = p.communicate(timeout=300)
        out[k] = subprocess.CompletedProcess(command(*runs[k]), p.returncode, stdout, stderr)
    return out


def reference(raw: bytes) -> dict[str, str]:
    """id -> sequence by plain string splitting (independent of data_prep)."""
    out = {}
    for block in raw.decode("ascii").replace("\r\n", "\n").split("\n>"):
        head, *lines = block.removeprefix(">").split("\n")
        out[head.split()[0]] = "".join(s.strip() for s in lines)
    return out


def samples(directory: Path) -> dict[str, tuple[bytes, dict]]:
    m = load_manifest(directory)
    out = {}
    for s in m.shards:
        assert sha256_file(directory / s.path) == s.sha256
        for key, tokens, meta in read_shard(directory / s.path, s.samples):
            assert key not in out and "." not in key and "/" not in key
            out[key] = (tokens.tobytes(), meta)
    return out


@pytest.fixture(scope="module")
def sample_raw() -> bytes:
    return gzip.decompress(SAMPLE.read_bytes())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def runs(root, sample_raw) -> dict[str, subprocess.CompletedProcess]:
    plain = root / "sample.fasta"
    plain.write_bytes(sample_raw)
    # Malformed inputs: real lines with one base replaced by '*', and a file that starts inside a record.
    lines = sample_raw.decode().split("\r\n")[:40]
    assert lines[3].startswith(">") and not lines[4].startswith(">")
    for name, text in (("bad_char", lines[:4] + [lines[4][:29] + "*" + lines[4][30:]] + lines[5:]),
                       ("no_header", lines[1:])):
        (root / name).mkdir()
        (root / name / f"{name}.fasta").write_text("\r\n".join(text) + "\r\n")
    # A real header whose sequence lines are removed: an empty record.
    (root / "empty.fasta").write_text(lines[0] + "\r\n")

    rna = ("rnacentral", "--shard-size", 1000, "--input")
    bad, nohead = root / "bad_char", root / "no_header"
    first = {"gz": rna + (SAMPLE, "--output", root / "gz"),
             "min_length": rna + (SAMPLE, root / "empty.fasta", "--output", root / "min", "--min-length", MIN_LENGTH),
             **{f"job{i}": rna + (SAMPLE, "--output", root / "mj", "--num-jobs", 2, "--job-index", i)
                for i in range(2)},
             # The sample first: its 2107 records already written must be cleaned up too.
             # --strict: an invalid record is an error (the default skips and counts it; see test_sources.py)
             "bad_char": rna + (SAMPLE, bad / "bad_char.fasta", "--output", bad / "new" / "out", "--strict"),
             # Fails on its first line, before anything is written.
             "no_header": rna + (nohead / "no_header.fasta", "--output", nohead / "new" / "out")}
    done = cli_parallel(first)
    for k in ("gz", "min_length", "job0", "job1"):
        assert done[k].returncode == 0, (k, done[k].stderr)

    shutil.copytree(root / "min", root / "min_keep")
    shutil.copytree(root / "min", root / "plain")
    # The state while job 1 is still running: its shards may be there, its manifest is not.
    shutil.copytree(root / "mj", root / "unfinished")
    (root / "unfinished" / "manifest-job0001-of-0002.json").unlink()
    done |= cli_parallel({"no_overwrite": ("rnacentral", "--input", SAMPLE, "--output", root / "min_keep"),
                          # the plain-text sample replaces the copy of the min-length output
                          "plain": rna + (plain, "--output", root / "plain", "--overwrite"),
                          "merge": ("merge", "--output", root / "mj"),
                          "merge_unfinished": ("merge", "--output", root / "unfinished")})
    return done


def test_help():
    p = cli("--help")
    assert p.returncode == 0 and all(s in p.stdout for s in ("fasta", "rnacentral", "merge"))
    p = cli("fasta", "--input", SAMPLE, "--output", "unused")
    assert p.returncode == 2 and "--alphabet" in p.stderr


def test_repo_sample(runs, root, sample_raw):
    out = root / "gz"
    assert runs["gz"].stdout.strip() == (
        "data_prep rnacentral: records read 2107, written 2107, filtered 0 (empty=0, shorter_than_10=0), "
        f"tokens 341942, shards 3 -> {out / 'manifest.json'}")
    m = load_manifest(out)
    assert [s.samples for s in m.shards] == [1000, 1000, 107]
    assert (m.total_samples, m.total_tokens) == (2107, 341_942)
    assert m.source == "rnacentral" and m.filtered == {"empty": 0, "shorter_than_10": 0}
    assert m.tokenizer == {"name": "nucleotide", "vocab": list(VOCAB), "alphabet": "rna"}
    assert m.inputs == [{"path": str(SAMPLE), "size": SAMPLE.stat().st_size, "sha256_sampled": hashlib.sha256(
        SAMPLE.read_bytes()).hexdigest(), "records": 2107, "kept": 2107, "residues": 341_942}]  # small: all sampled
    assert m.stats["residues"] == 341_942 and m.stats["records_kept"] == 2107
    ref = reference(sample_raw)
    got = samples(out)
    assert sorted(meta["id"] for _, meta in got.values()) == sorted(ref)
    for tokens, meta in got.values():
        seq = ref[meta["id"]]
        assert meta["source"] == "rnacentral" and meta["length"] == len(seq) == len(tokens)
        assert RNA.decode(tokens) == seq.upper().replace("T", "U")
    assert not list(root.glob("*.tmp-*")) and not list(root.glob("*.old-*"))


def test_gz_and_plain_give_identical_shards(runs, root):
    gz, plain = load_manifest(root / "gz"), load_manifest(root / "plain")
    assert [(s.path, s.sha256) for s in gz.shards] == [(s.path, s.sha256) for s in plain.shards]


def test_malformed_input_fails_cleanly(runs, root):
    bad, nohead = runs["bad_char"], runs["no_header"]
    assert bad.returncode == 1 and bad.stdout == ""
    assert bad.stderr.strip() == (f"data_prep: error: {root / 'bad_char' / 'bad_char.fasta'}:5:30: character '*' "
                                  "is not in the tokenizer alphabet (record RF00001_M28193_1_1-119)")
    assert nohead.returncode == 1
    assert nohead.stderr.strip() == (f"data_prep: error: {root / 'no_header' / 'no_header.fasta'}:1: "
                                     "sequence data before the first '>' header")
    # The records before the bad one were written, but neither the output, the parent it would have created nor
    # any temporary directory is left behind.
    for name in ("bad_char", "no_header"):
        assert [p.name for p in (root / name).iterdir()] == [f"{name}.fasta"]


def test_min_length_filter_counted(runs, root, sample_raw):
    ref = reference(sample_raw)
    short = sum(len(s) < MIN_LENGTH for s in ref.values())
    assert 0 < short < len(ref)
    assert (f"records read 2108, written {2107 - short}, filtered {short + 1} "
            f"(empty=1, shorter_than_{MIN_LENGTH}={short})") in runs["min_length"].stdout
    m = load_manifest(root / "min")
    assert m.filtered == {"empty": 1, f"shorter_than_{MIN_LENGTH}": short} and m.total_samples == 2107 - short
    assert [i["records"] for i in m.inputs] == [2107, 1]
    assert all(meta["length"] >= MIN_LENGTH for _, meta in samples(root / "min").values())


def test_existing_output_needs_overwrite(runs, root):
    p = runs["no_overwrite"]
    assert p.returncode == 1 and "already holds a data_prep output; pass --overwrite to replace it" in p.stderr
    assert (root / "min_keep" / "manifest.json").read_bytes() == (root / "min" / "manifest.json").read_bytes()
    assert runs["plain"].returncode == 0, runs["plain"].stderr
    assert load_manifest(root / "plain").total_samples == 2107
    assert sorted(p.name for p in (root / "plain").iterdir()) == [".written-by.json", "manifest.json"] + [
        f"rnacentral-00000{i}.tar" for i in range(3)]  # the marker: data_prep owns this directory
    assert not list(root.glob("plain.*"))


def test_overwrite_refuses_foreign_directory(tmp_path):
    foreign = tmp_path / "notes"
    foreign.mkdir()
    shutil.copy(SAMPLE, foreign)
    p = cli("fasta", "--alphabet", "dna", "--input", SAMPLE, "--output", foreign, "--overwrite")
    assert p.returncode == 1 and "is not empty and was not written by data_prep (it holds " in p.stderr
    assert [q.name for q in foreign.iterdir()] == [SAMPLE.name]


def test_multi_job_split_and_merge(runs, root):
    assert "job 1/2: records read 1053 (of 2107 in the inputs), written 1053" in runs["job1"].stdout
    p = runs["merge_unfinished"]
    assert p.returncode == 1 and "job 1 of 2 has not finished (manifest-job0001-of-0002.json missing)" in p.stderr
    assert not (root / "unfinished" / "manifest.json").exists()

    assert runs["merge"].returncode == 0, runs["merge"].stderr
    assert "records read 2107, written 2107" in runs["merge"].stdout
    out = root / "mj"
    merged, single = load_manifest(out), load_manifest(root / "gz")
    assert (merged.total_samples, merged.total_tokens) == (single.total_samples, single.total_tokens)
    assert [i["records"] for i in merged.inputs] == [2107]
    job = json.loads((out / "manifest-job0000-of-0002.json").read_text())["job"]
    assert (job["index"], job["count"], job["options"]["--min-length"], job["options"]["--dedup"]) == (0, 2, 10, False)
    # Keys are global record indices, so the split changes only which shard a sample lands in.
    assert samples(out) == samples(root / "gz")
    assert not [q.name for q in out.iterdir() if q.name.startswith(".")]
