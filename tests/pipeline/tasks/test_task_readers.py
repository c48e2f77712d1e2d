"""The pair parsers against hand-built structures (pseudoknots included) and bpRNA's own pair lists, the task readers
on fixtures in the published formats, and bad input as one error line naming the file and line (tools/prepare_task.py:
exit 2, nothing written)."""
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO
from pipeline.data.structure import (pairs_to_partner, parse_bpseq, parse_dbn, parse_dot_bracket, partner_to_pairs,
                                     to_dot_bracket)
from pipeline.tasks import get_task

TASKS = REPO / "data" / "samples" / "tasks"
SAMPLES = REPO / "data" / "samples"


def test_dot_bracket_with_a_pseudoknot_equals_the_hand_built_pairs():
    """Three bracket kinds, crossing each other: each matched on its own stack. Written out by hand, 1-based:
    ((..[[..))..{{..]]..}}  pairs (1,10) (2,9) (5,18) (6,17) (13,22) (14,21)."""
    s = "((..[[..))..{{..]]..}}"
    hand = [(1, 10), (2, 9), (5, 18), (6, 17), (13, 22), (14, 21)]
    partner = parse_dot_bracket(s)
    assert partner_to_pairs(partner) == [(i - 1, j - 1) for i, j in hand]
    assert np.array_equal(partner, pairs_to_partner(hand, len(s)))
    # the smallest pseudoknot: a 3 x 3 grid of pairs each crossing the next
    assert partner_to_pairs(parse_dot_bracket("([{)]}")) == [(0, 3), (1, 4), (2, 5)]
    assert to_dot_bracket(parse_dot_bracket(s)) == "((..[[..))..((..]]..))"  # nested kinds may reuse ()
    assert np.array_equal(parse_dot_bracket(to_dot_bracket(partner)), partner)


def test_dot_bracket_agrees_with_bprna_pair_lists_and_bpseq():
    """Every record of the bpRNA fixtures (6 of them pseudoknotted): the dot-bracket parse equals the file's own
    1-based base_pairs list; the ArchiveII .bpseq gives the tRNA cloverleaf."""
    import csv
    import json

    n_pk = 0
    for name in ("bprna_vl0_sample.csv", "bprna_ts0_sample.csv"):
        for row in csv.DictReader(open(TASKS / name, newline="")):
            got = parse_dot_bracket(row["structure"])
            assert np.array_equal(got, pairs_to_partner(json.loads(row["base_pairs"]), len(row["sequence"]))), row["id"]
            n_pk += "[" in row["structure"]
    assert n_pk == 8
    seq, partner = parse_bpseq((TASKS / "archiveII_tRNA_Halobacterium_salinarum_Ala.bpseq").read_text(), "x")
    assert len(seq) == 75 and seq.startswith("GGGCUCG")
    pairs = partner_to_pairs(partner)
    assert pairs[:5] == [(0, 70), (1, 69), (2, 68), (3, 67), (4, 66)]  # the file's first lines: 1 G 71, 2 G 70, ...
    assert len(pairs) == 7 + 4 + 5 + 5  # acceptor, D, anticodon and T stems of the cloverleaf
    assert np.array_equal(parse_dot_bracket(to_dot_bracket(partner)), partner)


def test_structure_errors_name_the_position():
    with pytest.raises(ValueError, match=r"f:3: unbalanced brackets: '\)' at position 7 closes no '\('"):
        parse_dot_bracket("((..))).", "f:3")
    with pytest.raises(ValueError, match=r"'\[' at position 3 is never closed"):
        parse_dot_bracket("..[..((..))", "f")
    with pytest.raises(ValueError, match=r"'\]' at position 4 closes no '\['"):
        parse_dot_bracket("((.]))", "f")  # a ']' does not close a '('
    with pytest.raises(ValueError, match="base 2 pairs with both 5 and 6"):
        pairs_to_partner([[2, 5], [2, 6]], 8, "f")
    with pytest.raises(ValueError, match=r"f:2: base 2 pairs with 4, but line 4 pairs 4 with 3"):
        parse_bpseq("1 G 0\n2 G 4\n3 C 4\n4 C 3\n", "f")
    with pytest.raises(ValueError, match=r"f:5: structure of 4 characters for a sequence of 5"):
        parse_dbn("#Name: a\n#Length: 5\n#PageNumber: 1\nGGAAC\n(..)\n", "f")


def test_readers_read_every_published_layout():
    ssp = get_task("ssp")
    csv_records = ssp.read(TASKS / "bprna_ts0_sample.csv")
    dbn = ssp.read(TASKS / "bprna_ts0_sample.dbn")
    by_id = {r.id: r for r in csv_records}
    assert len(dbn) == 6 and all(np.array_equal(by_id[r.id].label, r.label) and by_id[r.id].sequence == r.sequence
                                 for r in dbn)
    assert [r.where for r in dbn][:2] == [f"{TASKS / 'bprna_ts0_sample.dbn'}:5", f"{TASKS / 'bprna_ts0_sample.dbn'}:10"]
    nrc = get_task("nrc")
    records = nrc.read(SAMPLES / "rfam_nrc_heldout_sample.fasta.gz", nrc.config_cls())
    assert len(records) == 211 and records[0].label == "5S_rRNA" and set(records[0].sequence) <= set("ACGUTN")
    rea = get_task("reactivity")
    records = rea.read(TASKS / "ribonanza_layout_sample.csv", rea.config_cls())
    assert len(records) == 32 and all(r.label.shape == (len(r.sequence), 2) for r in records)
    # the low signal-to-noise profiles (SN_filter 0) were dropped: every kept value is the clean profile's
    first = records[3].label
    assert np.isnan(first[-5:]).all() and not np.isnan(first[:-5]).any()


def run_prepare(tmp_path, task, text, suffix, *extra):
    src = tmp_path / f"input{suffix}"
    src.write_text(text)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, str(REPO / "tools" / "prepare_task.py"), "--task", task, "--input", str(src),
                        "--output", str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=120)
    return r, src, out


@pytest.mark.parametrize("task, text, suffix, line, what", [
    ("ssp", "id,sequence,structure\na,GGGAAACCC,(((...)))\nb,GGGAAACCC,((((..)))\n", ".csv", 3, "unbalanced brackets"),
    ("nrc", ">RF1_a 5S_rRNA\nACGU\n>RF2_b tRNA\nACGUA\n>RF3_c snoRNA_X\nACG\n", ".fasta", 5,
     "class 'snoRNA_X' of >RF3_c is not in the label set"),
    ("reactivity", "sequence_id,sequence,experiment_type,SN_filter,reactivity_0001,reactivity_0002,reactivity_0003\n"
                   "s1,ACG,DMS_MaP,1,0.1,0.2,0.3\ns2,AC,2A3_MaP,1,0.1,0.2,0.3\n", ".csv", 3,
     "reactivity at position 3, past the end of its 2 residues"),
    ("reactivity", "sequence_id,sequence,experiment_type,SN_filter,reactivity_0001,reactivity_0002\n"
                   "s1,ACG,DMS_MaP,1,0.1,0.2\n", ".csv", 2, "3 residues but the file has only 2 reactivity columns"),
])
def test_bad_input_is_one_line_naming_file_and_line(tmp_path, task, text, suffix, line, what):
    r, src, out = run_prepare(tmp_path, task, text, suffix)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {src}:{line}: ") and what in lines[0], r.stderr
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [src.name]  # nothing half-written


def test_prepare_writes_train_and_val_shards_the_loader_reads(tmp_path):
    from pipeline.data.streams import set_records

    r, src, out = run_prepare(tmp_path, "ssp", (TASKS / "bprna_ts0_sample.csv").read_text(), ".csv",
                              "--val-fraction", "0.25", "--max-length", "76")
    assert r.returncode == 0, r.stderr
    train, val = set_records(str(out / "train")), set_records(str(out / "val"))
    records = [x for x in get_task("ssp").read(TASKS / "bprna_ts0_sample.csv") if len(x.sequence) <= 76]
    assert len(records) > 20 and len(train) + len(val) == len(records) and len(val) == round(0.25 * len(records))
    ids = [m["id"] for _, m in val]
    assert ids == [x.id for x in records if x.id in set(ids)]  # held-out records in file order
    by_id = {x.id: x for x in records}
    for tokens, meta in train + val:  # tokens and labels round-trip
        rec = by_id[meta["id"]]
        assert len(tokens) == len(rec.sequence)
        assert [tuple(p) for p in meta["pairs"]] == partner_to_pairs(rec.label)
