"""Every compatibility rule for checkpoints written by older versions of this code, in one place.

A checkpoint's ``client_state.json`` (pipeline/checkpoint/io.py writes it) grew keys over time. Reading code asks
for the current form only: ``client_state`` applies each migration below, oldest first, to a copy of what is on
disk, filling a missing key with the value that reproduces what the code of the time did. Each migration is named,
says when its key appeared and what the old behaviour was, and has its own test (tests/pipeline/test_migrate.py).

Format history (``client_state.json["format"]``):
    absent  written before the COMPLETE marker: a checkpoint of this kind counts as complete when its client state
            parses (``complete_without_marker``)
    2       COMPLETE is written after every rank's shards and the client state (pipeline/checkpoint/layout.py);
            later format-2 checkpoints hold SHA256SUMS too, earlier ones do not, and the two cannot be told apart:
            a format-2 checkpoint without SHA256SUMS is read as one from before digests (``has_digests``)
    3       SHA256SUMS is written with every checkpoint, before COMPLETE: a format-3 checkpoint whose digest file is
            missing or unreadable is damaged (campaign 3 case 1: SHA256SUMS deleted, a weight rotted, and the run
            resumed on the rotted weight as if the checkpoint predated digests)

Keys added within format 2 (no version bump: each default is the old behaviour exactly):
    zero_stage                      0, as resume always read it: such a checkpoint continues only on its own
                                    layout under stage 0 (before this module, train.init_from_optimizer assumed the
                                    new run's stage instead; an unknown stage is now refused there too)
    config.train.expert_parallel_size   1 (every rank held every expert)
    config.data.loader_streams      None (the default layout, ranks x max(1, workers) streams)
    config.data.mix_shards          1 (one shard read at a time)
    config.data.length_window       0 (microbatches in draw order)
    loader                          None: only ``batches_consumed`` counts the position (same world size only)
    schedule                        the lr horizon the checkpoint's own config gave: optim.schedule_steps, else
                                    train.max_steps, in steps
    cumulative, best, val_best, init_from   {} / None (no totals, no best so far, no recorded parent)
    data_fingerprint                None: the manifests trained on were not recorded, so a resume cannot check them

The loader's per-stream state inside ``loader`` has its own version (pipeline/data/loader.py, STATE_VERSION) and
is migrated by the loader, which alone knows its fields.
"""
from __future__ import annotations

import copy
from typing import Callable

CURRENT_FORMAT = 3  # what io.py writes
DIGESTS_FORMAT = 3  # the first format whose every checkpoint holds SHA256SUMS


def complete_without_marker(client: dict) -> bool:
    """A checkpoint from before the COMPLETE marker (no ``format`` key) is complete when its client state parses."""
    return "format" not in client


def has_digests(client: dict) -> bool:
    """Whether the checkpoint's own client state says it was written with SHA256SUMS (format 3 on): then a missing
    or unreadable digest file is damage, never a sign of age."""
    fmt = client.get("format")
    return isinstance(fmt, int) and not isinstance(fmt, bool) and fmt >= DIGESTS_FORMAT


def _zero_stage(c: dict):
    c.setdefault("zero_stage", 0)


def _expert_parallel_size(c: dict):
    c.setdefault("config", {}).setdefault("train", {}).setdefault("expert_parallel_size", 1)


def _loader_streams(c: dict):
    c.setdefault("config", {}).setdefault("data", {}).setdefault("loader_streams", None)


def _mix_shards(c: dict):
    c.setdefault("config", {}).setdefault("data", {}).setdefault("mix_shards", 1)


def _length_window(c: dict):
    c.setdefault("config", {}).setdefault("data", {}).setdefault("length_window", 0)


def _loader(c: dict):
    c.setdefault("loader", None)


def _schedule(c: dict):
    if not c.get("schedule"):
        cfg = c.get("config", {})
        own = {**cfg.get("optim", {}), **cfg.get("train", {})}
        c["schedule"] = {"unit": "steps", "total": own.get("schedule_steps") or own.get("max_steps")}


def _run_totals(c: dict):
    c.setdefault("cumulative", {})
    for key in ("best", "val_best", "init_from"):
        c.setdefault(key, None)


def _data_fingerprint(c: dict):
    c.setdefault("data_fingerprint", None)


# (name, migration), applied in this order; a migration fills what is missing and leaves present keys alone.
MIGRATIONS: list[tuple[str, Callable[[dict], None]]] = [
    ("zero_stage", _zero_stage),
    ("expert_parallel_size", _expert_parallel_size),
    ("loader_streams", _loader_streams),
    ("mix_shards", _mix_shards),
    ("length_window", _length_window),
    ("loader", _loader),
    ("schedule", _schedule),
    ("run_totals", _run_totals),
    ("data_fingerprint", _data_fingerprint),
]


def client_state(raw: dict) -> dict:
    """``raw`` (a parsed client_state.json of any age) in the current form; ``raw`` itself is not changed."""
    c = copy.deepcopy(raw)
    for _, migration in MIGRATIONS:
        migration(c)
    return c
