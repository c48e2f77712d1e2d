"""A crafted DeepSpeed checkpoint, whose unpickling would run code (it creates a marker file), is refused by every
reader of checkpoints, before anything is unpickled, with one line naming the file and the global it would call:
resume and --init-from (RunPlan, the launcher's dry run), weights for evaluation, export, the depth study and the
routing report (load_trained_model). The run's own checkpoints need no flag (tests/launchers/test_evaluate.py converts and evaluates
one without it). With --trust-checkpoint the same file does run its payload: the payload is live, so its absence
below is the rule's doing (tests/tools/test_convert_checkpoint.py)."""
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, TINY, launch_env

sys.path.insert(0, str(REPO / "tests" / "tools"))
from checkpoint_factory import write_deepspeed_like  # noqa: E402
from pipeline.checkpoint import load_trained_model  # noqa: E402
from pipeline.config import ConfigError, load_config  # noqa: E402
from pipeline.train import RunPlan  # noqa: E402

ZERO2 = str(REPO / "ds_configs" / "zero2.json")
REFUSED = r"mp_rank_00_model_states.pt: loading it would call builtins.exec, .* pass --trust-checkpoint"


@pytest.fixture
def crafted(sample_shards, tmp_path):
    """(the run's overrides, the crafted run dir, the marker its payload would create)."""
    marker = tmp_path / "PWNED"
    sets = [f"data.train_shards={sample_shards}", "train.max_steps=4", *TINY]
    write_deepspeed_like(tmp_path / "src", load_config(None, sets), marker)
    return sets, tmp_path / "src", marker


def test_resume_refuses_it(crafted, tmp_path):
    sets, src, marker = crafted
    with pytest.raises(ConfigError, match=REFUSED):
        RunPlan(load_config(None, [*sets, f"run_dir={src}"]), ZERO2)
    assert not marker.exists()


def test_init_from_refuses_it_for_weights_and_for_optimizer_moments(crafted, tmp_path):
    sets, src, marker = crafted
    for more in ([], ["train.init_from_optimizer=true"]):
        cfg = load_config(None, [*sets, f"run_dir={tmp_path / 'new'}", f"train.init_from={src}", *more])
        with pytest.raises(ConfigError, match=REFUSED):
            RunPlan(cfg, ZERO2)
    assert not marker.exists()


def test_the_launcher_refuses_it_in_one_line(crafted, tmp_path):
    from pipeline.config import dump_yaml

    sets, src, marker = crafted
    crafted_yaml = tmp_path / "config.yaml"  # the launcher's default is the demo; the crafted run's is the defaults
    crafted_yaml.write_text(dump_yaml(load_config(None, sets)))
    for how in (["--set", f"run_dir={src}"], ["--set", f"run_dir={tmp_path / 'new'}", "--init-from", str(src)]):
        argv = [sys.executable, str(REPO / "launchers" / "pretrain.py"), "--ds_config", ZERO2, "--dry-run",
                "--config", str(crafted_yaml),
                *[a for s in sets for a in ("--set", s)], *how]
        r = subprocess.run(argv, cwd=REPO, env=launch_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "would call builtins.exec" in r.stderr and not marker.exists()


def test_loading_its_weights_refuses_it(crafted):
    """load_trained_model: evaluation, export, the depth study, the routing report (each also checks first, through
    pipeline.eval.cli.require_trust, for its one-line error)."""
    _, src, marker = crafted
    with pytest.raises(ConfigError, match=REFUSED):
        load_trained_model(src)
    assert not marker.exists()


def test_the_loads_themselves_are_weights_only(crafted, monkeypatch):
    """The second wall: with the up-front scan (check_pickles) switched off, the loads DeepSpeed itself makes
    (TorchCheckpointEngine.load, which engine.load_checkpoint calls on resume and --init-from; zero_to_fp32 under
    load_state_dict) still refuse the file, because weights_only_loads makes them weights_only=True. Trusted, the
    payload runs: it is live, so its absence above is the rule's doing."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    import pipeline.checkpoint.read as read
    from pipeline.checkpoint.read import weights_only_loads

    _, src, marker = crafted
    tag = src / "checkpoints" / "step00000003"
    monkeypatch.setattr(read, "check_pickles", lambda tag_dir: None)
    refused = r"mp_rank_00_model_states.pt: loading it would call (builtins\.)?exec, .* --trust-checkpoint"
    with pytest.raises(ConfigError, match=refused):
        with weights_only_loads():
            TorchCheckpointEngine().load(str(tag / "mp_rank_00_model_states.pt"), map_location="cpu")
    # zero_to_fp32 wants optimizer shards beside the model states: give it one (a copy of the crafted file)
    shutil.copy(tag / "mp_rank_00_model_states.pt", tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(ConfigError, match=r"_states.pt: loading it would call (builtins\.)?exec"):
        read.load_state_dict(tag)
    assert not marker.exists()
    with weights_only_loads(trusted=True):
        TorchCheckpointEngine().load(str(tag / "mp_rank_00_model_states.pt"), map_location="cpu")
    assert marker.exists()


def test_the_scans_allowlist_names_the_classes_the_loads_allow():
    from pipeline.checkpoint.read import DEEPSPEED_GLOBALS, deepspeed_globals

    assert sorted(DEEPSPEED_GLOBALS) == sorted(f"{c.__module__}.{c.__qualname__}" for c in deepspeed_globals())
