"""Expert parallelism (ProtLingo MoE) under real multi-process DeepSpeed on CPU (gloo), against single-process
references.

Worker runs (ep_worker.py): 2 processes with EP = 2 (one EP group) and 4 processes with EP = 2 (two EP groups, so
each expert lives on two ranks: an expert-data-parallel group of 2), ZeRO-1 and ZeRO-2. Launcher runs
(launchers/pretrain.py): ZeRO-3 with experts as ordinary parameters, then EP = 2 started from its checkpoint,
SIGKILLed and resumed; every checkpoint converted with tools/convert_checkpoint.py.
"""
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, launch_and_kill, read_jsonl, run_launch, torchrun
from ep_worker import CLIP, initial_model, make_optimizer, run_config, step_batches
from pipeline.checkpoint import load_state_dict, load_trained_model
from pipeline.config import ConfigError, load_config
from pipeline.train import RunPlan
from pipeline.families import get_family
from pipeline.parallel import check_expert_parallel, check_parallelism, resolve_moe_backend

EXPERT = ".deepspeed_moe.experts.deepspeed_experts."
STEPS = 3


# ---- single-process reference ---------------------------------------------------------------------------------------
def reference(world: int, steps: int = STEPS) -> list[dict]:
    """The parameters after each step of one process on all world x 2 microbatches of the step: the update
    (1/Z) sum_b (S_b + m_b A_b) of the objective (A_b: microbatch b's MoE losses), clipped at CLIP, SGD on the same
    named groups. Also the gradient norm before clipping."""
    family = get_family("protlingo")
    cfg = run_config()
    model = initial_model(cfg)
    opt = make_optimizer(model, cfg)
    out = []
    # One thread: on a busy 2-core host, OpenMP's second thread turns each tiny index_add into ~0.1 s of waiting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(steps):
            out.append(_reference_step(model, opt, family, cfg, step_batches(cfg, step, world)))
    finally:
        torch.set_num_threads(threads)
    return out


def _reference_step(model, opt, family, cfg, batches) -> dict:
    Z = sum(b.num_supervised for b in batches)
    total = sum(family.loss(model, b, cfg, family.plan(b, cfg, step=0, stream=0, index=0)).sum_loss
                for b in batches) / Z
    opt.zero_grad()
    total.backward()
    norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
    opt.step()
    return {"state": {k: v.detach().clone() for k, v in model.named_parameters()}, "grad_norm": norm,
            "loss": float(total.detach())}


@pytest.fixture(scope="module")
def worker_runs(tmp_path_factory):
    """(world, stage, bf16, steps) -> output folder of one ep_worker launch, run once per module."""
    cache = {}

    def run(world, stage, bf16=False, steps=STEPS):
        key = (world, stage, bf16, steps)
        if key not in cache:
            out = tmp_path_factory.mktemp(f"w{world}_z{stage}{'_bf16' if bf16 else ''}")
            args = ["--stage", str(stage), "--ep", "2", "--steps", str(steps), "--out", str(out)]
            proc = run_launch(torchrun(world, REPO / "tests/pipeline/parallel/ep_worker.py",
                                       args + (["--bf16"] if bf16 else [])), timeout=300)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            cache[key] = out
        return cache[key]

    return run


def gathered(out: Path, world: int, name: str) -> dict:
    """Union of every rank's parameters (global names); replicated ones must agree exactly between ranks."""
    state = {}
    for r in range(world):
        for k, v in torch.load(out / f"rank{r}_{name}.pt", weights_only=True).items():
            if k in state:
                assert torch.equal(state[k], v), f"{k} differs between ranks"
            state[k] = v
    return state


def max_diff(got: dict, want: dict) -> float:
    """Largest elementwise difference. The memory's W_q is compared up to scale: no gradient reaches it (its
    addresses read only the signs of W_q h, Eq. 3-4), and the ZeRO optimizer's weight decay rescales it where the
    single-process reference's torch optimizer skips a parameter without a gradient; a positive scale keeps every
    sign, hence every address (docs/protlingo.md, "W_q")."""
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))[:4]

    def unit(k, t):
        return t / t.norm() if k.endswith(".W_q.weight") else t
    return max((unit(k, got[k]) - unit(k, want[k])).abs().max().item() for k in want)


def parameters_of(state: dict) -> dict:
    """A saved state dict without the memory's ``addressed`` flags (a buffer: each rank's own usage record)."""
    return {k: v for k, v in state.items() if not k.endswith(".addressed")}


def experts_of(state: dict, layer: int, e: int) -> torch.Tensor:
    prefix = f"layers.{layer}.ffn{EXPERT}{e}."
    return torch.cat([v.flatten() for k, v in sorted(state.items()) if k.startswith(prefix)])


@pytest.mark.slow
@pytest.mark.parametrize("world,stage", [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_expert_parallel_equals_single_process(worker_runs, world, stage):
    out = worker_runs(world, stage)
    ref = reference(world)
    summaries = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    # Rank r is EP rank r % 2 of its group and holds global experts 2 (r % 2) and 2 (r % 2) + 1 (local ids 0, 1);
    # with 4 ranks, ranks r and r + 2 hold the same two (an expert-data-parallel group; ``gathered`` checks they
    # agree exactly).
    for r, s in enumerate(summaries):
        assert sorted({k.split(EXPERT)[1].split(".")[0] for k in s["local_experts"]}) == ["0", "1"]
        held = torch.load(out / f"rank{r}_step1.pt", weights_only=True)
        assert {int(k.split(EXPERT)[1].split(".")[0]) for k in held if EXPERT in k} == {2 * (r % 2), 2 * (r % 2) + 1}
    for step in range(STEPS):
        got = gathered(out, world, f"step{step + 1}")
        diff = max_diff(got, ref[step]["state"])  # every expert, router and shared expert; measured <= 1.2e-7
        assert diff <= 1e-6, (step, diff)
        rec = summaries[0]["recs"][step]
        # rel 1e-5: the memory table's sparse gradient is summed over the rows in another order (measured 2.5e-6)
        assert rec["grad_norm"] == pytest.approx(ref[step]["grad_norm"], rel=1e-5)
        assert rec["loss"] == pytest.approx(ref[step]["loss"], rel=1e-5)
    assert ref[0]["grad_norm"] > CLIP  # the clip bound: the norm is over every expert of every EP rank
    # Experts started as copies of expert 0; different tokens reached them, so they now differ.
    final = gathered(out, world, f"step{STEPS}")
    for layer in (0, 1):
        w = [experts_of(final, layer, e) for e in range(4)]
        assert all((w[a] - w[b]).abs().max() > 1e-4 for a in range(4) for b in range(a + 1, 4))
    tokens = [summaries[0]["recs"][0][f"moe/L00/tokens/e{e}"] for e in range(4)]
    assert all(t > 0 for t in tokens), tokens
    # Checkpoint: a differently initialized engine loads it and gets its own experts back bit for bit, and the next
    # step agrees bit for bit (optimizer and expert groups restored too).
    assert all(s["restored"] and s["same_next_step"] for s in summaries)
    # The consolidated checkpoint (one file per expert + the non-expert module, fp32 masters) is the single-process
    # model: the gathered parameters exactly, the reference to 1e-6.
    saved = load_state_dict(out / "ckpt" / "final")
    consolidated = parameters_of(saved)
    assert max_diff(consolidated, final) == 0.0
    assert max_diff(consolidated, ref[-1]["state"]) <= 1e-6
    model = initial_model(run_config(), seed=3)
    model.load_state_dict(saved, strict=True)


@pytest.mark.slow
def test_bf16_checkpoint_consolidates_fp32_masters(worker_runs):
    """Under bf16 the module and expert files hold bf16 weights; the export takes the fp32 masters of the optimizer
    shards (each must round to the saved bf16 weight, which also checks where every expert was placed)."""
    out = worker_runs(2, 2, bf16=True, steps=1)
    masters = gathered(out, 2, "fp32")
    saved = gathered(out, 2, "step1")  # the bf16 parameters, as floats
    consolidated = parameters_of(load_state_dict(out / "ckpt" / "final"))
    assert max_diff(consolidated, masters) == 0.0
    assert all(v.dtype == torch.float32 for v in consolidated.values())
    assert max_diff(consolidated, saved) > 0  # not the bf16 copies ...
    assert all(torch.equal(consolidated[k].bfloat16().float(), saved[k]) for k in saved)  # ... but what they round


@pytest.mark.slow
def test_tampered_expert_file_is_refused(worker_runs, tmp_path):
    """An expert whose saved weight is not what its fp32 master rounds to (here: a modified file) is an error."""
    tag = tmp_path / "final"
    shutil.copytree(worker_runs(2, 2) / "ckpt" / "final", tag)
    f = tag / "layer_1_expert_3_mp_rank_00_model_states.pt"
    experts = torch.load(f, weights_only=True)
    key = next(iter(experts))
    experts[key] = experts[key] + 1
    torch.save(experts, f)
    with pytest.raises(ConfigError, match=r"layers\.1\.ffn\.deepspeed_moe\.experts\.deepspeed_experts\.3\..*does not "
                                          r"match"):
        load_state_dict(tag)


# ---- through the launcher: ZeRO-3 without EP, EP with --init-from, SIGKILL and resume, conversion ------------------
PROTLINGO_YAML = """family: protlingo
seed: 7
model: {d_model: 32, n_layers: 2, n_heads: 4, d_ff: 64, moe_layers: [0, 1], num_experts: 4, memory_layers: [1],
        attn_backend: sdpa}
data: {context_length: 64}
objective: {lambda_aux: 0.01, lambda_z: 0.001}
optim: {lr: 3.0e-3, warmup_steps: 2}
train: {micro_batch_size: 4, grad_accum_steps: 2, log_every: 1}
tracking: {enabled: false}
"""


@pytest.fixture(scope="module")
def protein_shards(tmp_path_factory) -> Path:
    """Protein shards built by the real data_prep CLI: the shipped UniRef90 member sample, else the shared UniRef50
    training FASTA."""
    sample = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"
    shared = REPO.parent / "shared" / "data" / "protein" / "uniref50_202104_esm2_train_5000.fasta"
    source = sample if sample.is_file() else shared
    if not source.is_file():
        pytest.skip(f"no protein sample: neither {sample} nor {shared}")
    out = tmp_path_factory.mktemp("protein") / "uniref"
    subprocess.run([sys.executable, "-m", "data_prep", "uniref", "--input", str(source), "--output", str(out),
                    "--shard-size", "50", "--max-length", "2000"], cwd=REPO, check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def protlingo_yaml(tmp_path_factory) -> Path:
    f = tmp_path_factory.mktemp("cfg") / "protlingo_tiny.yaml"
    f.write_text(PROTLINGO_YAML)
    return f


def pretrain_cmd(nproc, ds_config, yaml, shards, run_dir, steps, *more, init_from=None) -> list:
    sets = [f"data.train_shards={shards}", f"run_dir={run_dir}", f"train.max_steps={steps}", *more]
    args = ["--ds_config", str(REPO / ds_config), "--config", str(yaml)] + [a for o in sets for a in ("--set", o)]
    return torchrun(nproc, REPO / "launchers" / "pretrain.py", args + (["--init-from", str(init_from)]
                                                                        if init_from else []))


def pretrain(*args, **kw):
    proc = run_launch(pretrain_cmd(*args, **kw), timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def convert(checkpoint: Path, output: Path) -> dict:
    """tools/convert_checkpoint.py's main, in this process (DeepSpeed is already imported here: a subprocess would
    spend its seconds importing it again) -> the exported state dict."""
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--checkpoint", str(checkpoint), "--output", str(output)]) == 0  # EP shards: no flag
    from safetensors.torch import load_file

    return load_file(str(output / "model.safetensors"))


def assert_same(a: dict, b: dict):
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))[:4]
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.slow
def test_launcher_zero3_then_expert_parallel_resume_and_convert(protein_shards, protlingo_yaml, tmp_path):
    # ZeRO-3, EP 1: the experts are ordinary data-parallel parameters; it trains and its checkpoint converts.
    z3_dir = tmp_path / "z3"
    pretrain(2, "ds_configs/zero3.json", protlingo_yaml, protein_shards, z3_dir, 2)
    z3_metrics = read_jsonl(z3_dir / "metrics.jsonl")
    assert [m["step"] for m in z3_metrics] == [1, 2] and all(m["loss"] == m["loss"] for m in z3_metrics)
    z3_ckpt = z3_dir / "checkpoints" / "step00000002"
    z3_export = convert(z3_ckpt, tmp_path / "z3_export")
    assert_same(z3_export, load_state_dict(z3_ckpt))
    fresh = get_family("protlingo").build_model(load_config(protlingo_yaml).model).state_dict()
    assert {k: v.shape for k, v in z3_export.items()} == {k: v.shape for k, v in fresh.items()}

    # EP 2 under ZeRO-2, started from the ZeRO-3 checkpoint (--init-from consolidates it, then EP keeps each rank's
    # experts); SIGKILLed after step 5 (last checkpoint: step 3) and resumed: bit-identical losses and weights.
    steps, opts = 6, ["train.expert_parallel_size=2", "checkpoint.every_steps=3"]
    ref_dir, kill_dir = tmp_path / "ep_ref", tmp_path / "ep_killed"
    run = (protlingo_yaml, protein_shards)
    ref = pretrain(2, "ds_configs/zero2.json", *run, ref_dir, steps, *opts, init_from=z3_ckpt)
    assert f"initialized from {z3_ckpt}" in ref.stdout
    final = ref_dir / "checkpoints" / f"step{steps:08d}"
    assert sorted(p.name for p in final.glob("layer_*_expert_*")) == sorted(
        f"layer_{L}_expert_{e}_mp_rank_00_model_states.pt" for L in (0, 1) for e in range(4))

    # The same start without EP (every expert on every rank, ordinary data-parallel parameters) trains the same
    # model: EP changes where the experts run, not what is computed (AdamW, real loader, clipping at 1.0).
    dp_dir = tmp_path / "dp"
    pretrain(2, "ds_configs/zero2.json", *run, dp_dir, 3, "checkpoint.every_steps=3", init_from=z3_ckpt)
    ep_losses = [m["loss"] for m in read_jsonl(ref_dir / "metrics.jsonl")]
    dp_losses = [m["loss"] for m in read_jsonl(dp_dir / "metrics.jsonl")]
    assert dp_losses[0] == pytest.approx(ep_losses[0], rel=1e-6, abs=0)
    assert dp_losses == pytest.approx(ep_losses[:3], rel=1e-5, abs=0)
    assert not any(dp_dir.glob("checkpoints/step*/layer_*_expert_*"))  # EP 1: no DeepSpeed MoE, no expert files

    launch_and_kill(pretrain_cmd(2, "ds_configs/zero2.json", *run, kill_dir, steps, *opts, init_from=z3_ckpt),
                    kill_dir / "metrics.jsonl", at_step=5)
    assert (kill_dir / "checkpoints" / "latest").read_text() == "step00000003"
    resumed = pretrain(2, "ds_configs/zero2.json", *run, kill_dir, steps, *opts, init_from=z3_ckpt)
    assert "resumed from" in resumed.stdout and "initialized from" not in resumed.stdout
    ref_m, got_m = read_jsonl(ref_dir / "metrics.jsonl"), read_jsonl(kill_dir / "metrics.jsonl")
    assert [m["step"] for m in got_m] == list(range(1, steps + 1))
    assert [m["loss"] for m in got_m] == [m["loss"] for m in ref_m]  # bit-identical
    assert [m["grad_norm"] for m in got_m] == [m["grad_norm"] for m in ref_m]
    ref_state = load_state_dict(final)
    # Every expert of every EP rank came back exactly: the resumed run ends on the same weights, bit for bit.
    assert_same(load_state_dict(kill_dir / "checkpoints" / f"step{steps:08d}"), ref_state)
    resumed3 = load_state_dict(kill_dir / "checkpoints" / "step00000003")
    assert any(not torch.equal(resumed3[k], ref_state[k]) for k in ref_state if EXPERT in k)  # experts trained on

    # The export is the single-process model: the names of a plain ProtLingo, every expert under its global id.
    export = convert(ref_dir, tmp_path / "ep_export")
    assert_same(export, ref_state)
    trained = load_trained_model(tmp_path / "ep_export")
    assert type(trained.model.layers[0].ffn).__name__ == "UpcycledMoE"
    assert_same({k: v for k, v in trained.model.state_dict().items()}, ref_state)


# ---- errors before anything starts -----------------------------------------------------------------------------------
def test_expert_parallel_errors_name_the_key(protlingo_yaml, tmp_path, monkeypatch):
    cfg = load_config(protlingo_yaml, ["train.expert_parallel_size=2"])
    m = cfg.model
    with pytest.raises(ConfigError, match=r"^train\.expert_parallel_size: 2 needs ZeRO stage 1 or 2 .*ZeRO-3"):
        check_expert_parallel(m, 2, 2, zero_stage=3)
    with pytest.raises(ConfigError, match=r"^train\.expert_parallel_size: 2 needs ZeRO stage 1 or 2 .*stage is 0"):
        check_expert_parallel(m, 2, 2, zero_stage=0)
    with pytest.raises(ConfigError, match=r"^train\.expert_parallel_size: 3 does not divide model\.num_experts = 4"):
        check_expert_parallel(m, 3, 3, zero_stage=2)
    with pytest.raises(ConfigError, match=r"^train\.expert_parallel_size: 4 does not divide the data-parallel world"):
        check_expert_parallel(m, 4, 2, zero_stage=2)
    with pytest.raises(ConfigError, match=r"^train\.expert_parallel_size: 2 needs a model with MoE layers"):
        check_expert_parallel(load_config(protlingo_yaml, ["model.moe_layers=[]"]).model, 2, 2, zero_stage=2)
    with pytest.raises(ConfigError, match=r"^--set train\.expert_parallel_size=0: train\.expert_parallel_size: must be "
                                          r">= 1, got 0"):  # named by the flag the value came from
        load_config(protlingo_yaml, ["train.expert_parallel_size=0"])
    check_expert_parallel(m, 2, 4, zero_stage=1)  # fits: no error
    check_expert_parallel(m, 1, 3, zero_stage=3)  # EP 1 is always fine, ZeRO-3 included

    # The engine refuses EP with ZeRO-3 in Trainer.__init__, before any process group or shard is touched.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match=r"^train\.expert_parallel_size: 2 needs ZeRO stage 1 or 2"):
        RunPlan(cfg, str(REPO / "ds_configs" / "zero3.json"))


def test_moe_backend_megablocks_needs_cuda_and_the_package(protlingo_yaml):
    cfg = load_config(protlingo_yaml, ["model.moe_backend=megablocks"])
    if torch.cuda.is_available():
        pytest.skip("CPU behaviour")
    with pytest.raises(ConfigError, match=r"^model\.moe_backend: megablocks needs a CUDA device"):
        resolve_moe_backend(cfg.model)
    assert resolve_moe_backend(load_config(protlingo_yaml, ["model.moe_backend=auto"]).model) == "torch"
    assert check_parallelism(load_config(protlingo_yaml), 2, 2) == "torch"
