"""``python -m data_prep train-spm``: a sentencepiece BPE model on BabyLM-style text, and the job-side encoder.

Training reads the same normalized lines the ``babylm`` source writes (BOM/CR stripped, blank lines skipped), so the
model never sees a character the shards will not hold. Settings chosen for a lossless round trip: ``identity``
normalization and no whitespace folding (tabs after CHILDES / Switchboard speaker codes survive), byte fallback (no
``<unk>`` for rare characters). Ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, like the nucleotide tokenizer's first four.
"""
from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline.data.tokenizer import SPM_BOS_ID as BOS_ID
from pipeline.data.tokenizer import SPM_EOS_ID as EOS_ID
from pipeline.data.tokenizer import SPM_PAD_ID as PAD_ID
from pipeline.data.tokenizer import SPM_UNK_ID as UNK_ID

from .fasta import FastaError
from .sources import Context, check_text_inputs, expand_text_inputs, iter_text_lines


def _sentences(paths: list[Path], text_column: str | None = None) -> Iterator[str]:
    ctx = Context(text_column=text_column)
    for p in paths:
        for rec in iter_text_lines(p, ctx):
            if rec.error is None:
                yield rec.seq.decode("utf-8")


def train_spm(inputs: list[Path], output: Path, vocab_size: int = 32768, max_sentences: int = 10_000_000,
              text_column: str | None = None) -> Path:
    """Train BPE on ``inputs`` (files or folders of ``*.train``; a ``.csv`` needs ``text_column``, read as the babylm
    source reads it); writes ``output.model`` / ``output.vocab``."""
    import sentencepiece as spm

    paths = expand_text_inputs([Path(p) for p in inputs])
    for p in paths:
        if not p.is_file():
            raise FastaError(f"{p}: input does not exist or is not a file")
    check_text_inputs(paths, text_column)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_sentences(paths, text_column), model_prefix=str(output), vocab_size=vocab_size,
            model_type="bpe",
            normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True,
            split_digits=True, character_coverage=0.9995, input_sentence_size=max_sentences,
            shuffle_input_sentence=True, max_sentence_length=1 << 16, pad_id=PAD_ID, bos_id=BOS_ID, eos_id=EOS_ID,
            unk_id=UNK_ID, num_threads=os.cpu_count() or 1, minloglevel=2)
    except RuntimeError as e:  # one line in this CLI's terms, not sentencepiece's C++ trace and its flag names
        raise FastaError(_spm_error(str(e).strip().splitlines()[-1], vocab_size)) from None
    return output.with_suffix(output.suffix + ".model") if output.suffix else Path(f"{output}.model")


def _spm_error(message: str, vocab_size: int) -> str:
    """sentencepiece's training error as this CLI's flags say it (sentencepiece suggests options such as
    --character_coverage that `data_prep train-spm` does not take)."""
    low = re.search(r"smaller than required_chars\. \d+ vs (\d+)", message)
    if low:
        return (f"--vocab-size {vocab_size} is below the {low.group(1)} pieces the text needs (its distinct "
                f"characters, 256 byte-fallback pieces and the special tokens); use --vocab-size {low.group(1)} or "
                "more")
    high = re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", message)
    if high:
        return (f"--vocab-size {vocab_size} is more than the text can fill ({high.group(1)} at most); use a "
                "smaller --vocab-size or more text")
    return f"sentencepiece training failed: {message}"


class SpmEncoder:
    """UTF-8 line -> int ids of a trained model; the manifest entry names the model copied beside the shards."""

    def __init__(self, model: Path):
        import sentencepiece as spm

        self.model = Path(model)
        if not self.model.is_file():
            raise FastaError(f"{self.model}: sentencepiece model does not exist")
        self.sp = spm.SentencePieceProcessor(model_file=str(self.model))
        self.vocab_size = self.sp.get_piece_size()
        self.sha256 = hashlib.sha256(self.model.read_bytes()).hexdigest()

    def encode(self, seq: bytes) -> np.ndarray:
        return np.asarray(self.sp.encode(seq.decode("utf-8")), dtype=np.int64)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])
