"""Raw corpora -> tokenized WebDataset shards + manifest.json (format: pipeline/data/shards.py).

Sources (``python -m data_prep SOURCE --input ... --output DIR``):

* ``fasta`` / ``genome``: nucleotide FASTA(.gz); ``genome`` is ``fasta --alphabet dna`` for genome assemblies.
* ``rnacentral``: RNAcentral FASTA, written as RNA (T -> U).
* ``opengenome2``: OpenGenome2 JSON Lines(.gz) with a ``text`` field (policies for soft-masking, ``|tax|`` tags,
  ``@`` and ``#`` in ``data_prep/sources.py``: tags stripped into meta ``taxonomy``, ``@`` dropped and counted,
  ``#`` -> ``<sep>``, lowercase upper-cased and counted), DNA alphabet (T).
* ``uniref``: UniRef50/90 FASTA, header fields in meta (id, name, n, tax, taxid, repid), ESM-2 amino-acid tokens
  (``pipeline/data/protein_tokenizer.py``); ``--uniref90-members TSV`` adds meta ``members``. With
  ``--clusters TSV`` each sample is instead a UniRef50 cluster holding all its UniRef90 member sequences (below).
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

UniRef50 clusters for ESM-2 sampling (``data_prep/clusters.py``)::

    python -m data_prep uniref --input uniref90_members.fasta.gz [more.fasta ...] \
        --clusters uniref50_to_uniref90.tsv --output DIR [--num-jobs N --job-index I] [--min-length ...]

* ``--input``: the UniRef90 member FASTA(.gz) files (in any order; headers other than the id are not kept);
  ``--clusters``: the mapping TSV, header ``UR50_cluster_name<TAB>mapped_id`` (optional), one UniRef50 cluster a
  line, member ids comma-separated, the ids being the member FASTA ids. The TSV's data row r is sample key
  ``f"{r:012d}"``; samples are written in TSV order, members in the TSV's member order.
* Output layout ``"clusters"`` (``pipeline/data/shards.py``): per sample ``<key>.tokens.npy`` (the members' tokens
  end to end), ``<key>.offsets.npy`` (n + 1 boundaries) and ``<key>.meta.json`` (``id`` = UniRef50 id, ``members``
  = kept member ids in stored order, ``length`` = their residues, ``listed`` = members in the TSV, ``dropped`` =
  {id: reason} when some were not kept). The loader draws one member per (seed, epoch, sample); manifest
  ``layout: "clusters"``, shard ``tokens`` = residues of all members.
* Counted, never silently dropped: ``stats.members_filtered`` per member (``not_in_fasta``, ``invalid_character``,
  ``empty``, ``shorter_than_N``, ``longer_than_N``; the length filters apply to each member; X B Z U O and the
  gap characters . - are ESM tokens, so only other characters are invalid; lowercase is upper-cased), ``filtered`` per cluster left without members
  (``no_member_in_fasta``, ``all_members_filtered``), ``stats.records_in_no_cluster`` (FASTA records no cluster
  lists), plus ``clusters``/``clusters_kept``, ``members_listed``/``members_found``/``members_kept``, ``residues``,
  ``lowercase_residues``, ``fasta_records`` and the whole TSV's ``mapping`` counts.
* One error naming ``file:line``, before anything is written, for a TSV line without two tab-separated fields, an
  empty or blank-containing id, a cluster listed twice, a member listed twice (two clusters, or one), a repeated
  header; and, while reading the FASTA, for a member record found twice. ``--strict`` makes an invalid member an
  error naming ``file:line:column``. ``--dedup`` and ``--uniref90-members`` are refused with ``--clusters``.
* ``--num-jobs N``: job I keeps the clusters with row % N == I (a cluster's members meet in one job); every job
  reads the whole TSV and FASTA. A job cannot tell another job's member from a record in no cluster, so its manifest
  has ``records_in_no_cluster: null``; ``merge`` computes it (FASTA records minus the members all jobs found) and
  checks that the jobs together cover every cluster of the TSV. Resume after a crash works as for every source.
* Memory: a job holds the whole TSV's ids only as 8-byte hashes for the uniqueness checks (8 bytes per member and
  per cluster, about twice that while they are sorted) and, for its own clusters, the member ids (about 300 bytes
  each, measured on the shared 2,500-cluster set) plus the kept members' tokens (1 byte a residue) until it writes.
  The full UniRef90 (about 150M members, some 40G residues at the sample's mean of 279) needs about 90 GB in one
  job, so at that scale run it as an array of jobs, e.g. ``--num-jobs 64`` (about 1.5 GB of clusters plus ~3 GB of
  transient hashes per job), then ``python -m data_prep merge --output DIR``. Each job parses the whole FASTA
  (~10 MB/s of FASTA per job on one core here), so the jobs should run in parallel on the same files.

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
