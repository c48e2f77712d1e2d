"""Protein structures for contact evaluation, read with gemmi (PDB or mmCIF, plain or gzipped).

``read_structure(path)`` -> :class:`Structure`: the chain's full sequence and, per residue, the coordinates the
contact definition uses (paper 002 / CASP: C-beta, C-alpha for glycine), NaN where the residue or that atom was not
observed. How the sequence is aligned to the coordinates:

* The chain is the first protein chain of the first model (or the one named).
* With the deposited sequence (mmCIF ``entity_poly_seq``, PDB ``SEQRES``), the sequence is that full sequence and
  each observed residue sits at its ``label_seq_id`` (mmCIF's own, or gemmi's alignment of the PDB residues to
  SEQRES: ``assign_label_seq_id``); residues that were not observed (REMARK 465, missing loops) are in the sequence
  with no coordinates, so every pair touching them is masked, never counted as a non-contact.
* Without it (a domain file of ATOM records only) the sequence is the observed residues in file order; a chain
  break between two consecutive residues (C to N farther than 2 angstrom) would hide residues whose identity the
  file does not give, so it is an error naming the file, chain and residues.
* Modified residues read as their parent (MSE as M); an unknown residue is X. Alternate locations: the first.

Every error is a ValueError naming the file.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

STRUCTURE_SUFFIXES = (".pdb", ".cif", ".mmcif", ".ent", ".pdb.gz", ".cif.gz", ".mmcif.gz", ".ent.gz")
PEPTIDE_BOND_MAX = 2.0  # angstrom: C(i) to N(i+1) beyond this is a chain break (a peptide bond is 1.33)


@dataclass
class Structure:
    name: str  # file name without the structure suffixes
    path: Path
    chain: str
    sequence: str  # one letter a residue (ESM-2 alphabet), the full chain
    coords: np.ndarray  # float64 [L, 3]: C-beta (C-alpha for glycine); NaN where not observed
    observed: np.ndarray  # bool [L]: the residue has coordinates
    aligned_by: str  # "seqres" (label_seq_id against the deposited sequence) or "atoms" (observed residues only)

    @property
    def length(self) -> int:
        return len(self.sequence)


def structure_files(folder) -> list[Path]:
    """The structure files of a folder (STRUCTURE_SUFFIXES), sorted; ValueError naming it when there is none."""
    folder = Path(folder)
    if not folder.is_dir():
        return [folder]
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.lower().endswith(STRUCTURE_SUFFIXES))
    if not files:
        raise ValueError(f"{folder}: no structure file ({', '.join(STRUCTURE_SUFFIXES)})")
    return files


def one_letter(name: str) -> str:
    """A residue name's one-letter code (a modified residue its parent's: MSE -> M), X when unknown."""
    import gemmi

    info = gemmi.find_tabulated_residue(name)
    code = info.one_letter_code.upper() if info is not None and info.is_amino_acid() else "X"
    return code if code.isalpha() and code != " " else "X"


def _atom(residue, name: str):
    atom = residue.find_atom(name, "*")  # the first alternate location
    return None if atom is None else np.array([atom.pos.x, atom.pos.y, atom.pos.z])


def contact_atom(residue) -> np.ndarray | None:
    """C-beta, or C-alpha for glycine (paper 002's contact definition); None when that atom is absent."""
    return _atom(residue, "CA" if residue.name == "GLY" else "CB")


def read_structure(path, chain: str | None = None) -> Structure:
    """The structure of ``path`` (module docstring)."""
    import gemmi

    path = Path(path)
    name = path.name
    for suffix in sorted(STRUCTURE_SUFFIXES, key=len, reverse=True):
        if name.lower().endswith(suffix):
            name = name[:-len(suffix)]
            break
    try:
        st = gemmi.read_structure(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise ValueError(f"{path}: cannot be read as a PDB or mmCIF structure ({str(e).splitlines()[0][:200]})") from None
    if len(st) == 0:
        raise ValueError(f"{path}: no model in the file")
    st.setup_entities()
    model = st[0]
    chains = [ch for ch in model if len(ch.get_polymer()) and ch.get_polymer().check_polymer_type() in (
        gemmi.PolymerType.PeptideL, gemmi.PolymerType.PeptideD)]
    if chain is not None:
        chains = [ch for ch in chains if ch.name == chain]
        if not chains:
            raise ValueError(f"{path}: no protein chain {chain!r}")
    if not chains:
        raise ValueError(f"{path}: no protein chain")
    ch = chains[0]
    polymer = list(ch.get_polymer())
    entity = st.get_entity_of(ch.get_polymer())
    full = list(entity.full_sequence) if entity is not None else []
    if full:
        if st.input_format != gemmi.CoorFormat.Mmcif or any(r.label_seq is None for r in polymer):
            st.assign_label_seq_id(True)  # PDB: align the residues to SEQRES (mmCIF files carry their own)
            polymer = list(st[0][ch.name].get_polymer())
        seq = [one_letter(gemmi.Entity.first_mon(m)) for m in full]
        coords = np.full((len(seq), 3), np.nan)
        for r in polymer:
            if r.label_seq is None or not 1 <= r.label_seq <= len(seq):
                raise ValueError(f"{path}: chain {ch.name} residue {r.name} {r.seqid} is not in its deposited "
                                 "sequence (SEQRES / entity_poly_seq)")
            i = r.label_seq - 1
            if np.isnan(coords[i]).all():  # microheterogeneity: the first residue at a position
                seq[i] = one_letter(r.name)
                xyz = contact_atom(r)
                coords[i] = xyz if xyz is not None else np.nan
        observed = np.zeros(len(seq), dtype=bool)
        observed[[r.label_seq - 1 for r in polymer]] = True
        return Structure(name, path, ch.name, "".join(seq), coords, observed, "seqres")
    for a, b in zip(polymer, polymer[1:]):
        c, n = _atom(a, "C"), _atom(b, "N")
        if c is not None and n is not None and np.linalg.norm(c - n) > PEPTIDE_BOND_MAX:
            raise ValueError(f"{path}: chain {ch.name}: residues {a.name} {a.seqid} and {b.name} {b.seqid} are not "
                             f"bonded (C-N {np.linalg.norm(c - n):.1f} angstrom) and the file has no SEQRES: the "
                             "missing residues' identities are unknown")
    seq = "".join(one_letter(r.name) for r in polymer)
    coords = np.array([xyz if (xyz := contact_atom(r)) is not None else [np.nan] * 3 for r in polymer], dtype=float)
    return Structure(name, path, ch.name, seq, coords.reshape(-1, 3), np.ones(len(seq), dtype=bool), "atoms")


def contact_map(coords: np.ndarray, threshold: float = 8.0) -> tuple[np.ndarray, np.ndarray]:
    """(contacts, known), both bool [L, L]: atoms closer than ``threshold`` angstrom, and where both atoms exist (a
    pair with a missing atom is unknown, never a non-contact)."""
    d = np.linalg.norm(coords[:, None, :] - coords[None, :, :], axis=-1)
    known = np.isfinite(d)
    return known & (np.nan_to_num(d, nan=np.inf) < threshold), known
