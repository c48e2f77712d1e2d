"""train.profile: {start, steps} records those optimizer steps with torch.profiler on rank 0 of a real 2-process
launch: a Chrome trace (Perfetto) under RUN_DIR/profile holding the step's operators, the top operators printed
into train.log, and the run's numbers unchanged (the same losses as the unprofiled run)."""
import json

import pytest

from conftest import TINY, read_jsonl, run_torchrun
from pipeline.config import ConfigError, load_config


@pytest.mark.slow
def test_profiled_steps_write_a_trace_and_the_top_operators(sample_shards, tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("profiled", ["train.profile={start: 2, steps: 2}"])):
        r = run_torchrun(2, "ds_configs/zero2.json", TINY + [f"data.train_shards={sample_shards}",
                                                             f"run_dir={tmp_path / name}", "train.max_steps=4",
                                                             *extra], timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        runs[name] = tmp_path / name
    assert [m["loss"] for m in read_jsonl(runs["profiled"] / "metrics.jsonl")] == \
        [m["loss"] for m in read_jsonl(runs["plain"] / "metrics.jsonl")]
    (trace,) = (runs["profiled"] / "profile").iterdir()  # rank 0 only, one window
    assert trace.name == "trace_steps_2-3.json"
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    # the core's attention and its gated (SiLU) MLP, forward and backward
    assert {"aten::scaled_dot_product_attention", "aten::linear", "aten::silu", "aten::silu_backward"} <= names
    assert any("scaled_dot_product" in n and n.endswith("_backward") for n in names)
    log = (runs["profiled"] / "train.log").read_text()
    assert f"[rank 0] profile of steps 2-3: {trace} (open in ui.perfetto.dev); top operators by self cpu time" in log
    assert "Self CPU" in log and not (runs["plain"] / "profile").exists()


def test_profile_keys_are_checked():
    assert load_config(None, ["train.profile={start: 3, steps: 1}"]).train.profile.start == 3
    with pytest.raises(ConfigError, match="train.profile.steps: must be >= 1, got 0"):
        load_config(None, ["train.profile={start: 3, steps: 0}"])
    with pytest.raises(ConfigError, match="train.profile.stop"):
        load_config(None, ["train.profile={start: 3, stop: 4}"])
