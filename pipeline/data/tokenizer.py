"""Nucleotide tokenizer: 23 tokens, character level.

Vocabulary (id: token), fixed forever because checkpoints depend on it:

    0 <pad>  1 <cls>  2 <eos>  3 <unk>  4 <mask>  5 <sep>
    6 A  7 C  8 G  9 U  10 T  11 N
    12 R  13 Y  14 S  15 W  16 K  17 M  18 B  19 D  20 H  21 V
    22 -

* ``<cls>``/``<eos>`` frame every sequence; ``<sep>`` joins segments of one record (OpenGenome2 marks contig
  splits with ``#``); ``<unk>`` exists so a tokenizer never has to drop a character silently, but data_prep refuses
  characters outside the alphabet instead of emitting it.
* ``A C G U T`` are separate tokens: DNA sources keep T and RNA sources are written with U (Eco-RNA, A.3), so the
  model sees which kind of molecule it reads.
* ``N`` and the ten two-/three-base IUPAC ambiguity codes occur in RNAcentral and Rfam; ``-`` is the alignment gap.
"""
from __future__ import annotations

import numpy as np

# The label of positions without a loss (torch cross_entropy's ignore_index default); every objective uses it.
IGNORE_INDEX = -100

SPECIAL_TOKENS = ("<pad>", "<cls>", "<eos>", "<unk>", "<mask>", "<sep>")
NUCLEOTIDES = ("A", "C", "G", "U", "T", "N")
IUPAC_AMBIGUITY = ("R", "Y", "S", "W", "K", "M", "B", "D", "H", "V")
GAP = ("-",)
VOCAB = SPECIAL_TOKENS + NUCLEOTIDES + IUPAC_AMBIGUITY + GAP
assert len(VOCAB) == 23

PAD_ID, CLS_ID, EOS_ID, UNK_ID, MASK_ID, SEP_ID = range(len(SPECIAL_TOKENS))
NUM_SPECIAL = len(SPECIAL_TOKENS)

# The sentencepiece (BabyLM) convention shared by data_prep/spm.py, the causal-LM objective and the text evaluators:
# the model file beside the shards and its special ids (0 <pad>, 1 <s>, 2 </s>, 3 <unk>).
SPM_NAME = "tokenizer.model"
SPM_PAD_ID, SPM_BOS_ID, SPM_EOS_ID, SPM_UNK_ID = 0, 1, 2, 3


class CharTokenizer:
    """One character, one token, through a 256-entry byte table (255 = not in the alphabet). Subclasses fill
    ``_table`` and set ``vocab``, ``cls_id``, ``eos_id``, ``pad_id``, ``mask_id`` and ``alphabet_name``.
    ``tokenizer(seqs)`` gives a model's input; ``encode`` gives the shards' uint8 residues."""

    vocab: tuple
    cls_id: int
    eos_id: int
    pad_id: int
    mask_id: int
    alphabet_name: str
    _table: np.ndarray

    @staticmethod
    def _bytes(seq: str | bytes) -> np.ndarray:
        return np.frombuffer(seq.encode("ascii", "replace") if isinstance(seq, str) else seq, dtype=np.uint8)

    def invalid_positions(self, seq: str | bytes) -> np.ndarray:
        """0-based positions of characters outside the alphabet."""
        return np.flatnonzero(self._table[self._bytes(seq)] == 255)

    def encode(self, seq: str | bytes, add_special: bool = False) -> np.ndarray:
        """THE SHARD FORMAT, NOT A MODEL INPUT: residues to uint8 ids, without <cls>/<eos> unless ``add_special``.
        A model takes ``tokenizer(seqs)`` (int64, framed, padded; below) or the export's AutoTokenizer. Raises
        ValueError naming the first character outside the alphabet."""
        raw = self._bytes(seq)
        ids = self._table[raw]
        bad = np.flatnonzero(ids == 255)
        if bad.size:
            pos = int(bad[0])
            raise ValueError(f"character {chr(raw[pos])!r} at position {pos + 1} is not {self.alphabet_name}")
        if add_special:
            ids = np.concatenate([[self.cls_id], ids, [self.eos_id]]).astype(np.uint8)
        return ids

    def decode(self, ids) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def __call__(self, seqs: str | list[str]) -> dict:
        """A model's input: {"input_ids": int64 [B, L], "attention_mask": int64 [B, L]} for one sequence or a list,
        each framed as <cls> ... <eos> and right-padded with the pad id; ``<mask>`` in a sequence is the mask token
        (what the export's AutoTokenizer gives, tests/pipeline/test_hf_tokenizers.py)."""
        import torch

        rows = []
        for seq in [seqs] if isinstance(seqs, str) else seqs:
            parts = [self.encode(p).astype(np.int64) for p in seq.split("<mask>")]
            body = [int(i) for i in parts[0]]
            for p in parts[1:]:
                body += [self.mask_id, *p.tolist()]
            rows.append([self.cls_id, *body, self.eos_id])
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros(len(rows), width, dtype=torch.int64)
        for i, r in enumerate(rows):
            ids[i, :len(r)], mask[i, :len(r)] = torch.tensor(r), 1
        return {"input_ids": ids, "attention_mask": mask}


class NucleotideTokenizer(CharTokenizer):
    """Maps nucleotide strings to uint8 ids and back.

    ``alphabet='rna'`` writes T as U, ``'dna'`` writes U as T; ``None`` keeps both as given.
    """

    vocab = VOCAB
    vocab_size = len(VOCAB)
    pad_id, cls_id, eos_id, unk_id, mask_id, sep_id = PAD_ID, CLS_ID, EOS_ID, UNK_ID, MASK_ID, SEP_ID
    num_special = NUM_SPECIAL
    alphabet_name = "a nucleotide or IUPAC code"

    def __init__(self, alphabet: str | None = None):
        if alphabet not in (None, "rna", "dna"):
            raise ValueError(f"alphabet must be 'rna', 'dna' or None, got {alphabet!r}")
        self.alphabet = alphabet
        table = np.full(256, 255, dtype=np.uint8)  # 255 = not in the alphabet
        for i, tok in enumerate(VOCAB[NUM_SPECIAL:], start=NUM_SPECIAL):
            table[ord(tok)] = i
            table[ord(tok.lower())] = i  # soft-masked (lowercase) bases are the same base
        if alphabet == "rna":
            table[ord("T")] = table[ord("t")] = VOCAB.index("U")
        elif alphabet == "dna":
            table[ord("U")] = table[ord("u")] = VOCAB.index("T")
        self._table = table

    @staticmethod
    def residue_ids(molecule: str) -> np.ndarray:
        """Ids of the four canonical bases of ``molecule`` ('rna' or 'dna'): the random-replacement pool for MLM."""
        fourth = "U" if molecule == "rna" else "T"
        return np.array([VOCAB.index(c) for c in ("A", "C", "G", fourth)], dtype=np.int64)
