"""RNA secondary structures as the pair parsers read them: dot-bracket strings (with pseudoknot brackets), 1-based
base-pair lists, ``.bpseq`` and ``.dbn`` files, all to one representation, the partner vector.

A structure of L nucleotides is ``partner`` int64 [L]: ``partner[i] = j`` when i and j (0-based) pair, -1 when i is
unpaired. Each nucleotide pairs at most once, and pairs are symmetric (``partner[partner[i]] == i``); that is what
every format here can express (a base triple cannot be written in dot-bracket or bpseq), and what the secondary
structure task's pair matrix is built from (pipeline/tasks/ssp.py).

Dot-bracket (bpRNA, WUSS-extended): ``.`` (and WUSS's ``,:-_~``) is unpaired; ``()``, ``[]``, ``{}``, ``<>`` and the
letter pairs ``Aa`` .. ``Zz`` (upper case opens) are independent bracket kinds, each matched with its own stack, so a
pseudoknot (``((..[[..))..]]``) is read correctly. A closing bracket without an opening one, or an opening bracket
never closed, is a ValueError naming the position (1-based) and the bracket.

Every error is a ValueError whose message starts with ``where`` (the file and line, or the record), so the commands
print it as one line.
"""
from __future__ import annotations

import numpy as np

UNPAIRED = ".,:-_~"
BRACKETS = {"(": ")", "[": "]", "{": "}", "<": ">", **{chr(c): chr(c + 32) for c in range(ord("A"), ord("Z") + 1)}}
CLOSERS = {close: open_ for open_, close in BRACKETS.items()}


def parse_dot_bracket(structure: str, where: str = "structure") -> np.ndarray:
    """Dot-bracket -> partner int64 [L] (module docstring); ValueError naming ``where`` and the 1-based position."""
    structure = structure.strip()
    partner = np.full(len(structure), -1, dtype=np.int64)
    stacks: dict[str, list[int]] = {}
    for i, c in enumerate(structure):
        if c in UNPAIRED:
            continue
        if c in BRACKETS:
            stacks.setdefault(c, []).append(i)
        elif c in CLOSERS:
            stack = stacks.get(CLOSERS[c])
            if not stack:
                raise ValueError(f"{where}: unbalanced brackets: {c!r} at position {i + 1} closes no "
                                 f"{CLOSERS[c]!r}")
            j = stack.pop()
            partner[i], partner[j] = j, i
        else:
            raise ValueError(f"{where}: character {c!r} at position {i + 1} is neither a bracket nor '.'")
    for open_, stack in stacks.items():
        if stack:
            raise ValueError(f"{where}: unbalanced brackets: {open_!r} at position {stack[-1] + 1} is never "
                             f"closed by {BRACKETS[open_]!r} ({len(stack)} unclosed)")
    return partner


def pairs_to_partner(pairs, length: int, where: str = "pairs") -> np.ndarray:
    """1-based pairs [[i, j], ...] of a sequence of ``length`` -> partner int64 [length]; ValueError naming ``where``
    for a position out of range, a base paired with itself, or a base in two pairs."""
    partner = np.full(length, -1, dtype=np.int64)
    for pair in pairs:
        if len(pair) != 2:
            raise ValueError(f"{where}: pair {pair!r} is not two positions")
        i, j = (int(x) - 1 for x in pair)
        if not (0 <= i < length and 0 <= j < length):
            raise ValueError(f"{where}: pair {list(pair)} lies outside positions 1..{length}")
        if i == j:
            raise ValueError(f"{where}: pair {list(pair)} pairs a base with itself")
        for a, b in ((i, j), (j, i)):
            if partner[a] not in (-1, b):
                raise ValueError(f"{where}: base {a + 1} pairs with both {partner[a] + 1} and {b + 1}")
            partner[a] = b
    return partner


def partner_to_pairs(partner: np.ndarray) -> list[tuple[int, int]]:
    """partner [L] -> sorted 0-based pairs (i, j) with i < j."""
    p = np.asarray(partner)
    return [(int(i), int(p[i])) for i in np.flatnonzero(p > np.arange(len(p)))]


def check_partner(partner: np.ndarray, where: str = "structure") -> np.ndarray:
    """ValueError unless ``partner`` is a symmetric partner vector (module docstring)."""
    p = np.asarray(partner, dtype=np.int64)
    L = len(p)
    bad = np.flatnonzero((p < -1) | (p >= L) | (p == np.arange(L)))
    if bad.size:
        raise ValueError(f"{where}: base {bad[0] + 1} has partner {p[bad[0]] + 1}")
    paired = np.flatnonzero(p >= 0)
    asym = paired[p[p[paired]] != paired]
    if asym.size:
        i = int(asym[0])
        raise ValueError(f"{where}: base {i + 1} pairs with {p[i] + 1}, which pairs with {p[p[i]] + 1}")
    return p


def to_dot_bracket(partner: np.ndarray) -> str:
    """partner [L] -> dot-bracket, nested pairs in ``()``, each crossing layer in the next of ``[]``, ``{}``, ``<>``,
    ``Aa``..: the inverse of :func:`parse_dot_bracket` for any structure (a greedy layering by pair order)."""
    kinds = list(BRACKETS)
    out = ["."] * len(partner)
    layers: list[list[tuple[int, int]]] = []
    for i, j in partner_to_pairs(partner):
        for layer in layers:
            if all(not (a < i < b < j or i < a < j < b) for a, b in layer):  # crosses none of this layer
                layer.append((i, j))
                break
        else:
            layers.append([(i, j)])
    for k, layer in enumerate(layers):
        if k >= len(kinds):
            raise ValueError(f"{len(layers)} crossing layers of pairs: more than dot-bracket's {len(kinds)} kinds")
        for i, j in layer:
            out[i], out[j] = kinds[k], BRACKETS[kinds[k]]
    return "".join(out)


def parse_bpseq(text: str, where: str) -> tuple[str, np.ndarray]:
    """A ``.bpseq`` file (``index base partner`` per line, 1-based, 0 = unpaired; ``#`` comment lines and bpRNA's
    header lines such as ``Filename:`` are skipped) -> (sequence, partner [L]). ValueError naming ``where`` and the
    line for an index out of order, a partner out of range, or partners that do not agree."""
    seq, partners, lines = [], [], []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split()
        if not fields or line.lstrip().startswith("#") or not fields[0].isdigit():  # blank, comment or header line
            continue
        if len(fields) != 3 or not fields[2].lstrip("-").isdigit():
            raise ValueError(f"{where}:{n}: {line.strip()!r} is not 'index base partner'")
        if int(fields[0]) != len(seq) + 1:
            raise ValueError(f"{where}:{n}: index {fields[0]} follows {len(seq)} (bpseq lists every base in order)")
        seq.append(fields[1])
        partners.append(int(fields[2]))
        lines.append(n)
    if not seq:
        raise ValueError(f"{where}: no 'index base partner' line")
    L = len(seq)
    partner = np.full(L, -1, dtype=np.int64)
    for i, (j, n) in enumerate(zip(partners, lines)):
        if not 0 <= j <= L or j == i + 1:
            raise ValueError(f"{where}:{n}: base {i + 1} has partner {j} (positions run 1..{L}, 0 = unpaired)")
        if j and partners[j - 1] != i + 1:
            raise ValueError(f"{where}:{n}: base {i + 1} pairs with {j}, but line {lines[j - 1]} pairs {j} with "
                             f"{partners[j - 1]}")
        partner[i] = j - 1
    return "".join(seq), partner


def parse_dbn(text: str, where: str) -> list[tuple[str, str, np.ndarray, int]]:
    """A ``.dbn`` file -> [(name, sequence, partner [L], line of the structure)]. Records are bpRNA's (``#Name:``,
    ``#Length:``, ``#PageNumber:`` header lines, then the sequence and the dot-bracket lines) or FASTA-like
    (``>name``, sequence, structure); a structure whose length differs from its sequence's, or whose brackets do not
    balance, is a ValueError naming ``where`` and its line."""
    records, name, body = [], None, []

    def close():
        if name is None and not body:
            return
        if len(body) != 2:
            at = body[0][0] if body else "end"
            raise ValueError(f"{where}:{at}: record {name!r} needs a sequence line and a structure line, got "
                             f"{len(body)} line(s)")
        (_, seq), (n, structure) = body
        if len(seq) != len(structure.strip()):
            raise ValueError(f"{where}:{n}: structure of {len(structure.strip())} characters for a sequence of "
                             f"{len(seq)} ({name})")
        records.append((name or f"record{len(records) + 1}", seq, parse_dot_bracket(structure, f"{where}:{n}"), n))

    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if not s:
            continue
        if s.startswith("#Name:") or s.startswith(">"):
            close()
            name, body = s.split(":", 1)[1].strip() if s.startswith("#") else s[1:].split()[0], []
        elif s.startswith("#"):
            continue
        else:
            body.append((n, s))
    close()
    if not records:
        raise ValueError(f"{where}: no dot-bracket record")
    return records
