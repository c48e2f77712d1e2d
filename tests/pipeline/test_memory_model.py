"""The memory model (pipeline/train/memory.py) and train.max_tokens_per_microbatch: auto.

Two references, neither the model's own formula: autograd's saved tensors, counted storage by storage while each
family's real loss runs (every formula's per-token bytes within 3 %), and the resident memory of a real DeepSpeed
step measured in a process of its own (the predicted peak within 10 %, the acceptance of the issue that added it).
Then the resolution of ``auto``: the global batch in tokens kept, the fewest accumulation steps, one line when not
even a sequence fits, a resumed run keeping its checkpoint's microbatch."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.config import ConfigError, load_config
from pipeline.data.loader import make_loader
from pipeline.families import get_family
from pipeline.parallel.kernels import apply_kernels
from pipeline.train.memory import resolve_microbatch, saved_activation_bytes, state_bytes, step_memory
from pipeline.train.plan import RunPlan

REPO = Path(__file__).resolve().parents[2]
GOLDEN = "tests/golden/data"
ZERO2 = str(REPO / "ds_configs" / "zero2.json")

ECO = ["model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=256", "model.n_prelude=2",
       "model.n_core=2", "model.n_coda=1", "objective.depth_law=fixed", "objective.train_depth=4",
       "data.context_length=64", f"data.train_shards={GOLDEN}/rna", "train.micro_batch_size=8"]
PROT = ["train.init_from=null", "model.d_model=64", "model.n_heads=4", "model.d_ff=256", "model.moe_shared_hidden=128",
        "model.memory_latent=32", "data.context_length=48", f"data.train_shards={GOLDEN}/protein",
        "train.micro_batch_size=8", "train.grad_accum_steps=1"]
GPT = ["model.vocab_size=512", "model.d_model=64", "model.embed_dim=32", "model.n_heads=4", "model.mlp_ratio=4.0",
       "model.recurrence=3", "data.context_length=64", f"data.train_shards={GOLDEN}/text", "train.micro_batch_size=8",
       "train.global_batch_size=8"]
CASES = {
    "eco_rna": ("eco_rna_demo.yaml", ECO),
    "eco_rna W2": ("eco_rna_demo.yaml", ECO + ["objective.backward_window=2", "objective.train_depth=3"]),
    "eco_rna plain norms": ("eco_rna_demo.yaml", ECO + ["train.fused_norm=false"]),
    "eco_rna packed": ("eco_rna_demo.yaml", ECO + ["model.unpad=true", "objective.token_buckets=4"]),
    "eco_rna control": ("eco_rna_control_demo.yaml", ECO[:4] + ECO[9:]),
    "protlingo": ("protlingo_demo.yaml", PROT),
    "protlingo dense": ("protlingo_demo.yaml", PROT + ["model.moe_layers=[]", "model.memory_layers=[]"]),
    "recursive_gpt packed": ("recursive_gpt_demo.yaml", GPT),
    "recursive_gpt plain norms": ("recursive_gpt_demo.yaml", GPT + ["train.fused_norm=false"]),
    "standard_gpt": ("standard_h384.yaml", GPT[:2] + ["model.d_model=64", "model.n_layers=2", "model.n_heads=2",
                                                      "train.global_batch_size=null", "train.grad_accum_steps=1"]
                     + GPT[6:9]),
}


def first_batch(name: str, tmp_path):
    config, overrides = CASES[name]
    cfg = load_config(REPO / "launchers" / "configs" / config, overrides + [f"run_dir={tmp_path / 'run'}",
                                                                           "data.num_workers=0"])
    plan = RunPlan(cfg, ZERO2, resume="never", world_size=1)
    return cfg, plan.family, next(make_loader(plan.build_dataset(0), 0))


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_familys_formula_counts_what_autograd_saves(name, tmp_path):
    """The family's Scaling.activations per token against the storages autograd actually saves while its loss runs
    on a real first microbatch (fp32, the config's kernels applied), within 3 %."""
    cfg, family, batch = first_batch(name, tmp_path)
    torch.manual_seed(0)
    model = apply_kernels(family.build_model(cfg.model), cfg, family.blocks)
    plan = family.plan(batch, cfg, step=0, stream=batch.origin[0], index=batch.origin[1])
    saved, _ = saved_activation_bytes(lambda: family.loss(model, batch, cfg, plan), list(model.parameters()))
    measured = saved / batch.input_ids.numel()
    predicted = family.scaling.activations(cfg, 4, None).per_token()
    assert predicted == pytest.approx(measured, rel=0.03), (name, predicted, measured)


def test_saved_bytes_count_a_storage_once():
    """The reference itself: views of one storage count once, parameters not at all."""
    w = torch.nn.Parameter(torch.ones(4, 4))
    x = torch.randn(8, 4, requires_grad=True)
    n, y = saved_activation_bytes(lambda: (x[:4] * x[4:]) @ w, [w])  # mul saves both views of x; mm saves x*x
    assert n == 8 * 4 * 4 + 4 * 4 * 4 and y.shape == (4, 4)


def test_states_follow_the_zero_stage():
    shapes = [("a", 1000), ("layers.0.ffn.deepspeed_moe.experts.deepspeed_experts.0.w", 400),
              ("layers.0.ffn.deepspeed_moe.experts.deepspeed_experts.1.w", 400)]
    z1 = state_bytes(shapes, zero_stage=1, world=4, bf16=True, reduce_bucket=10)
    z2 = state_bytes(shapes, zero_stage=2, world=4, bf16=True, reduce_bucket=10)
    assert z1["weights"] == z2["weights"] == 2 * 1800  # bf16 weights, every parameter on every rank
    assert z1["gradients"] == 2 * 1800 and z2["gradients"] == 2 * 1800 / 4  # ZeRO-2 partitions the gradients
    assert z1["optimizer (fp32 master + AdamW moments)"] == 12 * 1800 / 4  # partitioned from stage 1
    ep = state_bytes(shapes, zero_stage=2, world=4, ep=2, bf16=True, reduce_bucket=10)
    # each rank holds half the experts, partitioned over the 2 ranks holding the same ones
    assert ep["optimizer (fp32 master + AdamW moments)"] == 12 * (1000 / 4 + 400 / 2)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["eco_rna", "protlingo", "recursive_gpt"])
def test_predicted_peak_within_ten_percent_of_a_measured_step(case, tmp_path):
    """A real ZeRO-2 step on the CPU (tests/pipeline/memory_peak_worker.py: the resident high-water mark over the
    process's memory before the model, large blocks returned to the system on free): the memory model's predicted
    peak (states + activations + the backward's transient) within 10 % of it. Microbatches of 4,096 tokens with
    little padding (the formulas count every padded token) and widths where activations dominate."""
    configs = {
        "eco_rna": ("eco_rna_demo.yaml", [f"data.train_shards={GOLDEN}/rna", "model.d_model=256", "model.n_heads=4",
                                          "model.n_kv_heads=2", "model.d_ff=1024", "model.n_prelude=1",
                                          "model.n_core=2", "model.n_coda=1", "objective.depth_law=fixed",
                                          "objective.train_depth=4", "data.context_length=256",
                                          "train.micro_batch_size=16"]),
        "protlingo": ("protlingo_demo.yaml", [f"data.train_shards={GOLDEN}/protein", "train.init_from=null",
                                              "model.d_model=256", "model.n_heads=4", "model.d_ff=1024",
                                              "model.moe_shared_hidden=512", "model.n_layers=6",
                                              "model.moe_layers=[1,2,3,4]", "model.memory_layers=[2]",
                                              "model.memory_latent=64", "data.context_length=64",
                                              "train.micro_batch_size=64", "train.grad_accum_steps=1"]),
        "recursive_gpt": ("recursive_gpt_demo.yaml", [f"data.train_shards={GOLDEN}/text", "model.vocab_size=512",
                                                      "model.d_model=256", "model.embed_dim=64", "model.n_heads=4",
                                                      "model.mlp_ratio=4.0", "model.recurrence=6",
                                                      "data.context_length=128", "train.micro_batch_size=32",
                                                      "train.global_batch_size=32"]),
    }
    config, overrides = configs[case]
    out = tmp_path / "peak.json"
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "2"}
    r = subprocess.run([sys.executable, str(REPO / "tests" / "pipeline" / "memory_peak_worker.py"),
                        str(REPO / "launchers" / "configs" / config), str(out), *overrides, "data.num_workers=0",
                        f"run_dir={tmp_path / 'run'}"], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(out.read_text())
    print(case, {k: round(v / 2 ** 20, 1) if k != "tokens" else v for k, v in got.items()}, "MiB")
    assert got["tokens"] >= 2048
    assert got["predicted"] == pytest.approx(got["measured"], rel=0.10), got


# ---- auto ------------------------------------------------------------------------------------------------------------
def eco_memory():
    cfg = load_config(REPO / "launchers" / "configs" / "eco_rna_80m.yaml", [])
    return cfg, step_memory(cfg, get_family("eco_rna"), zero_stage=2, world=1, bf16=True)


def test_auto_keeps_the_global_batch_with_the_fewest_accumulation_steps():
    cfg, memory = eco_memory()
    per_token = memory.per_token
    # a device that holds 40,000 tokens beside the states: 131,072 tokens in 4 microbatches of 32,768
    m = resolve_microbatch(memory, global_tokens=131072, world=1, context_length=512,
                           capacity=memory.state_total + 40_000 * per_token, where="test")
    assert (m.tokens, m.grad_accum_steps) == (32768, 4)
    assert memory.peak(m.tokens) <= m.capacity
    # more memory: one microbatch; more ranks: the global batch shared
    big = resolve_microbatch(memory, global_tokens=131072, world=1, context_length=512, capacity=1e15, where="x")
    assert (big.tokens, big.grad_accum_steps) == (131072, 1)
    eight = resolve_microbatch(memory, global_tokens=131072, world=8, context_length=512, capacity=1e15, where="x")
    assert (eight.tokens, eight.grad_accum_steps) == (16384, 1)
    # a global batch that does not divide: the microbatches hold at most their share
    odd = resolve_microbatch(memory, global_tokens=100_000, world=3, context_length=512,
                             capacity=memory.state_total + 20_000 * per_token, where="x")
    assert odd.tokens * odd.grad_accum_steps * 3 <= 100_000 < (odd.tokens + 1) * odd.grad_accum_steps * 3
    assert odd.tokens <= 20_000


def test_auto_refuses_a_device_without_room_for_one_sequence():
    cfg, memory = eco_memory()
    with pytest.raises(ConfigError, match="one sequence of data.context_length 512 needs"):
        resolve_microbatch(memory, global_tokens=131072, world=1, context_length=512,
                           capacity=memory.state_total + 100 * memory.per_token, where="a small GPU")
    with pytest.raises(ConfigError, match="less than one sequence"):
        resolve_microbatch(memory, global_tokens=1024, world=4, context_length=512, capacity=1e15, where="x")


def test_auto_config_keys():
    base = REPO / "launchers" / "configs" / "eco_rna_80m.yaml"
    with pytest.raises(ConfigError, match="train.global_batch_tokens: train.max_tokens_per_microbatch: auto needs"):
        load_config(base, ["train.max_tokens_per_microbatch=auto", "train.global_batch_tokens=null"])
    with pytest.raises(ConfigError, match="train.grad_accum_steps: is derived"):
        load_config(base, ["train.max_tokens_per_microbatch=auto", "train.global_batch_tokens=65536",
                           "train.grad_accum_steps=2"])
    with pytest.raises(ConfigError, match="train.max_tokens_per_microbatch: must be an integer >= 1, auto or null"):
        load_config(base, ["train.max_tokens_per_microbatch=big"])


def test_a_run_resolves_auto_once_and_a_resume_keeps_it(tmp_path):
    """RunPlan resolves auto into the config the run trains (and checkpoints) with; resuming a checkpoint whose
    config was resolved from the same global batch keeps its microbatch on another world size."""
    sets = [f"data.train_shards={GOLDEN}/rna", "model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1",
            "model.d_ff=64", "data.context_length=64", "train.max_tokens_per_microbatch=auto",
            "train.global_batch_tokens=2048", "train.grad_accum_steps=1", "data.length_window=0",
            f"run_dir={tmp_path / 'run'}"]
    cfg = load_config(REPO / "launchers" / "configs" / "eco_rna_demo.yaml", sets)
    plan = RunPlan(cfg, ZERO2, resume="never", world_size=2)
    t = plan.cfg.train
    assert plan.microbatch and (t.max_tokens_per_microbatch, t.grad_accum_steps) == (1024, 1)  # a tiny model
    saved = {"world_size": 2, "config": {"train": {"max_tokens_per_microbatch": 512, "grad_accum_steps": 2,
                                                   "global_batch_tokens": 2048}}}
    from pipeline.train.memory import resolve_auto

    probe = plan.ds_config
    resumed, mb = resolve_auto(cfg, plan.family, world=1, ds_config=probe, saved=saved)
    assert (resumed.train.max_tokens_per_microbatch, resumed.train.grad_accum_steps) == (512, 4)
    assert "kept from the checkpoint" in mb.why
    with pytest.raises(ConfigError, match="3 ranks cannot share"):
        resolve_auto(cfg, plan.family, world=3, ds_config=probe, saved=saved)
    # another global batch: resolved anew (the resume's config check then names the change)
    other = {**saved, "config": {"train": {**saved["config"]["train"], "global_batch_tokens": 4096}}}
    fresh, _ = resolve_auto(cfg, plan.family, world=1, ds_config=probe, saved=other)
    assert fresh.train.max_tokens_per_microbatch == 2048
