"""python -m data_prep SOURCE --input PATH [PATH ...] --output DIR [options] | python -m data_prep merge --output DIR"""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from . import SOURCES, FastaError


def _positive(text: str) -> int:
    v = int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonnegative(text: str) -> int:
    v = int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Tokenize a corpus into WebDataset tar shards plus manifest.json.",
        epilog="Multi-job: run job I of N with --num-jobs N --job-index I (job I takes the records whose global "
               "index % N == I), then `python -m data_prep merge --output DIR`.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="SOURCE|merge")
    for src in SOURCES.values():
        p = sub.add_parser(src.name, help=src.help, description=src.help)
        p.add_argument("--input", nargs="+", required=True, type=Path, metavar="PATH",
                       help="input files, read in the order given (gzip detected by content)")
        p.add_argument("--output", required=True, type=Path, metavar="DIR", help="shard directory to create")
        if src.alphabet is None:
            p.add_argument("--alphabet", required=True, choices=("rna", "dna"),
                           help="rna writes T as U, dna writes U as T")
        p.add_argument("--shard-size", type=_positive, default=10_000, metavar="N", help="samples per shard")
        p.add_argument("--min-length", type=_nonnegative, default=10, metavar="N",
                       help="records shorter than N residues are filtered (and counted)")
        p.add_argument("--num-jobs", type=_positive, default=1, metavar="N")
        p.add_argument("--job-index", type=_nonnegative, default=0, metavar="I")
        p.add_argument("--overwrite", action="store_true",
                       help="replace an existing output directory (or, with --num-jobs > 1, this job's files)")
    m = sub.add_parser("merge", help="combine the job manifests in DIR into manifest.json",
                       description="Combine manifest-jobIIII-of-NNNN.json files into manifest.json.")
    m.add_argument("--output", required=True, type=Path, metavar="DIR")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "merge" and args.job_index >= args.num_jobs:
        parser.error(f"--job-index {args.job_index} must be < --num-jobs {args.num_jobs}")
    # SIGTERM (scheduler preemption) must unwind like Ctrl-C so the temporary output is removed.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    # Imported here so that --help and argument errors do not pay for torch (imported by webdataset).
    from .jobs import PrepError, Settings, merge, run, summary
    try:
        if args.command == "merge":
            result = merge(args.output)
            print(summary(result.manifest.source, result.manifest, result.location, job=" merge"))
            return 0
        src = SOURCES[args.command]
        settings = Settings(args.shard_size, args.min_length, args.num_jobs, args.job_index)
        result = run(src, src.alphabet or args.alphabet, args.input, args.output, settings, args.overwrite)
    except (PrepError, FastaError, OSError) as e:
        print(f"data_prep: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("data_prep: interrupted; nothing written", file=sys.stderr)
        return 130
    job = f" job {args.job_index}/{args.num_jobs}" if args.num_jobs > 1 else ""
    print(summary(src.name, result.manifest, result.location, result.records_seen, job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
