"""data_prep's batch path (data_prep/batch.py) against the per-record path it replaces, and --workers.

The reference is the per-record reader and loop of data_prep/build.py (kept for the inputs the batch path hands over)
writing per-record shards (format 1, ``BLOCK_SAMPLES = None``): the code path and shard layout of data_prep before
blocks. Every record (key, tokens, meta), every manifest count and statistic and every filtered.tsv row must be
equal; only the tar layout differs.
"""
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

from data_prep import build, workdir
from data_prep.__main__ import main
from pipeline.data.shard_reader import read_clusters, read_shard

REPO = Path(__file__).resolve().parents[2]
SAMPLES = REPO / "data" / "samples"
RFAM = SAMPLES / "rfam_nrc_train_sample.fasta.gz"
UR90, UR_TSV = SAMPLES / "uniref90_clusters_sample.fasta.gz", SAMPLES / "uniref50_to_uniref90_sample.tsv"

# Every quirk the batch path must hand over or reproduce: lowercase, IUPAC, U and T, CRLF, blank and whitespace
# lines, a header without description, an empty and a short record, characters outside the alphabet (X, a blank
# inside a line) and a trailing tab (stripped), a non-ASCII header, a '>' inside a description.
QUIRKS = (b">r1 first one\nACGTacgtNNRY\nACGU\n>r2\n\nACGTACGTAC\n\n>r3 empty\n>r4 short \xc3\xa9\nACG\n"
          b">r5 bad char\nACGTXACGTACGT\n>r6 tab at end\nACGTACGTACGT\t\nACGT\n>r7 a > in it\r\nACGTACGTAAAA\r\n"
          b">r8   spaced   \nAC GTACGTACGT\n>r9 last\nacgtacgtacgtacgt")
UNIREF = (b">UniRef50_A name one n=3 Tax=Homo sapiens TaxID=9606 RepID=A_HUMAN\nMKTAYIAKQRQISFVKSHFSRQ\n"
          b">UniRef50_B TaxID=67581.0 RepID=B_STRVD\nmktayiakqrqisfvksh\n"
          b">UniRef50_C ClusterName=UniRef90_C TaxID=1 RepID=C_X\nMKTAYIAKQRQ\n"
          b">UniRef50_D odd n=1e3 Tax=x TaxID=007 RepID=D\nMKTAYIAKQRQISF\n"
          b">UniRef50_E\nMKTAY1AKQRQISF\n>UniRef50_F k=v n=2 Tax=a TaxID=2 RepID=F\nMKTAYIAKQRQ\n")


def content(d: Path, clusters: bool = False, name: str = "manifest*.json") -> list:
    """(records, manifest without shard list and format, filtered lists) of a shard directory (or its splits)."""
    dirs = [d] if list(d.glob("manifest*.json")) else [d / "train", d / "val"]
    out = []
    for x in dirs:
        m = json.loads(sorted(x.glob(name))[0].read_text())
        read = read_clusters if clusters else read_shard
        recs = [(k, [t.tolist() for t in v] if clusters else v.tolist(), meta)
                for s in m["shards"] for k, v, meta in read(x / s["path"], s["samples"])]
        for k in ("shards", "format"):
            m.pop(k)
        out.append((recs, m, [f.read_text() for f in sorted(x.glob("filtered*.tsv"))]))
    return out


def both(tmp_path: Path, monkeypatch, args: list, clusters: bool = False, rc: int = 0, capsys=None):
    """Run ``args`` on the batch path (blocks) and on the reference (per-record path, per-record shards)."""
    outs = []
    for name, reference in (("new", False), ("ref", True)):
        with monkeypatch.context() as mp:
            if reference:
                mp.setattr(build, "batch_reader", lambda *a: None)
                mp.setattr(workdir, "BLOCK_SAMPLES", None)
            out = tmp_path / name
            assert main([*map(str, args), "--output", str(out)]) == rc
            if capsys is not None:
                outs.append(capsys.readouterr().err.replace(str(out), "OUT"))
            elif rc == 0:
                outs.append(content(out, clusters))
    assert outs[0] == outs[1]
    return outs[0]


@pytest.mark.parametrize("extra", [
    [], ["--min-length", 60, "--max-length", 200, "--shard-size", 97],
    ["--val-fraction", 0.3, "--num-jobs", 3, "--job-index", 2], ["--num-jobs", 2, "--job-index", 1, "--strict"],
])
def test_rfam_sample_equals_per_record_path(tmp_path, monkeypatch, extra):
    got = both(tmp_path, monkeypatch, ["rnacentral", "--input", RFAM, *extra])
    assert sum(len(r) for r, _, _ in got) > 100


@pytest.mark.parametrize("extra", [["--max-filtered-fraction", 1], ["--replace-invalid", "N", "--min-length", 0],
                                   ["--max-filtered-fraction", 1, "--num-jobs", 2, "--job-index", 0]])
def test_quirks_equal_per_record_path(tmp_path, monkeypatch, extra):
    quirks = tmp_path / "quirks.fa.gz"
    quirks.write_bytes(gzip.compress(QUIRKS))
    (recs, manifest, lists), = both(tmp_path, monkeypatch, ["fasta", "--alphabet", "rna", "--input", quirks, RFAM,
                                                            *extra])
    if "--replace-invalid" not in extra and "--num-jobs" not in extra:
        # r5 (X) and r8 (a blank inside a line) are invalid; r6's trailing tab is stripped like any line end (the
        # batch path hands r6 over, the per-record parser keeps it)
        assert manifest["filtered"]["invalid_character"] == 2 and manifest["filtered"]["empty"] == 1
        assert manifest["stats"]["lowercase_residues"] > 16 and "r8" in lists[0] and "r6" not in lists[0]
        assert any(m["id"] == "r6" and m["length"] == 16 for _, _, m in recs)


def test_bad_input_errors_equal_per_record_path(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "bad.fa"
    bad.write_bytes(QUIRKS)
    err = both(tmp_path, monkeypatch, ["fasta", "--alphabet", "rna", "--input", bad], rc=1, capsys=capsys)
    assert "dropped as invalid" in err  # 3 of 9 records over --max-filtered-fraction 0.01
    both(tmp_path, monkeypatch, ["fasta", "--alphabet", "rna", "--input", bad, "--strict"], rc=1, capsys=capsys)
    bad.write_bytes(QUIRKS.replace(b">r4 short \xc3\xa9", b">  "))  # record 3: job 1's, an error in job 0 too
    err = both(tmp_path, monkeypatch, ["fasta", "--alphabet", "rna", "--input", bad, "--num-jobs", 2,
                                       "--job-index", 0], rc=1, capsys=capsys)
    assert "header has no record id" in err and not list(tmp_path.glob("*/*.tar"))


def test_uniref_headers_equal_per_record_path(tmp_path, monkeypatch):
    fa = tmp_path / "u.fasta"
    fa.write_bytes(UNIREF)
    (recs, manifest, _), = both(tmp_path, monkeypatch, ["uniref", "--input", fa, UR90, "--max-filtered-fraction", 1])
    metas = {m["id"]: m for _, _, m in recs}
    assert metas["UniRef50_A"]["name"] == "name one" and metas["UniRef50_B"]["taxid"] == 67581
    assert metas["UniRef50_D"]["n"] == 1000 and metas["UniRef50_D"]["taxid"] == 7  # as parse_uniref_header
    assert manifest["filtered"]["invalid_character"] == 1


def test_clusters_equal_per_record_shards(tmp_path, monkeypatch):
    both(tmp_path, monkeypatch, ["uniref", "--input", UR90, "--clusters", UR_TSV, "--shard-size", 40], clusters=True)


def unordered(d: Path) -> list:
    """content() with the records and filtered.tsv rows sorted: a fed --workers run holds a 1-process run's records
    and rows, grouped by worker."""
    out = []
    for recs, m, lists in content(d, name="manifest.json"):
        rows = sorted(line for f in lists[-1:] for line in f.splitlines()[1:])  # filtered.tsv (sorted last)
        m["stats"].pop("filtered_list", None)
        out.append((sorted(recs, key=lambda r: r[0]), m, rows))
    return out


@pytest.mark.parametrize("extra", [["--shard-size", 300, "--val-fraction", 0.2],
                                   ["--min-length", 60, "--max-length", 200, "--shard-size", 97]])
def test_fed_workers_equal_one_process(tmp_path, monkeypatch, capsys, extra):
    """--workers 3 on the batch reader: the parent cuts small chunks (many per input, dealt round-robin), the
    workers write them; records, counts and rows equal a 1-process run's, the shard list is job by job."""
    monkeypatch.setattr("data_prep.batch.CHUNK", 3000)
    quirks = tmp_path / "quirks.fa.gz"
    quirks.write_bytes(gzip.compress(QUIRKS))
    bom = tmp_path / "bom.fa"  # a UTF-8 byte-order mark: read by every worker itself, record by record
    bom.write_bytes(b"\xef\xbb\xbf" + QUIRKS.replace(b">r", b">b"))
    args = ["fasta", "--alphabet", "rna", "--input", RFAM, quirks, bom, RFAM.with_suffix(""),
            "--max-filtered-fraction", 1, *extra]
    (tmp_path / RFAM.with_suffix("").name).write_bytes(gzip.decompress(RFAM.read_bytes()))
    args[args.index(RFAM.with_suffix(""))] = tmp_path / RFAM.with_suffix("").name  # a plain-text input as well
    assert main([*map(str, args), "--output", str(tmp_path / "w"), "--workers", "3"]) == 0
    assert "(3 workers)" in capsys.readouterr().out
    assert main([*map(str, args), "--output", str(tmp_path / "one")]) == 0
    assert unordered(tmp_path / "w") == unordered(tmp_path / "one")
    # deterministic: a second run writes the same shards in the same order
    assert main([*map(str, args), "--output", str(tmp_path / "w2"), "--workers", "3"]) == 0
    assert content(tmp_path / "w2", name="manifest.json") == content(tmp_path / "w", name="manifest.json")
    d = tmp_path / "w" / ("train" if "--val-fraction" in extra else "")
    assert len({json.loads(p.read_text())["shards"][0]["path"].split("-")[1]
                for p in d.glob("manifest-job*.json")}) == 3  # every worker wrote shards
    assert not list(tmp_path.glob("*.workers-partial"))


@pytest.mark.parametrize("bad", [b">r2 x\nACGTXACGT\n", b">  \nACGT\n"])
def test_fed_workers_report_the_first_error(tmp_path, monkeypatch, capsys, bad):
    """Errors in several chunks: the one a single process meets first (--strict bad character, header without id)."""
    monkeypatch.setattr("data_prep.batch.CHUNK", 200)
    good = b"".join(b">g%d\nACGTACGTACGTACGTACGT\n" % i for i in range(60))
    fa = tmp_path / "e.fa"
    fa.write_bytes(good + bad.replace(b"r2", b"first") + good + bad.replace(b"r2", b"second") + good)
    errs = []
    for w in ("1", "2", "3"):
        assert main(["rnacentral", "--input", str(fa), "--output", str(tmp_path / "o"), "--strict",
                     "--workers", w]) == 1
        errs.append(capsys.readouterr().err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["e.fa"]
    assert errs[0].count("\n") == 1 and errs[1] == errs[0] == errs[2], errs
    assert "first" in errs[0] or ":121:" in errs[0]


def test_truncated_gzip_in_a_fed_run_is_one_error(tmp_path, capsys):
    raw = gzip.compress(b"".join(b">g%d\n%s\n" % (i, b"ACGU" * 300) for i in range(20000)))
    gz = tmp_path / "t.fa.gz"
    gz.write_bytes(raw[:len(raw) // 2])
    assert main(["rnacentral", "--input", str(gz), "--output", str(tmp_path / "o"), "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{gz}: corrupt or truncated gzip data" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.fa.gz"]


def test_unfed_workers_equal_num_jobs_and_merge(tmp_path, capsys):
    """--dedup takes the per-record path: --workers N is exactly jobs 0..N-1 of N and merge."""
    args = ["rnacentral", "--input", RFAM, "--shard-size", 300, "--val-fraction", 0.2, "--dedup"]
    assert main([*map(str, args), "--output", str(tmp_path / "w"), "--workers", "2"]) == 0
    assert "(2 workers)" in capsys.readouterr().out
    for i in range(2):
        assert main([*map(str, args), "--output", str(tmp_path / "j"), "--num-jobs", "2", "--job-index",
                     str(i)]) == 0
    assert main(["merge", "--output", str(tmp_path / "j")]) == 0
    assert content(tmp_path / "w") == content(tmp_path / "j")
    assert json.loads((tmp_path / "w" / "split.json").read_text()) == \
        json.loads((tmp_path / "j" / "split.json").read_text())
    assert not list(tmp_path.glob("*.workers-partial"))


def test_workers_bad_input_one_error_nothing_left(tmp_path, capsys):
    bad = tmp_path / "bad.fa"
    bad.write_bytes(QUIRKS)
    assert main(["fasta", "--alphabet", "rna", "--input", str(bad), "--output", str(tmp_path / "o"),
                 "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("data_prep: error: ") and "dropped as invalid" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.fa"]


def test_windows_and_dedup_take_the_per_record_path(tmp_path):
    """--window / --dedup need each record on its own: no batch reader, the same output as before."""
    from data_prep import SOURCES
    from data_prep.sources import Context
    from data_prep.encode import Encoder
    from data_prep.settings import Settings
    enc = Encoder(SOURCES["rnacentral"], "rna", None)
    ctx = Context(enc.invalid_positions)
    assert build.batch_reader(SOURCES["rnacentral"], enc, Settings(), ctx) is not None
    assert build.batch_reader(SOURCES["rnacentral"], enc, Settings(dedup=True), ctx) is None
    assert build.batch_reader(SOURCES["rnacentral"], enc, Settings(window=10), ctx) is None
    assert build.batch_reader(SOURCES["opengenome2"], enc, Settings(), ctx) is None
    assert np.array_equal(np.frombuffer(b"acgtACGTN".translate(build.batch_reader(
        SOURCES["rnacentral"], enc, Settings(), ctx).tokens), np.uint8), enc.encode(b"ACGUACGUN"))
