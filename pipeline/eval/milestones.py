"""The BabyLM challenge's word milestones of a run: which checkpoint is each milestone's, its branch name
(``chck_1M``, ...) and the words it had seen; read by tools/convert_checkpoint.py --milestones (one export per
milestone, EXPORT/chck_NAME/) and launchers/evaluate.py --milestones (every milestone scored, against words seen).

A training saves a milestone checkpoint at the step whose words total first reaches each ``checkpoint.at_words``
value (pipeline/train/callbacks.py SaveCadence; kept out of the rotation), and every checkpoint records the run's
exact words total (client_state.json ``cumulative.words``). So milestone W's checkpoint is the earliest one whose
total reaches W, and it must be marked a milestone; metrics.jsonl, when the run directory has it, also shows that
the step before it had seen fewer than W words. A milestone whose checkpoint is missing (the run stopped before
it, or its save was refused during a non-finite streak) is reported, never replaced by another checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

PREFIX = "chck_"


@dataclass(frozen=True)
class Milestone:
    name: str  # the branch name, chck_1M
    target: int  # the milestone, in words
    words: int  # words the checkpoint had seen (>= target; the step that reached it)
    step: int
    path: Path  # the checkpoint tag dir, or the milestone's export


def milestone_name(words: int) -> str:
    """chck_{N}M for whole millions (the challenge's names: chck_1M ... chck_1000M), chck_{N}K for whole thousands
    (a scaled-down demo's), else chck_{words}."""
    if words % 1_000_000 == 0:
        return f"{PREFIX}{words // 1_000_000}M"
    if words % 1_000 == 0:
        return f"{PREFIX}{words // 1_000}K"
    return f"{PREFIX}{words}"


def _steps_words(run_dir: Path) -> dict[int, float]:
    """{step: words total} from metrics.jsonl (empty when the run directory has none)."""
    out = {}
    f = run_dir / "metrics.jsonl"
    if f.is_file():
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and "step" in rec and "total/words" in rec:
                out[int(rec["step"])] = float(rec["total/words"])
    return out


def run_milestones(run_dir: Path) -> tuple[list[Milestone], list[str]]:
    """(milestones found, in order; one line per milestone of the schedule that has no checkpoint) of a run
    directory (or its checkpoints/ folder), from the schedule of its latest checkpoint's config."""
    from pipeline.checkpoint.layout import checkpoint_tags, read_client, tag_step
    from pipeline.config import ConfigError, build_config, load_yaml, word_milestones

    run_dir = Path(run_dir)
    ckpts = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    if ckpts.name == "checkpoints" and run_dir == ckpts:
        run_dir = ckpts.parent
    tags = sorted(checkpoint_tags(ckpts), key=tag_step)
    if not tags:
        raise ConfigError(f"{ckpts}: no checkpoints (--milestones reads a run directory's milestone checkpoints)")
    cfg = build_config(load_yaml(ckpts / tags[-1] / "config.yaml"))
    schedule = word_milestones(cfg)
    if not schedule:
        raise ConfigError(f"{ckpts / tags[-1] / 'config.yaml'}: checkpoint.at_words is empty: the run has no word "
                          "milestones (set checkpoint.at_words: babylm)")
    seen = []
    for t in tags:
        client = read_client(ckpts / t) or {}
        seen.append((tag_step(t), float((client.get("cumulative") or {}).get("words", 0.0)),
                     bool(client.get("milestone")), ckpts / t))
    steps_words = _steps_words(run_dir)
    found, missing = [], []
    reached = max((w for _, w, _, _ in seen), default=0.0)
    for target in schedule:
        if target > reached:
            missing.append(f"{milestone_name(target)}: not reached (the last checkpoint has {reached:,.0f} words)")
            continue
        step, words, flagged, path = next(s for s in seen if s[1] >= target)
        before = steps_words.get(step - 1)
        if not flagged or (before is not None and before >= target):
            missing.append(f"{milestone_name(target)}: no checkpoint at the step that reached {target:,} words (the "
                           f"first after it is {path.name}, {words:,.0f} words)")
            continue
        found.append(Milestone(milestone_name(target), target, int(words), step, path))
    return found, missing


def export_milestones(export: Path) -> list[Milestone]:
    """The chck_* exports inside ``export`` (tools/convert_checkpoint.py --milestones), by words."""
    out = []
    for d in Path(export).glob(f"{PREFIX}*"):
        meta = d / "export.json"
        if d.is_dir() and meta.is_file():
            m = json.loads(meta.read_text()).get("milestone")
            if isinstance(m, dict):
                out.append(Milestone(d.name, int(m["target"]), int(m["words"]), int(m["step"]), d))
    return sorted(out, key=lambda m: m.target)


def find_milestones(path: Path) -> tuple[list[Milestone], list[str]]:
    """An export's chck_* folders, else a run directory's milestone checkpoints."""
    path = Path(path)
    if (path / "export.json").is_file():
        found = export_milestones(path)
        if not found:
            from pipeline.config import ConfigError

            raise ConfigError(f"{path}: no {PREFIX}* milestone exports in it (tools/convert_checkpoint.py "
                              "--milestones writes them)")
        return found, []
    return run_milestones(path)
