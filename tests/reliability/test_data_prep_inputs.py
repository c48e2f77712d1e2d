"""data_prep inputs a research user trips over (issue 11, 'Inputs'): silent data loss, long genomes, train/val.

* Too many invalid records fail the job (``--max-filtered-fraction``, default 0.01) with one error line naming the
  first offending records and characters, and leave nothing behind; ``--replace-invalid`` keeps them and counts
  each replaced character; ``filtered.tsv`` lists every record dropped.
* ``--window L --stride S`` tiles long genomes into samples ``ID:start-end``; ``--val-fraction`` splits by a hash of
  the record id into ``DIR/train`` and ``DIR/val``.
* a BabyLM ``.csv`` needs ``--text-column``; the members TSV's header is recognized and a members file matching no
  record is an error; progress goes to stderr and never into the summary line on stdout.

Inputs are real: the Rfam sample shipped in data/samples (always present) and, where ../shared/data is there, the
phiX174 / E. coli genomes, the UniRef sets and the CHILDES CSV. Oracles are plain string splitting of the input
text, independent of data_prep's readers. Runs are in-process (``data_prep.__main__.main``) to import torch once.
"""
from __future__ import annotations

import csv
import gzip
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from data_prep.__main__ import main
from data_prep.windows import window_spans
from data_prep.common import split_of
from pipeline.data.shard_reader import read_shard
from pipeline.data.shards import load_manifest, sha256_file

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared" / "data"
SAMPLE = REPO / "data" / "samples" / "rfam_nrc_train_sample.fasta.gz"
PHIX = SHARED / "genome" / "phiX174_variants_134_genomes.fna"
PHIX_REF = SHARED / "genome" / "phiX174_NC_001422.1.fna"
UR50 = SHARED / "protein" / "uniref50_202104_esm2_train_5000.fasta"
UR90 = SHARED / "protein" / "uniref90_202104_members_of_ur50_first2500.fasta"
MAPPING = SHARED / "protein" / "uniref50_to_uniref90_mapping_first2500.tsv"
CHILDES = SHARED / "text" / "childes_nelson_utterances.csv"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason="needs ../shared/data (the real genomes, UniRef "
                                                              "and CHILDES files)")


def run(*args) -> int:
    return main([str(a) for a in args])


def records(text: str) -> list[tuple[str, str, str]]:
    """(id, description, sequence) of FASTA text, by string splitting."""
    out = []
    for block in text.replace("\r\n", "\n").split("\n>"):
        head, *lines = block.removeprefix(">").split("\n")
        rid, _, desc = head.partition(" ")
        out.append((rid, desc, "".join(s.strip() for s in lines)))
    return out


def write_fasta(path: Path, recs, width: int = 60) -> None:
    with open(path, "w") as f:
        for rid, desc, seq in recs:
            f.write(f">{rid} {desc}\n" if desc else f">{rid}\n")
            f.writelines(seq[k:k + width] + "\n" for k in range(0, len(seq), width))


def samples(directory: Path) -> dict:
    """key -> (tokens as text, meta), every shard checked against its sha256."""
    m = load_manifest(directory)
    vocab = m.tokenizer["vocab"]
    out = {}
    for s in m.shards:
        assert sha256_file(directory / s.path) == s.sha256
        for key, tokens, meta in read_shard(directory / s.path, s.samples):
            out[key] = ("".join(vocab[t] for t in tokens), meta)
    return out


def tsv_rows(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    assert lines[0] == "id\treason\tinput\tline\tdetail"
    return [dict(zip(lines[0].split("\t"), ln.split("\t"))) for ln in lines[1:]]


@pytest.fixture(scope="module")
def rfam() -> list[tuple[str, str, str]]:
    return records(gzip.decompress(SAMPLE.read_bytes()).decode())


def gapped(recs, every: int = 10, keep: int = 1):
    """Real records with alignment gaps ('.') in all but ``keep`` of every ``every`` records: 90 % invalid by
    default. Returns (records, {id: number of '.'})."""
    out, dots = [], {}
    for k, (rid, desc, seq) in enumerate(recs):
        if k % every >= keep:
            cut = [len(seq) // 3, len(seq) // 2, len(seq) // 2 + 1]
            seq = "".join("." if j in cut else c for j, c in enumerate(seq))
            dots[rid] = 3
        out.append((rid, desc, seq))
    return out, dots


# ------------------------------------------------------------------------------------- invalid records: fail, fix, list
def test_ninety_percent_invalid_fails_by_default_and_leaves_nothing(rfam, tmp_path, capsys):
    recs, dots = gapped(rfam[:200])
    assert len(dots) == 180
    src = tmp_path / "gapped.fasta"
    write_fasta(src, recs)
    out = tmp_path / "new" / "out"
    assert run("rnacentral", "--input", src, "--output", out) == 1
    cap = capsys.readouterr()
    assert cap.out == ""
    err = [ln for ln in cap.err.splitlines() if "error:" in ln]
    assert len(err) == 1 and "Traceback" not in cap.err
    first = next(rid for rid, _, _ in recs if rid in dots)
    assert err[0].startswith("data_prep: error: 180 of 200 records (90.0%) dropped as invalid "
                             "(invalid_character=180), above --max-filtered-fraction 0.01; "
                             "characters outside the alphabet: '.' x540; first: ")
    assert f"{src}:" in err[0] and f"character '.' is not in the tokenizer alphabet (record {first})" in err[0]
    assert "--replace-invalid" in err[0]
    # the line:column it names holds the '.'
    where = err[0].split("first: ")[1].split(": character")[0]
    _, lineno, col = where.rsplit(":", 2)
    assert src.read_text().splitlines()[int(lineno) - 1][int(col) - 1] == "."
    # nothing half-written: no output, no work directory, not even the parent the run would have created
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gapped.fasta"]


def test_replace_invalid_keeps_every_record_and_counts(rfam, tmp_path, capsys):
    recs, dots = gapped(rfam[:200])
    src = tmp_path / "gapped.fasta"
    write_fasta(src, recs)
    out = tmp_path / "out"
    assert run("rnacentral", "--input", src, "--output", out, "--replace-invalid", "N") == 0
    summary = capsys.readouterr().out.strip()
    assert "records read 200, written 200, filtered 0" in summary
    assert "replaced 540 characters by 'N' in 180 records ('.'=540)" in summary
    m = load_manifest(out)
    assert m.total_samples == 200 and sum(m.filtered.values()) == 0
    assert (m.stats["replaced_characters"], m.stats["records_with_replacements"]) == (540, 180)
    assert m.stats["replaced"] == {".": 540} and m.stats["replacement"] == "N"
    assert not (out / "filtered.tsv").exists() and "filtered_list" not in m.stats
    got = {meta["id"]: text for text, meta in samples(out).values()}
    for rid, _, seq in recs:
        assert got[rid] == seq.upper().replace("T", "U").replace(".", "N")


def test_filtered_tsv_lists_every_dropped_record(rfam, tmp_path, capsys):
    recs, dots = gapped(rfam[:200])
    recs[0] = (recs[0][0], recs[0][1], recs[0][2][:7])  # a valid record under --min-length 10
    src = tmp_path / "gapped.fasta"
    write_fasta(src, recs)
    out = tmp_path / "out"
    assert run("rnacentral", "--input", src, "--output", out, "--max-filtered-fraction", 1) == 0
    summary = capsys.readouterr().out.strip()
    assert summary.endswith(f"; dropped records listed in {out / 'filtered.tsv'}")
    m = load_manifest(out)
    assert m.filtered == {"empty": 0, "shorter_than_10": 1, "invalid_character": 180}
    assert m.stats["invalid_characters"] == {".": 540} and m.stats["filtered_list"] == "filtered.tsv"
    rows = tsv_rows(out / "filtered.tsv")
    assert {r["id"] for r in rows if r["reason"] == "invalid_character"} == set(dots)
    assert [(r["id"], r["reason"], r["detail"]) for r in rows if r["reason"] != "invalid_character"] == [
        (recs[0][0], "shorter_than_10", "7 residues")]
    text = src.read_text().splitlines()
    for r in rows:
        assert r["input"] == str(src) and text[int(r["line"]) - 1].split()[0] == f">{r['id']}"
    assert m.total_samples == 200 - len(rows) == 19


def test_limit_is_a_fraction_and_chosen_filters_do_not_count(rfam, tmp_path, capsys):
    """1 invalid record of 200 (0.5%) passes the default; the same with --max-filtered-fraction 0.001 fails;
    records dropped by --min-length never count, however many."""
    recs, _ = gapped(rfam[:200], every=200, keep=199)
    src = tmp_path / "one_bad.fasta"
    write_fasta(src, recs)
    assert run("rnacentral", "--input", src, "--output", tmp_path / "a") == 0
    assert run("rnacentral", "--input", src, "--output", tmp_path / "b", "--max-filtered-fraction", 0.001) == 1
    assert "1 of 200 records (0.5%) dropped as invalid" in capsys.readouterr().err
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()
    assert run("rnacentral", "--input", SAMPLE, "--output", tmp_path / "c", "--min-length", 120) == 0
    m = load_manifest(tmp_path / "c")
    assert m.filtered["shorter_than_120"] > 0.3 * 2107


@needs_shared
def test_real_phix_genomes_with_gaps(tmp_path, capsys):
    """The issue's case: phiX174 genomes with '.' (alignment gaps) fed to the genome job. Measured on the real 134
    variants: 39 of them, 35 given gaps."""
    recs = records(PHIX.read_text())[:39]
    recs, dots = gapped(recs, every=39, keep=4)
    assert len(dots) == 35
    src = tmp_path / "phix_gapped.fna"
    write_fasta(src, recs)
    assert run("genome", "--input", src, "--output", tmp_path / "g") == 1
    err = capsys.readouterr().err
    assert "data_prep: error: 35 of 39 records (89.7%) dropped as invalid" in err and "'.' x105" in err
    assert not (tmp_path / "g").exists()
    assert run("genome", "--input", src, "--output", tmp_path / "g", "--replace-invalid", "n") == 0
    assert "replaced 105 characters by 'N' in 35 records ('.'=105)" in capsys.readouterr().out
    m = load_manifest(tmp_path / "g")
    assert m.total_samples == 39 and m.stats["residues"] == sum(len(s) for *_, s in recs)
    # the untouched real files have nothing to replace
    assert run("genome", "--input", PHIX, PHIX_REF, "--output", tmp_path / "real", "--replace-invalid", "N") == 0
    m = load_manifest(tmp_path / "real")
    assert (m.total_samples, m.stats["replaced_characters"], m.stats["records_with_replacements"]) == (135, 0, 0)


@needs_shared
def test_proteins_given_to_a_nucleotide_job(tmp_path, capsys):
    assert run("rnacentral", "--input", UR50, "--output", tmp_path / "p") == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(err) == 1
    assert err[0].startswith("data_prep: error: 5000 of 5001 records (100.0%) dropped as invalid")
    assert "are amino acids: a protein file? use the uniref source" in err[0]
    assert any(f"{path}:2:" in err[0] for path in (UR50, Path(UR50).resolve()))  # ../shared may be a symlink
    assert "--replace-invalid" not in err[0]  # N for every amino acid would be no fix
    assert not (tmp_path / "p").exists()


@needs_shared
def test_replace_invalid_in_proteins_and_clusters(tmp_path, capsys):
    recs = records(UR50.read_text())[:300]
    bad = [(rid, desc, seq[:20] + "*" + seq[21:]) if k % 3 == 0 else (rid, desc, seq)
           for k, (rid, desc, seq) in enumerate(recs)]
    src = tmp_path / "ur50_star.fasta"
    write_fasta(src, bad, 80)
    assert run("uniref", "--input", src, "--output", tmp_path / "u") == 1
    assert run("uniref", "--input", src, "--output", tmp_path / "u", "--replace-invalid", "X") == 0
    m = load_manifest(tmp_path / "u")
    assert m.total_samples == 300 and m.stats["replaced"] == {"*": 100}
    # cluster members: the same, counted per member
    members = records(UR90.read_text())
    starred = [(rid, desc, seq[:10] + "*" + seq[11:]) if k % 4 == 0 else (rid, desc, seq)
               for k, (rid, desc, seq) in enumerate(members)]
    src90 = tmp_path / "ur90_star.fasta"
    write_fasta(src90, starred, 80)
    n_star = len(range(0, len(members), 4))
    capsys.readouterr()
    assert run("uniref", "--input", src90, "--clusters", MAPPING, "--output", tmp_path / "c") == 1
    assert f"{n_star} of {len(members)} members" in capsys.readouterr().err
    assert run("uniref", "--input", src90, "--clusters", MAPPING, "--output", tmp_path / "c",
               "--replace-invalid", "X") == 0
    assert f"replaced {n_star} characters by 'X' in {n_star} members" in capsys.readouterr().out
    m = load_manifest(tmp_path / "c")
    assert m.stats["members_kept"] == len(members) == 6376 and m.stats["replaced"] == {"*": n_star}
    # --replace-invalid must be a residue of the alphabet
    capsys.readouterr()
    assert run("uniref", "--input", src, "--output", tmp_path / "v", "--replace-invalid", "*") == 1
    assert "--replace-invalid '*' is not one residue of the ESM amino-acid alphabet" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------- windows
@pytest.mark.parametrize("n,L,S", [(5386, 1000, 800), (5386, 1000, 1000), (4600, 1000, 900), (10, 20, 5),
                                   (1000, 1000, 100), (2001, 1000, 1000), (7, 3, 1)])
@pytest.mark.parametrize("tail", ["short", "align", "drop"])
def test_window_spans_cover_the_record(n, L, S, tail):
    spans, kind = window_spans(n, L, S, tail)
    assert all(0 <= a < b <= n and b - a <= L for a, b in spans)
    starts = [a for a, _ in spans]
    assert starts == sorted(set(starts))
    if n <= L:
        assert spans == [(0, n)] and kind == "whole"
        return
    body = spans[:-1] if kind in ("short", "align") else spans
    assert body == [(k * S, k * S + L) for k in range(len(body))]
    if kind in ("exact", "short", "align"):  # nothing lost
        covered = set()
        for a, b in spans:
            covered.update(range(a, b))
        assert covered == set(range(n)) and spans[-1][1] == n
    assert kind == "exact" or kind == tail
    if kind == "short":
        assert spans[-1] == (len(body) * S, n) and n - len(body) * S < L
    elif kind == "align":
        assert spans[-1] == (n - L, n)
    elif kind == "drop":
        assert spans[-1][1] < n <= len(body) * S + L  # the next window would have been the short tail


@needs_shared
@pytest.mark.parametrize("tail", ["short", "align", "drop"])
def test_windows_of_a_real_genome(tail, tmp_path, capsys):
    (rid, _, seq), = records(PHIX_REF.read_text())
    assert len(seq) == 5386
    out = tmp_path / tail
    assert run("genome", "--input", PHIX_REF, "--output", out, "--window", 1000, "--stride", 800,
               "--window-tail", tail, "--shard-size", 3) == 0
    summary = capsys.readouterr().out
    m = load_manifest(out)
    got = samples(out)
    # windows start every 800 until one reaches 5386: 0 .. 4000 (4000 + 1000 < 5386), then the tail from 4800
    want = [(a, a + 1000) for a in range(0, 4001, 800)]
    want += {"short": [(4800, 5386)], "align": [(4386, 5386)], "drop": []}[tail]
    assert [(meta["start"], meta["end"]) for _, meta in sorted(got.values(), key=lambda x: x[1]["start"])] == want
    for text, meta in got.values():
        a, b = meta["start"], meta["end"]
        assert meta["id"] == f"{rid}:{a}-{b}" and meta["record"] == rid and meta["length"] == b - a == len(text)
        assert text == seq[a:b].upper()
    w = m.stats["windows"]
    assert m.stats["windowing"] == {"window": 1000, "stride": 800, "tail": tail}
    assert (w["records"], w["samples"], m.total_samples) == (1, len(want), len(want))
    assert w["residues_written"] == m.total_tokens == sum(b - a for a, b in want)
    assert w["tail_residues_dropped"] == (5386 - 5000 if tail == "drop" else 0)
    assert m.stats["residues"] == 5386 and m.inputs[0]["kept"] == 1
    assert f"(windows of 1 records: --window 1000 --stride 800, 1 {tail} tails" in summary
    # keys: record index then window number, sorted as written
    assert sorted(got) == [f"{0:012d}_{k:06d}" for k in range(len(want))]


# ------------------------------------------------------------------------------------------------ train/val split
def test_split_is_by_record_id(rfam, tmp_path, capsys):
    out = tmp_path / "split"
    assert run("rnacentral", "--input", SAMPLE, "--output", out, "--val-fraction", 0.1, "--shard-size", 500) == 0
    summary = capsys.readouterr().out.strip()
    assert summary.count("\n") == 0
    assert f"split by record-id hash (--val-fraction 0.1) into {out}/{{train,val}}" in summary
    assert f"-> {out / 'train' / 'manifest.json'}" in summary and f"-> {out / 'val' / 'manifest.json'}" in summary
    assert sorted(p.name for p in out.iterdir()) == [".written-by.json", "split.json", "train", "val"]
    doc = json.loads((out / "split.json").read_text())
    train, val = load_manifest(out / "train"), load_manifest(out / "val")
    assert doc["splits"]["val"]["samples"] == val.total_samples and doc["val_fraction"] == 0.1
    ids = {s: {meta["id"] for _, meta in samples(out / s).values()} for s in ("train", "val")}
    assert not ids["train"] & ids["val"] and len(ids["train"] | ids["val"]) == 2107

    def oracle(rid: str) -> bool:  # the documented rule, computed here
        return int.from_bytes(hashlib.sha256(rid.encode()).digest()[:8], "little") < 0.1 * 2 ** 64
    assert ids["val"] == {rid for rid, _, _ in rfam if oracle(rid)}
    assert 0.07 < len(ids["val"]) / 2107 < 0.13
    assert val.stats["split"] == {"name": "val", "val_fraction": 0.1, "by": "sha256(record id)"}
    assert train.inputs[0]["records"] + val.inputs[0]["records"] == 2107
    # the order of the records does not move any of them to the other split
    shuffled = tmp_path / "reversed.fasta"
    write_fasta(shuffled, rfam[::-1])
    assert run("rnacentral", "--input", shuffled, "--output", tmp_path / "rev", "--val-fraction", 0.1) == 0
    assert {meta["id"] for _, meta in samples(tmp_path / "rev" / "val").values()} == ids["val"]
    assert all(split_of(rid, 0.1) == ("val" if rid in ids["val"] else "train") for rid, _, _ in rfam)


@needs_shared
def test_split_keeps_the_windows_of_a_record_together_and_jobs_agree(tmp_path, capsys):
    args = ["genome", "--input", PHIX, "--window", 2000, "--stride", 1500, "--val-fraction", 0.25, "--dedup",
            "--shard-size", 40]
    assert run(*args, "--output", tmp_path / "one") == 0
    for i in range(3):
        assert run(*args, "--output", tmp_path / "three", "--num-jobs", 3, "--job-index", i) == 0
    assert run("merge", "--output", tmp_path / "three") == 0
    for s in ("train", "val"):
        one, three = samples(tmp_path / "one" / s), samples(tmp_path / "three" / s)
        assert one == three
        records_here = {meta["record"] for _, meta in one.values()}
        assert all(split_of(r, 0.25) == s for r in records_here)
        a, b = load_manifest(tmp_path / "one" / s), load_manifest(tmp_path / "three" / s)
        assert a.filtered == b.filtered and a.stats["windows"] == b.stats["windows"]
        assert a.stats["windowing"] == b.stats["windowing"] and a.stats["split"] == b.stats["split"]
        # the merged filtered.tsv lists the same records as the single job's
        key = lambda r: (r["id"], r["reason"], r["line"])  # noqa: E731
        assert sorted(map(key, tsv_rows(tmp_path / "one" / s / "filtered.tsv"))) == \
            sorted(map(key, tsv_rows(tmp_path / "three" / s / "filtered.tsv")))
    val = {meta["record"] for _, meta in samples(tmp_path / "one" / "val").values()}
    train = {meta["record"] for _, meta in samples(tmp_path / "one" / "train").values()}
    assert val and train and not val & train
    assert json.loads((tmp_path / "three" / "split.json").read_text())["splits"]["val"]["samples"] == \
        load_manifest(tmp_path / "one" / "val").total_samples


def test_split_run_resumes_byte_identical(tmp_path, monkeypatch, capsys, default_sigint):
    """Ctrl-C after the 4th finished shard (of both splits) keeps DIR.partial; the rerun verifies and continues."""
    import os
    import signal

    from data_prep import workdir
    args = ["rnacentral", "--input", SAMPLE, "--val-fraction", 0.3, "--shard-size", 100]
    assert run(*args, "--output", tmp_path / "ref") == 0
    record = workdir.WorkDir.record
    calls = []

    def interrupt_after_four(self, info, split=""):
        record(self, info, split)
        calls.append(split)
        if len(calls) == 4:  # Ctrl-C, from the shard writer's thread: the job stops a few shards later at most
            os.kill(os.getpid(), signal.SIGINT)
    monkeypatch.setattr(workdir.WorkDir, "record", interrupt_after_four)
    out = tmp_path / "out"
    assert run(*args, "--output", out) == 130
    monkeypatch.undo()
    assert not out.exists() and len(list((tmp_path / "out.partial").glob("*/*.tar"))) >= 4
    capsys.readouterr()
    assert run(*args, "--output", out) == 0
    assert int(re.search(r"(\d+) complete shards verified \(train ", capsys.readouterr().err)[1]) >= 4
    for s in ("train", "val"):
        a, b = load_manifest(out / s), load_manifest(tmp_path / "ref" / s)
        assert [(x.path, x.sha256) for x in a.shards] == [(x.path, x.sha256) for x in b.shards]
        assert a.stats == b.stats
    assert not (tmp_path / "out.partial").exists()



def test_a_failed_shard_write_fails_the_job_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    """A shard set's writes run on a thread of its own (data_prep/workdir.py ShardSet._send): a write that fails
    there (a full disk at the 3rd shard's block) is the job's error, exit 1, nothing published; the finished shards
    stay in DIR.partial and the rerun ends byte-identical to an uninterrupted run."""
    import errno

    from pipeline.data import shards

    args = ["rnacentral", "--input", SAMPLE, "--shard-size", 100]
    assert run(*args, "--output", tmp_path / "ref") == 0
    flush, calls = shards.ShardWriter._flush_block, []

    def full(self):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return flush(self)
    monkeypatch.setattr(shards.ShardWriter, "_flush_block", full)
    out = tmp_path / "out"
    capsys.readouterr()
    assert run(*args, "--output", out) == 1
    assert "No space left on device" in capsys.readouterr().err
    monkeypatch.undo()
    assert not out.exists() and len(list((tmp_path / "out.partial").glob("*.tar"))) >= 2
    assert run(*args, "--output", out) == 0
    a, b = load_manifest(out), load_manifest(tmp_path / "ref")
    assert [(x.path, x.sha256) for x in a.shards] == [(x.path, x.sha256) for x in b.shards] and a.stats == b.stats

# ---------------------------------------------------------------------------------------------- BabyLM CSV, members
@needs_shared
def test_babylm_csv_needs_text_column(tmp_path, capsys):
    with open(CHILDES, newline="", encoding="utf-8") as f:
        gloss = [row["gloss"] for row in csv.DictReader(f)]
    texts = [g for g in gloss if g.strip()]
    spm = tmp_path / "spm" / "childes"
    assert run("train-spm", "--input", CHILDES, "--output", spm, "--vocab-size", 500) == 1
    err = capsys.readouterr().err
    assert f"data_prep: error: {CHILDES}: a CSV file, not one utterance a line: pass --text-column NAME" in err
    assert "gloss" in err
    assert run("train-spm", "--input", CHILDES, "--output", spm, "--vocab-size", 500, "--text-column", "gloss") == 0
    out = tmp_path / "bl"
    assert run("babylm", "--input", CHILDES, "--output", out, "--spm", f"{spm}.model") == 1
    assert "--text-column NAME" in capsys.readouterr().err and not out.exists()
    assert run("babylm", "--input", CHILDES, "--output", out, "--spm", f"{spm}.model", "--text-column", "gloss") == 0
    m = load_manifest(out)
    assert m.total_samples == len(texts) and m.stats["residues"] == sum(map(len, texts))
    assert m.stats["input"].get("blank_cells", 0) == len(gloss) - len(texts)
    import sentencepiece
    sp = sentencepiece.SentencePieceProcessor(model_file=str(out / "tokenizer.model"))
    got = []
    for s in m.shards:
        got += [(meta, sp.decode(t.tolist())) for _, t, meta in read_shard(out / s.path, s.samples)]
    assert [t for _, t in got] == texts
    assert got[0][0]["id"].startswith("childes_nelson_utterances:") and got[0][0]["domain"] == \
        "childes_nelson_utterances"
    capsys.readouterr()
    assert run("babylm", "--input", CHILDES, "--output", tmp_path / "x", "--spm", f"{spm}.model",
               "--text-column", "utterance") == 1
    err = capsys.readouterr().err
    assert any(f"{path}:1: --text-column 'utterance' is not a column of the header (" in err
               for path in (CHILDES, Path(CHILDES).resolve()))  # ../shared may be a symlink


@needs_shared
def test_members_tsv_header_and_a_file_matching_nothing(tmp_path, capsys):
    """The real mapping TSV (header UR50_cluster_name<TAB>mapped_id) as --uniref90-members of the UniRef50 FASTA."""
    lines = MAPPING.read_text().splitlines()
    assert lines[0] == "UR50_cluster_name\tmapped_id"
    mapped = {ln.split("\t")[0]: ln.split("\t")[1].split(",") for ln in lines[1:]}
    assert run("uniref", "--input", UR50, "--output", tmp_path / "u", "--uniref90-members", MAPPING) == 0
    m = load_manifest(tmp_path / "u")
    fasta_ids = [rid for rid, _, _ in records(UR50.read_text())]
    assert m.stats["input"]["with_members"] == sum(rid in mapped for rid in fasta_ids) == 2500
    got = {meta["id"]: meta.get("members") for _, meta in samples(tmp_path / "u").values()}
    assert "UR50_cluster_name" not in got and all(got[k] == v for k, v in mapped.items())
    # ids without the UniRef50_ prefix match no record: an error, not 5001 samples without members
    wrong = tmp_path / "wrong.tsv"
    wrong.write_text(lines[0] + "\n" + "".join(f"{k.removeprefix('UniRef50_')}\t{','.join(v)}\n"
                                               for k, v in list(mapped.items())[:50]))
    capsys.readouterr()
    assert run("uniref", "--input", UR50, "--output", tmp_path / "w", "--uniref90-members", wrong) == 1
    err = capsys.readouterr().err
    assert f"--uniref90-members {wrong}: none of its 50 UniRef50 ids is a record id of the inputs" in err
    assert not (tmp_path / "w").exists() and not (tmp_path / "w.partial").exists()
    # --clusters whose member ids are not the FASTA's ids (UniRef90_ names instead of entry names)
    bad = tmp_path / "clusters_wrong.tsv"
    bad.write_text(lines[0] + "\n" + "".join(f"{k}\tUniRef90_{v[0]}\n" for k, v in list(mapped.items())[:20]))
    assert run("uniref", "--input", UR90, "--clusters", bad, "--output", tmp_path / "c") == 1
    err = capsys.readouterr().err
    assert f"{bad}: none of the 20 member ids of the clusters is a record id of the FASTA inputs" in err
    assert not (tmp_path / "c").exists()


# --------------------------------------------------------------------------------------------------------- progress
def test_progress_goes_to_stderr_and_stdout_stays_one_line(tmp_path):
    base = [sys.executable, "-m", "data_prep", "rnacentral", "--input", str(SAMPLE), "--output", str(tmp_path / "o")]
    p = subprocess.run(base + ["--progress", "log", "--progress-interval", "0.000001"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("\n") == 1 and p.stdout.startswith("data_prep rnacentral: records read 2107")
    logs = [ln for ln in p.stderr.splitlines() if ln.startswith("data_prep rnacentral: ")]
    assert logs and "bytes (" in logs[-1] and "records" in logs[-1] and "elapsed" in logs[-1]
    assert any("remaining ~" in ln for ln in logs)
    # a bar forced on while stderr is a pipe: still nothing on stdout but the summary
    p = subprocess.run(base + ["--progress", "bar", "--overwrite"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stdout.count("\n") == 1 and "rnacentral" in p.stderr
    p = subprocess.run(base + ["--progress", "off", "--overwrite"], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and p.stderr == ""
