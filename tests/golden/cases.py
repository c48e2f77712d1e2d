"""The golden cases: each family's tiny config, trained 5 steps on 2 processes through the real launcher on shards
committed beside this file (tests/golden/data), so that a redesign of the trainer, the loader or the models can be
checked against the numbers today's code produced (test_golden.py; regenerate with make_golden.py only on purpose).

Paths are relative to the repository root (launches run there): the checkpoints written here resume on any clone."""
from __future__ import annotations

import tarfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
REL = HERE.relative_to(REPO)  # tests/golden
STEPS, SAVED = 5, 3  # steps of a run; the step whose checkpoint is committed
COMMON = ["train.log_every=1", "tracking.enabled=false", f"checkpoint.every_steps={SAVED}", "checkpoint.keep_last=0",
          "seed=11"]

# name -> (config, ds_config, overrides); shards relative to the repository root
CASES = {
    "eco_rna_zero2": ("launchers/configs/eco_rna_demo.yaml", "ds_configs/zero2.json", [
        f"data.train_shards={REL}/data/rna", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
        "model.d_ff=64", "data.context_length=64", "train.micro_batch_size=4", "optim.warmup_steps=2"]),
    "protlingo_zero2": ("launchers/configs/protlingo_demo.yaml", "ds_configs/zero2.json", [
        f"data.train_shards={REL}/data/protein", "train.init_from=null", "model.d_model=32", "model.n_layers=2", "model.n_heads=4",
        "model.d_ff=64", "model.moe_shared_hidden=32", "model.moe_layers=[0,1]", "model.num_experts=4", "model.memory_layers=[1]",
        "data.context_length=64", "train.micro_batch_size=4", "train.grad_accum_steps=2", "optim.warmup_steps=2"]),
    "recursive_gpt_zero2": ("launchers/configs/recursive_gpt_demo.yaml", "ds_configs/zero2.json", [
        f"data.train_shards={REL}/data/text", "model.vocab_size=512", "model.d_model=32", "model.embed_dim=16",
        "model.recurrence=2", "data.context_length=64", "train.micro_batch_size=4", "optim.warmup_steps=2"]),
    "standard_zero2": ("launchers/configs/standard_h384.yaml", "ds_configs/zero2.json", [
        f"data.train_shards={REL}/data/text", "model.vocab_size=512", "model.d_model=32", "model.n_layers=2",
        "model.n_heads=2", "data.context_length=64", "train.micro_batch_size=4", "train.grad_accum_steps=1",
        "train.global_batch_size=null",
        "optim.warmup_steps=2"]),
}
# Variants trained but not checkpointed: Eco-RNA under ZeRO-3, ProtLingo with expert parallelism.
CASES["eco_rna_zero3"] = (CASES["eco_rna_zero2"][0], "ds_configs/zero3.json", CASES["eco_rna_zero2"][2])
CASES["protlingo_ep2"] = (CASES["protlingo_zero2"][0], "ds_configs/zero2.json",
                          CASES["protlingo_zero2"][2] + ["train.expert_parallel_size=2"])
CHECKPOINTED = ("eco_rna_zero2", "protlingo_zero2", "recursive_gpt_zero2", "standard_zero2")


def overrides(name: str, run_dir: str, steps: int = STEPS) -> list:
    return [*CASES[name][2], *COMMON, f"run_dir={run_dir}", f"train.max_steps={steps}"]


ARCHIVE = HERE / "checkpoints.tar"  # the CHECKPOINTED cases' step-3 checkpoints, one folder each (make_golden.py)


def unpack_checkpoint(name: str, checkpoints_dir: Path) -> Path:
    """Extract case ``name``'s committed checkpoint (``latest`` + its tag dir) into ``checkpoints_dir`` (a run dir's
    checkpoints/, created) and return it. Kept as one archive: a checkpoint tree in the repository would look like a
    run's output; tarfile's "data" filter refuses members that would leave the folder."""
    checkpoints_dir = Path(checkpoints_dir)
    checkpoints_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(ARCHIVE) as tar:
        members = [m for m in tar.getmembers() if m.name == name or m.name.startswith(f"{name}/")]
        if not members:
            raise KeyError(f"{ARCHIVE}: no checkpoint of {name}")
        tar.extractall(checkpoints_dir.parent / ".golden-unpack", members=members, filter="data")
    src = checkpoints_dir.parent / ".golden-unpack" / name
    for item in src.iterdir():
        item.rename(checkpoints_dir / item.name)
    src.rmdir()
    (checkpoints_dir.parent / ".golden-unpack").rmdir()
    return checkpoints_dir
