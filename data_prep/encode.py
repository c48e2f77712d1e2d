"""The source's tokenizer as a job needs it (nucleotide, ESM amino-acid or sentencepiece): the alphabet check,
bytes -> token ids, the --replace-invalid replacement and the manifest's tokenizer entry."""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pipeline import commands
from pipeline.data.protein_tokenizer import ProteinTokenizer
from pipeline.data.tokenizer import SEP_ID, SPM_NAME, VOCAB, NucleotideTokenizer

from .checks import PrepError
from .spm import BOS_ID, EOS_ID, PAD_ID, UNK_ID, SpmEncoder

if TYPE_CHECKING:
    from . import Source


class Encoder:
    """The source's tokenizer as the job needs it: alphabet check, bytes -> ids, manifest entry."""

    def __init__(self, source: Source, alphabet: str | None, spm: Path | None):
        self.kind, self.spm_path = source.tokenizer, None
        self.text = self.kind == "sentencepiece"
        # OpenGenome2's '#' (contig split) is valid there, written as <sep>: never replaced
        self.sep_char = source.name == "opengenome2"
        if self.kind == "nucleotide":
            tok = NucleotideTokenizer(alphabet)
            self.invalid_positions, self._encode, self.vocab_size = tok.invalid_positions, tok.encode, tok.vocab_size
            self.entry = {"name": "nucleotide", "vocab": list(VOCAB), "alphabet": alphabet}
        elif self.kind == "protein":
            tok = ProteinTokenizer()
            self.invalid_positions, self._encode, self.vocab_size = tok.invalid_positions, tok.encode, tok.vocab_size
            self.entry = {"name": "esm", "vocab": list(tok.vocab)}
        else:
            if spm is None:
                raise PrepError(f"{source.name} needs --spm MODEL (train one with `{commands.python()} -m data_prep train-spm`)")
            enc = SpmEncoder(spm)
            self.spm_path, self.invalid_positions, self._encode = enc.model, None, enc.encode
            self.vocab_size = enc.vocab_size
            self.entry = {"name": "sentencepiece", "model": SPM_NAME, "sha256": enc.sha256,
                          "vocab_size": enc.vocab_size, "pad_id": PAD_ID, "bos_id": BOS_ID, "eos_id": EOS_ID,
                          "unk_id": UNK_ID}

    def encode(self, seq: bytes) -> np.ndarray:
        if not self.text and b"#" in seq:  # OpenGenome2 contig split -> one <sep>
            ids = self._encode(seq.replace(b"#", b"N"))
            ids[np.frombuffer(seq, dtype=np.uint8) == ord("#")] = SEP_ID
            return ids
        return self._encode(seq)

    def residues(self, seq: bytes) -> int:
        return len(seq.decode("utf-8")) if self.text else len(seq) - seq.count(b"#")

    def bad_positions(self, seq: bytes) -> np.ndarray:
        """Positions of ``seq`` (normalized) outside the alphabet, as the source's reader judged them."""
        return self.invalid_positions(seq.replace(b"#", b"N") if self.sep_char else seq)

    def check_replacement(self, char: str) -> str:
        """The --replace-invalid character, upper-cased, if it is a residue of this alphabet."""
        name = {"nucleotide": "nucleotide", "protein": "ESM amino-acid"}.get(self.kind)
        if self.text:
            raise PrepError("--replace-invalid applies to nucleotide and protein sources, not to text")
        c = char.upper()
        if len(c) != 1 or not c.isascii() or c == "#" or self.invalid_positions(c.encode()).size:
            raise PrepError(f"--replace-invalid {char!r} is not one residue of the {name} alphabet "
                            "(e.g. N for nucleotides, X for proteins)")
        return c

    def replace(self, seq: bytes, char: str) -> tuple[bytes, dict]:
        """``seq`` with every character outside the alphabet replaced by ``char``; {character: count}."""
        bad = self.bad_positions(seq)
        if not bad.size:
            return seq, {}
        arr = np.frombuffer(seq, dtype=np.uint8)
        if int(arr.max()) < 128:
            values, counts = np.unique(arr[bad], return_counts=True)
            out = arr.copy()
            out[bad] = ord(char)
            return out.tobytes(), {chr(v): int(c) for v, c in zip(values.tolist(), counts.tolist())}
        # non-ASCII: one replacement per character (not per UTF-8 byte)
        found: Counter = Counter()
        chars = []
        for ch in seq.decode("utf-8", "replace"):
            if not ch.isascii() or self.bad_positions(ch.encode()).size:
                found[ch] += 1
                chars.append(char)
            else:
                chars.append(ch)
        return "".join(chars).encode("ascii"), dict(found)

    def bad_characters(self, seq: bytes) -> Counter:
        """{character: count} of the characters outside the alphabet (for the manifest and the error)."""
        bad = self.bad_positions(seq)
        if not bad.size:
            return Counter()
        arr = np.frombuffer(seq, dtype=np.uint8)
        if int(arr.max()) < 128:
            values, counts = np.unique(arr[bad], return_counts=True)
            return Counter({chr(v): int(c) for v, c in zip(values.tolist(), counts.tolist())})
        return Counter(ch for ch in seq.decode("utf-8", "replace")
                       if not ch.isascii() or self.bad_positions(ch.encode()).size)
