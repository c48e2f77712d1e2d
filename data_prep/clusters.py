"""UniRef50 clusters of UniRef90 members (``data_prep uniref --clusters TSV``): the ESM-2 sampling set as shards.

One sample per UniRef50 cluster, holding every UniRef90 member sequence of the cluster that survives the filters
(layout "clusters", pipeline/data/shards.py); the training loader draws one member per (seed, epoch, sample).

Inputs: the member FASTA(.gz) files (``--input``; ids are the FASTA record ids, headers otherwise unused) and the
mapping TSV (``--clusters``): an optional header ``UR50_cluster_name<TAB>mapped_id``, then one cluster a line,
``UniRef50_X<TAB>id,id,...``. The TSV's data row r (0-based) is the sample key ``f"{r:012d}"`` and, with
``--num-jobs N``, belongs to job r % N: the split is by cluster, and a cluster's members always meet in one job.

Bad input is one FastaError naming ``file:line`` before anything is written: a line without exactly two
tab-separated fields, an empty or blank-containing cluster name or member id, a cluster listed twice, a member listed
twice (in two clusters or in one), a header line after the first line, a member record found twice in the FASTA.
Everything else that is not written is counted (see ``build``).
"""
from __future__ import annotations

from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from .checks import DamageCheck, PrepError, sum_stats
from .common import FINGERPRINT, LOWERCASE, TSV_HEADER, input_fingerprint
from .fasta import FastaError, input_position, iter_fasta, numbered_lines
from .progress import Progress

if TYPE_CHECKING:
    from pipeline.data.shards import Manifest

NOT_IN_FASTA = "not_in_fasta"


@dataclass
class Cluster:
    index: int  # data row of the TSV (0-based): sample key and job
    name: str  # UniRef50 id
    members: list[str]  # member ids in TSV order
    line: int  # 1-based line of the TSV
    start: int  # slot of its first member among this job's members


@dataclass
class ClusterMap:
    """This job's clusters, and counts over the whole TSV (every job parses all of it)."""

    path: Path
    own: list[Cluster]
    slot: dict[str, int]  # member id -> slot, for this job's members only
    clusters: int  # data rows of the whole file
    members: int  # member ids of the whole file
    blank_lines: int

    @property
    def own_members(self) -> int:
        return len(self.slot)


def _parse_row(path: Path, lineno: int, parts: list[str]) -> tuple[str, list[str]]:
    if len(parts) != 2:
        raise FastaError(f"{path}:{lineno}: expected 'UniRef50 cluster<TAB>member,member,...' (2 tab-separated "
                         f"fields), got {len(parts)} field{'s' if len(parts) != 1 else ''}")
    name, mapped = parts
    if not name or len(name.split()) != 1 or name.strip() != name:
        raise FastaError(f"{path}:{lineno}: cluster name {name!r} is empty or contains blanks")
    members = mapped.split(",")
    for k, m in enumerate(members):
        if not m or len(m.split()) != 1 or m.strip() != m:
            raise FastaError(f"{path}:{lineno}: member {k + 1} of cluster {name} ({m!r}) is empty or contains "
                             "blanks (ids are comma-separated without spaces)")
    return name, members


def _rows(path: Path):
    """(line, fields) of the data rows, after the optional header; blank lines yield None."""
    first = True
    for lineno, line in numbered_lines(path):
        if line.endswith(b"\r"):
            line = line[:-1]
        if not line.strip():
            yield lineno, None
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise FastaError(f"{path}:{lineno}: invalid UTF-8 byte {line[e.start]:#04x}") from None
        parts = text.split("\t")
        if tuple(parts) == TSV_HEADER:
            if not first:  # two TSVs concatenated: the header would become a cluster named UR50_cluster_name
                raise FastaError(f"{path}:{lineno}: header line {TSV_HEADER[0]}<TAB>{TSV_HEADER[1]} repeated "
                                 "after the first line (concatenated files?)")
            first = False
            continue
        first = False
        yield lineno, parts


def load_clusters(path: Path, num_jobs: int = 1, job_index: int = 0, progress: tuple = ("auto", 60.0)
                  ) -> ClusterMap:
    """Parse and check the whole mapping TSV; keep the clusters of job ``job_index`` of ``num_jobs``.

    Uniqueness over the whole file is checked with one 64-bit hash per cluster name and per member id (8 bytes each,
    every job), so that a job need not hold other jobs' ids; equal hashes are confirmed by a second pass that
    compares the ids themselves and names both lines.
    """
    own: list[Cluster] = []
    slot: dict[str, int] = {}
    cluster_hashes, member_hashes = array("q"), array("q")
    n_clusters = n_members = blank = 0
    with Progress(f"{path.name} (clusters TSV)", path.stat().st_size, *progress) as bar:
        for lineno, parts in _rows(path):
            if lineno % 4096 == 0:
                bar.update(input_position(path), clusters=n_clusters, members=n_members)
            if parts is None:
                blank += 1
                continue
            name, members = _parse_row(path, lineno, parts)
            cluster_hashes.append(hash(name))
            member_hashes.extend(hash(m) for m in members)
            if n_clusters % num_jobs == job_index:
                own.append(Cluster(n_clusters, name, members, lineno, len(slot)))
                for m in members:
                    slot[m] = len(slot)  # a repeated id is caught below, before this map is used
            n_clusters += 1
            n_members += len(members)
    if n_clusters == 0:
        raise FastaError(f"{path}: no cluster rows (expected 'UniRef50 cluster<TAB>member,member,...' lines)")
    dup_clusters, dup_members = _repeated(cluster_hashes), _repeated(member_hashes)
    del cluster_hashes, member_hashes
    if dup_clusters or dup_members:
        _name_repeat(path, dup_clusters, dup_members)
    return ClusterMap(path, own, slot, n_clusters, n_members, blank)


def _repeated(hashes: array) -> set[int]:
    a = np.sort(np.frombuffer(hashes, dtype=np.int64)) if len(hashes) else np.zeros(0, np.int64)
    return set(a[1:][a[1:] == a[:-1]].tolist())


def _name_repeat(path: Path, dup_clusters: set[int], dup_members: set[int]) -> None:
    """Second pass over the TSV for the ids whose hashes repeat: raise at the first real repeat, in line order."""
    seen_cluster: dict[str, int] = {}
    seen_member: dict[str, tuple[str, int]] = {}
    for lineno, parts in _rows(path):
        if parts is None:
            continue
        name, members = _parse_row(path, lineno, parts)
        if hash(name) in dup_clusters:
            if name in seen_cluster:
                raise FastaError(f"{path}:{lineno}: cluster {name} is listed again (first at line "
                                 f"{seen_cluster[name]})")
            seen_cluster[name] = lineno
        for m in members:
            if hash(m) in dup_members:
                if m in seen_member:
                    other, at = seen_member[m]
                    where = f"twice in cluster {name}" if at == lineno else \
                        f"in cluster {name} and in cluster {other} (line {at})"
                    raise FastaError(f"{path}:{lineno}: member {m} is listed {where}; a UniRef90 member belongs "
                                     "to one UniRef50 cluster")
                seen_member[m] = (name, lineno)
    # equal hashes of distinct ids (a 64-bit collision): nothing is repeated


def member_reasons(min_length: int, max_length: int | None) -> dict[str, int]:
    """The member filter reasons every cluster manifest lists (invalid-record reasons are added when they occur)."""
    out = {NOT_IN_FASTA: 0, "empty": 0, f"shorter_than_{min_length}": 0}
    if max_length is not None:
        out[f"longer_than_{max_length}"] = 0
    return out


def build(encoder, inputs: list[Path], cmap: ClusterMap, settings, splits: dict, source_name: str = "uniref",
          progress: tuple = ("auto", 60.0)) -> tuple[dict, int]:
    """Read the member FASTA files, then write this job's clusters in TSV order; returns ({"": manifest}, FASTA
    records). ``splits``: data_prep.workdir.open_splits (one, ""; --val-fraction is refused with --clusters).

    Filtered and counted (nothing is dropped silently), each member and cluster not written also listed in
    ``filtered.tsv`` (id, reason, input, line, detail naming the cluster):

    * a member listed but absent from every FASTA input: ``stats.members_filtered.not_in_fasta`` (named in the
      cluster's meta ``dropped``);
    * a member record with a character outside the ESM alphabet (``invalid_character``; ``--strict`` makes it an
      error naming file:line:column; ``--replace-invalid X`` writes such characters as X instead, counted in
      ``stats.replaced``), empty, shorter than ``--min-length`` or longer than ``--max-length``: dropped from its
      cluster, counted under ``stats.members_filtered`` and named in meta ``dropped``;
    * a cluster left without members: ``filtered.no_member_in_fasta`` (every member absent from the FASTA) or
      ``filtered.all_members_filtered`` (some found, none kept);
    * FASTA records in no cluster: ``stats.records_in_no_cluster`` (= ``fasta_records - members_found``; a job
      cannot tell another job's members from none, so its manifest holds null and ``merge`` computes it).

    Errors: no member of this job's clusters found in the FASTA at all (the TSV and the FASTA do not belong
    together); more than ``--max-filtered-fraction`` of the members found dropped as invalid or empty.
    Clusters already in the verified shards of an interrupted run are counted and not rewritten.
    """
    s = settings
    sp = splits[""]
    short, long = f"shorter_than_{s.min_length}", f"longer_than_{s.max_length}"
    members_filtered = member_reasons(s.min_length, s.max_length)
    # per slot: encoded member tokens (bytes), (reason, path, line, detail) when filtered, or None (not found yet)
    found: list = [None] * cmap.own_members
    check = encoder.invalid_positions

    def upper_check(seq: bytes) -> np.ndarray:  # lowercase is accepted and upper-cased, as in the uniref source
        return check(seq.upper())

    damage = DamageCheck(s, "members")
    replaced_stats = {"replacement": s.replace_invalid, "replaced_characters": 0, "records_with_replacements": 0,
                      "replaced": {}} if s.replace_invalid is not None else None
    invalid_chars: Counter = Counter()
    counts, records, lowercase = [], 0, 0
    first_record = None
    sizes = [p.stat().st_size for p in inputs]
    try:
        with Progress(f"{source_name} members", sum(sizes), *progress) as bar:
            for n_input, path in enumerate(inputs):
                inp = {"path": str(path), **input_fingerprint(path), "records": 0, "members": 0, "kept": 0,
                       "residues": 0}
                for rec in iter_fasta(path, upper_check, on_invalid="yield"):
                    inp["records"] += 1
                    if first_record is None:
                        first_record = rec.id
                    if inp["records"] % 256 == 0:
                        bar.update(sum(sizes[:n_input]) + input_position(path), records=records + inp["records"],
                                   members=sum(x["members"] for x in counts) + inp["members"])
                        damage.poll(sum(x["members"] for x in counts) + inp["members"])
                    i = cmap.slot.get(rec.id)
                    if i is None:
                        continue  # in no cluster of this job (another job's member, or in no cluster at all)
                    if found[i] is not None:
                        raise FastaError(f"{path}:{rec.line}: record {rec.id} appears a second time in the FASTA "
                                         "input; as a cluster member it must be unique")
                    inp["members"] += 1
                    seq = rec.seq.upper()
                    replaced = None
                    if rec.error is not None:
                        if rec.reason == "invalid_character" and s.replace_invalid is not None:
                            seq, replaced = encoder.replace(seq, s.replace_invalid)
                        elif s.strict:
                            raise FastaError(rec.error)
                        else:
                            chars = encoder.bad_characters(seq) if rec.reason == "invalid_character" else None
                            if chars:
                                invalid_chars.update(chars)
                            damage.add(rec.reason, rec.error, chars)
                            detail = rec.error[len(str(path)) + 1:] if rec.error.startswith(f"{path}:") \
                                else rec.error
                            found[i] = (rec.reason, n_input, rec.line, detail)
                            continue
                    n = len(seq)
                    if n == 0:
                        found[i] = ("empty", n_input, rec.line, "")
                        damage.add("empty", f"{path}:{rec.line}: member {rec.id} has no sequence")
                    elif n < s.min_length:
                        found[i] = (short, n_input, rec.line, f"{n} residues")
                    elif s.max_length is not None and n > s.max_length:
                        found[i] = (long, n_input, rec.line, f"{n} residues")
                    else:
                        if rec.seq.upper() != rec.seq:  # soft-masked (lowercase) residues present
                            lowercase += int(LOWERCASE[np.frombuffer(rec.seq, dtype=np.uint8)].sum())
                        if replaced:
                            replaced_stats["replaced_characters"] += sum(replaced.values())
                            replaced_stats["records_with_replacements"] += 1
                            for c, k in replaced.items():
                                replaced_stats["replaced"][c] = replaced_stats["replaced"].get(c, 0) + k
                        found[i] = encoder.encode(seq).tobytes()
                        inp["kept"] += 1
                        inp["residues"] += n
                if inp["records"] == 0:
                    raise PrepError(f"{path}: no records in this input (empty after decompression?)")
                records += inp["records"]
                counts.append(inp)
            bar.update(sum(sizes), records=records, members=sum(x["members"] for x in counts))
        members_found = sum(x["members"] for x in counts)
        if cmap.own_members and members_found == 0:
            first_member = cmap.own[0].members[0]
            raise PrepError(f"{cmap.path}: none of the {cmap.own_members} member ids of "
                            f"{'the' if s.num_jobs == 1 else 'this job' + chr(39) + 's'} clusters is a record id of "
                            f"the FASTA inputs (first member {first_member!r}, first FASTA record "
                            f"{first_record!r}); do the TSV and the FASTA belong together?")
        damage.check(members_found, False)

        filtered = {"no_member_in_fasta": 0, "all_members_filtered": 0}
        stats = {"clusters": len(cmap.own), "clusters_kept": 0, "members_listed": cmap.own_members,
                 "members_kept": 0, "residues": 0, "lowercase_residues": lowercase,
                 "members_filtered": members_filtered, "fasta_records": records, "members_found": members_found}
        if replaced_stats is not None:
            stats.update(replaced_stats)
        for c in cmap.own:
            kept, dropped = [], {}
            for k, m in enumerate(c.members):
                got = found[c.start + k]
                if isinstance(got, bytes):
                    kept.append((m, got))
                else:
                    reason = NOT_IN_FASTA if got is None else got[0]
                    members_filtered[reason] = members_filtered.get(reason, 0) + 1
                    dropped[m] = reason
                    if got is None:
                        sp.dropped.add(m, reason, cmap.path, c.line, f"member of {c.name}")
                    else:
                        sp.dropped.add(m, reason, inputs[got[1]], got[2],
                                       f"member of {c.name}" + (f"; {got[3]}" if got[3] else ""))
                found[c.start + k] = None  # released as written
            if not kept:
                absent = all(r == NOT_IN_FASTA for r in dropped.values())
                reason = "no_member_in_fasta" if absent else "all_members_filtered"
                filtered[reason] += 1
                sp.dropped.add(c.name, reason, cmap.path, c.line, f"cluster of {len(c.members)} members")
                continue
            lengths = [len(t) for _, t in kept]
            stats["clusters_kept"] += 1
            stats["members_kept"] += len(kept)
            stats["residues"] += sum(lengths)
            if sp.written + 1 <= sp.skip:
                sp.written += 1  # already in a verified shard of the interrupted run
                continue
            tokens = np.frombuffer(b"".join(t for _, t in kept), dtype=np.uint8)
            offsets = np.concatenate([[0], np.cumsum(lengths)])
            meta = {"id": c.name, "source": source_name, "length": int(offsets[-1]),
                    "members": [m for m, _ in kept], "listed": len(c.members)}
            if dropped:
                meta["dropped"] = dropped
            sp.write(f"{c.index:012d}", tokens, meta, offsets)
        shards = sp.close()
    except (PrepError, FastaError, ValueError):
        sp.abort()
        raise
    # With one job every member is this job's, so a record it did not match is in no cluster at all.
    stats["records_in_no_cluster"] = records - stats["members_found"] if s.num_jobs == 1 else None
    stats["mapping"] = {"path": str(cmap.path), "clusters": cmap.clusters, "members": cmap.members,
                        "blank_lines": cmap.blank_lines}
    if invalid_chars:
        stats["invalid_characters"] = dict(invalid_chars.most_common())
    listed = sp.dropped.finish()
    if listed is not None:
        stats["filtered_list"] = listed.name
    from pipeline.data.shards import Manifest  # torch's import time: see data_prep/workdir.py
    return {"": Manifest(source=source_name, tokenizer=encoder.entry, shards=shards, filtered=filtered,
                         inputs=counts, stats=stats, layout="clusters")}, records


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


def summary(m: Manifest, location: Path, job: str = "") -> str:
    st = m.stats
    members = ", ".join(f"{k}={v}" for k, v in st["members_filtered"].items())
    clusters = ", ".join(f"{k}={v}" for k, v in m.filtered.items())
    none = st.get("records_in_no_cluster")
    return (f"data_prep {m.source}{job}: clusters {st['clusters']}, written {m.total_samples}, filtered "
            f"{sum(m.filtered.values())} ({clusters}); members listed {st['members_listed']}, kept "
            f"{st['members_kept']}, filtered {sum(st['members_filtered'].values())} ({members}); FASTA records "
            f"{st['fasta_records']}, in no cluster {'(computed by merge)' if none is None else none}"
            + (f"; replaced {st['replaced_characters']} characters by {st['replacement']!r} in "
               f"{st['records_with_replacements']} members" if "replaced_characters" in st else "")
            + f"; tokens {m.total_tokens}, shards {len(m.shards)} -> {location}"
            + (f"; dropped members and clusters listed in {location.parent / st['filtered_list']}"
               if st.get("filtered_list") else ""))
