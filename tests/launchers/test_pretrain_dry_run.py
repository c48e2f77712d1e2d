"""launchers/pretrain.py --dry-run: the plan of a training (world, batch arithmetic, resume point, ds_config, shards
per rank) from the training's own checks, with nothing started and nothing written."""
import json
import re

from conftest import REPO, TINY
from prewarmed import run_python

from pipeline.config import dump_yaml, load_config
from pipeline.checkpoint.layout import CHECKPOINT_FORMAT, mark_complete
from pipeline.data.streams import resolve_shards

PRETRAIN = str(REPO / "launchers" / "pretrain.py")
DEMO = str(REPO / "launchers" / "configs" / "eco_rna_demo.yaml")  # what pretrain.py runs without --config
# every rank's line: "rank R (node N): stream G [a b], stream G' [c]: S samples"
RANK_LINE = re.compile(r"^  rank (\d+) \(node (\d+)\): (.*): (\d+) samples$")
STREAM = re.compile(r"stream (\d+) \[([^\]]*)\]")


def overrides(shards, run_dir) -> list:
    return [f"data.train_shards={shards}", f"run_dir={run_dir}", *TINY]


def dry_run(shards, run_dir, args=(), extra=()):
    cmd = [PRETRAIN, "--dry-run", "--ds_config", str(REPO / "ds_configs/zero2.json")]
    for o in [*overrides(shards, run_dir), *extra]:
        cmd += ["--set", o]
    return run_python([*cmd, *args], REPO, timeout=120)  # a dry run starts nothing: forked (tests/prewarmed.py)


def ranks(out: str) -> dict[int, tuple[int, dict[int, list[str]], int]]:
    """rank -> (node, {stream: [shard]}, samples), from the dry run's per-rank lines."""
    found = {}
    for line in out.splitlines():
        m = RANK_LINE.match(line)
        if m:
            streams = {int(g): names.split() for g, names in STREAM.findall(m[3])}
            found[int(m[1])] = (int(m[2]), streams, int(m[4]))
    return found


def test_plan_for_one_rank(sample_shards, tmp_path):
    proc = dry_run(sample_shards, tmp_path / "run", ["--world-size", "1"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "world: 1 ranks = 1 node x 1 ranks per node (--world-size)" in out
    assert "batch: micro_batch_size 4 x grad_accum_steps 2 x 1 ranks = global batch 8 sequences per optimizer step" in out
    assert "supervised tokens per step: data-dependent" in out
    assert f"resume: none; a fresh start (no checkpoint in {tmp_path / 'run' / 'checkpoints'})" in out
    ds = json.loads(out[out.index("\n{\n") + 1:out.index("\n}\n") + 2])  # the resolved ds_config, as JSON
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (8, 4, 2)
    plan = ranks(out)
    assert list(plan) == [0] and sorted(n for names in plan[0][1].values() for n in names) == [
        f"{i:06d}" for i in range(8)]
    assert plan[0][2] == sum(s.samples for s in resolve_shards(str(sample_shards)))
    assert not (tmp_path / "run").exists()


def test_plan_for_two_nodes_covers_every_shard_once(sample_shards, tmp_path):
    proc = dry_run(sample_shards, tmp_path / "run", ["--world-size", "4", "--nproc-per-node", "2"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "world: 4 ranks = 2 nodes x 2 ranks per node (--world-size, --nproc-per-node)" in out
    assert "x grad_accum_steps 2 x 4 ranks = global batch 32 sequences per optimizer step" in out
    assert '"train_batch_size": 32' in out
    assert "data: 4 loader streams (default: 4 ranks x max(1, data.num_workers 0)): rank r reads stream r" in out
    plan = ranks(out)
    assert sorted(plan) == [0, 1, 2, 3]
    assert [plan[r][0] for r in range(4)] == [0, 0, 1, 1]  # nodes
    assert [list(plan[r][1]) for r in range(4)] == [[0], [1], [2], [3]]  # rank r reads stream r
    names = [n for r in range(4) for shards in plan[r][1].values() for n in shards]
    assert sorted(names) == [f"{i:06d}" for i in range(8)]  # every shard exactly once
    assert "shard names rnacentral-*.tar" in out
    counts = {s.name: s.samples for s in resolve_shards(str(sample_shards))}
    per_rank = [sum(counts[f"rnacentral-{n}.tar"] for n in plan[r][1][r]) for r in range(4)]
    assert [plan[r][2] for r in range(4)] == per_rank
    lo, hi = min(per_rank), max(per_rank)
    assert f"samples per rank in epoch 0: min {lo} (rank {per_rank.index(lo)}), max {hi}" in out
    assert not (tmp_path / "run").exists()


def test_streams_per_rank_from_loader_streams(sample_shards, tmp_path):
    proc = dry_run(sample_shards, tmp_path / "run", ["--world-size", "2"], ["data.loader_streams=4"])
    assert proc.returncode == 0, proc.stderr
    plan = ranks(proc.stdout)
    assert [list(plan[r][1]) for r in range(2)] == [[0, 1], [2, 3]]  # contiguous blocks of streams
    names = [n for r in range(2) for shards in plan[r][1].values() for n in shards]
    assert sorted(names) == [f"{i:06d}" for i in range(8)]


def test_batch_arithmetic_mismatch_exits_2(sample_shards, tmp_path):
    proc = dry_run(sample_shards, tmp_path / "run", ["--world-size", "4", "--nproc-per-node", "2"],
                   ["train.global_batch_size=16"])
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert lines == ["error: train.global_batch_size: 16 != micro_batch_size 4 x grad_accum_steps 2 x world size 4 "
                     "= 32"], proc.stderr
    assert proc.stdout == "" and not (tmp_path / "run").exists()


def test_streams_not_dividing_and_nodes_not_dividing_exit_2(sample_shards, tmp_path):
    proc = dry_run(sample_shards, tmp_path / "run", ["--world-size", "4"], ["data.loader_streams=6"])
    assert proc.returncode == 2 and proc.stderr.startswith("error: data.loader_streams: "), proc.stderr
    proc = dry_run(sample_shards, tmp_path / "run", ["--world-size", "16"])  # 8 shards < 16 streams
    assert proc.returncode == 2 and proc.stderr.startswith("error: data.train_shards: "), proc.stderr
    assert "has 8 shards, fewer than the 16 loader streams" in proc.stderr
    proc = dry_run(sample_shards, tmp_path / "run", ["--world-size", "6", "--nproc-per-node", "4"])
    assert proc.returncode == 2 and "world size 6 does not split into nodes of 4 ranks" in proc.stderr
    assert not (tmp_path / "run").exists()


def fake_checkpoint(run_dir, cfg, step: int, world_size: int = 1):
    """The files resume reads before DeepSpeed starts: client_state.json, config.yaml, SHA256SUMS, COMPLETE and
    latest."""
    tag = f"step{step:08d}"
    tag_dir = run_dir / "checkpoints" / tag
    tag_dir.mkdir(parents=True)
    client = {"format": CHECKPOINT_FORMAT, "step": step, "world_size": world_size, "zero_stage": 2, "config": cfg.to_dict()}
    (tag_dir / "client_state.json").write_text(json.dumps(client))
    (tag_dir / "config.yaml").write_text(dump_yaml(cfg))
    mark_complete(tag_dir)  # the digests, then COMPLETE: a checkpoint of the current format has both
    (run_dir / "checkpoints" / "latest").write_text(tag)
    return tag_dir


def test_names_the_checkpoint_it_would_resume_from(sample_shards, tmp_path):
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, load_config(DEMO, overrides(sample_shards, run_dir)), 5)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    proc = dry_run(sample_shards, run_dir, ["--world-size", "1"])
    assert proc.returncode == 0, proc.stderr
    assert (f"resume: from {run_dir / 'checkpoints' / 'step00000005'} (step 5, written by 1 ranks under ZeRO stage "
            "2), on its own layout") in proc.stdout
    # on 2 ranks the global batch must stay (tests/launchers/test_slurm.py plans a real 2 -> 1 rank continuation)
    proc = dry_run(sample_shards, run_dir, ["--world-size", "2"])
    assert proc.returncode == 2 and "set train.grad_accum_steps=1" in proc.stderr, proc.stderr
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before  # nothing written


def test_resume_config_mismatch_exits_2(sample_shards, tmp_path):
    run_dir = tmp_path / "run"
    fake_checkpoint(run_dir, load_config(DEMO, overrides(sample_shards, run_dir)), 5)
    proc = dry_run(sample_shards, run_dir, ["--world-size", "1"], ["seed=7"])
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the config differs from the one checkpoint "), lines
    assert "(seed: 1234 -> 7)" in lines[0], lines


def test_a_batch_for_more_ranks_asks_for_world_size(sample_shards, tmp_path):
    """A global batch that needs 2 ranks, dry-run without a launcher (1 rank): the line says which --world-size to
    pass; with it the plan goes through."""
    batch = ["train.micro_batch_size=4", "train.grad_accum_steps=1", "train.global_batch_size=8"]
    proc = dry_run(sample_shards, tmp_path / "run", extra=batch)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "this dry run planned 1 rank (no launcher: one rank): pass --world-size 2 to plan the world size this batch "
        "needs"), proc.stderr
    assert dry_run(sample_shards, tmp_path / "run", ["--world-size", "2"], batch).returncode == 0


def test_world_size_flags_need_dry_run(sample_shards, tmp_path):
    proc = run_python([PRETRAIN, "--ds_config", str(REPO / "ds_configs/zero2.json"), "--world-size", "4"], REPO,
                      timeout=60)
    assert proc.returncode == 2 and "they go with --dry-run" in proc.stderr, proc.stderr
