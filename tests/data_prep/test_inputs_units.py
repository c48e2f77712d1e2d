"""Units behind the input options: character replacement, the on-disk position progress measures, the progress
line, the train/val hash and the fingerprint kept stable for work directories of earlier versions."""
import gzip
import io
import json

import pytest

from data_prep import SOURCES
from data_prep.checks import PrepError
from data_prep.common import split_of
from data_prep.encode import Encoder
from data_prep.fasta import input_position, iter_fasta
from data_prep.progress import Progress
from data_prep.settings import Settings, settings_doc


@pytest.mark.parametrize("source,seq,char,want,counts", [
    ("genome", b"ACGT.NN..ACGT", "N", b"ACGTNNNNNACGT", {".": 3}),
    ("genome", b"ACGU*?RY", "N", b"ACGUNNRY", {"*": 1, "?": 1}),  # U, R, Y are in the alphabet
    ("opengenome2", b"ACGT#AC.T", "N", b"ACGT#ACNT", {".": 1}),  # OG2's '#' is a contig split, kept
    ("genome", b"ACGT#A", "N", b"ACGTNA", {"#": 1}),  # elsewhere '#' is just a bad character
    ("uniref", b"MKV*LL J", "X", b"MKVXLLXX", {"*": 1, " ": 1, "J": 1}),
    ("genome", "ACGTéAC".encode(), "N", b"ACGTNAC", {"é": 1}),  # one replacement per character, not per byte
])
def test_replace_counts_each_character(source, seq, char, want, counts):
    enc = Encoder(SOURCES[source], SOURCES[source].alphabet, None)
    got, found = enc.replace(seq, char)
    assert (got, found) == (want, counts)
    assert not enc.bad_positions(got).size
    assert dict(enc.bad_characters(seq)) == counts


def test_replacement_must_be_a_residue():
    dna = Encoder(SOURCES["genome"], "dna", None)
    assert dna.check_replacement("n") == "N"
    for bad in (".", "#", "*", "é"):
        with pytest.raises(PrepError, match="not one residue of the nucleotide alphabet"):
            dna.check_replacement(bad)
    esm = Encoder(SOURCES["uniref"], None, None)
    assert esm.check_replacement("x") == "X"


def test_input_position_counts_disk_bytes(tmp_path):
    text = "".join(f">r{i}\n{'ACGT' * 500}\n" for i in range(300)).encode()
    for name, blob in (("plain.fa", text), ("packed.fa.gz", gzip.compress(text))):
        p = tmp_path / name
        p.write_bytes(blob)
        assert input_position(p) == 0
        seen = []
        for rec in iter_fasta(p):
            seen.append(input_position(p))
        assert len(seen) == 300 and seen == sorted(seen) and 0 < seen[0] <= len(blob)
        assert input_position(p) == len(blob)  # closed: the whole file


def test_progress_log_line_has_an_estimate():
    out = io.StringIO()
    with Progress("genome", 4_000_000, "log", interval=0.0, stream=out) as bar:
        bar.update(1_000_000, records=10, written=9, filtered=1)
    line = out.getvalue().strip()
    assert line.startswith("data_prep genome: 1.0M/4.0M bytes (25%), 10 records, 9 written, 1 filtered, ")
    assert "elapsed 0:00:00" in line and "remaining ~" in line
    quiet = io.StringIO()
    with Progress("genome", 10, "auto", stream=quiet) as bar:  # not a terminal: nothing
        bar.update(5, records=1)
    assert quiet.getvalue() == ""


def test_split_of_is_the_documented_hash():
    import hashlib
    ids = [f"URS{i:010X}_9606" for i in range(4000)]
    val = [r for r in ids if split_of(r, 0.05) == "val"]
    assert 0.04 < len(val) / len(ids) < 0.06
    for r in ids[:200]:
        h = int.from_bytes(hashlib.sha256(r.encode()).digest()[:8], "little")
        assert split_of(r, 0.05) == ("val" if h < 0.05 * 2 ** 64 else "train")
        assert split_of(r, None) == ""
    # a larger fraction only moves records from train to val
    assert set(val) <= {r for r in ids if split_of(r, 0.2) == "val"}


def test_fingerprint_of_default_settings_is_unchanged():
    """A work directory left by a version without the input options resumes: at their defaults the new settings
    (and --max-filtered-fraction, which never changes shard bytes) are not part of the fingerprint."""
    doc = settings_doc(Settings())
    assert doc == {"shard_size": 10_000, "min_length": 10, "num_jobs": 1, "job_index": 0, "max_length": None,
                   "strict": False, "dedup": False}
    assert settings_doc(Settings(max_filtered_fraction=0.5)) == doc
    windowed = settings_doc(Settings(window=100, stride=50, val_fraction=0.1, replace_invalid="N"))
    assert json.loads(json.dumps(windowed)) == doc | {"window": 100, "stride": 50, "val_fraction": 0.1,
                                                      "replace_invalid": "N"}
    assert settings_doc(Settings(window=100, window_tail="align"))["window_tail"] == "align"
