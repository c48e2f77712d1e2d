"""Residue annotations in their standard formats, for the MoE routing analyses (pipeline/eval/routing.py; paper 002,
Fig. 4a-b and Table 4), and the matched background every annotated residue is compared with.

Each reader returns {protein id: {category: set of 0-based residue positions}}:

* :func:`read_uniprot`: UniProtKB flat files (the ``.dat`` / ``.txt`` text of Swiss-Prot, entries ending in
  ``//``). The protein is the entry's primary accession (first ``AC``); its ``SQ`` sequence is kept to check the
  protein set. Feature (``FT``) keys of residues and regions, the 19 of ``UNIPROT_FEATURES``, become categories
  ``UniProt/KEY``; a location ``a..b`` covers a to b, ``a`` one residue, and for DISULFID and CROSSLNK
  ``a..b`` names the two bonded residues only. Uncertain ends (``<a``, ``>b``, ``?``) are skipped and counted.
* :func:`read_domtblout`: HMMER3 ``--domtblout`` of a Pfam scan (``hmmscan``: the target is the Pfam family, the
  query the protein; ``hmmsearch`` layout, protein as target, is recognised by which name is a protein of the set).
  Each domain's envelope (``env from``..``env to``) becomes category ``Pfam/<accession without version>``, domains
  with an independent E-value above ``max_evalue`` dropped (counted).
* :func:`read_secondary_structure`: secondary-structure labels as FASTA-aligned strings: a FASTA file whose record
  for a protein holds one label per residue (DSSP's eight states ``H G I E B T S C``, ``-`` or ``.`` for coil, or
  the three states ``H E C``), as TAPE's and NetSurfP's Q3/Q8 labels are written; categories ``SS8/X`` (for
  eight-state strings) and ``SS3/H``, ``SS3/E``, ``SS3/C`` (H G I -> H, E B -> E, the rest -> C). A string whose
  length is not the protein's is an error naming the record.

Protein ids: a FASTA record ``sp|P62258|1433E_HUMAN`` is known by its accession (P62258) and by its full id; others
by their id. An annotation naming no protein of the set is skipped and counted; a bad line is a ValueError naming
``file:line``.

Matched background (:func:`matched_background`): every annotated residue of a category is paired with a residue of
the same protein carrying the same amino acid, in the same relative-position bin (``bins`` equal bins of position /
length), and not annotated with that category, drawn uniformly (seeded, with replacement); a residue without any such
partner is left out and counted.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

UNIPROT_FEATURES = ("ACT_SITE", "BINDING", "SITE", "MOD_RES", "LIPID", "CARBOHYD", "DISULFID", "CROSSLNK", "DOMAIN",
                    "REGION", "MOTIF", "COMPBIAS", "REPEAT", "ZN_FING", "DNA_BIND", "TRANSMEM", "INTRAMEM", "SIGNAL",
                    "TRANSIT")
BONDS = ("DISULFID", "CROSSLNK")  # a..b names the two bonded residues, not a range
SS8 = "HGIEBTSC"
SS3 = {"H": "H", "G": "H", "I": "H", "E": "E", "B": "E"}  # every other state is coil (C)

Annotations = dict  # {protein: {category: set(int)}}


def protein_ids(record_id: str) -> list[str]:
    """The names a FASTA record is known by: its id, and the accession of a UniProt-style ``db|ACC|NAME`` id."""
    parts = record_id.split("|")
    return [record_id, parts[1]] if len(parts) >= 3 and parts[0] in ("sp", "tr") else [record_id]


def read_proteins(path) -> tuple[dict[str, str], dict[str, str]]:
    """({protein id: sequence}, {every name a record is known by: its protein id}) of a FASTA file (the id is the
    record's id; :func:`protein_ids` gives the other names); ValueError naming a name read twice."""
    from data_prep.fasta import iter_fasta
    from pipeline.data.protein_tokenizer import ProteinTokenizer

    tok = ProteinTokenizer()
    sequences, aliases, first = {}, {}, {}
    for r in iter_fasta(Path(path), lambda seq: tok.invalid_positions(seq.upper())):
        seq = r.seq.decode().upper()
        if not seq:
            continue
        for name in protein_ids(r.id):
            if name in first:
                raise ValueError(f"{path}:{r.line}: protein {name} already read at line {first[name]}")
            first[name] = r.line
            aliases[name] = r.id
        sequences[r.id] = seq
    if not sequences:
        raise ValueError(f"{path}: no protein sequence")
    return sequences, aliases


def by_name(sequences: dict[str, str], aliases: dict[str, str]) -> dict[str, str]:
    """{every name: sequence}: what the readers look proteins up in."""
    return {name: sequences[pid] for name, pid in aliases.items()}


def canonical(annotations: Annotations, aliases: dict[str, str]) -> Annotations:
    """Annotations keyed by protein id, whichever of its names a source used."""
    out: Annotations = {}
    for name, cats in annotations.items():
        for cat, pos in cats.items():
            _add(out, aliases[name], cat, pos)
    return out


def _lines(path: Path) -> list[str]:
    """A text file's lines, gunzipped when it starts with the gzip magic (UniProt ships uniprot_sprot.dat.gz)."""
    from data_prep.fasta import open_input

    with open_input(path) as fh:
        return fh.read().decode("utf-8", errors="replace").splitlines()


def _add(out: Annotations, protein: str, category: str, positions) -> None:
    out.setdefault(protein, {}).setdefault(category, set()).update(positions)


def read_uniprot(path, proteins: dict[str, str], features=UNIPROT_FEATURES) -> tuple[Annotations, dict]:
    """UniProtKB flat-file features (module docstring) -> (annotations, counts of what was skipped)."""
    path = Path(path)
    out: Annotations = {}
    skipped = {"not_in_set": 0, "uncertain": 0}
    entry, seq_lines, in_seq, feats = None, [], False, []
    for n, line in enumerate(_lines(path), 1):
        if line.startswith("AC   ") and entry is None:
            entry = line[5:].split(";")[0].strip()
        elif line.startswith("SQ   "):
            in_seq = True
        elif line.startswith("//"):
            if entry is None:
                raise ValueError(f"{path}:{n}: an entry without an AC line")
            seq = "".join(seq_lines)
            if entry not in proteins:
                skipped["not_in_set"] += 1
            elif proteins[entry] != seq:
                raise ValueError(f"{path}:{n}: entry {entry}'s sequence ({len(seq)} residues) is not the protein set's "
                                 f"({len(proteins[entry])})")
            else:
                for ln, key, loc in feats:
                    m = re.fullmatch(r"(\d+)(?:\.\.(\d+))?", loc)
                    if m is None:
                        if re.fullmatch(r"[<>?\d.]+", loc):
                            skipped["uncertain"] += 1
                            continue
                        raise ValueError(f"{path}:{ln}: FT {key}: location {loc!r} is not a..b or a")
                    a, b = int(m.group(1)), int(m.group(2) or m.group(1))
                    if not 1 <= a <= b <= len(seq):
                        raise ValueError(f"{path}:{ln}: FT {key} {loc}: outside the {len(seq)} residues of {entry}")
                    _add(out, entry, f"UniProt/{key}", {a - 1, b - 1} if key in BONDS else range(a - 1, b))
            entry, seq_lines, in_seq, feats = None, [], False, []
        elif in_seq:
            seq_lines.append(line.replace(" ", "").strip())
        elif line.startswith("FT   ") and line[5] != " ":
            key, _, loc = line[5:].strip().partition(" ")
            if key in features:
                feats.append((n, key, loc.strip()))
    return out, skipped


def read_domtblout(path, proteins: dict[str, str], max_evalue: float = 1e-5) -> tuple[Annotations, dict]:
    """Pfam domains of an HMMER3 --domtblout (module docstring) -> (annotations, skipped counts)."""
    path = Path(path)
    out: Annotations = {}
    skipped = {"not_in_set": 0, "evalue": 0}
    for n, line in enumerate(_lines(path), 1):
        if not line.strip() or line.startswith("#"):
            continue
        f = line.split(None, 22)
        if len(f) < 22:
            raise ValueError(f"{path}:{n}: {len(f)} columns; a --domtblout row has 22 and a description")
        target, t_acc, query, q_acc = f[0], f[1], f[3], f[4]
        if query in proteins:  # hmmscan: target = family
            protein, family, acc, length = query, target, t_acc, int(f[5])
        elif target in proteins:  # hmmsearch: target = protein
            protein, family, acc, length = target, query, q_acc, int(f[2])
        else:
            skipped["not_in_set"] += 1
            continue
        try:
            i_evalue, env_from, env_to = float(f[12]), int(f[19]), int(f[20])
        except ValueError:
            raise ValueError(f"{path}:{n}: i-Evalue / env from / env to are not numbers") from None
        if length != len(proteins[protein]) or not 1 <= env_from <= env_to <= length:
            raise ValueError(f"{path}:{n}: {protein}: length {length} / envelope {env_from}-{env_to} do not fit its "
                             f"{len(proteins[protein])} residues")
        if i_evalue > max_evalue:
            skipped["evalue"] += 1
            continue
        name = acc.split(".")[0] if acc != "-" else family
        _add(out, protein, f"Pfam/{name}", range(env_from - 1, env_to))
    return out, skipped


def read_secondary_structure(path, proteins: dict[str, str]) -> tuple[Annotations, dict]:
    """Q8 / Q3 labels as FASTA-aligned strings (module docstring) -> (annotations, skipped counts)."""
    path = Path(path)
    out: Annotations = {}
    skipped = {"not_in_set": 0}
    records, name, line_no = [], None, 0
    for n, line in enumerate(_lines(path), 1):
        if line.startswith(">"):
            name, line_no = line[1:].split()[0] if line[1:].split() else "", n
            records.append([name, line_no, []])
        elif line.strip():
            if name is None:
                raise ValueError(f"{path}:{n}: labels before the first '>' header")
            records[-1][2].append(line.strip())
    for name, ln, parts in records:
        labels = "".join(parts).upper().replace("-", "C").replace(".", "C")
        protein = next((p for p in protein_ids(name) if p in proteins), None)
        if protein is None:
            skipped["not_in_set"] += 1
            continue
        bad = next((c for c in labels if c not in SS8), None)
        if bad is not None:
            raise ValueError(f"{path}:{ln}: {name}: label {bad!r} is not a DSSP state ({SS8}, - or .)")
        if len(labels) != len(proteins[protein]):
            raise ValueError(f"{path}:{ln}: {name}: {len(labels)} labels for its {len(proteins[protein])} residues")
        eight = any(c in "GIBTS" for c in labels)
        for i, c in enumerate(labels):
            if eight:
                _add(out, protein, f"SS8/{c}", [i])
            _add(out, protein, f"SS3/{SS3.get(c, 'C')}", [i])
    return out, skipped


def merge(*sources: Annotations) -> Annotations:
    out: Annotations = {}
    for src in sources:
        for protein, cats in src.items():
            for cat, pos in cats.items():
                _add(out, protein, cat, pos)
    return out


def position_bin(i: int, length: int, bins: int) -> int:
    """The relative-position bin of residue ``i`` (0-based) of a chain of ``length``: floor(bins * i / length)."""
    return min(bins - 1, bins * i // length)


def matched_background(positions: dict[str, set], sequences: dict[str, str], bins: int,
                       rng: np.random.Generator) -> tuple[list[tuple[str, int, int]], int]:
    """([(protein, annotated residue, its partner)], unmatched count) for one category's ``positions`` {protein:
    annotated residues}: each partner is a residue of the same protein, with the same amino acid, in the same
    relative-position bin, not annotated with this category, drawn uniformly with replacement (module docstring)."""
    pairs, unmatched = [], 0
    for protein in sorted(positions):
        seq, annotated = sequences[protein], positions[protein]
        pool: dict[tuple[str, int], list[int]] = {}
        for j, aa in enumerate(seq):
            if j not in annotated:
                pool.setdefault((aa, position_bin(j, len(seq), bins)), []).append(j)
        for i in sorted(annotated):
            candidates = pool.get((seq[i], position_bin(i, len(seq), bins)))
            if not candidates:
                unmatched += 1
                continue
            pairs.append((protein, i, candidates[int(rng.integers(len(candidates)))]))
    return pairs, unmatched
