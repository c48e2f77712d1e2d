"""The process pool of ``--workers N`` (data_prep/workers.py): N forked processes that die with their parent.

With the "fork" context the initializer's arguments are inherited, not pickled, so a worker gets the parent's
objects as they are (the batch reader's tables and closures); ``state()`` returns them in the worker."""
from __future__ import annotations

import ctypes
import fcntl
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from contextlib import contextmanager

_STATE = None  # this worker's object from the pool's initializer
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)  # Linux


def state():
    return _STATE


def _die_with_parent(parent: int) -> None:
    """Kill this worker when its parent dies (SIGKILL of the main process, an OOM kill): an orphan would go on
    holding its job's locks. Linux: the kernel's parent-death signal, SIGKILL so that a stopped worker or one in a
    long C call dies too (the kernel drops its flocks; a rerun drops a half-written shard); elsewhere a thread that
    watches the parent pid."""
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL) != 0:  # 1 = PR_SET_PDEATHSIG
            raise OSError
    except (OSError, AttributeError):
        def watch():
            while os.getppid() == parent:
                time.sleep(0.5)
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=watch, daemon=True, name="parent-watch").start()
    if os.getppid() != parent:  # the parent died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)


def _init(parent: int, obj) -> None:
    global _STATE
    _STATE = obj
    _die_with_parent(parent)
    # Ctrl-C is the parent's to handle; SIGTERM ends a worker at once (a Python handler unwinding a job could leave
    # the pool's queue locks held, and the other workers waiting on them for good)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Pool(ProcessPoolExecutor):
    """A ProcessPoolExecutor of ``size`` forked workers, each with ``state()`` = ``obj``."""

    def __init__(self, size: int, obj=None):
        super().__init__(size, mp_context=multiprocessing.get_context("fork"), initializer=_init,
                         initargs=(os.getpid(), obj))
        self.size = size
        for end in (self._call_queue._reader, self._result_queue._reader):  # chunks of MBs: 1 MB pipes, not 64 KB
            try:  # (a third fewer switches between the ends: measured, 9 ms against 13 a chunk sent and returned)
                fcntl.fcntl(end.fileno(), F_SETPIPE_SZ, 1 << 20)
            except OSError:  # above /proc/sys/fs/pipe-max-size, or the user's pipe pages spent: 64 KB it is
                pass
        self.submit(int).result()  # the first call forks all the workers (in this thread, before any other)
        self.workers = list(self._processes.values())  # (Python 3.14 has terminate_workers())

    def result(self, future):
        """``future.result()``; BrokenExecutor, naming the worker's exit status, once a worker has ended: one killed
        while it sent a result leaves the executor's reader waiting for the rest, and the result never comes."""
        while True:
            try:
                return future.result(timeout=0.2)
            except TimeoutError:
                if all(p.exitcode is None for p in self.workers):
                    continue
            except BrokenExecutor:
                pass
            raise BrokenExecutor(self.ended()) from None

    def ended(self) -> str:
        """Which worker ended: its exit status (the executor ends the others with SIGTERM: named last)."""
        for _ in range(100):  # the executor's thread may be reaping it
            codes = sorted((p.exitcode for p in self.workers if p.exitcode is not None),
                           key=lambda code: code == -signal.SIGTERM)
            if codes:
                return f"a worker process exited with status {codes[0]}"
            time.sleep(0.01)
        return "a worker process ended"

    def stop(self) -> None:
        """End the workers now and the executor with them. SIGKILL: the kernel drops a job's locks, and a rerun its
        half-written shard."""
        for p in self.workers:
            if p.exitcode is None:
                p.kill()
        for p in self.workers:
            p.join()
        self._result_queue._writer.close()  # the executor's reader, stuck in a half-sent result, meets its end
        self.shutdown(wait=True, cancel_futures=True)


@contextmanager
def processes(n: int, obj=None):
    """A Pool of ``n`` workers, stopped (``Pool.stop``) on an exception here; a fork copies no other thread of this
    process, and the parent-death signal follows the forking thread: opened before any other thread starts."""
    pool = Pool(n, obj)
    try:
        yield pool
    except BaseException as e:
        ended = pool.ended() if isinstance(e, BrokenExecutor) else None  # (raised by submit, too)
        pool.stop()
        if ended is not None:
            raise BrokenExecutor(ended) from None
        raise
    pool.shutdown(wait=True)
