"""Long records as windows (``--window L --stride S --window-tail``, OpenGenome2 / Evo 2 style): the spans of a
record's windows and their samples, counted for the manifest (docs/data.md, "Long genomes")."""
from __future__ import annotations

_TAIL_COUNTER = {"short": "short_tails", "align": "aligned_tails", "drop": "dropped_tails"}


def window_spans(n: int, window: int, stride: int, tail: str) -> tuple[list[tuple[int, int]], str]:
    """[start, end) spans of the windows of a record of ``n`` positions, and what its tail was.

    Starts are 0, S, 2S, ...; the last window is the first that reaches the record's end. When it would be shorter
    than L, ``tail`` decides: ``short`` keeps it short ([kS, n)), ``align`` moves it back to end at the record's
    end ([n - L, n), full length, overlapping its neighbour more), ``drop`` leaves it out (those residues are lost,
    counted). A record of at most L positions is one window, the whole record, whatever ``tail`` says.
    Kinds: 'whole' (n <= L), 'exact' (the windows end at n), or the tail policy."""
    if n <= window:
        return [(0, n)], "whole"
    spans = []
    start = 0
    while start + window < n:
        spans.append((start, start + window))
        start += stride
    if start + window == n:
        spans.append((start, n))
        return spans, "exact"
    if tail == "short":
        spans.append((start, n))
    elif tail == "align":
        spans.append((n - window, n))
    return spans, tail


def write_windows(sp, w: dict, key: str, rid: str, seq: bytes, meta: dict, s, encoder) -> None:
    """The windows of one kept record (``seq``, normalized) as samples ``<key>_<k>`` of the shard set ``sp``, ids
    ``<record id>:<start>-<end>`` (0-based, end exclusive, in positions of the normalized sequence), counted in
    ``w`` (the manifest's ``stats.windows``); ``s``: the job's settings (window, stride, tail)."""
    spans, kind = window_spans(len(seq), s.window, s.stride, s.window_tail)
    w["records"] += 1
    if kind == "whole":
        w["records_shorter_than_window"] += len(seq) < s.window
    elif kind == "exact":
        w["exact_ends"] += 1
    else:
        w[_TAIL_COUNTER[kind]] += 1
        if kind == "drop":
            w["tail_residues_dropped"] += encoder.residues(seq[spans[-1][1]:])
    tokens = None
    for k, (a, b) in enumerate(spans):
        n = encoder.residues(seq[a:b]) if b"#" in seq else b - a
        w["samples"] += 1
        w["residues_written"] += n
        if sp.written + 1 <= sp.skip:
            sp.written += 1
            continue
        if tokens is None:
            tokens = encoder.encode(seq)
        sp.write(f"{key}_{k:06d}", tokens[a:b], meta | {"id": f"{rid}:{a}-{b}", "record": rid, "start": a,
                                                          "end": b, "length": n})
