"""What a user follows: RUN_DIR/train.log (every rank's output, prefixed) and fatal errors that reach the console.

``install(rank)`` wraps this process's stdout and stderr before anything else prints: lines still go to the console
as before, and each one is also kept (buffered until the run directory is known and locked) for
``RUN_DIR/train.log`` as ``[rank R] line``. ``attach(run_dir)`` opens that file; ranks append whole lines, so their
lines interleave but never mix.

A fatal error on any rank is printed rank-prefixed and recorded in ``RUN_DIR/errors.jsonl``. A rank whose error
followed from another's (a collective failing because its peer died) reads that record and prints the first error
again as its last line, so that the root cause, not "Connection closed by peer", is what the user sees last.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ERRORS = "errors.jsonl"
TRAIN_LOG = "train.log"


class _Tee:
    """A text stream that writes through to ``stream`` and hands complete lines to ``sink``."""

    def __init__(self, stream, sink):
        self._stream, self._sink, self._partial = stream, sink, ""

    def write(self, s: str) -> int:
        n = self._stream.write(s)
        text = self._partial + s
        *lines, self._partial = text.split("\n")
        for line in lines:
            self._sink(line)
        return n

    def flush(self):
        self._stream.flush()

    def __getattr__(self, name):  # fileno, isatty, encoding, ... of the real stream
        return getattr(self._stream, name)


class RunLog:
    def __init__(self, rank: int):
        self.rank = rank
        self.pending: list[str] = []  # lines printed before the run directory is locked
        self.file = None
        self.run_dir: Path | None = None

    def _sink(self, line: str):
        prefix = f"[rank {self.rank}] "
        line = line.rstrip(chr(13))
        if not line.startswith(prefix):  # a fatal error line (report_fatal) carries its rank already
            line = prefix + line
        if self.file is None:
            self.pending.append(line)
            del self.pending[:-10000]  # bounded: a run that never attaches keeps only its last lines
        else:
            try:
                self.file.write(line + "\n")
                self.file.flush()
            except OSError as e:  # a full disk: the console keeps every line; train.log ends here, said once
                self.file = None
                sys.__stderr__.write(f"warning: {self.run_dir / TRAIN_LOG}: cannot write ({e.strerror or e}); the "
                                     "rest of this run's output is on the console only\n")

    def attach(self, run_dir: Path, fresh_errors: bool):
        """Start writing RUN_DIR/train.log (appending: a resumed run continues its log)."""
        self.run_dir = Path(run_dir)
        if fresh_errors:  # rank 0, holding the run directory's lock: errors of earlier attempts are history
            (self.run_dir / ERRORS).unlink(missing_ok=True)
        self.file = open(self.run_dir / TRAIN_LOG, "a", buffering=1)
        self.file.write(f"[rank {self.rank}] ==== {time.strftime('%Y-%m-%d %H:%M:%S')} start ====\n")
        for line in self.pending:
            self.file.write(line + "\n")
        self.pending.clear()

    def record_error(self, line: str):
        if self.run_dir is None:
            return
        try:
            with open(self.run_dir / ERRORS, "a") as f:  # one short append per rank: lines do not mix
                f.write(json.dumps({"time": time.time(), "rank": self.rank, "error": line}) + "\n")
        except OSError:  # a full or read-only disk: the error line is on the console already, and that is what counts
            pass

    def first_error(self) -> dict | None:
        if self.run_dir is None:
            return None
        try:
            records = [json.loads(ln) for ln in (self.run_dir / ERRORS).read_text().splitlines() if ln.strip()]
        except (OSError, ValueError):
            return None
        return min(records, key=lambda r: r["time"]) if records else None


_LOG: RunLog | None = None


def install(rank: int) -> RunLog:
    """Tee stdout and stderr of this process (idempotent)."""
    global _LOG
    if _LOG is None:
        _LOG = RunLog(rank)
        sys.stdout = _Tee(sys.stdout, _LOG._sink)
        sys.stderr = _Tee(sys.stderr, _LOG._sink)
    return _LOG


def current() -> RunLog | None:
    return _LOG


def report_fatal(rank: int, message: str, rank_specific: bool):
    """Print one ``error:`` line for a fatal error and make sure the first error of the run is printed last.

    ``rank_specific`` errors (raised after the ranks started working together) are printed by every rank with its
    rank; errors raised before (a config error, alike on every rank of a node) by the first rank of each node: each
    node has a console of its own, and such an error may concern one node only (its copy of the data or config).
    """
    if not rank_specific:
        if rank == 0 or os.environ.get("LOCAL_RANK") == "0":
            print(f"error: {message}", file=sys.stderr, flush=True)
        else:  # the launcher kills the other ranks as soon as one exits: give the one that prints time to print
            time.sleep(1.0)
        return
    line = f"[rank {rank}] error: {message}"
    print(line, file=sys.stderr, flush=True)
    log = current()
    if log is None:
        return
    log.record_error(line)
    time.sleep(0.2)  # a peer failing at the same moment records its error too
    first = log.first_error()
    if first is not None and first["rank"] != rank:
        print(f"error: first error of this run: {first['error']}", file=sys.stderr, flush=True)
