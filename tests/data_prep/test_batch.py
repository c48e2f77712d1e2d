"""data_prep's batch path (data_prep/batch.py) against the per-record path it replaces, and --workers.

The reference is the per-record reader and loop of data_prep/build.py (kept for the inputs the batch path hands over)
writing per-record shards (format 1, ``BLOCK_SAMPLES = None``): the code path and shard layout of data_prep before
blocks. Every record (key, tokens, meta), every manifest count and statistic and every filtered.tsv row must be
equal; only the tar layout differs.
"""
import gzip
import json
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from data_prep import batch, build, workdir
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


def files(d: Path) -> dict:
    """Every file of an output directory, its own path written as OUT (the ownership marker left out)."""
    return {str(p.relative_to(d)): p.read_bytes().replace(str(d).encode(), b"OUT") for p in sorted(d.rglob("*"))
            if p.is_file() and p.name != ".written-by.json"}


def parsed_in(monkeypatch, log: Path) -> None:
    """Log the pid of every batch parse (Reader.parse) into ``log``: a pool worker inherits the patch by fork. In a
    pool worker every other chunk (by its first record's index) takes 5 ms longer, one holding a record named
    "first" 50 ms: the parses end out of order."""
    real, parent = batch.Reader.parse, os.getpid()

    def logged(self, text, first_line, first_index):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        if os.getpid() != parent:
            time.sleep(0.05 if b">first" in text else 0.005 if first_index % 2 else 0)
        return real(self, text, first_line, first_index)
    monkeypatch.setattr(batch.Reader, "parse", logged)


@pytest.mark.parametrize("extra", [["--shard-size", 300, "--val-fraction", 0.2],
                                   ["--min-length", 60, "--max-length", 200, "--shard-size", 97]])
def test_workers_equal_one_process_byte_for_byte(tmp_path, monkeypatch, capsys, extra):
    """--workers 3 on the batch reader: the chunks (small: many per input) are parsed in the pool's processes, not
    in this one, and written here in input order: every file equals a 1-process run's, byte for byte (inputs that
    the batch reader does not take, a byte-order mark, read record by record in their place)."""
    monkeypatch.setattr("data_prep.cut.CHUNK", 3000)
    quirks = tmp_path / "quirks.fa.gz"
    quirks.write_bytes(gzip.compress(QUIRKS))
    bom = tmp_path / "bom.fa"  # a UTF-8 byte-order mark: read record by record
    bom.write_bytes(b"\xef\xbb\xbf" + QUIRKS.replace(b">r", b">b"))
    plain = tmp_path / RFAM.with_suffix("").name  # a plain-text input as well
    plain.write_bytes(gzip.decompress(RFAM.read_bytes()))
    args = ["fasta", "--alphabet", "rna", "--input", RFAM, quirks, bom, plain, "--max-filtered-fraction", 1, *extra]
    log = tmp_path / "parsed.log"
    parsed_in(monkeypatch, log)
    assert main([*map(str, args), "--output", str(tmp_path / "one")]) == 0
    assert set(log.read_text().split()) == {str(os.getpid())}
    log.unlink()
    assert main([*map(str, args), "--output", str(tmp_path / "w"), "--workers", "3"]) == 0
    assert "(3 workers)" in capsys.readouterr().out
    pids = log.read_text().split()
    assert len(pids) > 50 and str(os.getpid()) not in pids  # every chunk parsed in a pool process
    assert files(tmp_path / "w") == files(tmp_path / "one")
    assert not list(tmp_path.glob("*.workers-partial")) and not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("bad", [b">r2 x\nACGTXACGT\n", b">  \nACGT\n"])
def test_workers_report_the_first_error(tmp_path, monkeypatch, capsys, bad):
    """Errors in several chunks (--strict bad character, header without id), each chunk parsed in a pool process:
    the error is the one a single process meets first, naming its file and line."""
    monkeypatch.setattr("data_prep.cut.CHUNK", 200)
    good = b"".join(b">g%d\nACGTACGTACGTACGTACGT\n" % i for i in range(60))
    fa = tmp_path / "e.fa"
    fa.write_bytes(good + bad.replace(b"r2", b"first") + good + bad.replace(b"r2", b"second") + good)
    log = tmp_path / "parsed.log"
    parsed_in(monkeypatch, log)
    errs = []
    for w in ("1", "2", "3"):
        assert main(["rnacentral", "--input", str(fa), "--output", str(tmp_path / "o"), "--strict",
                     "--workers", w]) == 1
        errs.append(capsys.readouterr().err)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["e.fa", "parsed.log"]
    assert errs[0].count("\n") == 1 and errs[1] == errs[0] == errs[2], errs
    # the first bad record (header line 121): its bad character, or its header
    assert (f"{fa}:122:5: character 'X'" if b"X" in bad else f"{fa}:121: header has no record id") in errs[0]
    assert len(set(log.read_text().split()) - {str(os.getpid())}) >= 2  # the --workers runs parsed in the pool


def test_a_killed_parse_worker_stops_the_run_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    """A pool worker SIGKILLed (as by the OOM killer) while it parses: one error naming its exit status, the
    finished shards kept in OUT.partial (no bad input), and the rerun resumes to the 1-process output."""
    monkeypatch.setattr("data_prep.cut.CHUNK", 3000)
    plain = tmp_path / "rfam.fa"
    plain.write_bytes(gzip.decompress(RFAM.read_bytes()))
    args = ["rnacentral", "--input", str(plain), "--shard-size", "50", "--progress", "off"]
    real, parent, marker = batch.Reader.parse, os.getpid(), tmp_path / "killed"

    def die_once(self, text, first_line, first_index):
        if os.getpid() != parent and first_index > 1000 and not marker.exists():
            marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, text, first_line, first_index)
    monkeypatch.setattr(batch.Reader, "parse", die_once)
    assert main([*args, "--output", str(tmp_path / "w"), "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert err == "data_prep: error: --workers 2: a worker process exited with status -9\n", err
    assert list((tmp_path / "w.partial").glob("*.tar")) and not (tmp_path / "w").exists()
    assert main([*args, "--output", str(tmp_path / "w"), "--workers", "2"]) == 0
    assert "resuming" in capsys.readouterr().err
    assert main([*args, "--output", str(tmp_path / "one")]) == 0
    assert files(tmp_path / "w") == files(tmp_path / "one")


def test_truncated_gzip_in_a_workers_run_is_one_error(tmp_path, capsys):
    raw = gzip.compress(b"".join(b">g%d\n%s\n" % (i, b"ACGU" * 300) for i in range(20000)))
    gz = tmp_path / "t.fa.gz"
    gz.write_bytes(raw[:len(raw) // 2])
    assert main(["rnacentral", "--input", str(gz), "--output", str(tmp_path / "o"), "--workers", "2"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{gz}: corrupt or truncated gzip data" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.fa.gz"]


def test_per_record_workers_equal_num_jobs_and_merge(tmp_path, capsys):
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
    assert batch.batch_reader(SOURCES["rnacentral"], enc, Settings(), ctx) is not None
    assert batch.batch_reader(SOURCES["rnacentral"], enc, Settings(dedup=True), ctx) is None
    assert batch.batch_reader(SOURCES["rnacentral"], enc, Settings(window=10), ctx) is None
    assert batch.batch_reader(SOURCES["opengenome2"], enc, Settings(), ctx) is None
    assert np.array_equal(np.frombuffer(b"acgtACGTN".translate(batch.batch_reader(
        SOURCES["rnacentral"], enc, Settings(), ctx).tokens), np.uint8), enc.encode(b"ACGUACGUN"))


def test_record_ids_of_a_clusters_scan_are_str_split_s():
    """The --clusters scan takes a chunk's record ids by one regex over its headers (batch._ID); reference: the
    first field of str.split(), for headers with every whitespace character str.split knows (Unicode included),
    before, inside and after the id, and headers with no id at all."""
    from data_prep.batch import _ID

    spaces = [chr(c) for c in range(0x3001) if chr(c).isspace() and chr(c) != "\n"]
    heads = ["", "UniRef90_A0A 1", "é_id desc"] + [f"{s}id{k}{s}x y{s}" for k, s in enumerate(spaces)] + spaces
    want = [(h.split(None, 1) or [""])[0] for h in heads]
    assert _ID.findall("\n".join(heads)) == want
    assert want.count("") == len(spaces) + 1
