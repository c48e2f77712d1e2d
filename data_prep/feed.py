"""The worker's side of a fed ``--workers`` run (data_prep/workers.py): the chunks of whole records its parent
sends it, read in place of the input file by the batch reader (data_prep/batch.py ``Reader``)."""
from __future__ import annotations

from pathlib import Path

from .fasta import track_position

FEED_DEPTH = 2  # chunks queued per worker: bounds the parent's lead (memory: workers x depth x CHUNK)


class Aborted(Exception):
    """The --workers parent stopped feeding (another worker's error, or its own while reading)."""


class Feed:
    """What the --workers parent sends one worker: for each input the batch reader takes, that worker's chunks of
    whole records (chunk c of all inputs goes to worker c % N) as ("chunk", path, c, text, first line, index of its
    first record within the input, compressed bytes read so far), then ("end", path, records of the input, chunks
    cut so far) to every worker; ("abort",) stops it. ``rank``: where an error of this worker falls in the input
    order (the chunk being handled; between chunks after an input's end), so that the parent reports the error a
    single process would have met first.

    --clusters: ``spill``, the folder of bucket files that the parent made for all its workers
    (data_prep/join.py ``Spill``); ``scanned``, an Event this worker sets once its chunks are in it
    (``wait_for_peers``), after which the parent sends ("go",) to every worker, when all have set theirs."""

    def __init__(self, queue, failed, scanned=None, spill: str | None = None):
        self.queue, self.failed, self.rank = queue, failed, -1.0  # failed: an Event every worker sets on an error
        self.scanned, self.spill = scanned, spill

    def wait_for_peers(self) -> None:
        """Tell the parent that this worker's records are in the spill and wait until every worker's are: each
        worker's join needs all of them. Raises Aborted when the parent stops the run instead."""
        self.scanned.set()
        msg = self.queue.get()
        if msg[0] == "abort":
            raise Aborted()
        if msg[0] != "go":  # cannot happen: the parent sends chunks only before the inputs' ends
            raise RuntimeError(f"--workers: expected the parent's go, got {msg[0]!r}")

    def texts(self, path: Path) -> FedInput:
        return FedInput(self, str(path))


class FedInput:
    """The chunks of one input as the batch Reader iterates them: (text, first line, index of the first record
    within the input); ``end`` is the input's record count once they are read."""

    def __init__(self, feed: Feed, path: str):
        self.feed, self.path, self.end = feed, path, None

    def __iter__(self):
        while True:
            msg = self.feed.queue.get()
            if msg[0] == "abort":
                raise Aborted()
            if msg[1] != self.path:  # cannot happen: parent and workers walk the same inputs
                raise RuntimeError(f"--workers: fed {msg[1]} while reading {self.path}")
            if msg[0] == "end":
                self.end, self.feed.rank = msg[2], msg[3] - 0.5
                return
            _, _, number, text, line, first, position = msg
            self.feed.rank = float(number)
            track_position(self.path, lambda: position)  # the progress bar's bytes: what the parent has read
            yield text, line, first
