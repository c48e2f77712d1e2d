"""Raw corpora -> tokenized WebDataset shards + manifest.json (format: pipeline/data/shards.py).

Sources (``python -m data_prep SOURCE --input ... --output DIR``):

* ``fasta`` / ``genome``: nucleotide FASTA(.gz); ``genome`` is ``fasta --alphabet dna`` for genome assemblies.
* ``rnacentral``: RNAcentral FASTA, written as RNA (T -> U).
* ``opengenome2``: OpenGenome2 JSON Lines(.gz) with a ``text`` field (policies for soft-masking, ``|tax|`` tags,
  ``@`` and ``#`` in ``data_prep/sources.py``: tags stripped into meta ``taxonomy``, ``@`` dropped and counted,
  ``#`` -> ``<sep>``, lowercase upper-cased and counted), DNA alphabet (T).
* ``uniref``: UniRef50/90 FASTA, header fields in meta (id, name, n, tax, taxid, repid), ESM-2 amino-acid tokens
  (``pipeline/data/protein_tokenizer.py``); ``--uniref90-members TSV`` adds meta ``members``.
* ``babylm``: folders / files of ``*.train`` text, one line one record (BOM and CR removed, blank lines skipped,
  speaker codes kept), sentencepiece ids from ``--spm MODEL`` trained by ``python -m data_prep train-spm``; the
  model is copied beside the shards and named in the manifest's tokenizer entry.

Normalization and filtering, shared by all sources, every decision counted in the manifest:

* residues are upper-cased (``stats.lowercase_residues``); nucleotide T/U follow the source's alphabet.
* a record with a character outside the tokenizer alphabet (or invalid UTF-8, or a broken tag) is skipped and
  counted under its reason (``filtered.invalid_character`` ...); ``--strict`` makes the first one an error naming
  ``file:line``. Structural damage (no FASTA header, a JSON line without ``text``, truncated gzip, binary data,
  an empty input) is always an error, and nothing is left in the output directory.
* ``--min-length`` / ``--max-length`` filter by residue count (characters for text); nothing is cropped: long
  sequences are stored whole and cropped at load time.
* ``--dedup`` drops exact duplicates by sha1 of the normalized sequence (reason ``duplicate``; the first occurrence
  in record order is kept). With ``--num-jobs N`` a record's job is then chosen by that hash instead of its index,
  so all copies of a sequence meet in one job and per-job dedup is global: N jobs + merge keep exactly the samples
  one job keeps. Hashes are held in memory (about 100 bytes per kept record).

Manifest: per source records read / kept / filtered by reason, ``stats`` (residues and the normalization
counters above), per input file records, kept and residues.

Jobs are resumable: shards are written as ``.tmp`` and renamed when whole into a work directory
(``DIR.partial`` or ``DIR/.jobIIII-of-NNNN.partial``) whose ``progress.jsonl`` lists each finished shard with its
sha256. A rerun of the same command after a crash or SIGKILL verifies those shards, drops anything else, and
regenerates from the first missing one (the record order is deterministic, so the result is byte-identical to an
uninterrupted run). A bad-input error removes the work directory; Ctrl-C / SIGTERM keep it for the rerun.
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
    tokenizer: str = "nucleotide"  # 'nucleotide' | 'protein' | 'sentencepiece'
    min_length: int = 10  # default --min-length
    expand: Callable[[list[Path]], list[Path]] | None = None  # directories -> files


SOURCES: dict[str, Source] = {s.name: s for s in (
    Source("fasta", iter_fasta_source, None, "any nucleotide FASTA / FASTA.gz (--alphabet rna|dna required)"),
    Source("genome", iter_fasta_source, "dna", "genome FASTA / FASTA.gz (chromosomes, plasmids), DNA alphabet (T)"),
    # RNAcentral exports mostly write T; Eco-RNA writes RNA with U, so the rna alphabet maps T -> U.
    Source("rnacentral", iter_fasta_source, "rna", "RNAcentral FASTA / FASTA.gz, tokenized as RNA (T -> U)"),
    Source("opengenome2", iter_opengenome2, "dna",
           "OpenGenome2 JSON Lines (.jsonl / .jsonl.gz, 'text' field), DNA alphabet (T)"),
    Source("uniref", iter_uniref, None, "UniRef50/90 FASTA / FASTA.gz, ESM-2 amino-acid tokens", tokenizer="protein"),
    Source("babylm", iter_text_lines, None, "BabyLM *.train text files or folders, sentencepiece tokens (--spm)",
           tokenizer="sentencepiece", min_length=1, expand=expand_text_inputs),
)}

__all__ = ["SOURCES", "Source", "Record", "FastaError", "iter_fasta", "Context"]
