"""One record rule (issue 50 item 1): the same damaged records through every path give the same outcomes and
reasons, and every path takes them from data_prep/rule.py.

The paths: the batch path (a plain FASTA starting with a header), the per-record path (the same records after a
UTF-8 byte-order mark, which the batch reader leaves to it; and --dedup), two jobs of --num-jobs 2 then merge (byte ranges),
--workers 2 on the gzipped file, and the cluster members (--clusters, one and two workers), each record its own
cluster. The outcome of a record is its filtered.tsv row (reason and detail; a member's detail without its
"member of <cluster>; " prefix), or kept.
"""
import gzip
from pathlib import Path

import pytest

from data_prep import rule
from data_prep.__main__ import main

OK = "MKTAYIAKQRQISFVKSHFSRQLEERLGLIEVQ"
RECORDS = [  # id, sequence lines, expected reason (None: kept)
    ("ok1", [OK], None),
    ("empty", [], "empty"),
    ("short", ["MKTA"], "shorter_than_10"),
    ("long", [OK * 3, OK * 2], "longer_than_120"),
    ("bad", [OK[:10] + "J1" + OK[10:]], "invalid_character"),
    ("lower", [(OK[1:] + "W").lower()], None),
    ("edge", ["M" * 120], None),
    ("over", ["M" * 121], "longer_than_120"),
    ("ok2", [OK[::-1]], None),
]
OPTIONS = ["--min-length", "10", "--max-length", "120", "--max-filtered-fraction", "1"]


def _fasta(records) -> bytes:
    return "".join(f">{rid} some description\n" + "".join(f"{x}\n" for x in seq) for rid, seq, _ in records).encode()


@pytest.fixture
def inputs(tmp_path):
    plain = tmp_path / "in.fasta"
    plain.write_bytes(_fasta(RECORDS))
    blank = tmp_path / "bom.fasta"
    blank.write_bytes(b"\xef\xbb\xbf" + _fasta(RECORDS))  # a BOM: the batch reader leaves it
    gz = tmp_path / "in.fasta.gz"
    gz.write_bytes(gzip.compress(_fasta(RECORDS)))
    tsv = tmp_path / "map.tsv"
    tsv.write_text("UR50_cluster_name\tmapped_id\n" + "".join(f"UniRef50_{rid}\t{rid}\n" for rid, _, _ in RECORDS))
    return {"plain": plain, "blank": blank, "gz": gz, "tsv": tsv}


def _paths(inputs, out: Path, options: tuple = ()) -> dict[str, Path]:
    """Every path's output directory."""
    def _run(*args) -> None:
        assert main([str(a) for a in args] + OPTIONS + list(options) + ["--progress", "off"]) == 0

    dirs = {}
    dirs["batch"] = out / "batch"
    _run("uniref", "--input", inputs["plain"], "--output", dirs["batch"])
    dirs["per_record"] = out / "per_record"
    _run("uniref", "--input", inputs["blank"], "--output", dirs["per_record"])
    dirs["dedup"] = out / "dedup"
    _run("uniref", "--input", inputs["plain"], "--output", dirs["dedup"], "--dedup")
    dirs["jobs"] = out / "jobs"
    for i in (0, 1):
        _run("uniref", "--input", inputs["plain"], "--output", dirs["jobs"], "--num-jobs", "2", "--job-index", i)
    assert main(["merge", "--output", str(dirs["jobs"])]) == 0
    dirs["workers"] = out / "workers"
    _run("uniref", "--input", inputs["gz"], "--output", dirs["workers"], "--workers", "2")
    dirs["clusters"] = out / "clusters"
    _run("uniref", "--input", inputs["gz"], "--clusters", inputs["tsv"], "--output", dirs["clusters"])
    dirs["clusters_workers"] = out / "clusters_workers"
    _run("uniref", "--input", inputs["plain"], "--clusters", inputs["tsv"], "--output", dirs["clusters_workers"],
         "--workers", "2")
    return dirs


def outcomes(directory: Path) -> dict[str, tuple[str, str]]:
    """record id -> (reason, detail) of the records (or members) filtered.tsv lists; kept records absent."""
    rows = (directory / "filtered.tsv").read_text().splitlines()
    assert rows[0] == "id\treason\tinput\tline\tdetail"
    got = {}
    for row in rows[1:]:
        rid, reason, _, _, detail = row.split("\t")
        if reason in (rule.NO_MEMBER_IN_FASTA, rule.ALL_MEMBERS_FILTERED):  # the cluster itself
            continue
        prefix = f"member of UniRef50_{rid}"
        if detail.startswith(prefix):
            detail = detail[len(prefix):].removeprefix("; ")
        assert rid not in got, f"{directory.name}: {rid} listed twice"
        got[rid] = (reason, detail)
    return got


def test_every_path_gives_the_same_outcomes_and_reasons(inputs, tmp_path):
    dirs = _paths(inputs, tmp_path)
    expected = {rid: reason for rid, _, reason in RECORDS if reason is not None}
    first = outcomes(dirs["batch"])
    assert {rid: r for rid, (r, _) in first.items()} == expected
    assert first["bad"][1].startswith("10:11: ")  # the reader's error, without the path (the input column has it)
    for name, d in dirs.items():
        assert outcomes(d) == first, f"the {name} path decides otherwise than the batch path"


def test_every_path_asks_the_rule(inputs, tmp_path, monkeypatch):
    """The rule's functions replaced by ones that mark their reasons: every dropped record of every path carries
    the mark (a path deciding on its own would list an unmarked reason)."""
    length, invalid = rule.length, rule.invalid

    def marked(verdict):
        if verdict is not None and verdict.reason is not None:
            verdict.reason += "@rule"
        return verdict

    monkeypatch.setattr(rule, "length", lambda *a, **k: marked(length(*a, **k)))
    monkeypatch.setattr(rule, "invalid", lambda *a, **k: (lambda v, s, r: (marked(v), s, r))(*invalid(*a, **k)))
    dirs = _paths(inputs, tmp_path)
    for name, d in dirs.items():
        got = outcomes(d)
        assert len(got) == sum(r is not None for _, _, r in RECORDS), name
        unmarked = {rid: r for rid, (r, _) in got.items() if not r.endswith("@rule")}
        assert not unmarked, f"the {name} path decided {unmarked} without data_prep/rule.py"


def test_replace_invalid_keeps_the_record_in_every_path(inputs, tmp_path):
    dirs = _paths(inputs, tmp_path, ("--replace-invalid", "X"))
    for name, d in dirs.items():
        got = outcomes(d)
        assert "bad" not in got and set(got) == {rid for rid, _, r in RECORDS if r not in (None,
                                                                                            "invalid_character")}, name
