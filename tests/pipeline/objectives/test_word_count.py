"""Words seen, counted as the BabyLM challenge counts them (pipeline/objectives/causal_lm.py): one epoch of a text's
records, framed and shifted by the training transform, counts exactly ``len(line.split())`` summed over its lines,
on the shipped BabyLM-style sample and on lines made to hold what a piece-initial count gets wrong (runs of spaces,
tabs after speaker codes, a leading space, digits and punctuation in byte pieces); a cropped record counts the words
it keeps, the one cut into once."""
import gzip
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO
from pipeline.objectives import causal_lm

SAMPLES = [REPO / "data" / "samples" / "babylm_alice_train_sample.txt.gz",
           REPO / "data" / "samples" / "babylm_shakespeare_train_sample.txt.gz"]
HARD = ["*MOT:\tthat's  a   big\tdog .", "A:\tOkay, uh,", "  two leading spaces", "x", "= = = Title = = =",
        "7 dogs and 12 cats!", "tab\tseparated\twords", "trailing space ", "\u201cquoted\u201d caf\u00e9 na\u00efve",
        "a\u00a0b with a no-break space", "one"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """data_prep train-spm + babylm on the shipped sample plus HARD lines: (shard dir, the lines it holds)."""
    tmp = tmp_path_factory.mktemp("words")
    hard = tmp / "hard.train"
    hard.write_text("\n".join(HARD) + "\n", encoding="utf-8")
    inputs = [*map(str, SAMPLES), str(hard)]
    spm, out = tmp / "spm" / "m", tmp / "shards"
    for cmd in (["train-spm", "--input", *inputs, "--output", str(spm), "--vocab-size", "1024"],
                ["babylm", "--spm", f"{spm}.model", "--input", *inputs, "--output", str(out)]):
        proc = subprocess.run([sys.executable, "-m", "data_prep", *cmd], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    lines = []
    for f in SAMPLES:
        with gzip.open(f, "rt", encoding="utf-8") as fh:
            lines += [ln.rstrip("\n").removeprefix("\ufeff").rstrip("\r") for ln in fh]
    lines += HARD
    return out, [ln for ln in lines if ln.strip()]


def epoch_words(shard_dir, context_length=100_000) -> int:
    """Words the objective counts over one pass of every record, uncropped at a large context."""
    from pipeline.data.shard_reader import shard_sequences

    tables = causal_lm.word_tables(str(shard_dir / "tokenizer.model"))
    cfg = type("C", (), {"data": type("D", (), {"context_length": context_length})()})()
    tf = causal_lm.make_transform(cfg)
    total = 0
    for seq in shard_sequences(shard_dir):
        s = tf(np.asarray(seq), np.random.default_rng(0))
        total += causal_lm.count_words(torch.as_tensor(s["input_ids"])[None], torch.as_tensor(s["labels"])[None],
                                       tables)
    return total


def test_one_epoch_counts_the_whitespace_words_of_the_text(shards):
    shard_dir, lines = shards
    want = sum(len(ln.split()) for ln in lines)
    assert epoch_words(shard_dir) == want  # 0 words off on the whole sample
    # the rule it replaces, pieces that start with "▁", is off on these lines: the test can tell them apart
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(shard_dir / "tokenizer.model"))
    old = sum(sum(p.startswith("\u2581") and p != "\u2581" * len(p) for p in sp.encode(ln, out_type=str))
              for ln in HARD)
    assert old != sum(len(ln.split()) for ln in HARD)


def test_a_crop_counts_the_words_it_keeps(shards):
    shard_dir, _ = shards
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(shard_dir / "tokenizer.model"))
    tables = causal_lm.word_tables(str(shard_dir / "tokenizer.model"))
    text = "alpha beta gamma delta"
    ids = sp.encode(text)
    for start in range(len(ids)):
        for stop in range(start + 1, len(ids) + 1):
            kept = ids[start:stop]
            framed = [1, *kept, 2]
            got = causal_lm.count_words(torch.tensor([framed[:-1]]), torch.tensor([framed[1:]]), tables)
            # the characters the crop keeps, and the words any of them belong to
            first = len(sp.decode(ids[:start])) if start else 0
            chars = sp.decode(ids[:stop])
            words, pos = 0, 0
            for w in text.split():
                i = text.index(w, pos)
                pos = i + len(w)
                if i < len(chars) and i + len(w) > first and chars[max(i, first):pos].strip():
                    words += 1
            assert got == words, (start, stop, sp.id_to_piece(kept))


def test_padding_and_ignored_targets_count_nothing(shards):
    shard_dir, _ = shards
    tables = causal_lm.word_tables(str(shard_dir / "tokenizer.model"))
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(shard_dir / "tokenizer.model"))
    ids = [1, *sp.encode("one two three"), 2]
    row = torch.tensor([ids[:-1] + [0, 0]])
    labels = torch.tensor([ids[1:] + [-100, -100]])
    assert causal_lm.count_words(row, labels, tables) == 3
