"""The process pool of ``--workers N`` (data_prep/workers.py): N forked processes that die with their parent.

With the "fork" context the initializer's arguments are inherited, not pickled, so a worker gets the parent's
objects as they are (the batch reader's tables and closures); ``state()`` returns them in the worker."""
from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import threading
import time
from concurrent.futures import BrokenExecutor, ProcessPoolExecutor
from contextlib import contextmanager

_STATE = None  # this worker's object from the pool's initializer


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


def _init(parent: int, obj, quiet: bool) -> None:
    global _STATE
    _STATE = obj
    _die_with_parent(parent)
    if quiet:  # holds nothing: Ctrl-C is the parent's to handle, SIGTERM ends it at once
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextmanager
def processes(n: int, obj=None, quiet: bool = True):
    """A ProcessPoolExecutor of ``n`` forked workers, started here (in this thread, before any other: a fork
    copies no other thread, and the parent-death signal follows the forking thread). ``obj``: ``state()`` in each
    worker; ``size``: n. ``quiet``: the workers ignore SIGINT and die of SIGTERM (else they keep the parent's handlers: a job
    unwinds). On an exception here the workers are terminated (SIGTERM), unfinished calls cancelled; a worker that
    ended is named by its exit status."""
    pool = ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("fork"), initializer=_init,
                               initargs=(os.getpid(), obj, quiet))
    pool.size = n
    pool.submit(int).result()  # the first call forks all n workers
    workers = list(pool._processes.values())  # (Python 3.14 has pool.terminate_workers())
    pool.exit_codes = lambda: [p.exitcode for p in workers]
    try:
        yield pool
    except BaseException as e:
        for p in workers:
            if p.exitcode is None:
                p.terminate()
        pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(e, BrokenExecutor):
            raise BrokenExecutor(died(pool)) from None
        raise
    pool.shutdown(wait=True)


def died(pool) -> str:
    """Why the pool broke (BrokenExecutor): the exit status of a worker that ended."""
    codes = [c for c in pool.exit_codes() if c not in (None, 0)]
    return f"a worker process exited with status {codes[0]}" if codes else "a worker process ended"
