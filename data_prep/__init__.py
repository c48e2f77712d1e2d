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
  counted under its reason (``filtered.invalid_character`` ...; ``stats.invalid_characters`` counts the characters);
  ``--strict`` makes the first one an error naming ``file:line``. Structural damage (no FASTA header, a JSON line
  without ``text``, truncated gzip, binary data, an empty input) is always an error, and nothing is left in the
  output directory.
* ``--max-filtered-fraction F`` (default 0.01): when more than F of a job's records are dropped as damaged (an
  invalid-record reason above, or ``empty``) the job fails with one error line naming the counts, the characters
  outside the alphabet and the first three offending records (``file:line:column``), and nothing is written.
  Drops the user asked for (``shorter_than_N``, ``longer_than_N``, ``duplicate``) do not count. While reading, one
  warning goes to stderr once the fraction after 1,000 records is above F. Cluster runs apply it to the members
  found.
* ``--replace-invalid CHAR`` (nucleotide and protein sources): every character outside the alphabet is written as
  CHAR (a residue of the alphabet: ``N``, ``X``) instead of dropping the record; ``stats.replaced`` counts them per
  character, ``stats.replaced_characters`` / ``records_with_replacements`` in total, and the summary line says so.
  OpenGenome2's ``#`` is never replaced. Non-ASCII characters count once each, not per UTF-8 byte.
* ``filtered.tsv`` beside the manifest lists every record not written, one a line, columns ``id reason input line
  detail`` (detail: the bad character and its ``line:column``, the length, the kept duplicate's id, the cluster a
  member belongs to); the manifest names it in ``stats.filtered_list``. It exists only when something was dropped.
  Job I of N writes ``filtered-jobIIII-of-NNNN.tsv``; ``merge`` concatenates them into ``filtered.tsv``.
* ``--min-length`` / ``--max-length`` filter by residue count (characters for text); nothing is cropped: long
  sequences are stored whole and cropped at load time.
* ``--dedup`` drops exact duplicates by sha1 of the normalized sequence (reason ``duplicate``; the first occurrence
  in record order is kept). With ``--num-jobs N`` a record's job is then chosen by that hash instead of its index,
  so all copies of a sequence meet in one job and per-job dedup is global: N jobs + merge keep exactly the samples
  one job keeps. Hashes are held in memory (about 100 bytes per kept record).

Long sequences and splits:

* ``--window L [--stride S] [--window-tail short|align|drop]`` tiles each kept record into windows, one sample
  each (OpenGenome2 / Evo 2 style): starts 0, S, 2S, ... (S defaults to L; S < L overlaps by L - S; S > L is
  refused, it would lose the positions between windows), the last window being the first that reaches the record's
  end. That tail, when shorter than L, is kept short (default), moved back to end at the record's end (``align``:
  full length, more overlap) or dropped (``drop``: ``tail_residues_dropped`` counts the residues lost). A record of
  at most L positions is one window, the whole record. Sample key ``<record index>_<window>``, meta ``id``
  ``RECORD:START-END`` (0-based, end exclusive, positions of the normalized sequence), ``record``, ``start``,
  ``end``. ``stats.windowing`` holds L, S and the policy; ``stats.windows`` counts records, samples,
  records shorter than a window, exact ends, each kind of tail and the residues written (overlaps counted twice).
  Length filters and ``--dedup`` apply to whole records, before windowing. ``--stride`` here is the step between
  window starts (as in ``bedtools makewindows -s``); Hugging Face tokenizers' ``stride`` is the overlap instead.
* ``--val-fraction F`` writes ``DIR/train`` and ``DIR/val``, two complete shard directories (each its manifest,
  ``filtered.tsv``, tokenizer model), and ``DIR/split.json`` (the fraction, the rule, samples and records per
  split). A record goes to val when ``int.from_bytes(sha256(id)[:8], "little") < F * 2**64``: the split depends on
  the record id only, so it is the same for any record order, job count or other option, and all windows of a
  record land together. Filtered records are counted in the manifest of the split their id hashes to. Identical
  sequences under two ids can land on both sides: add ``--dedup`` (dedup is across splits). Jobs write
  ``DIR/train`` and ``DIR/val`` alike, ``merge --output DIR`` merges both and writes ``split.json``. Not available
  with ``--clusters`` yet.

BabyLM CSV: a ``.csv`` (or ``.csv.gz``) input is refused unless ``--text-column NAME`` names one of its header's
columns; that column is then read with the csv module, one record per non-blank cell (``blank_cells`` counted, a
line break inside a cell becomes a space, ``cells_with_line_breaks``), id ``<file name>:<line of the row>``.
``train-spm`` takes the same flag.

Progress (``--progress auto|bar|log|off``, data_prep/progress.py) goes to stderr, measured in input bytes on disk
(compressed bytes for gzip) so the remaining time is estimated from the start: a tqdm bar on a terminal (``auto``),
one plain line every ``--progress-interval`` seconds (``log``, for batch logs), or nothing. stdout holds only the
summary line.

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
  gap characters . - are ESM tokens, so only other characters are invalid; lowercase is upper-cased), ``filtered``
  per cluster left without members
  (``no_member_in_fasta``, ``all_members_filtered``), ``stats.records_in_no_cluster`` (FASTA records no cluster
  lists), plus ``clusters``/``clusters_kept``, ``members_listed``/``members_found``/``members_kept``, ``residues``,
  ``lowercase_residues``, ``fasta_records`` and the whole TSV's ``mapping`` counts.
* One error naming ``file:line``, before anything is written, for a TSV line without two tab-separated fields, an
  empty or blank-containing id, a cluster listed twice, a member listed twice (two clusters, or one), a repeated
  header; and, once the FASTA is read, for a member record found twice. A TSV none of whose member ids (of the
  job's clusters) is a FASTA record id is one error naming both first ids. ``--uniref90-members`` reads the same
  header (skipped on line 1) and fails the same way when no input record carries one of its UniRef50 ids.
  ``--strict`` makes an invalid member an error naming ``file:line:column``; ``--replace-invalid X`` writes its bad
  characters as X instead. ``--dedup``, ``--uniref90-members``, ``--window`` and ``--val-fraction`` are refused with
  ``--clusters``.
* ``--num-jobs N``: job I keeps the clusters with row % N == I (a cluster's members meet in one job); every job
  reads the whole TSV and FASTA. A job cannot tell another job's member from a record in no cluster, so its manifest
  has ``records_in_no_cluster: null``; ``merge`` computes it (FASTA records minus the members all jobs found) and
  checks that the jobs together cover every cluster of the TSV. Resume after a crash works as for every source.
* Memory does not grow with the corpus: the member FASTA is read in chunks by the batch reader into a Parquet table
  and every member is joined to its record by DuckDB under a memory limit, spilling under ``$TMPDIR``
  (data_prep/join.py gives the four passes). The full UniRef90 can run as one job, as ``--workers N``
  (the parent deals the FASTA's chunks out, each worker parses its own into a spill they share and joins its
  clusters against all of it), or as an array of ``--num-jobs N`` jobs that each read the whole FASTA and write a
  1/N of the clusters, then ``merge``.

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
