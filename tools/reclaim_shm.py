"""python tools/reclaim_shm.py [--dry-run]   (--dry-run: list the segments, remove nothing)

Removes the ``/dev/shm/deepspeed_allreduce_buffer_*`` segments that DeepSpeed runs on CPU left behind and that no
live process still maps. DeepSpeed's CPU backend creates one 69 MB segment per rank and never unlinks it; /dev/shm is
RAM, so a machine that ran many trainings (a CI host, a laptop) slowly runs out of memory. Our engine no longer
creates them (``pipeline.distributed.init_distributed``); this reclaims what older runs, or other DeepSpeed programs,
leaked. Only segments owned by the calling user are touched, and one that any process maps (a training in
progress) is kept. Prints one line: how many segments and bytes were reclaimed.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "deepspeed_allreduce_buffer_"


def mapped_paths(proc: Path = Path("/proc")) -> set:
    """Every file path that a process this user can inspect has mapped (from /proc/PID/maps)."""
    paths = set()
    for maps in proc.glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:  # the process ended, or belongs to another user
            continue
        for line in text.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/"):
                paths.add(fields[5].removesuffix(" (deleted)"))
    return paths


def orphaned_segments(shm_dir: Path = SHM_DIR) -> list:
    """DeepSpeed all-reduce segments of this user that no process maps."""
    if not shm_dir.is_dir():
        return []
    uid, in_use = os.getuid(), mapped_paths()
    return sorted(p for p in shm_dir.glob(PREFIX + "*")
                  if p.is_file() and p.stat().st_uid == uid and str(p) not in in_use)


def build_parser() -> argparse.ArgumentParser:
    """main's command line, apart from main: tests parse the documented commands with it without running them."""
    p = argparse.ArgumentParser(description="Remove the DeepSpeed /dev/shm segments of this user that no "
                                            "process maps.")
    p.add_argument("--dry-run", action="store_true", help="list what would be removed, remove nothing")
    p.add_argument("--shm-dir", type=Path, default=SHM_DIR, help=argparse.SUPPRESS)  # tests use a private folder
    return p


def main(argv=None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    removed, size = 0, 0
    for seg in orphaned_segments(args.shm_dir):
        try:
            n = seg.stat().st_size
            if args.dry_run:
                print(seg)
            else:
                seg.unlink()
        except FileNotFoundError:  # another cleaner was faster
            continue
        removed, size = removed + 1, size + n
    verb = "would reclaim" if args.dry_run else "reclaimed"
    print(f"reclaim_shm: {verb} {removed} orphaned DeepSpeed shared-memory segments, {size / 2**20:.0f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
