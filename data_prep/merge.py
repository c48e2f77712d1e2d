"""``python -m data_prep merge --output DIR``: the N job manifests of a job array (or of a --workers run) checked
against each other and combined into ``manifest.json``, their ``filtered-jobIIII-of-NNNN.tsv`` into ``filtered.tsv``;
with --val-fraction both ``DIR/train`` and ``DIR/val``, and ``split.json``. Everything is checked before anything is
written."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .checks import PrepError, sum_stats
from .common import (FILTERED, FILTERED_HEADER, FINGERPRINT, JOB_MANIFEST_RE, SPLIT_FILE, SPLITS, job_manifest_name,
                     output_lock, split_doc, write_json)
from .settings import Result


def merge(output: Path) -> Result:
    """Combine the N job manifests of ``output`` into ``manifest.json`` (with --val-fraction: those of
    ``output/train`` and ``output/val``, and ``split.json``); every job must have finished. Everything is checked
    before anything is written."""
    output = Path(output).resolve()
    if not output.is_dir():
        raise PrepError(f"output directory {output} does not exist")
    with output_lock(output, "data_prep merge"):  # not while a job of the array or another run writes there
        result = _merge(output)
        for scanned in output.glob(".scan-of-*"):  # a --clusters array's scan parts (data_prep/scan.py): used up
            shutil.rmtree(scanned)
        return result


def _merge(output: Path) -> Result:
    has_jobs = any(JOB_MANIFEST_RE.fullmatch(p.name) for p in output.iterdir())
    split_dirs = [output / s for s in SPLITS if (output / s).is_dir()]
    if has_jobs and split_dirs:  # some jobs ran with --val-fraction (train/, val/), others without
        jobs = {where: sorted(int(m[1]) for p in where.iterdir() if (m := JOB_MANIFEST_RE.fullmatch(p.name)))
                for where in (output, *split_dirs)}
        without, with_ = jobs[output], sorted(set().union(*(jobs[d] for d in split_dirs)))
        raise PrepError(f"the jobs ran with different --val-fraction (none in {_jobs(without)}; a fraction in "
                        f"{_jobs(with_)}){MIXED_JOBS}")
    if has_jobs or not split_dirs:
        return _merge_dir(output)()
    if len(split_dirs) != len(SPLITS):
        other = "val" if split_dirs[0].name == "train" else "train"
        raise PrepError(f"{output}: holds {split_dirs[0].name}/ but not {other}/; a --val-fraction run writes both")
    pending = {d.name: _merge_dir(d) for d in split_dirs}  # all checked before either is written
    results = {k: write() for k, write in pending.items()}
    fraction = results["train"].manifest.stats.get("split", {}).get("val_fraction")
    write_json(output / SPLIT_FILE, split_doc({k: r.manifest for k, r in results.items()}, fraction,
                                              results["train"].manifest.source))
    located = {k: (r.manifest, r.location) for k, r in results.items()}
    seen = sum(r.records_seen for r in results.values())
    return Result(results["train"].manifest, seen, results["train"].location, located, fraction)


def _check_same_options(docs: list[dict], names: list[str]) -> None:
    """Refuse jobs that ran with different RECORD_OPTIONS, naming the option, its values and the jobs."""
    options = [d.get("job", {}).get("options") for d in docs]
    if all(o is None for o in options):  # every job manifest predates the record (nothing to compare)
        return
    for name, o in zip(names, options):
        if o is None:
            raise PrepError(f"{name} does not record its options (written by an older data_prep); rerun that job "
                            "with the others' command line before merging")
    for flag in options[0]:
        by_value: dict[str, list[int]] = {}
        for i, o in enumerate(options):
            by_value.setdefault(json.dumps(o.get(flag)), []).append(i)
        if len(by_value) > 1:
            groups = "; ".join(f"{json.loads(v)!r} in {_jobs(js)}" for v, js in by_value.items())
            raise PrepError(f"the jobs ran with different {flag} ({groups}){MIXED_JOBS}")


MIXED_JOBS = ": their records would not add up to one run's; rerun the odd jobs with the same options (--overwrite) " \
    "before merging"


def _version(x: dict) -> str:
    size = f"{x['size']:,}" if "size" in x else "?"
    return f"{size} bytes, sampled sha256 {x.get('sha256_sampled', '?')[:12]}"


def _jobs(indices: list[int]) -> str:
    return f"job{'s' if len(indices) > 1 else ''} {', '.join(map(str, indices))}"


def _merge_dir(output: Path):
    """Check the job manifests of one shard directory; returns the function that writes the merged manifest (and
    the merged filtered.tsv) and returns the Result."""
    found = {}
    for p in output.iterdir():
        m = JOB_MANIFEST_RE.fullmatch(p.name)
        if m:
            found[(int(m[1]), int(m[2]))] = p
    if not found:
        raise PrepError(f"{output}: no manifest-jobIIII-of-NNNN.json to merge")
    counts = {n for _, n in found}
    if len(counts) != 1:
        raise PrepError(f"{output}: job manifests from runs with different --num-jobs {sorted(counts)}; "
                        "remove the stale ones")
    n = counts.pop()
    missing = [i for i in range(n) if (i, n) not in found]
    if missing:
        raise PrepError(f"{output}: job {missing[0]} of {n} has not finished ({job_manifest_name(missing[0], n)} "
                        f"missing{f'; {len(missing)} jobs missing' if len(missing) > 1 else ''})")
    # here, not at the top: webdataset (pipeline.data.shards) pulls in torch (~2 s), and a merge refused above
    # should not wait for it
    from pipeline.data.shards import Manifest, ShardError, ShardInfo, check_manifest_doc, write_manifest

    docs = []
    for i in range(n):
        path = found[(i, n)]
        try:
            docs.append(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise PrepError(f"{path}: not valid JSON ({e})") from None
        except RecursionError:
            raise PrepError(f"{path}: not a job manifest (JSON nested too deeply to read)") from None
        try:  # its shape before any of it is used
            check_manifest_doc(docs[-1], path)
        except ShardError as e:
            raise PrepError(str(e)) from None
    first = docs[0]
    for d in docs:
        d.setdefault("layout", "sequences")  # job manifests written before layouts existed
    for i, d in enumerate(docs):
        for key in ("format", "source", "tokenizer", "layout"):
            if d[key] != first[key]:
                raise PrepError(f"{found[(i, n)].name}: {key} differs from job 0's")
        if [x["path"] for x in d["inputs"]] != [x["path"] for x in first["inputs"]]:
            raise PrepError(f"{found[(i, n)].name}: ran on different inputs than job 0")
        for x, y in zip(d["inputs"], first["inputs"]):
            if any(k in x and k in y and x[k] != y[k] for k in FINGERPRINT):  # absent: written before the record
                raise PrepError(f"{found[(i, n)].name}: read another version of {x['path']} than job 0 did "
                                f"({_version(x)} against {_version(y)}): the file changed between the jobs, so their "
                                "records do not add up to one run's; rerun every job on one version (--overwrite)")
    _check_same_options(docs, [found[(i, n)].name for i in range(n)])
    shards = [ShardInfo(**s) for d in docs for s in d["shards"]]
    for s in shards:
        if not (output / s.path).is_file():
            raise PrepError(f"{output}: shard {s.path} listed by a job manifest is missing")
    if not shards:
        split = first.get("stats", {}).get("split")
        raise PrepError(f"{output}: the jobs wrote no samples" + (
            f" into the {split['name']} split (--val-fraction {split['val_fraction']} too small for the data?)"
            if split else ""))
    filtered: dict[str, int] = {}
    for d in docs:
        for k, v in d["filtered"].items():
            filtered[k] = filtered.get(k, 0) + v
    if first["layout"] == "clusters":
        # Every cluster job reads every FASTA record: record counts are whole-input, member counts per job.
        inputs, stats = merge_stats(docs, [found[(i, n)].name for i in range(n)])
        seen = stats["fasta_records"]
    else:
        inputs = [{**{f: v for f, v in x.items() if f in FINGERPRINT}, **{c: sum(d["inputs"][k].get(c, 0) for d in docs)
                                          for c in ("records", "kept", "residues")}}
                  for k, x in enumerate(first["inputs"])]
        stats = {}
        for d in docs:
            stats = sum_stats(stats, {k: v for k, v in d.get("stats", {}).items()
                                       if k not in ("input", "filtered_list")})
        # Reader counters (blank lines, tags, ...) are counted over all records of the inputs by every job alike.
        stats["input"] = first.get("stats", {}).get("input", {})
        seen = sum(x["records"] for x in inputs)
    lists = [output / d["stats"]["filtered_list"] for d in docs if d.get("stats", {}).get("filtered_list")]
    stats.pop("filtered_list", None)
    for p in lists:
        if not p.is_file():
            raise PrepError(f"{output}: {p.name}, listed by a job manifest, is missing")
    if lists:
        stats["filtered_list"] = FILTERED
    manifest = Manifest(source=first["source"], tokenizer=first["tokenizer"], shards=shards, filtered=filtered,
                        inputs=inputs, stats=stats, layout=first["layout"])

    def write() -> Result:
        if lists:
            tmp = output / f".{FILTERED}.tmp"
            with open(tmp, "wb") as f:
                f.write(("\t".join(FILTERED_HEADER) + "\n").encode())
                for p in lists:
                    with open(p, "rb") as src:
                        src.readline()  # its header
                        shutil.copyfileobj(src, f)
            os.replace(tmp, output / FILTERED)
        return Result(manifest, seen, write_manifest(output, manifest))
    return write


SUMMED = ("clusters", "clusters_kept", "members_listed", "members_kept", "residues", "lowercase_residues",
          "members_found")


def merge_stats(docs: list[dict], names: list[str]) -> tuple[list, dict]:
    """(inputs, stats) of N cluster job manifests: job counts summed, whole-input counts checked equal, and the
    records in no cluster computed (every FASTA record that no job matched)."""
    first = docs[0]
    for d, name in zip(docs, names):
        st = d["stats"]
        for key in ("fasta_records", "mapping"):
            if st[key] != first["stats"][key]:
                raise PrepError(f"{name}: stats.{key} differs from job 0's (jobs ran on different inputs)")
        if [x["records"] for x in d["inputs"]] != [x["records"] for x in first["inputs"]]:
            raise PrepError(f"{name}: read other FASTA record counts than job 0")
    inputs = [{**{k: v for k, v in x.items() if k in FINGERPRINT}, "records": x["records"],
               **{c: sum(d["inputs"][k][c] for d in docs) for c in ("members", "kept", "residues")}}
              for k, x in enumerate(first["inputs"])]
    stats: dict = {k: sum(d["stats"][k] for d in docs) for k in SUMMED}
    mf: dict = {}
    for d in docs:
        for k, v in d["stats"]["members_filtered"].items():
            mf[k] = mf.get(k, 0) + v
    stats["members_filtered"] = mf
    stats["fasta_records"] = first["stats"]["fasta_records"]
    stats["records_in_no_cluster"] = stats["fasta_records"] - stats["members_found"]
    stats["mapping"] = first["stats"]["mapping"]
    extra: dict = {}
    for d in docs:  # --replace-invalid counters and the characters outside the alphabet
        extra = sum_stats(extra, {k: v for k, v in d["stats"].items() if k not in stats and k not in (
            "members_filtered", "records_in_no_cluster", "filtered_list")})
    stats.update(extra)
    mapping = stats["mapping"]
    if (stats["clusters"], stats["members_listed"]) != (mapping["clusters"], mapping["members"]):
        raise PrepError(f"the jobs cover {stats['clusters']} clusters / {stats['members_listed']} members but "
                        f"{mapping['path']} lists {mapping['clusters']} / {mapping['members']}")
    return inputs, stats
