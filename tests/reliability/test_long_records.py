"""Issue 49 case 4: a gzip bomb hung data_prep. A 2 MB file holding one 2 GiB FASTA record ran past 240 s at 2.3 GB
of memory, and --max-length 1000 did not help: the batch reader (data_prep/batch.py) rebuilt and searched the growing
record on every block, so time grew with the square of the record's length. Now a record is read in time linear in
its length (each block searched once, the text kept as a list of blocks, joined once), and a record longer than
--max-record-length (or --max-length) is counted as filtered and skipped while it is read, in bounded memory, without
being built.

Bombs are built as gzip members laid end to end: one member holding the header, then one compressed MiB of sequence
lines repeated (a 2 GiB record in about 2 MB, as in the campaign)."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import REPO, SAMPLE_FASTA, launch_env

MIB = 1 << 20
LINE = 60  # residues per sequence line


def sequence_mib(seed: int = 0) -> bytes:
    """One MiB of sequence lines: one random line of 60 residues (ACGT) and its line break, repeated (what deflate
    packs about 1000 to 1), the last line cut short."""
    rng = np.random.default_rng(seed)
    line = np.frombuffer(b"ACGT", np.uint8)[rng.integers(0, 4, LINE)].tobytes() + b"\n"
    return (line * (MIB // len(line) + 1))[:MIB - 1] + b"\n"


def bomb(path, mib: int, rid: str = "bomb", tail: bytes = b"") -> int:
    """A gzip file of one record of ``mib`` MiB of sequence lines, then ``tail`` (gzip members of whole records).
    Returns the record's residues."""
    block = sequence_mib()
    member = gzip.compress(block, compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(f">{rid} a record of {mib} MiB\n".encode()))
        for _ in range(mib):
            f.write(member)
        f.write(tail)
    return mib * (len(block) - block.count(b"\n"))


def data_prep(args: list, timeout: int = 600) -> tuple[subprocess.CompletedProcess, float, int]:
    """``python -m data_prep ARGS`` in a process that reports its own peak RSS (KiB): (process, seconds, peak)."""
    code = ("import resource, runpy, sys\n"
            f"sys.argv = ['data_prep', *{[str(a) for a in args]!r}]\n"
            "try:\n    runpy.run_module('data_prep', run_name='__main__')\n"
            "except SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
            "sys.exit(code)\n")
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=launch_env(), capture_output=True, text=True,
                       timeout=timeout)
    seconds = time.perf_counter() - t
    peak = [int(ln.split()[1]) for ln in r.stderr.splitlines() if ln.startswith("peak_rss_kib")]
    return r, seconds, peak[0] if peak else -1


def test_a_gzip_bomb_is_counted_as_too_long_in_bounded_memory(tmp_path):
    """A 256 MiB record in 0.25 MB of gzip, before the sample's 2,107 records. Under --max-length 1000 (which did
    not help before) and under --max-record-length 10 M, the record is filtered (longer_than_N, listed with its
    residues), the others are written as without it, and the run's peak memory is within 2x a run on the sample
    alone."""
    fasta = tmp_path / "bomb.fasta.gz"
    residues = bomb(fasta, 256, tail=SAMPLE_FASTA.read_bytes())
    assert fasta.stat().st_size < MIB
    normal, _, normal_peak = data_prep(["rnacentral", "--input", SAMPLE_FASTA, "--output", tmp_path / "normal",
                                        "--progress", "off", "--max-length", "1000"])
    assert normal.returncode == 0, normal.stderr
    written = json.loads((tmp_path / "normal" / "manifest.json").read_text())["total_samples"]
    for flag, bound in (("--max-length", 1000), ("--max-record-length", 10_000_000)):
        out = tmp_path / flag.strip("-")
        r, _, peak = data_prep(["rnacentral", "--input", fasta, "--output", out, "--progress", "off", flag,
                                str(bound)])
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
        manifest = json.loads((out / "manifest.json").read_text())
        assert manifest["total_samples"] == written
        rows = (out / "filtered.tsv").read_text().splitlines()
        assert rows[1].split("\t") == ["bomb", f"longer_than_{bound}", str(fasta), "1", f"{residues} residues"]
        assert f"longer_than_{bound}=" in r.stdout
        assert 0 < peak <= 2 * normal_peak, (flag, peak, normal_peak)
    assert manifest["filtered"]["longer_than_10000000"] == 1

    # the bomb alone (the campaign's file): one line, nothing written
    alone = tmp_path / "alone.fasta.gz"
    bomb(alone, 64)
    r, _, _ = data_prep(["rnacentral", "--input", alone, "--output", tmp_path / "none", "--progress", "off",
                         "--max-record-length", "10000000"])
    assert r.returncode == 1 and r.stderr.splitlines()[0] == (
        "data_prep: error: no records written: all 1 records filtered {'empty': 0, 'shorter_than_10': 0, "
        "'longer_than_10000000': 1}"), r.stderr
    assert not (tmp_path / "none").exists()


def test_reading_a_long_record_takes_time_linear_in_its_length(tmp_path):
    """cut.chunks over one record of 64 and of 256 MiB: 4 times the bytes, about 4 times the time (it was 16: the
    square of the length; the bound, 8, lies between the two by the same factor). The skip path (past the bound) and
    the keep path (spilled to a temporary file and handed out whole) each. CPU seconds of this process (its read-ahead
    thread's included), best of 2: other work on the machine moves wall time by more than the margin."""
    from data_prep import cut

    def seconds(path, bound):
        best = float("inf")
        for _ in range(2):
            t = time.process_time()
            out = list(cut.chunks(path, **({} if bound is None else {"bound": bound})))
            best = min(best, time.process_time() - t)
        return best, out

    small, large = tmp_path / "64.fa.gz", tmp_path / "256.fa.gz"
    n_small, n_large = bomb(small, 64), bomb(large, 256)
    for bound in (None, 10_000_000):
        (t_small, out_small), (t_large, out_large) = seconds(small, bound), seconds(large, bound)
        if bound is None:  # kept: the record's text, whole, once
            assert [len(t) for t, _ in out_small] == [len(gzip.decompress(small.read_bytes()))]
            assert len(out_large) == 1 and out_large[0][0].count(b">") == 1
        else:
            assert [(t.residues, t.line) for t, _ in out_small + out_large] == [(n_small, 1), (n_large, 1)]
        assert t_large / t_small < 8, (bound, t_small, t_large)


def test_a_record_straddling_many_blocks_is_parsed_once(tmp_path, monkeypatch, capsys):
    """A 50 MB record read in 64 KiB blocks (800 of them) among short records: parsed once, written whole, in about
    the time the same residues take as 50,000 records of 1,000 (it took the square of the block count before)."""
    from data_prep import batch, cut
    from data_prep.__main__ import main
    from pipeline.data.shard_reader import read_shard
    from pipeline.data.tokenizer import NucleotideTokenizer

    rng = np.random.default_rng(1)
    seq = np.frombuffer(b"ACGU", np.uint8)[rng.integers(0, 4, 50_000_000)].tobytes()
    wrapped = b"\n".join(seq[i:i + LINE] for i in range(0, len(seq), LINE))
    short = b"".join(b">s%d\n%s\n" % (i, seq[i * 100:i * 100 + 100]) for i in range(20))
    one = tmp_path / "one.fa"
    one.write_bytes(short + b">long\n" + wrapped + b"\n" + short.replace(b">s", b">t"))
    many = tmp_path / "many.fa"
    many.write_bytes(short + b"".join(b">m%d\n%s\n" % (i, seq[i * 1000:(i + 1) * 1000]) for i in range(50_000)))

    parsed = []
    parse = batch.Reader.parse
    monkeypatch.setattr(batch.Reader, "parse", lambda self, text, line, first: parsed.append(text.count(b">")) or
                        parse(self, text, line, first))
    monkeypatch.setattr(cut, "CHUNK", 1 << 16)

    def prep(path, out):
        t = time.perf_counter()
        assert main(["rnacentral", "--input", str(path), "--output", str(out), "--progress", "off",
                     "--shard-size", "100000", "--max-length", "60000000"]) == 0, capsys.readouterr().err
        return time.perf_counter() - t

    baseline = prep(many, tmp_path / "many")
    parsed.clear()
    took = prep(one, tmp_path / "one")
    long_chunks = [n for n in parsed if n == 1]
    assert sum(parsed) == 41 and long_chunks, parsed  # every record parsed once; the long one on its own
    manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    records = {m["id"]: t for s in manifest["shards"] for _, t, m in read_shard(tmp_path / "one" / s["path"])}
    assert len(records) == 41
    assert np.array_equal(records["long"], NucleotideTokenizer("rna").encode(seq))
    assert took < 3 * baseline + 5, (took, baseline)
