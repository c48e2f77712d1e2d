"""python -m data_prep SOURCE --input PATH [PATH ...] --output DIR [options] | merge --output DIR | train-spm ..."""
from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path

from . import SOURCES, FastaError
from .checks import PrepError
from .jobs import run
from .merge import merge
from .progress import MODES
from .settings import MAX_RECORD_LENGTH, Job, Launch, Settings, split_summary, summary
from .spm import train_spm
from .synthetic import HopsTask, SyntheticError, write
from .workers import run_workers


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None


def _positive(text: str) -> int:
    v = _int(text)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _nonnegative(text: str) -> int:
    v = _int(text)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _fraction(low_open: bool):
    """A float in [0, 1] (``low_open``: in (0, 1))."""
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        ok = (0.0 < v < 1.0) if low_open else (0.0 <= v <= 1.0)
        if not ok:  # nan fails both
            raise argparse.ArgumentTypeError(f"must be in {'(0, 1)' if low_open else '[0, 1]'}, got {text}")
        return v
    return parse


def _output(text: str) -> Path | str:
    """--output: a directory, or an object-store URL kept as written (a Path would fold s3:// into s3:/)."""
    from pipeline.data.remote import is_remote

    return text if is_remote(text) else Path(text)


def _char(text: str) -> str:
    if len(text) != 1:
        raise argparse.ArgumentTypeError(f"one character expected, got {text!r}")
    return text


# One example a subcommand, shown at the end of its --help (tests/docs/test_cli_help.py parses each).
EXAMPLES = {
    "fasta": "python -m data_prep fasta --input seqs.fasta.gz --alphabet rna --output data/shards/seqs",
    "genome": "python -m data_prep genome --input ecoli.fna.gz --output data/shards/ecoli --window 8192 "
              "--replace-invalid N",
    "rnacentral": "python -m data_prep rnacentral --input rnacentral_active.fasta.gz --output data/shards/rnacentral",
    "opengenome2": "python -m data_prep opengenome2 --input data_mrna_train_chunk1.jsonl.gz --output "
                   "data/shards/og2_mrna",
    "uniref": "python -m data_prep uniref --input uniref90_members.fasta.gz --clusters uniref50_to_uniref90.tsv "
              "--output data/shards/uniref50_clusters",
    "babylm": "python -m data_prep babylm --spm data/shards/spm/babylm.model --input babylm/train_10M --output "
              "data/shards/babylm",
    "synthetic-hops": "python -m data_prep synthetic-hops --hops 3 --slots 5 --queries 3 --records 20000 --seed 0 "
                      "--output data/shards/hops3",
    "merge": "python -m data_prep merge --output data/shards/rnacentral   # after --num-jobs N --job-index I jobs",
    "train-spm": "python -m data_prep train-spm --input babylm/train_10M --output data/shards/spm/babylm "
                 "--vocab-size 32768",
    "upload": "python -m data_prep upload data/shards/rnacentral s3://bucket/shards/rnacentral",
}


class _ExampleFormatter(argparse.HelpFormatter):
    """Descriptions wrapped as usual; an ``Example:`` epilog kept as written, so the command copies as one line."""

    def _fill_text(self, text, width, indent):
        return text if text.startswith("Example:") else super()._fill_text(text, width, indent)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m data_prep",
        description="Tokenize a corpus into WebDataset tar shards plus manifest.json.",
        epilog="Multi-job: run job I of N with --num-jobs N --job-index I, then `python -m data_prep merge "
               "--output DIR`. Job I parses about 1/N of plain FASTA inputs (a byte range cut at record starts); "
               "of gzip and other inputs it reads every record and keeps those whose index % N == I; with "
               "--clusters, the clusters whose TSV row % N == I.")
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="SOURCE|synthetic-hops|merge|train-spm|upload")
    for src in SOURCES.values():
        p = sub.add_parser(src.name, help=src.help, description=src.help, epilog=f"Example:\n  {EXAMPLES[src.name]}",
                           formatter_class=_ExampleFormatter)
        p.add_argument("--input", nargs="+", required=True, type=Path, metavar="PATH",
                       help="input files (babylm: also folders of *.train), read in the order given "
                            "(gzip detected by content)")
        p.add_argument("--output", required=True, type=_output, metavar="DIR",
                       help="shard directory to create, or an object-store URL (s3://, gs://, https://): the set is "
                            "built in $TMPDIR and uploaded, manifest last (as `data_prep upload`)")
        if src.alphabet is None and src.tokenizer == "nucleotide":
            p.add_argument("--alphabet", required=True, choices=("rna", "dna"),
                           help="rna writes T as U, dna writes U as T")
        if src.tokenizer == "sentencepiece":
            p.add_argument("--spm", required=True, type=Path, metavar="MODEL",
                           help="sentencepiece model from `python -m data_prep train-spm` (copied beside the shards)")
        if src.name == "uniref":
            p.add_argument("--uniref90-members", type=Path, metavar="TSV",
                           help="UniRef50 id<TAB>UniRef90 ids (comma-separated): stored as meta 'members'")
            p.add_argument("--clusters", type=Path, metavar="TSV",
                           help="UniRef50 -> UniRef90 mapping (header UR50_cluster_name<TAB>mapped_id, member ids "
                                "comma-separated, ids = the --input FASTA ids): --input is then the UniRef90 member "
                                "FASTA and each sample is one UniRef50 cluster with all its member sequences "
                                "(ESM-2 sampling; --num-jobs splits by cluster)")
            p.add_argument("--stage", choices=("scan", "build"), default=None,
                           help="with --clusters and --num-jobs N, run the array in two stages so that the member "
                                "FASTA is read once across the jobs: scan (job I parses its share of the FASTA "
                                "into DIR/.scan-of-NNNN), then build (job I joins its clusters against every part; "
                                "after all scans), then merge. Default: each job reads the whole FASTA")
        p.add_argument("--shard-size", type=_positive, default=10_000, metavar="N", help="samples per shard")
        unit = "characters" if src.tokenizer == "sentencepiece" else "residues"
        p.add_argument("--min-length", type=_nonnegative, default=src.min_length, metavar="N",
                       help=f"records shorter than N {unit} are filtered (and counted); default {src.min_length}")
        p.add_argument("--max-length", type=_positive, default=None, metavar="N",
                       help=f"records longer than N {unit} are filtered (default: none; long records are stored "
                            "whole and cropped at load time)")
        p.add_argument("--max-record-length", type=_positive, default=MAX_RECORD_LENGTH, metavar="N",
                       help=f"records longer than N {unit} are counted as filtered (longer_than_N, listed in "
                            "filtered.tsv) and, in FASTA inputs, skipped while they are read, without being built "
                            f"or held in memory; default {MAX_RECORD_LENGTH:,}, four times the longest human "
                            "chromosome (raise it for the giant chromosomes of some conifers and amphibians)")
        p.add_argument("--strict", action="store_true",
                       help="the first invalid record is an error naming file:line (default: skip and count it)")
        p.add_argument("--max-filtered-fraction", type=_fraction(False), default=0.01, metavar="F",
                       help="fail (exit 1, nothing written) when more than this fraction of the records is dropped "
                            "as invalid (characters outside the alphabet, invalid UTF-8, broken tags) or empty; "
                            "--min-length/--max-length/--dedup drops do not count. Default 0.01; 1 never fails. "
                            "Every dropped record is listed in DIR/filtered.tsv")
        if src.tokenizer != "sentencepiece":
            p.add_argument("--replace-invalid", type=_char, default=None, metavar="CHAR",
                           help="write characters outside the alphabet as CHAR (e.g. N for genomes, X for proteins) "
                                "instead of dropping the record; counted per character in the manifest "
                                "(stats.replaced) and the summary")
            p.add_argument("--window", type=_positive, default=None, metavar="L",
                           help="tile each record into windows of L positions, one sample each, id "
                                "RECORD:START-END (0-based, end exclusive); for long genomes")
            p.add_argument("--stride", type=_positive, default=None, metavar="S",
                           help="step between window starts (default L: no overlap; S < L overlaps by L - S; "
                                "S > L is refused). Note: Hugging Face tokenizers' 'stride' is the overlap instead")
            p.add_argument("--window-tail", choices=("short", "align", "drop"), default="short",
                           help="the last window of a record when it would be shorter than L: short keeps it "
                                "short (default), align ends it at the record's end (full length, more overlap), "
                                "drop leaves those residues out (counted); every case is counted in "
                                "stats.windows")
        else:
            p.add_argument("--text-column", default=None, metavar="NAME",
                           help="read the column NAME of .csv inputs (csv module, header row) as the text, one "
                                "record a row; a .csv input without it is refused")
        p.add_argument("--val-fraction", type=_fraction(True), default=None, metavar="F",
                       help="split by record id (sha256) into DIR/train and DIR/val, each with its own "
                            "manifest.json; a fraction F of the records (all windows of a record together) goes to "
                            "val, the same whatever the job count or record order")
        p.add_argument("--dedup", action="store_true",
                       help="drop exact duplicate sequences (sha1 of the normalized sequence), counted as 'duplicate'")
        p.add_argument("--workers", type=_positive, default=1, metavar="N",
                       help="run on N processes of this machine (default 1): FASTA on the batch reader is one "
                            "job whose chunks they parse (the 1-process output); otherwise jobs 0..N-1 of "
                            "--num-jobs N (same records, filters and lists), merged into DIR in one command")
        p.add_argument("--num-jobs", type=_positive, default=1, metavar="N",
                       help="a job array of N jobs, e.g. on several machines (default 1); then merge")
        p.add_argument("--job-index", type=_nonnegative, default=0, metavar="I",
                       help="this job's index, 0..N-1: it takes the records whose index %% N == I")
        p.add_argument("--overwrite", action="store_true",
                       help="replace an existing output directory (or, with --num-jobs > 1, this job's files)")
        p.add_argument("--progress", choices=MODES, default="auto",
                       help="progress on stderr with a time estimate: bar (tqdm), log (a plain line every "
                            "--progress-interval seconds, for batch logs), off; auto (default): bar on a terminal, "
                            "else off")
        p.add_argument("--progress-interval", type=float, default=60.0, metavar="SECONDS",
                       help="seconds between two --progress log lines (default 60)")
    h = sub.add_parser("synthetic-hops", help="the depth task: answers H pointers away from their value",
                       description="Write the synthetic depth task (data_prep/synthetic.py) as nucleotide shards: "
                                   "S literals (A C G U at S = 4), H - 1 levels of S pointers (the next 2 S - 1 "
                                   "letters of A C G U T N R Y S W K M B D H V: the value d = 1 .. 2 S - 1 positions "
                                   "back), Q query pointers, <sep> and the queries' values, which only following all "
                                   "H pointers gives.",
                       epilog=f"Example:\n  {EXAMPLES['synthetic-hops']}",
                       formatter_class=_ExampleFormatter)
    h.add_argument("--hops", required=True, type=_positive, metavar="H", help="pointers of the hardest records")
    h.add_argument("--min-hops", type=_nonnegative, default=0, metavar="M",
                   help="each record's pointer count is uniform in M..H (default 0: shorter chains, down to a query "
                        "that is its own value, as a curriculum; --min-hops H for a held-out set at exactly H)")
    h.add_argument("--slots", type=_positive, default=4, metavar="S",
                   help="values and slots per level, 2..5 (default 4; chance 1/S, S!^H x S records at H pointers)")
    h.add_argument("--queries", type=_positive, default=1, metavar="Q",
                   help="queries per record, 1..S, of distinct slots of the last level; their Q answers follow "
                        "<sep> in the same order (default 1)")
    h.add_argument("--records", required=True, type=_positive, metavar="N", help="records to write")
    h.add_argument("--seed", required=True, type=_nonnegative, metavar="SEED",
                   help="record i is drawn from (SEED, i) alone: the same records on any machine")
    h.add_argument("--exclude", type=Path, default=None, metavar="DIR",
                   help="skip (and count) records that DIR's shards hold: a held-out set disjoint from training")
    h.add_argument("--output", required=True, type=Path, metavar="DIR", help="shard directory to create")
    h.add_argument("--shard-size", type=_positive, default=10_000, metavar="N", help="samples per shard")
    h.add_argument("--overwrite", action="store_true", help="replace an output directory data_prep wrote")
    m = sub.add_parser("merge", help="combine the job manifests in DIR into manifest.json",
                       description="Combine manifest-jobIIII-of-NNNN.json files into manifest.json.",
                       epilog=f"Example:\n  {EXAMPLES['merge']}",
                       formatter_class=_ExampleFormatter)
    m.add_argument("--output", required=True, type=Path, metavar="DIR",
                   help="the shard directory the jobs wrote (their --output)")
    t = sub.add_parser("train-spm", help="train a sentencepiece BPE model on BabyLM text",
                       description="Train a sentencepiece BPE model on *.train text (files or folders).",
                       epilog=f"Example:\n  {EXAMPLES['train-spm']}",
                       formatter_class=_ExampleFormatter)
    t.add_argument("--input", nargs="+", required=True, type=Path, metavar="PATH",
                   help="text files or folders of *.train (.csv with --text-column)")
    t.add_argument("--output", required=True, type=Path, metavar="PREFIX", help="writes PREFIX.model, PREFIX.vocab")
    t.add_argument("--vocab-size", type=_positive, default=32768, metavar="N",
                   help="pieces in the model (default 32768)")
    t.add_argument("--max-sentences", type=_positive, default=10_000_000, metavar="N",
                   help="lines sampled for training (sentencepiece input_sentence_size)")
    t.add_argument("--text-column", default=None, metavar="NAME",
                   help="read the column NAME of .csv inputs as the text (as the babylm source does)")
    u = sub.add_parser("upload", help="publish a finished shard set to object storage (manifest last)",
                       description="Upload a data_prep output (a shard set, or a --val-fraction split) to an "
                                   "object-store prefix: the ownership marker first, then the shards, the manifests "
                                   "last, so a reader never sees a manifest whose shards are missing "
                                   "(data_prep/upload.py).",
                       epilog=f"Example:\n  {EXAMPLES['upload']}", formatter_class=_ExampleFormatter)
    u.add_argument("directory", type=Path, metavar="DIR", help="the finished output directory")
    u.add_argument("url", metavar="URL", help="s3://bucket/prefix, gs://bucket/prefix or https://host/prefix")
    u.add_argument("--overwrite", action="store_true",
                   help="replace a shard set data_prep uploaded there (its manifests go first)")
    return parser


def _upload(directory: Path, url: str, overwrite: bool) -> int:
    from pipeline.data.remote import FetchError

    from .upload import upload
    try:
        done = upload(directory, url, overwrite)
    except (PrepError, FetchError, OSError) as e:
        print(f"data_prep: error: {e}", file=sys.stderr)
        return 1
    print(f"data_prep upload: {done['files']} files, {done['bytes'] / 1e6:.1f} MB -> {url}")
    return 0


def _remote_output(args, run_job) -> int:
    """--output URL: the job writes into a staging directory under $TMPDIR, then the finished set is uploaded
    (data_prep/upload.py); the prefix is checked before any work, and the staging directory always removed."""
    import shutil
    import tempfile

    from pipeline.data.remote import FetchError

    from .upload import check_remote_output
    if args.num_jobs > 1:
        print(f"data_prep: error: --output {args.output}: the jobs of an array write to one shared directory and "
              "are merged there; upload the merged directory with `data_prep upload DIR URL`", file=sys.stderr)
        return 1
    url = args.output
    try:
        check_remote_output(url, args.overwrite)
    except (PrepError, FetchError) as e:
        print(f"data_prep: error: {e}", file=sys.stderr)
        return 1
    staging = Path(tempfile.mkdtemp(prefix="data_prep-upload-"))
    try:
        args.output, args.overwrite = staging / "out", False
        code = run_job(args)
        return code if code else _upload(staging / "out", url, True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _synthetic_hops(args) -> int:
    try:
        task = HopsTask(args.hops, args.min_hops, args.slots, args.queries)
        stats = write(args.output, task, args.records, args.seed, args.shard_size, args.overwrite, args.exclude)
    except (SyntheticError, PrepError, OSError) as e:
        print(f"data_prep: error: {e}", file=sys.stderr)
        return 1
    print(f"data_prep synthetic-hops: {args.records} records (per pointer count {stats['records_per_hops']}, seed "
          f"{args.seed}) -> {args.output.resolve()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "synthetic-hops":
        return _synthetic_hops(args)
    if args.command == "upload":
        return _upload(args.directory, args.url, args.overwrite)
    if args.command not in ("merge", "train-spm") and isinstance(args.output, str):
        return _remote_output(args, lambda a: _main(parser, a))
    return _main(parser, args)


def _main(parser, args) -> int:
    if args.command not in ("merge", "train-spm") and args.job_index >= args.num_jobs:
        parser.error(f"--job-index {args.job_index} must be < --num-jobs {args.num_jobs}")
    if args.command not in ("merge", "train-spm") and not args.progress_interval > 0:
        parser.error(f"--progress-interval {args.progress_interval} must be > 0")
    # SIGTERM (scheduler preemption) unwinds like Ctrl-C: the partial shard is dropped, finished ones are kept.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        if args.command == "merge":
            result = merge(args.output)
            if result.splits:
                print(split_summary(result.manifest.source, result, job=" merge"))
            else:
                print(summary(result.manifest.source, result.manifest, result.location, job=" merge"))
            return 0
        if args.command == "train-spm":
            model = train_spm(args.input, args.output, args.vocab_size, args.max_sentences, args.text_column)
            print(f"data_prep train-spm: vocabulary {args.vocab_size} -> {model}")
            return 0
        src = SOURCES[args.command]
        job = Job(src, tuple(args.input), args.output, Settings.from_args(args),
                  src.alphabet or getattr(args, "alphabet", None), args.overwrite, getattr(args, "spm", None),
                  getattr(args, "uniref90_members", None), getattr(args, "clusters", None),
                  getattr(args, "text_column", None))
        launch = Launch((args.progress, args.progress_interval))
        result = run_workers(args.workers, job, launch) if args.workers > 1 else run(job, launch)
    except (PrepError, FastaError, OSError, ValueError) as e:
        print(f"data_prep: error: {e}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, RuntimeError) as e:
        if isinstance(e, RuntimeError) and str(e) != "Query interrupted":  # DuckDB's Ctrl-C inside a query
            raise
        print("data_prep: interrupted; finished shards are kept, rerun the same command to resume", file=sys.stderr)
        return 130
    job = f" job {args.job_index}/{args.num_jobs}" if args.num_jobs > 1 else ""
    if result.manifest is None:  # --stage scan
        print(f"data_prep {src.name}{job}: scanned {result.records_seen} member records into {result.location}; "
              "build the clusters once every part is scanned (--stage build)")
        return 0
    if args.workers > 1:
        job = f" ({args.workers} workers)"
        if not result.splits:  # merged: the records of all jobs, like a single run's summary
            print(summary(src.name, result.manifest, result.location, None, job))
            return 0
    if result.splits:
        print(split_summary(src.name, result, job))
    else:
        print(summary(src.name, result.manifest, result.location, result.records_seen, job))
    return 0


if __name__ == "__main__":
    sys.exit(main())
