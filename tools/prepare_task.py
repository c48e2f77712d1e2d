#!/usr/bin/env python
r"""Write a supervised task's file as shards the fine-tuning reads (docs/adaptation.md).

    python tools/prepare_task.py --task nrc --input data/samples/rfam_nrc_train_sample.fasta.gz \
        --output data/shards/nrc_demo --val-fraction 0.1
    python tools/prepare_task.py --task ssp --input ../shared/data/eval/structure/bpRNA_VL0.csv \
        --output data/shards/ssp_vl0 --val-fraction 0.1 --max-length 126
    python tools/prepare_task.py --task reactivity --input train_data.csv --output data/shards/ribonanza \
        --val-fraction 0.05 --set min_reads=100

The task's reader (pipeline/tasks: nrc FASTA ``>ID CLASS``; ssp bpRNA / PseudoBase CSV, .bpseq, .dbn or a folder of
them; reactivity the Ribonanza CSV layout) reads --input; every record becomes one sample of a nucleotide shard set
(the tokens as data_prep writes them, T read as U) whose meta holds its label, in file order. With --val-fraction F
a seeded random F of the records (--seed) go to OUTPUT/val, in file order, and the rest, shuffled (task files are
often sorted by class), to OUTPUT/train: the layout whose val/ the training validates on. Without it everything goes
to OUTPUT in file order (a test set). --max-length N leaves out records longer than N
residues (a subset whose sequences fit a model's window whole), --limit N keeps the first N records (after
--max-length). --set KEY=VALUE sets a field of the task's config (its label set, the reactivity filter; the values
the run's task: section must then hold too), --config RUN.yaml takes the task: section of a run config instead.

Bad input (a class outside the label set, brackets that do not balance, a reactivity row of the wrong length) is one
error line naming the file and line, exit 2, and nothing is written: the output is built beside OUTPUT and renamed
into place. An OUTPUT that holds anything but this tool's earlier output is refused; --force replaces its own.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

TOOL = "prepare_task.py"


def build_parser() -> argparse.ArgumentParser:
    from pipeline.tasks import TASKS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, choices=sorted(TASKS), help="the task whose reader reads --input")
    p.add_argument("--input", required=True, type=Path, help="the task's file (or folder, ssp)")
    p.add_argument("--output", required=True, type=Path, help="the shard directory to write")
    p.add_argument("--val-fraction", type=float, default=0.0, help="share of records held out into OUTPUT/val")
    p.add_argument("--seed", type=int, default=0, help="seeds the held-out draw")
    p.add_argument("--max-length", type=int, default=None, help="leave out records longer than this many residues")
    p.add_argument("--limit", type=int, default=None, help="keep the first N records")
    p.add_argument("--shard-size", type=int, default=None,
                   help="records per shard (default: about an eighth of the records, so up to 8 loader streams)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="a field of the task's config, e.g. --set min_reads=50 (repeatable)")
    p.add_argument("--config", type=Path, default=None, help="take the task: section of this run config")
    p.add_argument("--force", action="store_true", help="replace an earlier output of this tool")
    return p


def task_config(task, args):
    """The task config the reader runs with: --config's task: section, else the task's defaults, then --set."""
    import yaml

    from pipeline.config import ConfigError, from_dict, load_yaml

    raw = {"name": task.name}
    if args.config is not None:
        section = load_yaml(args.config).get("task")
        if not isinstance(section, dict) or section.get("name") != task.name:
            raise ConfigError(f"{args.config}: task: is not a {task.name} section")
        raw = dict(section)
    for item in args.overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key=value")
        raw[key.removeprefix("task.")] = yaml.safe_load(text)
    return from_dict(task.config_cls, raw, prefix="task.")


def write_split(directory: Path, records: list, task, shard_size: int) -> list:
    """One shard set of ``records`` (tokens + the label in the meta) with its manifest."""
    from pipeline.data.shards import BLOCK_SAMPLES, Manifest, ShardWriter, write_manifest
    from pipeline.data.tokenizer import VOCAB, NucleotideTokenizer

    directory.mkdir(parents=True)
    tok = NucleotideTokenizer("rna")
    writer = ShardWriter(directory, prefix=task.name, max_samples=shard_size, block_samples=BLOCK_SAMPLES)
    try:
        for i, r in enumerate(records):
            try:
                tokens = tok.encode(r.sequence)
            except ValueError as e:
                raise ValueError(f"{r.where}: {e}") from None
            writer.write(f"r{i:08d}", tokens, task.meta(r))
        shards = writer.close()
    except BaseException:
        writer.abort()
        raise
    write_manifest(directory, Manifest(source=f"task:{task.name}", shards=shards,
                                       tokenizer={"name": "nucleotide", "vocab": list(VOCAB), "alphabet": "rna"},
                                       stats={"task": task.name}))
    return shards


def summary(task, records: list) -> str:
    if task.name == "nrc":
        return ", ".join(f"{k} {v}" for k, v in sorted(Counter(r.label for r in records).items()))
    lengths = [len(r.sequence) for r in records]
    return f"lengths {min(lengths)}-{max(lengths)}"


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import numpy as np

    from pipeline.outputs import check_output_dir, publish_dir, staging_dir, written_by
    from pipeline.tasks import get_task

    task = get_task(args.task)
    tmp = None
    try:
        if not 0 <= args.val_fraction < 1:
            raise ValueError(f"--val-fraction: must be in [0, 1), got {args.val_fraction}")
        for flag, v in (("--max-length", args.max_length), ("--limit", args.limit), ("--shard-size", args.shard_size)):
            if v is not None and v < 1:
                raise ValueError(f"{flag}: must be >= 1, got {v}")
        if not args.input.exists():
            raise FileNotFoundError(f"{args.input}: no such file or directory")
        check_output_dir(args.output, force=args.force, owned=written_by(TOOL), what="task shards", tool=TOOL)
        tcfg = task_config(task, args)
        records = task.read(args.input, tcfg)
        total = len(records)
        if args.max_length is not None:
            records = [r for r in records if len(r.sequence) <= args.max_length]
        records = records[:args.limit] if args.limit is not None else records
        if not records:
            raise ValueError(f"{args.input}: no record left (--max-length {args.max_length}, --limit {args.limit})")
        splits = {"": records}
        rng = np.random.default_rng(args.seed)
        if args.val_fraction:
            n_val = max(1, round(args.val_fraction * len(records)))
            held = set(rng.permutation(len(records))[:n_val].tolist())
            train = [r for i, r in enumerate(records) if i not in held]
            if not train:
                raise ValueError(f"--val-fraction {args.val_fraction} leaves no training record of {len(records)}")
            # the training records shuffled (task files are often sorted by class: each shard would hold one or two
            # of them); the held-out ones in file order
            splits = {"train": [train[i] for i in rng.permutation(len(train))],
                      "val": [r for i, r in enumerate(records) if i in held]}
        tmp = staging_dir(args.output)
        lines = []
        for name, recs in splits.items():
            size = args.shard_size or max(1, -(-len(recs) // 8))
            shards = write_split(tmp / name if name else tmp / "set", recs, task, size)
            lines.append(f"{name or 'all'}: {len(recs):,} records in {len(shards)} shards ({summary(task, recs)})")
        if not args.val_fraction:  # the one set is OUTPUT itself
            inner = tmp / "set"
            for f in inner.iterdir():
                f.rename(tmp / f.name)
            inner.rmdir()
        publish_dir(tmp, args.output, TOOL)
        tmp = None
    except (ValueError, OSError) as e:  # ConfigError, OutputDirError and the readers' errors are ValueErrors
        where = f"{e.filename}: " if isinstance(e, OSError) and e.filename and e.strerror else ""
        print(f"error: {where}{e.strerror if where else e}", file=sys.stderr)
        return 2
    finally:
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    left = total - len(records)
    print(f"{args.task}: {len(records):,} of {total:,} records of {args.input} -> {args.output}"
          + (f" ({left:,} left out by --max-length/--limit)" if left else ""))
    for line in lines:
        print(f"  {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
