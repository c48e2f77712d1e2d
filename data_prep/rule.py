"""The record rule: whether a record (or a cluster member) is kept or dropped, and why, for every path.

Every path asks here and nowhere else: the per-record path (data_prep/build.py ``SequenceBuild.record``), the batch
path (``SequenceBuild._write_run``, whole chunks at once through ``length_drops``; under --workers too, the job
writing what its pool parsed) and the cluster members (data_prep/scan.py, each scan part). What this module owns:

* the outcome codes (``KEPT``, ``REPLACED``, ``FILTERED``, ``STRICT``);
* the checks, in this order: a record the reader marked invalid (``reason`` set by the reader, e.g.
  ``invalid_character``) is kept with its characters replaced under --replace-invalid, an error under --strict
  (``STRICT``), else dropped as damage; then the length: ``empty``, ``shorter_than_<--min-length>``,
  ``longer_than_<--max-length>`` (or ``longer_than_<--max-record-length>``, also for a record skipped unread);
  ``duplicate`` under --dedup (the build keeps the hashes, this module names it);
* the reason names and the manifest's reason lists (``filter_reasons``, ``member_reasons``);
* the ``filtered.tsv`` row of a dropped record or member (``Verdict.detail``, ``member_detail``).

A path calls ``invalid`` and ``length`` (or ``length_drops``, the same numbers as an array); a test replaces them
and checks that every path's output follows (tests/data_prep/test_record_rule.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KEPT, FILTERED, REPLACED, STRICT = 0, 1, 2, 3
EMPTY, DUPLICATE, INVALID_CHARACTER = "empty", "duplicate", "invalid_character"
NOT_IN_FASTA = "not_in_fasta"  # a cluster member without a FASTA record
NO_MEMBER_IN_FASTA, ALL_MEMBERS_FILTERED = "no_member_in_fasta", "all_members_filtered"  # a cluster without members


def shorter(min_length: int) -> str:
    return f"shorter_than_{min_length}"


def longer(limit: int) -> str:
    return f"longer_than_{limit}"


def filter_reasons(min_length: int, max_length: int | None = None, dedup: bool = False) -> dict[str, int]:
    """The reasons every manifest lists (0 or not); invalid-record reasons are added when they occur."""
    out = {EMPTY: 0, shorter(min_length): 0}
    if max_length is not None:
        out[longer(max_length)] = 0
    if dedup:
        out[DUPLICATE] = 0
    return out


def member_reasons(min_length: int, max_length: int | None) -> dict[str, int]:
    """The member filter reasons every cluster manifest lists (invalid-record reasons are added when they occur)."""
    return {NOT_IN_FASTA: 0, **filter_reasons(min_length, max_length)}


def read_bound(settings) -> int:
    """Residues past which a FASTA record is skipped while it is read instead of built: --max-length when given
    (such a record is filtered anyway), else --max-record-length."""
    return min(settings.max_length or settings.max_record_length, settings.max_record_length)


def too_long(settings, n: int) -> str | None:
    """The filter reason of a record of ``n`` residues (built or skipped unread) that a length bound drops:
    longer_than_<--max-length>, else longer_than_<--max-record-length>; None when it is not too long."""
    if settings.max_length is not None and n > settings.max_length:
        return longer(settings.max_length)
    if n > settings.max_record_length:
        return longer(settings.max_record_length)
    return None


@dataclass
class Verdict:
    """A dropped record: its reason, the detail column of its filtered.tsv row, and, when it counts as damage
    (--max-filtered-fraction), the error message (``damage``) and the characters outside the alphabet."""
    status: int
    reason: str | None = None
    detail: str = ""
    damage: str | None = None
    chars: Counter | None = None


def length(settings, n: int, rid: str, path: Path, line: int, noun: str = "record") -> Verdict | None:
    """The length checks of a record of ``n`` residues (``noun``: record or member, named in the damage message);
    None when it is kept. ``length_drops`` is the same rule for an array of lengths."""
    if n == 0:
        return Verdict(FILTERED, EMPTY, "", f"{path}:{line}: {noun} {rid} has no sequence")
    if n < settings.min_length:
        return Verdict(FILTERED, shorter(settings.min_length), f"{n} residues")
    reason = too_long(settings, n)
    if reason is not None:
        return Verdict(FILTERED, reason, f"{n} residues")
    return None


def length_drops(settings, lengths: np.ndarray) -> np.ndarray:
    """Which of ``lengths`` ``length`` drops (as a bool array; ``length`` names each)."""
    return (lengths < max(settings.min_length, 1)) | (lengths > read_bound(settings))


def invalid(settings, encoder, rec, seq: bytes, path: Path) -> tuple[Verdict | None, bytes, dict | None]:
    """A record the reader marked invalid (``rec.error``; ``seq``: its normalised residues): (verdict, residues,
    replacements). Kept with its characters replaced under --replace-invalid (verdict None, or REPLACED), refused
    under --strict (STRICT, ``damage`` the reader's error), else dropped as damage, naming the characters."""
    if rec.error is None:
        return None, seq, None
    if rec.reason == INVALID_CHARACTER and settings.replace_invalid is not None:
        seq, replaced = encoder.replace(seq, settings.replace_invalid)
        return (Verdict(REPLACED) if replaced else None), seq, replaced
    if settings.strict:
        return Verdict(STRICT, rec.reason, damage=rec.error), seq, None
    chars = encoder.bad_characters(seq) if rec.reason == INVALID_CHARACTER else None
    return Verdict(FILTERED, rec.reason, _detail(rec.error, path), rec.error, chars or None), seq, None


def _detail(error: str, path: Path) -> str:
    """A reader's error without its leading 'path:' (the list has an input column)."""
    prefix = f"{path}:"
    return error[len(prefix):] if error.startswith(prefix) else error


def member_detail(cluster: str, detail: str = "") -> str:
    """The detail column of a dropped member's filtered.tsv row."""
    return f"member of {cluster}" + (f"; {detail}" if detail else "")


def cluster_reason(dropped: dict[str, str]) -> str:
    """Why a cluster none of whose members is kept is dropped (``dropped``: member -> reason)."""
    return NO_MEMBER_IN_FASTA if all(r == NOT_IN_FASTA for r in dropped.values()) else ALL_MEMBERS_FILTERED
