"""What every data_prep job checks and adds up, below the modules that read, build and merge (no import of them):
the user-facing error, the damaged-record budget (--max-filtered-fraction) and the sum of two jobs' counters."""
from __future__ import annotations

import sys
from collections import Counter

FILTERED = "filtered.tsv"  # the list of dropped records (re-exported by data_prep.common)
# Characters that occur in protein but not in nucleotide FASTA: named in the error when a protein file is given to a
# nucleotide source.
_AMINO_ONLY = set("EFILPQJOXZ")


class PrepError(Exception):
    """A user-facing error: bad arguments or an output directory in the way."""


class DamageCheck:
    """--max-filtered-fraction: counts the records dropped as damaged, keeps the first few errors and the characters
    outside the alphabet, warns once while reading when the fraction so far is above the limit, and raises at the
    end when the job's fraction is."""

    EXAMPLES = 3
    WARN_AFTER = 1000  # records read before the running fraction is worth a warning

    def __init__(self, settings, unit: str = "records"):
        self.limit = settings.max_filtered_fraction
        self.unit = unit
        self.damaged = 0
        self.reasons: Counter = Counter()
        self.examples: list[str] = []
        self.characters: Counter = Counter()
        self._warned = False

    def add(self, reason: str, error: str | None, characters: Counter | None = None) -> None:
        self.damaged += 1
        self.reasons[reason] += 1
        if error is not None and len(self.examples) < self.EXAMPLES:
            self.examples.append(error)
        if characters:
            self.characters.update(characters)

    def poll(self, read: int) -> None:
        if not self._warned and read >= self.WARN_AFTER and self.damaged > self.limit * read:
            self._warned = True
            print(f"data_prep: warning: {self.damaged} of the first {read} {self.unit} dropped as invalid "
                  f"({self.damaged / read:.1%}, above --max-filtered-fraction {self.limit}); the job will fail at "
                  f"the end unless that changes. First: {self.examples[0] if self.examples else '-'}",
                  file=sys.stderr)

    def check(self, read: int, nucleotide: bool) -> None:
        if read == 0 or self.damaged <= self.limit * read:
            return
        reasons = ", ".join(f"{k}={v}" for k, v in self.reasons.most_common())
        msg = (f"{self.damaged} of {read} {self.unit} ({self.damaged / read:.1%}) dropped as invalid ({reasons}), "
               f"above --max-filtered-fraction {self.limit}")
        fix = ""
        if self.characters:
            chars = ", ".join(f"{c!r} x{n}" for c, n in self.characters.most_common(6))
            more = f" and {len(self.characters) - 6} more" if len(self.characters) > 6 else ""
            msg += f"; characters outside the alphabet: {chars}{more}"
            amino = sorted(_AMINO_ONLY & set(self.characters))
            if nucleotide and len(amino) >= 2:
                msg += f" ({', '.join(amino)} are amino acids: a protein file? use the uniref source)"
            else:
                fix = "pass --replace-invalid CHAR (e.g. N for nucleotides, X for proteins) to keep them, "
        if self.examples:
            msg += "; first: " + "; ".join(self.examples)
        if fix:
            raise PrepError(f"{msg}. Nothing was written: {fix}or raise --max-filtered-fraction (1 keeps the job "
                            f"going and lists every dropped record in {FILTERED})")
        raise PrepError(f"{msg}. Nothing was written (--max-filtered-fraction 1 would keep the job going and list "
                        f"every dropped record in {FILTERED})")


# stats entries that are the job's options, not counters: equal in every job, never summed
_OPTION_STATS = ("windowing", "split", "replacement")


def sum_stats(a: dict, b: dict) -> dict:
    """Counters of two job manifests added: numbers summed, dicts merged key by key; the options recorded in
    stats (``_OPTION_STATS``) must be equal and are kept once."""
    out = dict(a)
    for k, v in b.items():
        if k not in out:
            out[k] = v
        elif k in _OPTION_STATS:
            if out[k] != v:
                raise PrepError(f"the job manifests differ in stats.{k} ({out[k]} and {v}): jobs of one run must "
                                "use the same options")
        elif isinstance(v, dict) and isinstance(out[k], dict):
            out[k] = sum_stats(out[k], v)
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(out[k], (int, float)):
            out[k] = out[k] + v
    return out
