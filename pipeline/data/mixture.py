"""Mixture schedules: per-source sampling weights as a function of the optimizer step, and stateless source choice.

A schedule is a list of stages over optimizer steps. Stage i covers steps [start_i, until_i) with start_0 = 0 and
start_i = until_{i-1}; the last stage may be open-ended (until = None). Within a stage the weight vector is

    constant  w(s) = w0
    linear    w(s) = (1 - t) w0 + t w1,                       t = (s - start) / (until - start)  in [0, 1)
    stepped   w(s) = (1 - t_q) w0 + t_q w1,  t_q = floor(t * levels) / (levels - 1)   (levels equal plateaus)

with w0 = ``weights`` and w1 = ``end_weights``. After the last bounded stage the final weights (its w1, or w0 when
constant) stay in force. Weights are normalized to sum to 1 at every step, so they need not be probabilities in YAML.

Source choice. Sample k of loader stream (rank r, stream w) picks source ``searchsorted(cumsum(w(step)), u_k)`` with
u_k uniform in [0, 1) from a generator seeded by (seed, r, w, k // BLOCK): u_k depends only on its coordinates, never
on history, so a resumed stream draws exactly the same sources from one integer (k), and the weights applied are those
of the step the sample's microbatch belongs to. Sources are sampled with replacement across epochs: each source is an
infinite stream that wraps into its next epoch independently of the others.

Stages count optimizer steps, not tokens: a token-indexed stage boundary would make sample k's weights depend on the
lengths of every sample drawn before it on every rank, which breaks the stateless per-sample seeding above.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RAMPS = ("constant", "linear", "stepped")
BLOCK = 4096  # uniforms generated per seed; one generator per BLOCK samples keeps source choice ~free


@dataclass
class Stage:
    start: int
    until: int | None  # exclusive; None = open-ended
    w0: np.ndarray  # [S] float64, sums to 1
    w1: np.ndarray  # [S] float64, sums to 1 (== w0 for constant)
    ramp: str = "constant"
    levels: int = 4

    def at(self, step: int) -> np.ndarray:
        if self.ramp == "constant" or self.until is None:
            return self.w0
        t = (step - self.start) / (self.until - self.start)
        if self.ramp == "stepped":
            t = np.floor(t * self.levels) / (self.levels - 1)
        w = (1 - t) * self.w0 + t * self.w1
        return w / w.sum()


def _vector(weights: dict, names: list[str], field: str) -> np.ndarray:
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"{field}: unknown source {unknown[0]!r} (sources: {', '.join(names)})")
    w = np.array([float(weights.get(n, 0.0)) for n in names], dtype=np.float64)
    if np.any(w < 0) or not np.all(np.isfinite(w)) or w.sum() <= 0:
        raise ValueError(f"{field}: weights must be finite, >= 0 and not all 0, got {weights}")
    return w / w.sum()


class MixtureSchedule:
    """Weights over ``names`` per optimizer step; built from DataConfig.sources/schedule or from plain dicts."""

    def __init__(self, names: list[str], stages: list[Stage]):
        if not names or not stages:
            raise ValueError("a mixture needs at least one source and one stage")
        self.names, self.stages = list(names), stages
        self._cache: tuple[int, np.ndarray] | None = None

    @classmethod
    def constant(cls, names: list[str], weights: dict | None = None) -> "MixtureSchedule":
        w = _vector(weights or {n: 1.0 for n in names}, names, "data.sources.weight")
        return cls(names, [Stage(0, None, w, w)])

    @classmethod
    def from_stages(cls, names: list[str], stages: list[dict], field: str = "data.schedule") -> "MixtureSchedule":
        """``stages``: [{"until_step", "weights", "ramp", "end_weights", "ramp_levels"}] as in the YAML."""
        out, start = [], 0
        for i, st in enumerate(stages):
            key = f"{field}[{i}]"
            until, ramp = st.get("until_step"), st.get("ramp", "constant")
            if ramp not in RAMPS:
                raise ValueError(f"{key}.ramp: must be one of {', '.join(RAMPS)}, got {ramp!r}")
            if until is not None and until <= start:
                raise ValueError(f"{key}.until_step: {until} must be > the stage's start step {start}")
            if until is None and i != len(stages) - 1:
                raise ValueError(f"{key}.until_step: only the last stage may be open-ended")
            w0 = _vector(st.get("weights") or {}, names, f"{key}.weights")
            if ramp == "constant":
                if st.get("end_weights"):
                    raise ValueError(f"{key}.end_weights: only for ramp linear or stepped")
                w1 = w0
            else:
                if until is None:
                    raise ValueError(f"{key}.until_step: a {ramp} ramp needs an end step")
                if not st.get("end_weights"):
                    raise ValueError(f"{key}.end_weights: a {ramp} ramp needs the weights reached at until_step")
                w1 = _vector(st["end_weights"], names, f"{key}.end_weights")
            levels = int(st.get("ramp_levels", 4))
            if levels < 2:
                raise ValueError(f"{key}.ramp_levels: must be >= 2, got {levels}")
            out.append(Stage(start, until, w0, w1, ramp, levels))
            start = until if until is not None else start
        return cls(names, out)

    def weights(self, step: int) -> np.ndarray:
        """Normalized weights [S] in force at optimizer step ``step`` (0-based: the step being computed)."""
        if self._cache is not None and self._cache[0] == step:
            return self._cache[1]
        for st in self.stages:
            if st.until is None or step < st.until:
                w = st.at(step)
                break
        else:  # past the last bounded stage: its final weights persist
            w = self.stages[-1].w1
        self._cache = (step, w)
        return w

    def as_dict(self, step: int) -> dict[str, float]:
        return dict(zip(self.names, self.weights(step).tolist()))


class SourceChooser:
    """u_k for sample k of one (rank, stream): stateless in k, cached one BLOCK at a time."""

    def __init__(self, seed: int, rank: int, stream: int):
        self.key = (seed, rank, stream)
        self._block, self._u = -1, None

    def uniform(self, k: int) -> float:
        b = k // BLOCK
        if b != self._block:
            self._u = np.random.default_rng([*self.key, b]).random(BLOCK)
            self._block = b
        return float(self._u[k % BLOCK])

    def choose(self, k: int, weights: np.ndarray) -> int:
        if len(weights) == 1:
            return 0
        cdf = np.cumsum(weights)
        return min(int(np.searchsorted(cdf, self.uniform(k), side="right")), len(weights) - 1)
