"""data_prep synthetic-hops (data_prep/synthetic.py): seeded, every answer determined by exactly its stated number of
pointers (an independent solver that only knows the documented token meanings), nothing below that number says
anything about the answer, and the shards pass tools/inspect_shards.py --verify."""
import subprocess
import sys
from collections import Counter

import pytest

from conftest import REPO
from data_prep.__main__ import main as data_prep_main
from data_prep.synthetic import HopsTask, generate
from pipeline.data.shard_reader import read_shard
from pipeline.data.shards import load_manifest
from pipeline.data.tokenizer import SEP_ID, VOCAB

LETTERS = "ACGUTNRYSWKMBDHV"  # the documented alphabet: S literals, then the pointers d = 1 .. 2 S - 1


def alphabet(slots: int) -> tuple[str, dict[str, int]]:
    """(the literals, {pointer: offset d}) of the documented alphabet at S slots."""
    return LETTERS[:slots], {c: d for d, c in enumerate(LETTERS[slots:3 * slots - 1], start=1)}


def solve(tokens, slots=4) -> list[tuple[str, int]]:
    """(value, pointers followed) of each query (the Q tokens before <sep>, Q = the tokens after it): follow 'same
    value as d positions back' until a literal. Independent of the generator: it knows the alphabet, not the levels."""
    literals, offset = alphabet(slots)
    text = [VOCAB[t] for t in tokens]
    assert text.count("<sep>") == 1
    sep = text.index("<sep>")
    q = len(text) - sep - 1
    assert 1 <= q <= sep
    solved = []
    for pos in range(sep - q, sep):
        followed = 0
        while text[pos] not in literals:
            pos -= offset[text[pos]]
            assert pos >= 0, "a pointer leaves the record"
            followed += 1
        solved.append((text[pos], followed))
    return solved


def records(directory):
    m = load_manifest(directory)
    return [(key, tokens, meta) for s in m.shards for key, tokens, meta in read_shard(directory / s.path, s.samples)]


def prep(*args) -> int:
    return data_prep_main(["synthetic-hops", *map(str, args)])


@pytest.mark.parametrize("slots,queries", [(4, 1), (5, 3), (2, 2), (5, 5)])
def test_every_answer_takes_exactly_its_pointers_and_the_shards_verify(tmp_path, slots, queries):
    assert prep("--hops", 4, "--slots", slots, "--queries", queries, "--records", 600, "--seed", 5,
                "--output", tmp_path / "d", "--shard-size", 250) == 0
    recs = records(tmp_path / "d")
    assert len(recs) == 600 and len(load_manifest(tmp_path / "d").shards) == 3
    for key, tokens, meta in recs:
        answers = [VOCAB[t] for t in tokens[len(tokens) - queries:]]
        solved = solve(tokens, slots)
        assert answers == [value for value, _ in solved] and {f for _, f in solved} == {meta["hops"]}, key
        assert len(set(answers)) == queries, key  # distinct slots of the last level hold distinct values
        assert len(tokens) == slots * max(meta["hops"], 1) + 2 * queries + 1, key  # levels, queries, <sep>, answers
    assert Counter(m["hops"] for _, _, m in recs).keys() == {0, 1, 2, 3, 4}  # the curriculum, 0 .. H
    out = subprocess.run([sys.executable, "tools/inspect_shards.py", str(tmp_path / "d"), "--verify"], cwd=REPO,
                         capture_output=True, text=True)
    assert out.returncode == 0 and "verified 3 shards" in out.stdout, out.stderr


@pytest.mark.parametrize("slots,queries", [(4, 1), (5, 3)])
def test_fewer_pointers_than_h_say_nothing_about_the_answer(tmp_path, slots, queries):
    """Every level of S is a permutation of the S values: the position a reader reaches after fewer than H
    pointers holds each value equally often, whatever the answer, and the counts of the visible tokens do not
    depend on the answer either (so the count model is at chance)."""
    literals, offset = alphabet(slots)
    n = -(-125 * slots * slots // queries)  # 125 answers per (slot, value) cell
    assert prep("--hops", 3, "--min-hops", 3, "--slots", slots, "--queries", queries, "--records", n, "--seed", 2,
                "--output", tmp_path / "d") == 0
    after_two = Counter()
    for _, tokens, _ in records(tmp_path / "d"):
        text = [VOCAB[t] for t in tokens]
        assert sorted(text[:slots]) == sorted(literals)  # level 0
        sep = text.index("<sep>")
        for j in range(queries):
            pos = sep - queries + j
            for _ in range(2):
                pos -= offset[text[pos]]
            after_two[(pos % slots, text[sep + 1 + j])] += 1  # where two pointers lead, against the answer
        assert Counter(text[:sep])["A"] == 1
    per_slot = [[after_two[(slot, v)] for v in literals] for slot in range(slots)]
    for row in per_slot:  # each slot of level 1 goes with every answer about equally (125 each)
        assert min(row) > 80 and max(row) < 170, per_slot


def test_one_query_at_four_slots_draws_the_records_of_the_first_version():
    """--slots and --queries came later: their defaults (S = 4, Q = 1) still draw exactly the records the task drew
    before (the CI guard's data and the earlier measurements in docs/depth_task.md), pinned here."""
    def text(task, seed, i):
        return " ".join(VOCAB[t] for t in generate(task, seed, i)[0])

    assert [text(HopsTask(2), 0, i) for i in range(2)] == ["G A C U T R S K Y <sep> U", "C U A G R <sep> U"]
    assert text(HopsTask(3, 3), 1, 0) == "A C G U T S Y W T S S S T <sep> G"
    assert text(HopsTask(3, 0, 5, 3), 0, 0) == "G T U A C N W W B K W S S S B S R S <sep> U T A"


def test_seeded_and_independent_of_count_and_shard_size(tmp_path):
    assert prep("--hops", 3, "--records", 300, "--seed", 9, "--output", tmp_path / "a") == 0
    assert prep("--hops", 3, "--records", 100, "--seed", 9, "--output", tmp_path / "b", "--shard-size", 7) == 0
    assert prep("--hops", 3, "--records", 300, "--seed", 9, "--output", tmp_path / "c") == 0
    assert prep("--hops", 3, "--records", 300, "--seed", 10, "--output", tmp_path / "e") == 0
    a, b = records(tmp_path / "a"), records(tmp_path / "b")
    assert [t.tobytes() for _, t, _ in a[:100]] == [t.tobytes() for _, t, _ in b]  # record i depends on (seed, i)
    assert [s.sha256 for s in load_manifest(tmp_path / "a").shards] == \
        [s.sha256 for s in load_manifest(tmp_path / "c").shards]  # byte-identical rerun
    assert [t.tobytes() for _, t, _ in a] != [t.tobytes() for _, t, _ in records(tmp_path / "e")]


def test_exclude_makes_a_disjoint_held_out_set_and_counts_what_it_skipped(tmp_path):
    assert prep("--hops", 2, "--records", 3000, "--seed", 0, "--output", tmp_path / "train") == 0
    assert prep("--hops", 2, "--min-hops", 2, "--records", 300, "--seed", 1, "--exclude", tmp_path / "train",
                "--output", tmp_path / "held") == 0
    train = {t.tobytes() for _, t, _ in records(tmp_path / "train")}
    held = records(tmp_path / "held")
    assert len(held) == 300 and not train & {t.tobytes() for _, t, _ in held}
    m = load_manifest(tmp_path / "held")
    assert m.filtered["in_exclude"] > 0 and m.inputs[0]["records"] == 300 + m.filtered["in_exclude"]
    assert {meta["hops"] for _, _, meta in held} == {2} and all(t[-2] == SEP_ID for _, t, _ in held)


def test_bad_arguments_are_one_line_and_write_nothing(tmp_path, capsys):
    assert prep("--hops", 2, "--min-hops", 3, "--records", 5, "--seed", 0, "--output", tmp_path / "x") == 1
    assert "--min-hops must lie in 0 .. --hops 2, got 3" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "x.partial").exists()
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert prep("--hops", 2, "--records", 5, "--seed", 0, "--output", tmp_path / "mine", "--overwrite") == 1
    assert "was not written by data_prep (it holds notes.txt)" in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    with pytest.raises(SystemExit):
        prep("--hops", 0, "--records", 5, "--seed", 0, "--output", tmp_path / "y")
    assert prep("--hops", 2, "--slots", 6, "--records", 5, "--seed", 0, "--output", tmp_path / "z") == 1
    assert "--slots must lie in 2 .. 5" in capsys.readouterr().err and not (tmp_path / "z").exists()
    assert prep("--hops", 2, "--slots", 4, "--queries", 5, "--records", 5, "--seed", 0, "--output", tmp_path / "z") == 1
    assert "--queries must lie in 1 .. --slots 4, got 5" in capsys.readouterr().err and not (tmp_path / "z").exists()
