"""Progress of a long data_prep job on stderr, with a time estimate.

The work is measured in input bytes as they lie on disk (compressed bytes for a .gz input), so the total is known
before the job starts and the estimate holds for gzip too. Modes (``--progress``):

* ``bar``: a tqdm bar (bytes done / total, rate, elapsed and remaining time, records / written / filtered);
* ``log``: one plain line every ``--progress-interval`` seconds (60 by default), for batch logs (Slurm) where a bar's
  carriage returns would garble the file: ``data_prep genome: 1.2G/5.0G bytes (24%), 1,234 records, ...``;
* ``off``: nothing;
* ``auto`` (default): ``bar`` when stderr is a terminal, else ``off`` (so captured output, as in the tests, is clean).

stdout is never written: the job's one summary line stays the only thing there.
"""
from __future__ import annotations

import sys
import threading
import time

MODES = ("auto", "bar", "log", "off")


def _size(n: float) -> str:
    for unit in ("", "k", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "" else f"{n:.1f}{unit}"
        n /= 1000
    return f"{n:.1f}T"


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Stopped(Exception):
    """A job ended at a progress update because its ``stop`` event was set (a --clusters scan of no more use)."""


class Progress:
    """``update(done_bytes, **counts)`` with the absolute bytes done; cheap enough to call every few hundred
    records. Use as a context manager. ``stop``: an event that, once set, makes the next update raise Stopped."""

    def __init__(self, desc: str, total_bytes: int, mode: str = "auto", interval: float = 60.0, stream=None,
                 stop: threading.Event | None = None):
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r}, expected one of {', '.join(MODES)}")
        self.stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if getattr(self.stream, "isatty", lambda: False)() else "off"
        self.mode, self.desc, self.total, self.interval = mode, desc, max(int(total_bytes), 0), float(interval)
        self.stop = stop
        self.done = 0
        self.counts: dict = {}
        self._start = self._last = time.monotonic()
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm
            self._bar = tqdm(total=self.total or None, unit="B", unit_scale=True, desc=desc, file=self.stream,
                             dynamic_ncols=True, mininterval=0.5)

    def update(self, done_bytes: int, **counts) -> None:
        if self.stop is not None and self.stop.is_set():
            raise Stopped
        done_bytes = min(int(done_bytes), self.total) if self.total else int(done_bytes)
        delta, self.done = done_bytes - self.done, max(done_bytes, self.done)
        self.counts.update(counts)
        if self._bar is not None:
            if delta > 0:
                self._bar.update(delta)
            if counts:
                self._bar.set_postfix(self.counts, refresh=False)
        elif self.mode == "log":
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._last = now
                print(self.line(now), file=self.stream, flush=True)

    def line(self, now: float | None = None) -> str:
        now = time.monotonic() if now is None else now
        elapsed = now - self._start
        parts = [f"{_size(self.done)}/{_size(self.total)} bytes"]
        if self.total:
            parts[0] += f" ({100 * self.done / self.total:.0f}%)"
        parts += [f"{v:,} {k}" for k, v in self.counts.items()]
        rate = self.done / elapsed if elapsed > 0 else 0.0
        parts.append(f"{_size(rate)}B/s, elapsed {_clock(elapsed)}")
        if rate > 0 and self.total:
            parts[-1] += f", remaining ~{_clock((self.total - self.done) / rate)}"
        return f"data_prep {self.desc}: " + ", ".join(parts)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
