"""``python -m data_prep synthetic-hops``: a masked-LM task whose answer needs a known number of sequential steps.

Eco-RNA's claim is that applying its shared core more often gives better predictions. On real RNA at CPU scale that
effect is too small to see (docs/benchmarks.md, depth study), which cannot tell "the model is too small to need
depth" from "the recurrence cannot learn to use depth". This task separates the two: it is written in the model's
own vocabulary, trained through the real shards, loader, objective and launcher, and its answer cannot be had
without following H pointers one after the other.

A record of ``--hops H``, ``--slots S`` (default 4) and ``--queries Q`` (default 1) is ``S H`` level tokens, the
Q queries, ``<sep>`` and the Q answers (S = 4, Q = 1)::

    level 0          level 1              ...  level H-1                query   <sep>  answer
    l_0 l_1 l_2 l_3  p_10 p_11 p_12 p_13  ...  p_H-1,0 ... p_H-1,3     q       <sep>  a

* A body token is a *literal* (a value: the first S letters of ``A C G U T N R Y S W K M B D H V``, ``A C G U`` at
  S = 4) or a *pointer* (the next 2 S - 1 letters, ``T N R Y S W K`` at S = 4), which means "same value as the
  token d positions back", d = 1 .. 2 S - 1 in that order.
* Level 0 holds the S literals in a random order. Each slot of level j >= 1 points at a slot of level j - 1,
  through a random permutation, so every level holds the S values once each. Query j points at a slot of level
  H - 1 (distinct slots for distinct queries), and answer j is its value: H pointers away from its literal.
* Every level is a permutation of the values, so nothing short of following all H pointers says anything about
  the answer: a model that reads fewer levels, or counts tokens, is at chance (1/S).
* There are S!^H S one-query records with H pointers: 55,296 at S = 4 and H = 3, few enough that a training set
  holds most of them and a model can fit them without reading; 8.6 million at S = 5. More queries give more
  supervised reads per record: the bench's S = 5, Q = 3 starts every training seed reading (docs/depth_task.md).

A block that resolves every position in parallel (one read per block, or per core application) has level j after j
reads and the query after H; the answer position copies it one read later, h = H + 1 reads in all (H if it reads
the query's target itself). A one-block model sees the query only. Resolved positions keep their value under further
reads, so iterating past h keeps the answer (a fixed point).

``--min-hops m`` (default 0: the query is its own value) draws each record's H uniformly from ``m .. --hops``: the
training set holds the shorter chains as a curriculum; a held-out set at exactly H is written with
``--min-hops H --hops H --exclude TRAIN_DIR``. Record ``i`` is drawn from ``numpy.random.default_rng([seed, i])``
alone, so a seed gives the same records whatever the count, shard size or machine. ``data.masking.kind:
last_segment`` supervises exactly the tokens after the last ``<sep>``: the answers.
"""
from __future__ import annotations

import functools
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pipeline.data.tokenizer import SEP_ID, VOCAB
from pipeline.outputs import kept_note, publish_dir

from .common import BLOCK_SAMPLES, TOOL, check_output_replaceable, manifest_files, output_lock

# With S slots per level, the first S letters are the literals and the next 2 S - 1 the pointers d = 1 .. 2 S - 1
# (slot i of a level reaches slot t of the level before it S + i - t back, at most 2 S - 1). S = 4: literals A C G U,
# pointers T N R Y S W K; S = 5: literals A C G U T, pointers N R Y S W K M B D.
ALPHABET = ("A", "C", "G", "U", "T", "N", "R", "Y", "S", "W", "K", "M", "B", "D", "H", "V")
MAX_SLOTS = (len(ALPHABET) + 1) // 3  # S + 2 S - 1 letters: 5
SOURCE = "synthetic-hops"


class SyntheticError(ValueError):
    """Bad synthetic-hops arguments; the message names the flag."""


@dataclass(frozen=True)
class HopsTask:
    hops: int  # pointers from the query to its literal, in the hardest records
    min_hops: int = 0  # each record's pointer count is uniform in min_hops .. hops (0: the query is its value)
    slots: int = 4  # S: values, and slots per level (chance 1 / S; S! ** H * S records at H pointers)
    queries: int = 1  # Q: queries of distinct slots of level H - 1, each with its answer after <sep>

    def __post_init__(self):
        if self.hops < 1:
            raise SyntheticError(f"--hops must be >= 1, got {self.hops}")
        if not 0 <= self.min_hops <= self.hops:
            raise SyntheticError(f"--min-hops must lie in 0 .. --hops {self.hops}, got {self.min_hops}")
        if not 2 <= self.slots <= MAX_SLOTS:
            raise SyntheticError(f"--slots must lie in 2 .. {MAX_SLOTS} (S literals and 2 S - 1 pointers among the "
                                 f"{len(ALPHABET)} letters), got {self.slots}")
        if not 1 <= self.queries <= self.slots:  # query j reaches S + j back at most: within the 2 S - 1 pointers
            raise SyntheticError(f"--queries must lie in 1 .. --slots {self.slots}, got {self.queries}")

    @property
    def literals(self) -> tuple[str, ...]:
        return ALPHABET[:self.slots]

    @property
    def pointers(self) -> tuple[str, ...]:  # offset d = index + 1
        return ALPHABET[self.slots:3 * self.slots - 1]


@functools.cache
def _ids(letters: tuple[str, ...]) -> np.ndarray:  # once per alphabet, not per record
    return np.array([VOCAB.index(c) for c in letters], dtype=np.uint8)


def generate(task: HopsTask, seed: int, index: int) -> tuple[np.ndarray, int]:
    """Record ``index`` of ``seed``: (token ids uint8 [S max(H, 1) + 2 Q + 1], its number of pointers H)."""
    n, q = task.slots, task.queries
    literal_ids, pointer_ids = _ids(task.literals), _ids(task.pointers)
    rng = np.random.default_rng([seed, index])
    hops = int(rng.integers(task.min_hops, task.hops + 1))
    literals = literal_ids[rng.permutation(n)]
    levels, targets = [literals], []
    for _ in range(1, hops):  # slot i of level j points at slot t[i] of level j - 1: n + i - t[i] back
        t = rng.permutation(n)
        targets.append(t)
        levels.append(pointer_ids[n + np.arange(n) - t - 1])
    # Query j follows level H - 1 (j places after its end) and points at its slot slots[j], n + j - slots[j] back;
    # distinct slots, the first drawn alone (so that Q = 1 gives the records of the one-query task).
    first = int(rng.integers(n))
    slots = [first, *rng.permutation([s for s in range(n) if s != first])[:q - 1].tolist()]
    queries = [pointer_ids[n + j - s - 1] if hops else literals[s] for j, s in enumerate(slots)]  # H = 0: literals
    answers = []
    for slot in slots:
        for t in reversed(targets):  # down the levels to the literal
            slot = int(t[slot])
        answers.append(literals[slot])
    return np.concatenate([*levels, queries, [SEP_ID], answers]).astype(np.uint8), hops


def read_records(directory: Path) -> set[bytes]:
    """The token bytes of every record in a shard directory (``--exclude``)."""
    from pipeline.data.shard_reader import read_shard  # torch's import time: see data_prep/workdir.py
    from pipeline.data.shards import load_manifest

    manifest = load_manifest(directory)
    return {tokens.tobytes() for s in manifest.shards for _, tokens, _ in read_shard(directory / s.path, s.samples)}


def write(output: Path, task: HopsTask, records: int, seed: int, shard_size: int = 10_000,
          overwrite: bool = False, exclude: Path | None = None) -> dict:
    """Write ``records`` records as nucleotide shards + manifest.json in ``output`` (built in ``output.partial``,
    renamed when whole; ``overwrite`` replaces only a directory data_prep wrote). ``exclude``: a shard directory
    (the training set) whose records are skipped, so that a held-out set shares none of them; the skipped draws are
    counted in the manifest (filtered ``in_exclude``) and more are drawn until ``records`` are written. Returns the
    manifest's stats."""
    if records < 1:
        raise SyntheticError(f"--records must be >= 1, got {records}")
    if seed < 0:
        raise SyntheticError(f"--seed must be >= 0, got {seed}")
    output = Path(output).resolve()
    if output.exists() and not output.is_dir():
        raise SyntheticError(f"output {output} exists and is not a directory")
    check_output_replaceable(output, overwrite)  # refused before anything is made
    output.parent.mkdir(parents=True, exist_ok=True)
    with output_lock(output, "data_prep synthetic-hops"):  # another run's .partial is never cleared under it
        check_output_replaceable(output, overwrite)
        return _write(output, task, records, seed, shard_size, exclude)


def _write(output: Path, task: HopsTask, records: int, seed: int, shard_size: int, exclude) -> dict:
    from pipeline.data.shards import Manifest, ShardWriter, write_manifest  # torch's import time, as above

    tmp = output.with_name(f"{output.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)  # generation is cheap and deterministic: never resumed
    tmp.mkdir(parents=True)
    per_hops, answers, skipped, kept, i = {}, {c: 0 for c in task.literals}, 0, 0, -1
    try:
        seen = read_records(Path(exclude)) if exclude is not None else set()
        writer = ShardWriter(tmp, prefix=SOURCE, max_samples=shard_size, vocab_size=len(VOCAB),
                             block_samples=BLOCK_SAMPLES)
        while kept < records:
            i += 1
            if skipped > 100 * records:
                raise SyntheticError(f"--exclude {exclude}: {skipped} draws were all in it; the task at --hops "
                                     f"{task.hops} has too few distinct records for {records} more")
            tokens, hops = generate(task, seed, i)
            if tokens.tobytes() in seen:
                skipped += 1
                continue
            kept += 1
            per_hops[str(hops)] = per_hops.get(str(hops), 0) + 1
            for a in tokens[len(tokens) - task.queries:]:
                answers[VOCAB[a]] += 1
            writer.write(f"hops{seed}-{i:09d}", tokens, {"hops": hops})
        shards = writer.close()
        stats = {"task": {"hops": task.hops, "min_hops": task.min_hops, "slots": task.slots,
                          "queries": task.queries, "seed": seed},
                 "records_per_hops": dict(sorted(per_hops.items(), key=lambda kv: int(kv[0]))),
                 "answers": answers}
        manifest = Manifest(source=SOURCE, tokenizer={"name": "nucleotide", "vocab": list(VOCAB), "alphabet": None},
                            shards=shards, filtered={"in_exclude": skipped} if exclude is not None else {},
                            inputs=[{"path": f"{SOURCE}:seed={seed}", "records": i + 1}], stats=stats)
        write_manifest(tmp, manifest)
        carried = publish_dir(tmp, output, TOOL, manifest_files)  # marked as data_prep's; others' files carried over
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if carried:
        print(kept_note(carried, TOOL), file=sys.stderr)
    return stats
