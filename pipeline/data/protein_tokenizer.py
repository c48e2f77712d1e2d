"""ESM-2 amino-acid tokenizer: 33 tokens whose ids equal Hugging Face ``EsmTokenizer`` (facebook/esm2_*) exactly.

Vocabulary (id: token), fixed because ESM checkpoints and their embeddings depend on it:

     0 <cls>  1 <pad>  2 <eos>  3 <unk>
     4 L  5 A  6 G  7 V  8 S  9 E  10 R  11 T  12 I  13 D  14 P  15 K  16 Q  17 N  18 F  19 Y  20 M  21 H  22 W  23 C
    24 X  25 B  26 U  27 Z  28 O  29 .  30 -  31 <null_1>  32 <mask>

* The 20 standard amino acids are ordered by ESM's frequency order, then the ambiguity / rare codes of UniRef
  (X unknown, B = D|N, U selenocysteine, Z = E|Q, O pyrrolysine), ``.`` and ``-`` (alignment gaps).
* Matching is case-sensitive like ``EsmTokenizer`` (lowercase would be ``<unk>`` there); data_prep upper-cases
  protein input before encoding, so shards never hold ``<unk>``.
"""
from __future__ import annotations

import numpy as np

from pipeline.data.tokenizer import CharTokenizer

VOCAB = ("<cls>", "<pad>", "<eos>", "<unk>",
         "L", "A", "G", "V", "S", "E", "R", "T", "I", "D", "P", "K", "Q", "N", "F", "Y", "M", "H", "W", "C",
         "X", "B", "U", "Z", "O", ".", "-", "<null_1>", "<mask>")
assert len(VOCAB) == 33

CLS_ID, PAD_ID, EOS_ID, UNK_ID = range(4)
MASK_ID = VOCAB.index("<mask>")
RESIDUES = VOCAB[4:31]  # single-character tokens
STANDARD_AMINO_ACIDS = VOCAB[4:24]


class ProteinTokenizer(CharTokenizer):
    """Maps amino-acid strings to uint8 ids (ESM-2 numbering) and back; ``add_special`` frames like
    EsmTokenizer.encode. Lowercase is outside the alphabet, as in EsmTokenizer."""

    vocab = VOCAB
    vocab_size = len(VOCAB)
    cls_id, pad_id, eos_id, unk_id, mask_id = CLS_ID, PAD_ID, EOS_ID, UNK_ID, MASK_ID
    alphabet_name = "an ESM amino-acid token"

    def __init__(self):
        table = np.full(256, 255, dtype=np.uint8)  # 255 = not in the alphabet
        for tok in RESIDUES:
            table[ord(tok)] = VOCAB.index(tok)
        self._table = table

    @staticmethod
    def residue_ids() -> np.ndarray:
        """Ids of the 20 standard amino acids: the random-replacement pool for MLM."""
        return np.arange(4, 24, dtype=np.int64)
