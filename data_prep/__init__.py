"""Raw corpora -> tokenized WebDataset shards + manifest.json (format: pipeline/data/shards.py), offline.

``python -m data_prep SOURCE --input PATH ... --output DIR [options]``, SOURCE one of ``SOURCES`` below: ``fasta``,
``genome``, ``rnacentral``, ``opengenome2``, ``uniref``, ``babylm`` (their readers and per-source policies:
data_prep/sources.py). Besides them: ``merge`` (an array's job manifests combined), ``train-spm`` (a sentencepiece
model for ``babylm``), ``synthetic-hops`` (the depth task) and ``upload`` (a finished shard set to object storage).

docs/data.md is the reference: the options, normalization and filtering (every decision counted in the manifest,
every dropped record in ``filtered.tsv``), the manifest's fields, windows and the train/val split, UniRef50 clusters
(``uniref --clusters``), ``--workers`` and ``--num-jobs`` jobs, and resume after a crash.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from .fasta import FastaError, Record, iter_fasta
from .sources import (Context, expand_text_inputs, iter_fasta_source, iter_opengenome2, iter_text_lines,
                      iter_uniref)

Reader = Callable[[Path, Context], Iterator[Record]]


@dataclass(frozen=True)
class Source:
    name: str
    reader: Reader
    alphabet: str | None  # nucleotide alphabet; None with tokenizer 'nucleotide': the user passes --alphabet
    help: str
    # what the reader reads: 'fasta' and 'uniref' (UniRef headers into meta) are FASTA, which the batch reader takes
    # (data_prep/batch.py); 'jsonl' and 'text' are read record by record
    kind: str = "fasta"
    tokenizer: str = "nucleotide"  # 'nucleotide' | 'protein' | 'sentencepiece'
    min_length: int = 10  # default --min-length
    expand: Callable[[list[Path]], list[Path]] | None = None  # directories -> files


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("fasta", iter_fasta_source, None, "any nucleotide FASTA / FASTA.gz (--alphabet rna|dna required)"),
    Source("genome", iter_fasta_source, "dna", "genome FASTA / FASTA.gz (chromosomes, plasmids), DNA alphabet (T)"),
    # RNAcentral exports mostly write T; Eco-RNA writes RNA with U, so the rna alphabet maps T -> U.
    Source("rnacentral", iter_fasta_source, "rna", "RNAcentral FASTA / FASTA.gz, tokenized as RNA (T -> U)"),
    Source("opengenome2", iter_opengenome2, "dna",
           "OpenGenome2 JSON Lines (.jsonl / .jsonl.gz, 'text' field), DNA alphabet (T)", kind="jsonl"),
    Source("uniref", iter_uniref, None, "UniRef50/90 FASTA / FASTA.gz, ESM-2 amino-acid tokens", kind="uniref",
           tokenizer="protein"),
    Source("babylm", iter_text_lines, None, "BabyLM *.train text files or folders, sentencepiece tokens (--spm)",
           kind="text", tokenizer="sentencepiece", min_length=1, expand=expand_text_inputs),
)}

__all__ = ["SOURCES", "Source", "Record", "FastaError", "iter_fasta", "Context"]
