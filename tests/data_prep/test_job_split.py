"""``--num-jobs N`` jobs then ``merge`` against one job, on real data: plain FASTA split into byte ranges (job I
parses only its share, data_prep/ranges.py ``byte_ranges``) and UniRef50 clusters (split by cluster, joined on disk in
hash buckets, data_prep/join.py). The reference is the one-job run of the same command: the merged directory
must hold the same records (keys, tokens, meta), the same manifest counts and the same filtered.tsv rows."""
import gzip
import json
import os
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from data_prep import cluster_write, cut, join, ranges, scan
from data_prep.__main__ import main
from data_prep.gather import gather
from pipeline.data.shard_reader import read_clusters, read_shard

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "data" / "samples"
RFAM = SAMPLES / "rfam_nrc_train_sample.fasta.gz"
UR90, UR_TSV = SAMPLES / "uniref90_clusters_sample.fasta.gz", SAMPLES / "uniref50_to_uniref90_sample.tsv"


def run(*args) -> int:
    return main([str(a) for a in args])


def content(d: Path, layout: str = "sequences", ordered: bool = True) -> tuple:
    """(records, manifest without its shard list, filtered.tsv rows) of a shard directory; ``ordered`` False sorts
    the records by key and the rows (the jobs of a cluster split hold every N-th cluster)."""
    m = json.loads((d / "manifest.json").read_text())
    read = read_clusters if layout == "clusters" else read_shard
    recs = [(k, [t.tolist() for t in v] if layout == "clusters" else v.tolist(), meta)
            for s in m["shards"] for k, v, meta in read(d / s["path"], s["samples"])]
    m.pop("shards")
    rows = (d / "filtered.tsv").read_text().splitlines() if (d / "filtered.tsv").exists() else []
    if not ordered:
        recs, rows = sorted(recs, key=lambda r: r[0]), rows[:1] + sorted(rows[1:])
    return recs, m, rows


def jobs_then_merge(args: list, out: Path, n: int) -> Path:
    for i in range(n):
        assert run(*args, "--output", out, "--num-jobs", n, "--job-index", i) == 0
    if n > 1:  # one job of one writes manifest.json itself
        assert run("merge", "--output", out) == 0
    return out


@pytest.fixture(scope="module")
def rna_inputs(tmp_path_factory) -> list[Path]:
    """The shipped Rfam sample as two plain FASTA files (the split falls inside the first), records filtered by
    --min-length among them."""
    tmp = tmp_path_factory.mktemp("rna")
    text = gzip.decompress(RFAM.read_bytes())
    cut = text.index(b"\n>", len(text) * 2 // 3) + 1
    a, b = tmp / "a.fa", tmp / "b.fa"
    a.write_bytes(text[:cut])
    b.write_bytes(text[cut:])
    return [a, b]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_rnacentral_byte_range_jobs_merge_to_one_job(rna_inputs, tmp_path, n):
    args = ["rnacentral", "--input", *rna_inputs, "--min-length", 60, "--shard-size", 150]
    assert run(*args, "--output", tmp_path / "one") == 0
    merged = jobs_then_merge(args, tmp_path / "jobs", n)
    one, got = content(tmp_path / "one"), content(merged)
    assert got == one  # in order too: job 0's bytes come first
    assert len(one[0]) > 1000 and one[1]["filtered"]["shorter_than_60"] > 0
    sizes = [p.stat().st_size for p in rna_inputs]
    parsed = [sum(r.hi - r.lo for r in ranges.byte_ranges(rna_inputs, n, i)) for i in range(n)]
    # each job parses its share: job 0 the most (no bytes to count before it), about SCAN_COST less per job after
    assert sum(parsed) == sum(sizes) and max(parsed) < sum(sizes) * (ranges.cut_fraction(1, n) + 0.02)
    assert n == 1 or min(parsed) > sum(sizes) * (ranges.cut_fraction(n, n) - ranges.cut_fraction(n - 1, n) - 0.02)
    assert n == 1 or parsed[0] > sum(sizes) * (1 / n + 0.01)  # weighted: job 0 counts nothing before its range


def test_a_record_across_a_cut_is_read_once_by_the_job_it_starts_in(tmp_path):
    """Four real records, the second made 3/4 of the file long: the nominal cuts at 1/3 and 2/3 fall inside it,
    so job 1 gets no bytes at all and job 2 starts at the third record; line numbers stay the file's."""
    recs = gzip.decompress(RFAM.read_bytes()).replace(b"\r\n", b"\n").split(b"\n>")[:4]
    recs = [r if r.startswith(b">") else b">" + r for r in recs]
    head, seq = recs[1].split(b"\n", 1)
    recs[1] = head + b"\n" + (seq.replace(b"\n", b"") * 60 + b"\n") * 10
    path = tmp_path / "long.fa"
    path.write_bytes(b"\n".join(r.rstrip(b"\n") for r in recs) + b"\n")
    size = path.stat().st_size
    starts = [0] + [i + 1 for i in range(size) if path.read_bytes()[i:i + 2] == b"\n>"]
    assert starts[1] < size // 3 and 2 * size // 3 < starts[2]  # both cuts inside record 2
    assert ranges.byte_ranges([path], 3, 1) == []
    assert [(r.lo, r.hi, r.first_index) for r in ranges.byte_ranges([path], 3, 2)] == [(starts[2], size, 2)]
    args = ["rnacentral", "--input", path]
    assert run(*args, "--output", tmp_path / "one") == 0
    assert content(jobs_then_merge(args, tmp_path / "jobs", 3)) == content(tmp_path / "one")

    bad = tmp_path / "bad.fa"  # record 4's header without an id: job 2's, named with the file's line number
    lines = path.read_bytes().split(b"\n")
    at = next(k for k in range(len(lines) - 1, 0, -1) if lines[k].startswith(b">"))
    lines[at] = b">"
    bad.write_bytes(b"\n".join(lines))
    for i in (0, 1):
        assert run("rnacentral", "--input", bad, "--output", tmp_path / "bad", "--num-jobs", 3, "--job-index", i) == 0
    assert run("rnacentral", "--input", bad, "--output", tmp_path / "bad", "--num-jobs", 3, "--job-index", 2) == 1
    assert run("rnacentral", "--input", bad, "--output", tmp_path / "bad-one") == 1


@pytest.mark.parametrize("block", [1, 2, 7, 4096])
def test_record_count_before_a_range_is_the_texts_own(tmp_path, block):
    """count_records against bytes.count on the real sample, with blocks that cut '\\n>' pairs apart; a '>' inside
    a header ("5'->3'") starts no record."""
    text = gzip.decompress(RFAM.read_bytes()).replace(b"\r\n", b"\n")[:20000]
    text = text.replace(b"\n", b" 5'->3'\n", 1)
    path = tmp_path / "r.fa"
    path.write_bytes(text)
    for end in (0, 1, 2, 5000, 5001, len(text)):
        part = text[:end]
        assert ranges.count_records(path, end, block) == (part.count(b"\n>") + part.startswith(b">"),
                                                         part.count(b"\n")), end


def test_bad_record_error_names_the_files_line(tmp_path, capsys):
    text = gzip.decompress(RFAM.read_bytes()).replace(b"\r\n", b"\n")
    lines = text.split(b"\n")
    k = next(i for i in range(len(lines) * 3 // 4, len(lines)) if lines[i] and not lines[i].startswith(b">"))
    lines[k] = lines[k][:5] + b"!" + lines[k][6:]
    path = tmp_path / "bad.fa"
    path.write_bytes(b"\n".join(lines))
    assert run("rnacentral", "--input", path, "--output", tmp_path / "o", "--num-jobs", 2, "--job-index", 1,
               "--strict") == 1
    assert f"{path}:{k + 1}:6: character '!'" in capsys.readouterr().err


def test_crlf_input_splits_like_one_job(tmp_path):
    text = gzip.decompress(RFAM.read_bytes()).replace(b"\r\n", b"\n").replace(b"\n", b"\r\n")
    path = tmp_path / "crlf.fa"
    path.write_bytes(text)
    args = ["rnacentral", "--input", path]
    assert run(*args, "--output", tmp_path / "one") == 0
    assert content(jobs_then_merge(args, tmp_path / "jobs", 2)) == content(tmp_path / "one")


@pytest.fixture(scope="module")
def cluster_inputs(tmp_path_factory) -> tuple[Path, Path]:
    """The shipped cluster sample with what a job must name: members missing from the FASTA, one with a character
    outside the alphabet, lowercase residues, a member too short for --min-length 30."""
    tmp = tmp_path_factory.mktemp("clusters")
    recs = [">" + r for r in gzip.decompress(UR90.read_bytes()).decode().split("\n>")]
    recs[0] = recs[0][1:]
    kept = [r for k, r in enumerate(recs) if k % 17 != 5]  # missing members
    head, *seq = kept[3].split("\n")
    kept[3] = head + "\n" + "\n".join(seq).replace("A", "J", 1)  # J: not in the ESM alphabet
    head, *seq = kept[8].split("\n")
    kept[8] = head + "\n" + "\n".join(seq).lower()
    head, *seq = kept[11].split("\n")
    kept[11] = head + "\nMKVLA\n"
    fasta = tmp / "members.fa"
    fasta.write_text("".join(r if r.endswith("\n") else r + "\n" for r in kept))
    return fasta, UR_TSV


@pytest.mark.parametrize("n", [1, 2, 3])
def test_cluster_jobs_merge_to_one_job(cluster_inputs, tmp_path, n):
    fasta, tsv = cluster_inputs
    args = ["uniref", "--input", fasta, "--clusters", tsv, "--min-length", 30, "--max-filtered-fraction", 1,
            "--shard-size", 60]
    assert run(*args, "--output", tmp_path / "one") == 0
    one = content(tmp_path / "one", "clusters", ordered=False)
    got = content(jobs_then_merge(args, tmp_path / "jobs", n), "clusters", ordered=False)
    assert got == one
    mf = one[1]["stats"]["members_filtered"]
    assert mf["not_in_fasta"] > 10 and mf["invalid_character"] == 1 and mf["shorter_than_30"] >= 1
    assert one[1]["stats"]["lowercase_residues"] > 0


def test_cluster_memory_limit_and_batches_do_not_change_the_output(cluster_inputs, tmp_path, monkeypatch):
    """DuckDB at its smallest memory limit and on one thread, pass-4 batches of 7 members and joined rows read 5 at a
    time (every batch boundary cuts clusters' slot ranges) give the bytes of the default run."""
    fasta, tsv = cluster_inputs
    args = ["uniref", "--input", fasta, "--clusters", tsv, "--min-length", 30, "--max-filtered-fraction", 1]
    assert run(*args, "--output", tmp_path / "one") == 0
    with monkeypatch.context() as mp:
        mp.setattr(join, "JOB_MEMORY", 0)
        mp.setattr(cluster_write.Writer, "BATCH", 7)
        mp.setattr(cluster_write.Slots, "BATCH", 5)
        assert join.memory_limit() == 16 << 20
        assert run(*args, "--output", tmp_path / "many") == 0
    assert content(tmp_path / "many", "clusters") == content(tmp_path / "one", "clusters")
    a = [(s.name, s.read_bytes()) for s in sorted((tmp_path / "one").glob("*.tar"))]
    assert a == [(s.name, s.read_bytes()) for s in sorted((tmp_path / "many").glob("*.tar"))]


def test_cluster_join_runs_under_the_jobs_memory_limit(tmp_path):
    """The join's DuckDB connection has the memory limit and the temporary folder the job derives (a join without
    them would hold the members' tokens in memory, or spill outside the job's folder)."""
    spill = join.Spill()
    try:
        limit, temp = spill.sql("SELECT current_setting('memory_limit'), current_setting('temp_directory')"
                                ).fetchone()
        assert limit.replace(" ", "") in (f"{join.memory_limit() >> 20}.0MiB", f"{join.memory_limit() >> 20}MiB"), limit
        assert Path(temp) == spill.temp and spill.temp.parent == spill.path
    finally:
        spill.remove()
    assert not spill.path.exists()


def test_cluster_spill_is_removed_whatever_the_end(cluster_inputs, tmp_path, monkeypatch):
    fasta, tsv = cluster_inputs
    spills = tmp_path / "tmp"
    spills.mkdir()
    monkeypatch.setenv("TMPDIR", str(spills))
    monkeypatch.setattr("tempfile.tempdir", None)
    assert run("uniref", "--input", fasta, "--clusters", tsv, "--output", tmp_path / "ok",
               "--max-filtered-fraction", 1) == 0
    assert run("uniref", "--input", fasta, "--clusters", tsv, "--output", tmp_path / "bad", "--strict") == 1  # J
    assert list(spills.iterdir()) == []


def test_gather_equals_slicing():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 255, 5000, dtype=np.uint8)
    starts = rng.integers(0, 4000, 300)
    sizes = rng.integers(0, 100, 300)
    want = np.concatenate([data[a:a + n] for a, n in zip(starts, sizes)])
    assert np.array_equal(gather(data, starts, sizes, group=7), want)


def test_cluster_members_read_record_by_record_give_the_same_clusters(cluster_inputs, tmp_path):
    """An input that starts with a UTF-8 byte-order mark is read record by record (iter_fasta,
    Outcomes.records_of): the clusters, counts and rows equal the batch reader's, whose chunks also hand some
    records over (the J)."""
    fasta, tsv = cluster_inputs
    blank = tmp_path / "bom_first.fa"
    blank.write_bytes(b"\xef\xbb\xbf" + fasta.read_bytes())
    out = {}
    for name, path in (("batch", fasta), ("records", blank)):
        assert run("uniref", "--input", path, "--clusters", tsv, "--output", tmp_path / name, "--min-length", 30,
                   "--max-filtered-fraction", 1) == 0
        recs, m, rows = content(tmp_path / name, "clusters")
        for x in m["inputs"]:
            x.pop("path"), x.pop("size"), x.pop("sha256_sampled", None)
        out[name] = (recs, m, [r.split("\t")[:2] + r.split("\t")[3:] for r in rows])  # the input column differs
    assert out["records"] == out["batch"]


def test_workers_on_plain_fasta_write_the_one_job(rna_inputs, tmp_path):
    """--workers 2 on plain inputs: one job whose chunks a pool parses, not byte-range jobs: the one job's
    shards, byte for byte, and no job manifests."""
    args = ["rnacentral", "--input", *rna_inputs, "--min-length", 60, "--shard-size", 150]
    assert run(*args, "--output", tmp_path / "one") == 0
    assert run(*args, "--output", tmp_path / "w2", "--workers", 2) == 0
    assert content(tmp_path / "w2") == content(tmp_path / "one")
    shards = [json.loads((d / "manifest.json").read_text())["shards"] for d in (tmp_path / "w2", tmp_path / "one")]
    assert shards[0] == shards[1] and not list((tmp_path / "w2").glob("manifest-job*.json"))


def test_cluster_join_tells_apart_ids_that_share_a_prefix(cluster_inputs, tmp_path):
    """Members whose ids differ in one character from other records' (and records in no cluster with ids that
    are prefixes of members') each meet their own record: the same clusters as without the look-alikes."""
    fasta, tsv = cluster_inputs
    args = ["--clusters", tsv, "--min-length", 30, "--max-filtered-fraction", 1]
    assert run("uniref", "--input", fasta, *args, "--output", tmp_path / "one") == 0
    text = fasta.read_text()
    ids = [h.split()[0] for h in re.findall(r"^>(\S+)", text, re.M)]
    alike = "".join(f">{i[:-1]}\nMKVLAAGIVGLLLA\n>{i}X\nMKVLAAGIVGLLLA\n" for i in ids[:50])
    (tmp_path / "alike.fa").write_text(alike + text)
    assert run("uniref", "--input", tmp_path / "alike.fa", *args, "--output", tmp_path / "alike") == 0
    assert content(tmp_path / "alike", "clusters")[0] == content(tmp_path / "one", "clusters")[0]


def cluster_workers_run(args: list, out: Path, workers: int, monkeypatch, log: Path) -> int:
    """``args --workers N`` with chunks of 2 KB (the members' FASTA spread over every worker), each worker logging
    (pid, records) of every chunk it parsed into ``log``."""
    real = scan.Outcomes.chunk

    def logged(self, chunk, path, n_input):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {len(chunk)}\n")
        return real(self, chunk, path, n_input)
    with monkeypatch.context() as mp:
        mp.setattr(cut, "CHUNK", 2048)
        mp.setattr(scan.Outcomes, "chunk", logged)
        return run(*args, "--output", out, "--workers", workers)


@pytest.mark.parametrize("workers,packed", [(2, "plain"), (3, "plain"), (2, "gzip")])
def test_cluster_workers_read_the_members_once_and_join_them_all(cluster_inputs, tmp_path, monkeypatch, workers,
                                                                   packed):
    """--workers N with --clusters: each pool worker parses only its share of the member FASTA into a scan part (a
    byte range of plain FASTA, every N-th chunk of gzip), and the job joins its clusters against all of them: each
    record is read by one worker, and the clusters, counts and rows are the one job's. The spill and its scan parts
    are gone afterwards."""
    fasta, tsv = cluster_inputs
    if packed == "gzip":
        fasta = tmp_path / "members.fa.gz"
        fasta.write_bytes(gzip.compress(cluster_inputs[0].read_bytes()))
    args = ["uniref", "--input", fasta, "--clusters", tsv, "--min-length", 30, "--max-filtered-fraction", 1,
            "--shard-size", 60]
    assert run(*args, "--output", tmp_path / "one") == 0
    one = content(tmp_path / "one", "clusters", ordered=False)
    spills = tmp_path / "tmp"
    spills.mkdir()
    monkeypatch.setenv("TMPDIR", str(spills))
    monkeypatch.setattr("tempfile.tempdir", None)
    log = tmp_path / "chunks.log"
    assert cluster_workers_run(args, tmp_path / "workers", workers, monkeypatch, log) == 0
    assert content(tmp_path / "workers", "clusters", ordered=False) == one
    per_worker: dict = {}
    for line in log.read_text().splitlines():
        pid, n = map(int, line.split())
        per_worker[pid] = per_worker.get(pid, 0) + n
    assert sum(per_worker.values()) == one[1]["stats"]["fasta_records"] and os.getpid() not in per_worker
    assert list(spills.iterdir()) == [] and not list((tmp_path / "workers").glob(".scan-of-*"))


def test_a_bad_member_record_stops_every_cluster_worker(cluster_inputs, tmp_path, monkeypatch, capsys):
    """A header without a record id in the middle of the members' FASTA: the worker that parses it fails, the
    others (still reading, or waiting for their peers) are stopped, and the run ends with the one error line of a
    single process, nothing written and no spill left."""
    fasta, tsv = cluster_inputs
    text = fasta.read_text()
    cut = text.index("\n>", len(text) // 2) + 1
    bad = tmp_path / "bad.fa"
    bad.write_text(text[:cut] + ">\nMKV\n" + text[cut:])
    args = ["uniref", "--input", bad, "--clusters", tsv, "--max-filtered-fraction", 1]
    assert run(*args, "--output", tmp_path / "one") == 1
    want = capsys.readouterr().err
    assert f"{bad}:" in want and "header has no record id" in want, want
    spills = tmp_path / "tmp"
    spills.mkdir()
    monkeypatch.setenv("TMPDIR", str(spills))
    monkeypatch.setattr("tempfile.tempdir", None)
    assert cluster_workers_run(args, tmp_path / "workers", 3, monkeypatch, tmp_path / "chunks.log") == 1
    assert capsys.readouterr().err == want
    assert not (tmp_path / "workers").exists() and not (tmp_path / "workers.workers-partial").exists()
    assert list(spills.iterdir()) == []


@pytest.mark.parametrize("packed", ["plain", "gzip"])
def test_cluster_workers_report_the_first_of_two_bad_records(cluster_inputs, tmp_path, monkeypatch, capsys, packed):
    """Headers without a record id in the first and the last third of the members' FASTA: the scan parts that meet
    them both fail, and --workers 3 reports the first in input order (a part's ``at``), as one process does."""
    text = cluster_inputs[0].read_text()
    a, b = text.index("\n>", len(text) // 4) + 1, text.index("\n>", 3 * len(text) // 4) + 1
    bad = text[:a] + ">\nMKV\n" + text[a:b] + ">\nMKV\n" + text[b:]
    fasta = tmp_path / ("bad.fa.gz" if packed == "gzip" else "bad.fa")
    fasta.write_bytes(gzip.compress(bad.encode()) if packed == "gzip" else bad.encode())
    args = ["uniref", "--input", fasta, "--clusters", cluster_inputs[1], "--max-filtered-fraction", 1]
    assert run(*args, "--output", tmp_path / "one") == 1
    want = capsys.readouterr().err
    assert "header has no record id" in want, want
    assert cluster_workers_run(args, tmp_path / "workers", 3, monkeypatch, tmp_path / "chunks.log") == 1
    assert capsys.readouterr().err == want


def test_a_cluster_worker_killed_stops_the_run(cluster_inputs, tmp_path, monkeypatch, capsys):
    """The first worker to parse a chunk dies (SIGKILL) while the other reads on: the parent stops the other,
    names the dead worker's exit status, and publishes nothing."""
    fasta, tsv = cluster_inputs
    marker = tmp_path / "killed"
    real = scan.Outcomes.chunk

    def die_first(self, *args):
        try:
            marker.touch(exist_ok=False)
        except FileExistsError:
            return real(self, *args)
        os.kill(os.getpid(), signal.SIGKILL)
    monkeypatch.setattr(scan.Outcomes, "chunk", die_first)
    args = ["uniref", "--input", fasta, "--clusters", tsv, "--max-filtered-fraction", 1]
    assert cluster_workers_run(args, tmp_path / "workers", 2, monkeypatch, tmp_path / "chunks.log") == 1
    err = capsys.readouterr().err
    assert marker.exists() and "exited with status -9" in err, err
    assert not (tmp_path / "workers").exists()


def test_cluster_workers_number_the_records_as_one_reader(cluster_inputs, tmp_path, monkeypatch, capsys):
    """A member's record twice in the FASTA, the first copy closing the first chunk and the second opening the
    next: the error names the second copy's line, as a single process does, with --workers 2 too."""
    fasta, tsv = cluster_inputs
    recs = [">" + r for r in fasta.read_text().split("\n>")]
    recs[0] = recs[0][1:]
    recs = [r if r.endswith("\n") else r + "\n" for r in recs]
    monkeypatch.setattr(cut, "CHUNK", 2048)

    def layout(records: list) -> list:  # records per chunk of cut.chunks
        path = tmp_path / "dup.fa"
        path.write_text("".join(records))
        return [t.count(b"\n>") + 1 for t, _ in cut.chunks(path)]
    first = layout(recs)[0]
    dup = recs[:first - 1] + [recs[first]] + recs[first:]  # chunk 0's last record: a copy of chunk 1's first
    assert layout(dup)[0] == first  # the copy is still the last record of chunk 0
    rid = recs[first][1:].split()[0]
    assert rid in tsv.read_text()
    args = ["uniref", "--input", tmp_path / "dup.fa", "--clusters", tsv, "--max-filtered-fraction", 1]
    assert run(*args, "--output", tmp_path / "one") == 1
    want = capsys.readouterr().err
    line = 1 + "".join(dup[:first]).count("\n")  # the second copy's header line
    assert f"dup.fa:{line}: record {rid} appears a second time" in want, want
    assert cluster_workers_run(args, tmp_path / "workers", 2, monkeypatch, tmp_path / "chunks.log") == 1
    assert capsys.readouterr().err == want


def test_records_read_one_by_one_keep_their_place_after_an_earlier_input(cluster_inputs, tmp_path, capsys):
    """The second input starts with a byte-order mark, so it is read record by record; its first record repeats a
    member of the first input. The error names the copy in the second input: its records are numbered after the
    first input's, not from 0."""
    fasta, tsv = cluster_inputs
    recs = [">" + r for r in fasta.read_text().split("\n>")]
    recs[0] = recs[0][1:]
    recs = [r if r.endswith("\n") else r + "\n" for r in recs]
    last = recs[-1]
    rid = last[1:].split()[0]
    assert rid in tsv.read_text()
    second = tmp_path / "bom.fa"
    second.write_bytes(b"\xef\xbb\xbf" + (last + recs[0]).encode())
    assert run("uniref", "--input", fasta, second, "--clusters", tsv, "--max-filtered-fraction", 1,
               "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err
    assert f"bom.fa:1: record {rid} appears a second time" in err, err


def test_a_chunk_read_record_by_record_keeps_its_place(cluster_inputs, tmp_path, monkeypatch, capsys):
    """A CR that is not part of a CRLF sends its whole chunk to the per-record path. That chunk (the second) opens
    with a copy of the first chunk's last record, a member: the error names the copy, because the chunk's records
    are numbered from the chunk's own place in the input, not from the input's start (under which the copy would
    come first)."""
    fasta, tsv = cluster_inputs
    monkeypatch.setattr(cut, "CHUNK", 2048)
    recs = [">" + r for r in fasta.read_text().split("\n>")]
    recs[0] = recs[0][1:]
    recs = [r if r.endswith("\n") else r + "\n" for r in recs]
    path = tmp_path / "cr.fa"

    def chunk_starts(records: list) -> list:  # index of each chunk's first record
        path.write_text("".join(records), newline="")
        counts = [t.count(b"\n>") + 1 for t, _ in cut.chunks(path)]
        return [sum(counts[:k]) for k in range(len(counts))]
    n0 = chunk_starts(recs)[1]
    head, rest = recs[n0 - 1].split("\n", 1)
    copy = head + "\r\r\n" + rest  # the first chunk's last record again, with a CR that ends no CRLF
    records = recs[:n0] + [copy] + recs[n0:]
    assert chunk_starts(records)[1] == n0  # the copy opens the second chunk
    rid = head[1:].split()[0]
    assert rid in tsv.read_text()
    assert run("uniref", "--input", path, "--clusters", tsv, "--max-filtered-fraction", 1,
               "--output", tmp_path / "out") == 1
    err = capsys.readouterr().err
    line = 1 + "".join(recs[:n0]).count("\n")
    assert f"cr.fa:{line}: record {rid} appears a second time" in err, err


def test_arrow_strings_equal_pyarrows_own():
    """join.arrow_array builds string columns from one joined encode: ASCII, non-ASCII (byte sizes, not characters),
    nulls and all-nulls read back as pyarrow's own conversion gives them."""
    import pyarrow as pa

    for values in (["a", "bc", ""], ["Ünïcode", "a", "漢字"], ["x", None, "ÿ", None], [None, None]):
        assert join.arrow_array(values, "string").to_pylist() == pa.array(values, pa.string()).to_pylist(), values
