"""tools/scaling.py: its module-call counts against real calls, its depth law against sampling, its command line,
and (slow) its communication volume against the bytes a 2-process ZeRO-2 and ZeRO-3 run sends
(bench/comm_volume.py)."""
import json
import sys

import pytest
import torch

from conftest import REPO
from prewarmed import run_python

sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "tests" / "pipeline" / "objectives"))
import comm_volume  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.families import get_family  # noqa: E402
from pipeline.models.eco_rna import initial_state  # noqa: E402
from pipeline.objectives.eco_rna import Plan, recurrent_loss, sample_depths  # noqa: E402
from test_eco_rna_objective import make_batch  # noqa: E402
from tools import scaling  # noqa: E402

TOOL = [REPO / "tools" / "scaling.py"]
ECO_SMALL = ["model.d_model=32", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64", "model.n_prelude=1",
             "model.n_core=2", "model.n_coda=1", "objective.backward_window=3", "objective.anchor_depth=1",
             "objective.lambda_anchor=0.5"]


# A full backward hook on a module whose inputs need no gradient (the embedding) still fires for its outputs.
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


def count_calls(model, run):
    """{top-level child: [forward calls, backward calls]} of ``run()`` (which runs forward and backward)."""
    counts, handles = {}, []
    for name, child in model.named_children():
        counts[name] = [0, 0]
        handles.append(child.register_forward_hook(lambda m, i, o, n=name: counts[n].__setitem__(0, counts[n][0] + 1)))
        handles.append(child.register_full_backward_hook(
            lambda m, gi, go, n=name: counts[n].__setitem__(1, counts[n][1] + 1)))
    run()
    for h in handles:
        h.remove()
    return counts


def expected_calls(cfg, model, k_max):
    calls = scaling.module_calls(cfg, k_max)
    return {name: list(calls.get(name, (1, 1))) for name, child in model.named_children()
            if any(True for _ in child.parameters())}


@pytest.mark.parametrize("k_max", [2, 5])
def test_eco_rna_module_calls_are_the_real_ones(k_max):
    """The counts ZeRO-3's per-call gathers follow: embedding 2 + anchor forward (input, head, anchor head) and 2
    backward; the core K_max forward and min(K_max, W) backward; the readout 1 + anchor forward, 1 backward."""
    cfg = load_config(None, ECO_SMALL)
    torch.manual_seed(0)
    model = get_family("eco_rna").build_model(cfg.model)
    batch = make_batch(2)
    depths = torch.full((len(batch.sample_ids),), k_max)
    depths[0] = 1
    plan = Plan(depths, None, {"k_max": k_max}, init_state=initial_state(cfg.model, batch.attention_mask))
    got = count_calls(model, lambda: recurrent_loss(model, batch, cfg, plan).sum_loss.backward())
    want = expected_calls(cfg, model, k_max)
    assert {n: got[n] for n in want} == want


def test_recursive_gpt_module_calls_are_the_real_ones():
    cfg = load_config(REPO / "launchers" / "configs" / "recursive_gpt_demo.yaml",
                      ["model.d_model=32", "model.n_heads=4", "model.embed_dim=16", "model.vocab_size=64",
                       "model.recurrence=3", "model.mlp_ratio=2"])
    torch.manual_seed(0)
    model = get_family("recursive_gpt").build_model(cfg.model)
    tokens = torch.randint(0, 64, (2, 8))
    got = count_calls(model, lambda: model(tokens, torch.ones_like(tokens, dtype=torch.bool)).sum().backward())
    want = expected_calls(cfg, model, 3)
    # the per-step norms live in one ModuleList child: each of its R sets runs once
    want["norms"] = [0, 0]
    got["norms"] = [0, 0]
    assert {n: got[n] for n in want} == want and want["block"] == [3, 3]


def test_expected_k_max_matches_sampling():
    cfg = load_config(None, ["objective.mu_k=4.0", "objective.sigma_k=0.5", "objective.k_cap=32"])
    for rows in (1, 32, 512):
        e_max, pmf = scaling.depth_law(cfg, rows)
        draws = sample_depths(rows * 400, cfg.objective, torch.Generator().manual_seed(rows)).view(400, rows)
        assert abs(draws.max(1).values.double().mean().item() - e_max) < 0.04 * e_max + 0.1, (rows, e_max)
    assert abs(sum(p for _, p in pmf) - 1) < 1e-9


@pytest.mark.parametrize("name", ["eco_rna_80m", "protlingo_150m", "recursive_gpt_100m"])
def test_parameter_skeleton_is_the_config_count(name):
    cfg = load_config(REPO / "launchers" / "configs" / f"{name}.yaml", [])
    assert sum(n for _, n in scaling.param_shapes(cfg)) == cfg.model.num_params()


def test_cli_prints_a_plan_per_gpu_count_and_json():
    out = run_python(TOOL + ["--config", "eco_rna_80m", "--gpus", "8,64", "--ds_config", "ds_configs/zero2.json"], REPO)
    assert out.returncode == 0, out.stderr
    assert "eco_rna on 8 GPUs (1 node x 8), ZeRO-2" in out.stdout and "on 64 GPUs (8 nodes x 8)" in out.stdout
    # ZeRO-2 all-reduces every gradient once per microbatch: 2 (p-1)/p x 80,856,192 x 2 bytes on 8 GPUs
    assert "gradient all-reduce (dense): 0.283 GB in 1 calls over 8 ranks (NVLink)" in out.stdout
    js = run_python(TOOL + ["--config", "protlingo_150m", "--gpus", "64", "--ds_config", "ds_configs/zero2.json",
                            "--ep", "4", "--json"], REPO)
    assert js.returncode == 0, js.stderr
    (pl,) = json.loads(js.stdout)
    names = [c["name"] for c in pl["traffic"]]
    assert pl["ep"] == 4 and "MoE all-to-all, backward (tokens to experts and back)" in names
    assert "gradient all-reduce (experts)" in names and pl["params"] < 309_214_116  # a quarter of the experts


@pytest.mark.parametrize("args, message", [
    (["--gpus", "eight"], "--gpus eight"),
    (["--gpus", "6", "--ep", "4"], "--ep 4: does not divide 6 GPUs"),
    (["--gpus", "8", "--set", "model.nope=1"], "model.nope"),
])
def test_cli_bad_input_exits_2(args, message):
    out = run_python(TOOL + ["--config", "protlingo_150m", "--ds_config", "ds_configs/zero2.json", *args], REPO)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


# The measured check: a 2-rank run of the demo Eco-RNA with a prelude, a 2-block core and a coda (1.02M parameters,
# the matrices above ZeRO-3's persistence threshold of 10,000), 2 microbatches a step, 3 steps.
MEASURED = ["model.n_prelude=1", "model.n_core=2", "model.n_coda=1"]


@pytest.mark.slow
def test_predicted_volume_is_the_counted_volume(sample_shards, tmp_path, capsys):
    """Three cases in one 2-rank launch: ZeRO-2; ZeRO-3 with the core kept gathered across iterations
    (objective.fixed_wavefront); ZeRO-3 re-gathering at every call (DeepSpeed keeps nothing between calls: the
    regime the model gives for a per-step K_max)."""
    ds = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    ds["zero_optimization"].update(stage3_max_reuse_distance=0, stage3_prefetch_bucket_size=0)
    per_call = tmp_path / "zero3_per_call.json"
    per_call.write_text(json.dumps(ds))
    rc = comm_volume.main(["--ds_config", str(REPO / "ds_configs" / "zero2.json"),
                           "--case", str(REPO / "ds_configs" / "zero3.json"), "objective.fixed_wavefront=true",
                           "--case", str(per_call), "--shards", str(sample_shards), "--steps", "3",
                           "--out", str(tmp_path / "out"), *[a for o in MEASURED for a in ("--set", o)]])
    printed = capsys.readouterr().out
    cases = json.loads((tmp_path / "out" / "comm_volume.json").read_text())
    assert rc == 0 and len(cases) == 3, printed
    for case in cases:
        assert len(case["rows"]) == 2 and all(abs(r["ratio"] - 1) <= 0.10 for r in case["rows"]), printed
        assert all(r["counted"]["backward"] > 0 for r in case["rows"])  # the gradients' reduction was counted
    kept, every_call = (sum(sum(r["counted"].values()) for r in c["rows"]) for c in cases[1:])
    assert every_call > 3 * kept, printed  # keeping the core gathered: measured 3.4x less


@pytest.mark.parametrize("name", ["eco_rna_80m", "protlingo_150m", "recursive_gpt_100m"])
def test_activation_checkpointing_shrinks_the_activation_estimate(name):
    """With train.activation_checkpointing: blocks a differentiated block keeps only its input: the estimate falls
    to (blocks x d + one block's activations) per token, the logits unchanged."""
    def activations(*sets):
        out = run_python(TOOL + ["--config", name, "--gpus", "8", "--ds_config", "ds_configs/zero2.json", "--json",
                                 *[a for s in sets for a in ("--set", s)]], REPO)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)[0]["memory"]["activations (estimate)"]

    plain, blocks = activations(), activations("train.activation_checkpointing=blocks")
    assert 0 < blocks < plain / 3, (plain, blocks)
