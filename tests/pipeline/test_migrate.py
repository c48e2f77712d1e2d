"""Checkpoints of older code (pipeline/checkpoint/migrate.py): one test per migration, each reading a client state
written before its key existed and showing that the reading code behaves as the code of the time did."""
import json

import pytest

from pipeline.checkpoint import migrate
from pipeline.checkpoint.io import TrainState
from pipeline.checkpoint.layout import COMPLETE, is_complete, load_client
from pipeline.checkpoint.resume import check_reshard, check_resume_config, expert_parallel_size
from pipeline.config import ConfigError, load_config


def current(cfg, **extra) -> dict:
    """A client state as today's code writes it (pipeline/checkpoint/io.py Checkpointer.save)."""
    return {"format": migrate.CURRENT_FORMAT, "step": 4, "batches_consumed": 8, "cumulative": {"samples": 32.0},
            "schedule": {"unit": "steps", "total": 100}, "best": [1.5, 3], "val_best": None, "init_from": None,
            "world_size": 2, "zero_stage": 2, "loader": [{"batches_consumed": 4}] * 2, "mlflow_run_id": None,
            "mlflow_tracking_uri": None, "milestone": False, "config": cfg.to_dict(),
            "data_fingerprint": {"data.train_shards": {"sha256": "ab" * 32, "shards": 4, "samples": 1200}}, **extra}


def without(client: dict, dotted: str) -> dict:
    out = json.loads(json.dumps(client))
    *parents, key = dotted.split(".")
    d = out
    for p in parents:
        d = d[p]
    del d[key]
    return out


@pytest.fixture
def cfg():
    return load_config(None, [])


def test_every_migration_has_its_test():
    names = [name for name, _ in migrate.MIGRATIONS]
    assert len(set(names)) == len(names)
    missing = [n for n in names if f"test_{n}" not in globals()]
    assert not missing, f"migrations without a test: {missing}"


def test_a_current_client_state_is_left_as_it_is_and_migrating_twice_changes_nothing(cfg):
    client = current(cfg)
    assert migrate.client_state(client) == client
    old = without(without(client, "schedule"), "config.data.mix_shards")
    once = migrate.client_state(old)
    assert migrate.client_state(once) == once
    assert "schedule" not in old  # the raw dict is not changed


def test_complete_without_marker(tmp_path, cfg):
    """Before the COMPLETE marker (no "format"), a parsable client state is a complete checkpoint; after, it is not
    without its marker."""
    old, new = tmp_path / "step00000004", tmp_path / "step00000008"
    for d, client in ((old, without(current(cfg), "format")), (new, current(cfg))):
        d.mkdir()
        (d / "client_state.json").write_text(json.dumps(client))
    assert is_complete(old) and not is_complete(new)
    (new / COMPLETE).write_text("")
    assert is_complete(new)


def test_zero_stage(tmp_path, cfg):
    """No zero_stage: stage 0, as resume read it: it continues on its own layout under stage 0 only."""
    (tmp_path / "client_state.json").write_text(json.dumps(without(current(cfg), "zero_stage")))
    client = load_client(tmp_path)
    assert client["zero_stage"] == 0
    assert check_reshard(client, tmp_path, 2, 0, 1) is None
    with pytest.raises(ConfigError, match="ZeRO stage 0 with EP 1, this run has 2 under stage 2"):
        check_reshard(client, tmp_path, 2, 2, 1)


def test_expert_parallel_size(cfg):
    client = migrate.client_state(without(current(cfg), "config.train.expert_parallel_size"))
    assert expert_parallel_size(client["config"]) == 1
    assert check_reshard(client, None, 2, 2, 1) is None  # EP 1 on both sides: its own layout


def _data_key(cfg, key, old_value, changed):
    """A data key added later: the old checkpoint reads with the old behaviour's value, so a resume that keeps it
    passes and one with another value is refused naming the key."""
    client = migrate.client_state(without(current(cfg), f"config.data.{key}"))
    assert client["config"]["data"][key] == old_value
    same = load_config(None, [f"data.{key}={'null' if old_value is None else old_value}"])
    check_resume_config(client["config"], same, "ckpt", 2, 2, False)
    other = load_config(None, [f"data.{key}={changed}"])
    with pytest.raises(ConfigError, match=rf"\(data\.{key}: {old_value} -> {changed}\)"):
        check_resume_config(client["config"], other, "ckpt", 2, 2, False)


def test_loader_streams(cfg):
    _data_key(cfg, "loader_streams", None, 4)


def test_mix_shards(cfg):
    _data_key(cfg, "mix_shards", 1, 2)


def test_length_window(cfg):
    _data_key(cfg, "length_window", 0, 64)


def test_loader(cfg):
    """No per-stream loader states: the position is the count alone, which continues on its own layout only."""
    client = migrate.client_state(without(current(cfg), "loader"))
    assert client["loader"] is None
    assert check_reshard(client, "ckpt", 2, 2, 1) is None
    with pytest.raises(ConfigError, match="holds no per-stream loader position"):
        check_reshard(client, "ckpt", 4, 2, 1)


@pytest.mark.parametrize("schedule_steps, want", [(None, 1000), (300, 300)])
def test_schedule(cfg, schedule_steps, want):
    """No stored horizon: the one the checkpoint's own config gave (optim.schedule_steps, else train.max_steps)."""
    old = without(current(cfg), "schedule")
    old["config"]["train"]["max_steps"], old["config"]["optim"]["schedule_steps"] = 1000, schedule_steps
    assert migrate.client_state(old)["schedule"] == {"unit": "steps", "total": want}


def test_run_totals(cfg):
    """No totals, best, val_best or init_from: an empty history, restored as such."""
    old = current(cfg)
    for key in ("cumulative", "best", "val_best", "init_from"):
        old = without(old, key)
    state = TrainState()
    state.restore(migrate.client_state(old))
    assert (state.step, state.batches_consumed, state.cumulative, state.best, state.val_best, state.init_from) == (
        4, 8, {}, None, None, None)
    state.restore(current(cfg))
    assert state.best == (1.5, 3) and state.cumulative == {"samples": 32.0}


def test_data_fingerprint(cfg):
    """No data_fingerprint: the manifests trained on are unknown, so a resume does not check them (None); a current
    record is kept as written."""
    assert migrate.client_state(without(current(cfg), "data_fingerprint"))["data_fingerprint"] is None
    assert migrate.client_state(current(cfg))["data_fingerprint"]["data.train_shards"]["shards"] == 4
