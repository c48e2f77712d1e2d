"""Resumable shard loader: deterministic per-rank sample streams with an exact, small position.

Files. This module holds the rank's microbatch stream (ShardStream: batching, length windows, the resumable state)
and its iterator (StreamLoader); pipeline/data/streams.py the sources, their per-stream sample order and the
layout of streams over ranks (reshard_states); pipeline/data/batch.py the Batch and how samples become one;
pipeline/data/shard_reader.py reads the shards (every reader of the format shares it).

Sources. A loader reads one source (``data.train_shards``) or a mixture of named sources (``data.sources``), each a
shard directory with manifest.json or brace-notation tar paths (``data/x/x-{000000..000007}.tar``). Without a
manifest the per-shard sample and token counts are obtained by reading every tar once when the loader is built (one
full read + decode of the source, per process; cached for the process) -- use a manifest for large sources.

Streams. The data is dealt into S sample streams fixed for the whole run (StreamLayout; ``data.loader_streams``,
default R ranks x max(1, workers) at the run's start, kept in the loader state). Rank r reads the contiguous block
of streams r*S/R .. (r+1)*S/R - 1, shared among its DataLoader workers (or read in turn by the rank itself), so a
checkpoint continues on any number of ranks dividing S with every stream where it stood (reshard_states): each
step then reads the samples of the uninterrupted run, with no sample repeated or skipped. The shards of a source in
epoch ``e`` are permuted with seed (key, e), key = (seed,) for the single-source loader and (seed, crc32(name)) for
a mixture source; stream g owns the shards at positions g, g + S, ... of that permutation. Every seed below that
names a "rank, stream" uses the stream's coordinates (g // w0, g % w0), w0 the streams per rank of the run's first
layout, so a stream's order does not depend on who reads it. Inside a shard the samples are permuted with seed (key, e, shard). Shard mixing (``mix_shards`` K,
default 4): the stream's n shards of the epoch, in that order, form ceil(n / K) groups of consecutive shards (sizes
differing by at most one; no group of one when K > 1), and a group's samples are a uniformly random interleaving of
its shards' permuted samples, seeded (key, e, rank, stream, group, K, tag), so a corpus written one domain per shard
still gives batches that mix domains; a stream holds one group's shards (about K) in memory. K = 1 reads the shards
one after the other (the order before mixing existed); a stream that owns a single shard in an epoch cannot mix
(more shards: ``data_prep --shard-size``). With ``shuffle_buffer`` N the stream's epoch is then cut into consecutive
windows of N samples, each permuted with seed (key, e, rank, stream, window, N), so samples of neighbouring groups
mix as in a shuffle buffer; unlike a reservoir buffer neither holds state to checkpoint (a position is still one
count) and every group and window is a uniform permutation. The order of a stream is thus a function of (seed,
rank, stream, K, N) and the manifest counts alone; resuming needs the same K and N (both are in the state and
checked). Every source is an infinite stream: after its shards it continues with its next epoch, independently of
the other sources (sampling with replacement across epochs). Every random choice for a sample (crop, masking) is
seeded by (key, epoch, shard, index), so a sample's content never depends on who read it or when.

Clusters. A source whose manifest has layout "clusters" (``data_prep uniref --clusters``) holds one UniRef50 cluster
per sample with all its UniRef90 members (pipeline/data/shards.py). Such a sample is a draw: the member is chosen
uniformly from the sample's own generator, seeded (key, epoch, shard, index) like every other choice and drawn
before the transform uses it, so the member depends on (seed, epoch, sample) only -- not on rank, worker count,
shuffle window or resume -- and a new epoch draws again (ESM-2's UniRef50/90 sampling; BioNeMo's ESM2 dataset seeds
one generator per (seed, index) and draws the member, the crop and the mask from it in that order). A one-member
cluster costs no draw. The transform sees the member's tokens as if they were the sample, and the sample id names
the member by its index in the cluster's meta ``members``: ``shard/key@epoch#member``. ``cluster_sampling`` True
requires cluster sources, False refuses them, None (default) follows each source's manifest.

Mixture. Draw k of stream (rank r, stream w) picks its source from u_k = U(seed, r, w, k) and the weights of the
optimizer step of the microbatch being filled (pipeline/data/mixture.py): stateless in k.

Batching. A microbatch holds ``micro_batch_size`` samples, or with a token budget as many as fit: a sample is added
unless (rows + 1) x max_len would exceed the budget, in which case it is held and opens the next microbatch. With
``pack`` each of the ``micro_batch_size`` rows concatenates whole documents as the transform framed them (both
families' transforms end a document with <eos>; ``pack_separator`` appends one more token after each) until the next
one would not fit in ``row_length``; a document longer than a row keeps its start. The row carries ``document_ids``
and ``position_ids`` (restarting at 0 per document) so attention and positions can keep documents apart.

Length windows. With ``length_window`` M (not with ``pack``: packed rows are full already) a stream's draws are cut
into consecutive windows of M (window i: draws i*M .. i*M + M - 1, each picking its source as above). The window's M
samples, after the transform (so crops count), are sorted by len(input_ids), stably, and cut in that order into
microbatches by the rules above (token budget, else groups of ``micro_batch_size``; M must then be a multiple of it);
the window's batches are then emitted in a random order seeded (seed, rank, stream, i, M, tag), so a step does not
walk from short to long sequences. A microbatch thus holds sequences of about one length and padding nearly vanishes
(bench/padding.py), while every sample of a window is still emitted exactly once, whole, with the content it has
without windows. Mixture weights: every draw of a window uses the weights of the optimizer step of the window's
first microbatch (the samples are drawn before any of the window's batches exists), so a schedule moves in steps of
one window; ``seen()`` still counts exactly the samples and tokens of the emitted batches. Memory: M transformed
samples per stream.

Position. Per stream the state is a handful of integers: draws made, microbatches emitted, samples and tokens taken
from each source, and the source of a drawn-but-held sample (-1 if none). A source's sample stream resumes from its
count alone (the manifest counts jump over whole epochs and shards without opening them), and the held sample is
re-read from its source's position. With length windows, ``draws`` is the position of the current window's start,
``window_taken`` the samples drawn from each source before it and ``window_batches`` how many of its batches were
emitted: a resumed stream draws the window again from those counts (a sample is a pure function of its position),
sorts and permutes it the same way and skips the emitted batches; once a window's last batch is out, the state names
the next window's start (without windows ``window_taken`` equals ``taken`` and ``window_batches`` is 0). Each Batch
carries its stream's state after it and its origin (global stream, index in it); the loader in the main process
keeps the state of the last batch it handed out per stream plus N, the microbatches consumed. A rank takes its L
streams in rotation (batch j from stream j mod L); torch's DataLoader takes batches from its P workers in strict
rotation, so worker p serves streams p, p + P, ... (P divides L); a resumed loader rotates the streams so that the
next batch comes from stream N mod L. State size: L x (4 + 3 x sources) integers per rank. States of version 1 (before length windows) load as
length_window 0; ``length_window`` must not change on resume.

Checks while reading. Every shard passes the tar-member check all shard readers share (shard_reader.member_problem: no
``..`` or absolute names, no links), its sample count is the manifest's, with ``vocab_size`` every token id is below
it (one max per sample), and with ``verify`` (default) its sha256 is compared with the manifest the first time a
process reads it, hashed from the same in-memory read that decodes it (brace URLs have no manifest: no digest). Each
failure is one ShardError line naming the shard file (and the member or sample); raised in a DataLoader worker, it
reaches the main process as the same one-line error (WorkerError), not a worker traceback. Whether a source's
tokenizer fits the model at all is checked before training by pipeline/data/compat.py.
"""
from __future__ import annotations

import copy
import zlib
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.data.batch import Batch, collate, pack_rows
from pipeline.data.length_window import length_window_problem
from pipeline.data.mixture import MixtureSchedule, SourceChooser
from pipeline.data.remote import COUNTERS, CacheSettings
from pipeline.data.shards import ShardError
from pipeline.data.streams import SampleTransform, Source, SourceStream, StreamLayout, saved_layout

STATE_VERSION = 2  # 2: length windows (window_taken, window_batches per stream; length_window)
_LEN_TAG = 0x6C656E  # "len": last seed entry of a length window's batch order


@dataclass
class StreamState:
    draws: int = 0  # samples placed into emitted batches (the mixture's k)
    batches: int = 0  # microbatches emitted by this stream
    pending: int = -1  # source of the drawn sample that did not fit the last batch; -1 = none
    taken: list = field(default_factory=list)  # [S] samples placed, per source
    tokens: list = field(default_factory=list)  # [S] tokens (len(input_ids)) placed, per source
    # length windows: [S] samples drawn per source before the current window, and the window's batches emitted
    window_taken: list = field(default_factory=list)
    window_batches: int = 0

    def as_dict(self) -> dict:
        return {"draws": self.draws, "batches": self.batches, "pending": self.pending, "taken": list(self.taken),
                "tokens": list(self.tokens), "window_taken": list(self.window_taken),
                "window_batches": self.window_batches}


class ShardStream(IterableDataset):
    """Microbatch stream of one rank. ``shards``: a shard spec (one source) or a list of :class:`Source`.

    ``mixture`` (required for several sources) gives the weights per optimizer step; ``grad_accum_steps`` maps
    microbatches to steps. ``max_tokens`` turns on token-budget batching, ``pack`` packing into rows of
    ``row_length`` (optionally with ``pack_separator`` after each document), ``shuffle_buffer`` the cross-shard
    window shuffle, ``length_window`` length-sorted batching within windows of that many draws (module docstring,
    "Length windows"); ``mix_shards`` K interleaves the samples of K shards at a time in every stream (1: one shard
    after the other, the order before shard mixing existed; holds about K shards per source and stream in memory).
    ``vocab_size`` (the model's) makes a token id at or above it a ShardError naming the shard and sample;
    ``verify`` checks each shard's sha256 against its manifest on its first read by a stream (sources given as
    brace URLs have no manifest and are not verified). ``batches_consumed`` resumes a single-source, fixed-size
    loader from that count alone (what checkpoints before loader state_dicts stored); otherwise use
    :meth:`load_state_dict`. ``cluster_sampling``: None reads each source as its manifest's layout says (a cluster
    source draws one member per sample), True requires every source to be UniRef50 clusters, False refuses cluster
    sources (module docstring, "Clusters"). Errors in the data (ShardError, a missing file) raised in a DataLoader
    worker reach the main process as the same exception with the same one-line message."""

    def __init__(self, shards: str | Path | list[Source], *, rank: int, world_size: int, num_workers: int,
                 micro_batch_size: int, seed: int, transform: SampleTransform, pad_id: int,
                 batches_consumed: int = 0, mixture: MixtureSchedule | None = None, grad_accum_steps: int = 1,
                 max_tokens: int | None = None, pack: bool = False, pack_separator: int | None = None,
                 row_length: int | None = None, shuffle_buffer: int = 0, cluster_sampling: bool | None = None,
                 mix_shards: int = 4, vocab_size: int | None = None, verify: bool = True, length_window: int = 0,
                 streams: int | None = None, seed_width: int | None = None, cache: CacheSettings | None = None):
        self.rank, self.world_size = rank, world_size
        self.layout = (StreamLayout.fresh(world_size, rank, num_workers, streams) if seed_width is None else
                       StreamLayout(streams, seed_width, world_size, rank))
        # num_streams: this rank's streams; the iterating processes (its workers, or itself) share them
        self.num_streams, self.shuffle_buffer = self.layout.local, shuffle_buffer
        self.processes = max(1, num_workers)
        if self.num_streams % self.processes:
            raise ValueError(f"data.num_workers: {num_workers} workers cannot share this rank's {self.num_streams} "
                             f"loader streams ({self.layout.describe()}); use a number that divides "
                             f"{self.num_streams}")
        if mix_shards < 1:
            raise ValueError(f"data.mix_shards: must be >= 1, got {mix_shards}")
        self.mix_shards = mix_shards
        self.micro_batch_size, self.seed = micro_batch_size, seed
        self.pad_id, self.grad_accum_steps = pad_id, grad_accum_steps
        self.max_tokens, self.pack, self.pack_separator, self.row_length = max_tokens, pack, pack_separator, row_length
        if pack and (row_length is None or row_length < 2):
            raise ValueError(f"data.context_length: packing needs a row length >= 2, got {row_length}")
        why = length_window_problem(length_window, pack=pack, max_tokens=max_tokens,
                                    micro_batch_size=micro_batch_size)
        if why:
            raise ValueError(f"data.length_window: {why}")
        self.length_window = length_window
        single = not isinstance(shards, list)
        sources = [Source(Path(str(shards)).name, shards)] if single else shards
        if not sources:
            raise ValueError("data.sources: empty")
        self.names = [s.name for s in sources]
        self.mixture = mixture or MixtureSchedule.constant(self.names)
        if self.mixture.names != self.names:
            raise ValueError(f"data.schedule: weights are for sources {self.mixture.names}, loader has {self.names}")
        # The single-source key (seed,) and unprefixed ids keep streams identical to loaders before mixtures.
        self.sources = [SourceStream(s, (seed,) if single else (seed, zlib.crc32(s.name.encode())),
                                     layout=self.layout, transform=transform,
                                     id_prefix="" if single else f"{s.name}:", shuffle_buffer=shuffle_buffer,
                                     cluster_sampling=cluster_sampling, mix_shards=mix_shards,
                                     vocab_size=vocab_size, verify=verify, cache=cache)
                        for s in sources]
        self.remote = any(s.remote for s in self.sources)  # batches then carry the fetch counters
        self.shard_dir = Path(str(shards)) if single else None
        self.counts = self.sources[0].counts
        self.state = self._fresh_state()
        if batches_consumed:
            self.load_state_dict({"batches_consumed": batches_consumed})

    # -- single-source helpers kept for callers that inspect one source's streams (``stream``: this rank's)
    def stream_shards(self, stream: int, epoch: int) -> np.ndarray:
        return self.sources[0].stream_shards(self.layout.global_stream(stream), epoch)

    def samples(self, stream: int, skip: int) -> Iterator[dict]:
        return self.sources[0].samples(self.layout.global_stream(stream), skip)

    # -- state
    def _fresh_state(self) -> dict:
        S = len(self.sources)
        return {"version": STATE_VERSION, "rank": self.rank, "world_size": self.world_size, "sources": self.names,
                "shuffle_buffer": self.shuffle_buffer, "mix_shards": self.mix_shards,
                "length_window": self.length_window, "batches_consumed": 0, "layout": self.layout.as_dict(),
                "streams": [StreamState(taken=[0] * S, tokens=[0] * S, window_taken=[0] * S).as_dict()
                            for _ in range(self.num_streams)]}

    def state_dict(self) -> dict:
        """The position iteration starts from (the loader's :meth:`StreamLoader.state_dict` is the live one)."""
        return copy.deepcopy(self.state)

    def load_state_dict(self, state: dict):
        """Accepts a full state, or ``{"batches_consumed": N}`` alone for a single-source fixed-size loader."""
        if set(state) == {"batches_consumed"}:
            state = self._legacy_state(int(state["batches_consumed"]))
        # states written before the shuffle buffer / shard mixing / length windows existed read their shards one
        # after the other and batch in draw order
        state = {"shuffle_buffer": 0, "mix_shards": 1, "length_window": 0, **state}
        if int(state.get("version", 1)) > STATE_VERSION:
            raise ValueError(f"loader state: version {state['version']} is newer than this loader's {STATE_VERSION}")
        tunables = ("shuffle_buffer", "mix_shards", "length_window")
        for key, ours in (("sources", self.names), ("world_size", self.world_size), ("rank", self.rank),
                          *((k, getattr(self, k)) for k in tunables)):
            if state.get(key) != ours:
                hint = (f" (data.{key} must not change on resume; set data.{key}={state.get(key)!r} to continue "
                        "this run)" if key in tunables else "")
                raise ValueError(f"loader state: {key} {state.get(key)!r} differs from this loader's {ours!r}{hint}")
        if len(state["streams"]) != self.num_streams or saved_layout(state) != self.layout.as_dict():
            raise ValueError(f"loader state: {len(state['streams'])} streams of layout {saved_layout(state)}, this "
                             f"loader has {self.num_streams} of {self.layout.as_dict()} (reshard_states deals a "
                             "checkpoint's streams to another world size)")
        state = copy.deepcopy(state)
        state["layout"] = self.layout.as_dict()
        for st in state["streams"]:  # version 1: no windows, so the window starts where the stream stands
            st.setdefault("window_taken", list(st["taken"]))
            st.setdefault("window_batches", 0)
        state["version"] = STATE_VERSION
        self.state = state

    def _legacy_state(self, n: int) -> dict:
        if len(self.sources) > 1 or self.max_tokens or self.pack or self.length_window:
            raise ValueError("loader state: a batches_consumed count alone only resumes a single-source loader with "
                             "fixed-size batches in draw order (no length windows)")
        st = self._fresh_state()
        W, mb = self.num_streams, self.micro_batch_size
        for w in range(W):
            b = max(0, -(-(n - w) // W))  # ceil((n - w) / W) batches taken from stream w
            st["streams"][w].update(draws=b * mb, batches=b, taken=[b * mb], window_taken=[b * mb])
        st["batches_consumed"] = n
        return st

    # -- iteration
    def __iter__(self) -> Iterator[Batch]:
        # The rank's batch j (after N consumed) comes from its stream (N + j) mod L; torch's DataLoader takes batch j
        # from worker j mod P, so worker p serves streams (N + p + i P) mod L in that order (P divides L).
        info = get_worker_info()
        physical = info.id if info is not None else 0
        L, P, N = self.num_streams, self.processes, self.state["batches_consumed"]
        mine = [(N + physical + i * P) % L for i in range(L // P)]
        streams = [self._batches(w, StreamState(**copy.deepcopy(self.state["streams"][w]))) for w in mine]
        batches = streams[0] if len(streams) == 1 else _round_robin(streams)
        if self.remote:
            batches = _counting(batches)
        return batches if info is None else _reporting(batches)

    def _batches(self, w: int, st: StreamState) -> Iterator[Batch]:
        if self.length_window:
            return self._window_batches(w, st)
        return self._draw_order_batches(w, st)

    def _draw_order_batches(self, w: int, st: StreamState) -> Iterator[Batch]:
        """Microbatches of this rank's stream ``w``, filled in draw order (no length windows)."""
        g = self.layout.global_stream(w)
        chooser = SourceChooser(self.seed, *self.layout.seed_coords(g))
        iters: dict[int, Iterator[dict]] = {}
        held: list = []  # [(source, sample)] at most one: drawn, not placed yet
        weights = None

        def draw() -> dict:
            if not held:
                s = st.pending if st.pending >= 0 else chooser.choose(st.draws, weights)
                if s not in iters:  # a source's stream resumes from the count of samples already placed
                    iters[s] = self.sources[s].samples(g, st.taken[s])
                held.append((s, next(iters[s])))
                st.pending = s
            return held[0][1]

        def place() -> dict:
            s, sample = held.pop()
            st.taken[s] += 1
            st.tokens[s] += len(sample["input_ids"])
            st.draws += 1
            st.pending = -1
            return sample

        while True:
            step = (st.batches * self.num_streams + w) // self.grad_accum_steps  # rank-local microbatch -> step
            weights = self.mixture.weights(step)
            if self.pack:
                extra = int(self.pack_separator is not None)
                body = self.row_length - extra  # most document tokens one row holds
                rows = []
                for _ in range(self.micro_batch_size):
                    row, used = [], 0
                    while True:
                        n = min(len(draw()["input_ids"]), body) + extra
                        if row and used + n > self.row_length:
                            break  # the held document opens the next row
                        sample = place()
                        if len(sample["input_ids"]) > body:  # longer than a row: keep its start
                            sample = {**sample, "input_ids": sample["input_ids"][:body],
                                      "labels": sample["labels"][:body]}
                        row.append(sample)
                        used += n
                    rows.append(row)
                batch = pack_rows(rows, self.row_length, self.pad_id, self.pack_separator)
            elif self.max_tokens:
                samples, longest = [], 0
                while True:
                    n = len(draw()["input_ids"])
                    if samples and (len(samples) + 1) * max(longest, n) > self.max_tokens:
                        break  # the held sample opens the next microbatch
                    samples.append(place())
                    longest = max(longest, n)
                batch = collate(samples, self.pad_id)
            else:
                samples = []
                for _ in range(self.micro_batch_size):
                    draw()
                    samples.append(place())
                batch = collate(samples, self.pad_id)
            st.batches += 1
            st.window_taken = list(st.taken)  # no windows: "the window" starts where the stream stands
            batch.stream, batch.state, batch.origin = w, st.as_dict(), (g, st.batches - 1)
            yield batch

    def _window_batches(self, w: int, st: StreamState) -> Iterator[Batch]:
        """Microbatches of length-sorted windows of ``length_window`` draws (module docstring, "Length windows").

        ``st`` names a window's start (draws, window_taken, the batches before it = batches - window_batches) and
        how many of its batches are out; the window is drawn again from there and those batches are skipped.
        """
        M, S = self.length_window, len(self.sources)
        g = self.layout.global_stream(w)
        chooser = SourceChooser(self.seed, *self.layout.seed_coords(g))
        iters = [self.sources[s].samples(g, st.window_taken[s]) for s in range(S)]  # lazy: nothing read yet
        while True:
            k0 = st.draws
            first = st.batches - st.window_batches  # this stream's microbatches before the window
            weights = self.mixture.weights((first * self.num_streams + w) // self.grad_accum_steps)
            drawn = []  # [M] (source, sample) in draw order
            for k in range(k0, k0 + M):
                s = chooser.choose(k, weights)
                drawn.append((s, next(iters[s])))
            lengths = np.array([len(x["input_ids"]) for _, x in drawn])
            groups = self._cut(lengths, np.argsort(lengths, kind="stable"))  # [n] lists of indices into drawn
            order = np.random.default_rng([self.seed, *self.layout.seed_coords(g), k0 // M, M,
                                           _LEN_TAG]).permutation(len(groups))
            for j in range(st.window_batches, len(groups)):
                group = groups[order[j]]
                for i in group:
                    s = drawn[i][0]
                    st.taken[s] += 1
                    st.tokens[s] += int(lengths[i])
                st.batches += 1
                st.window_batches = j + 1
                if st.window_batches == len(groups):  # the window is out: the state names the next one's start
                    st.draws, st.window_batches, st.window_taken = k0 + M, 0, list(st.taken)
                batch = collate([drawn[i][1] for i in group], self.pad_id)
                batch.stream, batch.state, batch.origin = w, st.as_dict(), (g, st.batches - 1)
                yield batch

    def _cut(self, lengths: np.ndarray, order: np.ndarray) -> list[list[int]]:
        """``order`` (indices by ascending length) cut into microbatches: with a token budget a sample joins unless
        (rows + 1) x its length (the longest so far: ascending) would exceed it, else groups of micro_batch_size."""
        if not self.max_tokens:
            mb = self.micro_batch_size
            return [order[a:a + mb].tolist() for a in range(0, len(order), mb)]
        groups, cur = [], []
        for i in order.tolist():
            if cur and (len(cur) + 1) * int(lengths[i]) > self.max_tokens:
                groups.append(cur)
                cur = []
            cur.append(i)
        return groups + [cur]


@dataclass
class WorkerError:
    """A data error raised in a DataLoader worker, sent to the main process as an item of the stream: torch would
    re-raise it as ``ShardError("Caught ShardError in DataLoader worker process 0. Original Traceback ...")``, many
    lines with the message at the end; the main process re-raises the original type and one-line message."""

    kind: type
    message: str

    def error(self) -> Exception:
        return self.kind(self.message)


_WORKER_ERRORS = (ShardError, FileNotFoundError)  # errors in the data, not in the code: their message is the report


def _round_robin(streams: list[Iterator[Batch]]) -> Iterator[Batch]:
    """One batch of each (infinite) stream in turn."""
    while True:
        for it in streams:
            yield next(it)


def _counting(batches: Iterator[Batch]) -> Iterator[Batch]:
    """Each batch with this process's remote-data counters since the previous one (pipeline/data/remote.py): bytes
    fetched, cache hits, retries, time the loader waited; a DataLoader worker's reach the training process so."""
    for batch in batches:
        batch.fetch = COUNTERS.take()
        yield batch


def _reporting(batches: Iterator[Batch]) -> Iterator:
    """A worker's batches, ending with a WorkerError item when the data it reads is bad."""
    try:
        yield from batches
    except _WORKER_ERRORS as e:
        yield WorkerError(type(e), str(e))


class WorkerDied(RuntimeError):
    """A DataLoader worker died (killed by the kernel for memory, by a signal) and died again when its loader was
    restarted; the message is one line naming the worker, its pid and the shard it was reading."""


class _Reading:
    """Which shard each DataLoader worker of this rank reads: one slot of shared memory per worker, made before the
    workers are forked (they inherit it) and written by each as it opens a shard (streams.reading), so that the rank
    can still read it once the worker is dead."""

    WIDTH = 1024  # bytes of a path kept

    def __init__(self, workers: int):
        import multiprocessing

        self.slots = multiprocessing.RawArray("c", workers * self.WIDTH)

    def set(self, worker: int, path) -> None:
        data = str(path).encode(errors="backslashreplace")[:self.WIDTH - 1]
        self.slots[worker * self.WIDTH:(worker + 1) * self.WIDTH] = data.ljust(self.WIDTH, b"\0")

    def get(self, worker: int) -> str | None:
        raw = bytes(self.slots[worker * self.WIDTH:(worker + 1) * self.WIDTH]).split(b"\0")[0]
        return raw.decode(errors="replace") or None


class StreamLoader:
    """Iterator over a ShardStream's microbatches (through DataLoader workers if any) with a live position.

    ``state_dict()`` is the position after the last batch handed out; ``load_state_dict()`` (before iterating, or to
    restart) makes the next batch the one that followed it.

    A worker that dies (the kernel's OOM killer, a stray SIGKILL) is named in ``worker_died`` (one line: the worker,
    its pid, the signal, the shard it was reading) and the loader restarts from the last batch it handed out, whose
    position is exact, so the step in progress gets the batches it would have had; the training then stops after
    that step with a checkpoint and says why (pipeline/train/callbacks.py StopOnRequest). A second death raises
    WorkerDied. torch would raise a dead worker's error from its SIGCHLD handler wherever the main thread is (in the
    middle of a step's collectives, where no checkpoint can be written); it is read here instead, in ``next``, from
    torch's own check of its workers while it waits for a batch (every 5 s).
    """

    def __init__(self, dataset: ShardStream, num_workers: int):
        self.dataset, self.num_workers = dataset, num_workers
        self._it = None
        self._state = dataset.state_dict()
        self._reading = _Reading(num_workers) if num_workers else None
        self.worker_died: str | None = None

    def __iter__(self):
        return self

    def __next__(self) -> Batch:
        while True:
            if self._it is None:
                self._start()
            try:
                batch = next(self._it)
            # torch's "worker exited unexpectedly", or a batch whose sender died while it was handed over (its shared
            # tensor's file descriptor: EOFError or a reset connection from multiprocessing's resource sharer)
            except (RuntimeError, EOFError, ConnectionError):
                died = self._dead_worker()
                if died is None:
                    raise
                self._it = None  # the DataLoader and its other workers go with it
                if self.worker_died is not None:
                    raise WorkerDied(f"{self.worker_died}; after a restart from the last batch, {died}") from None
                self.worker_died = died
                continue  # restart from the last batch handed out: the same batches follow
            break
        if isinstance(batch, WorkerError):
            self._it = None  # the DataLoader and its workers go with it; a retry restarts from the last batch
            raise batch.error() from None
        self._state["batches_consumed"] += 1
        self._state["streams"][batch.stream] = batch.state
        return batch

    def _start(self):
        self.dataset.load_state_dict(self._state)
        if self.num_workers == 0:
            self._it = iter(self.dataset)
            return
        # pin_memory on CUDA hosts: batches arrive page-locked (Batch.pin_memory), so that the step's copy to the
        # GPU is asynchronous (train_step moves them with non_blocking=True)
        self._it = iter(DataLoader(self.dataset, batch_size=None, num_workers=self.num_workers, prefetch_factor=4,
                                   persistent_workers=False, worker_init_fn=partial(_init_worker, self._reading),
                                   pin_memory=torch.cuda.is_available()))
        if getattr(self._it, "_worker_pids_set", False):  # no error from torch's SIGCHLD handler (class docstring)
            from torch.utils.data._utils import signal_handling

            signal_handling._remove_worker_pids(id(self._it))
            self._it._worker_pids_set = False

    def _dead_worker(self) -> str | None:
        """One line naming the first dead worker of the running DataLoader (None: none is dead, another error)."""
        import signal

        for i, w in enumerate(getattr(self._it, "_workers", ())):
            if w.exitcode is None and w.is_alive():
                continue
            code = w.exitcode
            how = (f"was killed by {signal.Signals(-code).name}" if code is not None and code < 0 and
                   -code in signal.Signals._value2member_map_ else f"exited with status {code}")
            shard = self._reading.get(i)
            return (f"data loader worker {i} of rank {self.dataset.rank} (pid {w.pid}) {how} while reading "
                    + (shard if shard else "its first shard") + (" (killed for memory? see the kernel log, dmesg)"
                                                                  if code == -signal.SIGKILL else ""))
        return None

    def state_dict(self) -> dict:
        return copy.deepcopy(self._state)

    def load_state_dict(self, state: dict):
        self.dataset.load_state_dict(state)  # validates
        self._state = self.dataset.state_dict()
        self._it = None  # a running DataLoader is dropped; its workers exit with it

    def seen(self) -> dict[str, tuple[int, int]]:
        """Per source (samples, tokens) this rank has consumed, summed over streams."""
        out = {}
        for i, name in enumerate(self._state["sources"]):
            out[name] = (sum(s["taken"][i] for s in self._state["streams"]),
                         sum(s["tokens"][i] for s in self._state["streams"]))
        return out


def _init_worker(reading: _Reading, worker_id: int):
    """A loader worker's start: it names each shard it opens in ``reading`` (StreamLoader names the shard of a dead
    worker), and ignores SIGTERM/SIGUSR1: a scheduler or DeepSpeed's launch.py signals the whole process tree, and
    the rank above them must keep its batches coming while it finishes its step and checkpoint (the engine's
    StopRequest). They end with the rank's DataLoader."""
    import signal

    from pipeline.data import streams

    streams.reading = partial(reading.set, worker_id)
    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, signal.SIG_IGN)


def make_loader(dataset: ShardStream, num_workers: int) -> StreamLoader:
    return StreamLoader(dataset, num_workers)
