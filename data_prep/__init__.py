"""Raw corpora -> tokenized WebDataset shards + manifest.json (format: pipeline/data/shards.py).

Each source is one registry entry: how to read its records and which tokenizer alphabet they are written in.
A new source (OpenGenome2 JSONL, UniRef, BabyLM) is a reader yielding ``fasta.Record``s plus one ``Source`` line.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from .fasta import FastaError, Record, iter_fasta

# reader(path, invalid_positions) -> records in file order
Reader = Callable[[Path, Callable[[bytes], np.ndarray]], Iterator[Record]]


@dataclass(frozen=True)
class Source:
    name: str
    reader: Reader
    alphabet: str | None  # tokenizer alphabet; None: the user must pass --alphabet
    help: str


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("fasta", iter_fasta, None, "any nucleotide FASTA / FASTA.gz (--alphabet rna|dna required)"),
    # RNAcentral exports mostly write T; Eco-RNA writes RNA with U, so the rna alphabet maps T -> U.
    Source("rnacentral", iter_fasta, "rna", "RNAcentral FASTA / FASTA.gz, tokenized as RNA (T -> U)"),
)}

__all__ = ["SOURCES", "Source", "Record", "FastaError", "iter_fasta"]
