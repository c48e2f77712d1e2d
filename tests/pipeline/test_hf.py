"""pipeline/hf.py without training (trained checkpoints: tests/tools/test_export_hf.py): Eco-RNA's hidden states,
num_loops and its default, generate against a manual argmax loop, registration, and that ``import pipeline`` stays
free of transformers."""
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from checkpoint_factory import tiny_config  # noqa: E402

import pipeline.hf as hf  # noqa: E402
from pipeline.families import eco_rna_hf as eco_hf  # noqa: E402
from pipeline.families import gpt_hf, protlingo_hf  # noqa: E402
from pipeline.objectives.eco_rna import trained_mean_depth  # noqa: E402
from pipeline.families import get_family  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def eco_rna(tmp_path, seed=0):
    cfg = tiny_config(tmp_path)
    torch.manual_seed(seed)
    model = eco_hf.EcoRNAForMaskedLM(hf.hf_config(cfg)).eval()
    with torch.no_grad():  # away from the identity-initialized maps, so that every loop changes the state
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return cfg, model


def test_eco_rna_hidden_states_are_every_block_and_loop(tmp_path):
    cfg, model = eco_rna(tmp_path)
    ids = torch.randint(5, 20, (2, 15))
    mask = torch.ones_like(ids)
    mask[1, 10:] = 0
    K, n_core = 3, cfg.model.n_core
    with torch.no_grad():
        plain = model(ids, mask, num_loops=K)
        out = model(ids, mask, num_loops=K, output_hidden_states=True)
        s0 = model.initial_state(mask.bool())
        per_k = model.net.logits_at_depths(ids, mask.bool(), range(1, K + 1), s0)
    assert torch.equal(out.logits, plain.logits)
    assert len(out.hidden_states) == 1 + K * (n_core + 1)
    assert all(h.shape == (2, 15, cfg.model.d_model) for h in out.hidden_states)
    rope, key_mask = model.net.rope(15, ids.device, torch.float32), mask.bool()
    for k in range(1, K + 1):  # the state after loop k reads out to the pipeline's depth-k logits
        state = out.hidden_states[k * (n_core + 1)]
        with torch.no_grad():
            logits = model.net.embed(model.net.readout(state, rope, key_mask), as_head=True)
        assert torch.allclose(logits, per_k[k], atol=1e-6, rtol=0)
    assert torch.allclose(per_k[K], plain.logits, atol=1e-6, rtol=0)
    assert not torch.allclose(per_k[1], per_k[K])  # depth matters: num_loops is not ignored
    base = eco_hf.EcoRNAModel(model.config)
    base.load_state_dict(model.state_dict())
    with torch.no_grad():
        feats = base(ids, mask, num_loops=K).last_hidden_state
    assert torch.equal(model.net.embed(feats, as_head=True), plain.logits)


def test_trained_mean_depth_is_the_depth_laws_mean(tmp_path):
    from pipeline.objectives.eco_rna import sample_depths

    cfg = tiny_config(tmp_path)
    draws = sample_depths(200_000, cfg.objective, torch.Generator().manual_seed(0)).double()
    assert abs(trained_mean_depth(cfg.objective) - float(draws.mean())) < 0.02  # 4 standard errors
    assert hf.hf_config(cfg).num_loops == round(float(draws.mean()))


def test_recursive_gpt_generate_is_greedy_argmax(tmp_path):
    cfg = tiny_config(tmp_path, "recursive_gpt")
    torch.manual_seed(0)
    model = gpt_hf.RecursiveGPTForCausalLM(hf.hf_config(cfg)).eval()
    ids = torch.randint(4, 300, (2, 5))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        x = ids
        for _ in range(6):
            x = torch.cat([x, model.net(x)[:, -1].argmax(-1, keepdim=True)], 1)
    assert out.tolist() == x.tolist()


def test_registration_and_import_cost():
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForMaskedLM

    hf.register()
    hf.register()  # idempotent
    assert type(AutoConfig.for_model("eco_rna")) is eco_hf.EcoRNAConfig
    assert AutoModelForMaskedLM._model_mapping[protlingo_hf.ProtLingoConfig] is protlingo_hf.ProtLingoForMaskedLM
    assert AutoModelForCausalLM._model_mapping[gpt_hf.StandardGPTConfig] is gpt_hf.StandardGPTForCausalLM
    proc = subprocess.run([sys.executable, "-c", "import sys, pipeline; "
                           "assert not {'torch', 'transformers'} & set(sys.modules), sorted(sys.modules)"],
                          cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_dense_protlingo_is_an_esm_directory(tmp_path):
    """esm_state_dict + esm_config: EsmForMaskedLM loads with nothing missing and gives the pipeline's logits."""
    from safetensors.torch import save_file
    from transformers import EsmForMaskedLM

    from pipeline.config import load_config

    cfg = load_config(REPO / "launchers/configs/protlingo_demo.yaml",
                      ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.d_ff=64", "model.moe_layers=[]",
                       "model.moe_shared_hidden=32", "model.memory_layers=[]", f"run_dir={tmp_path / 'run'}",
                       f"data.train_shards={tmp_path / 'none'}"])
    torch.manual_seed(1)
    net = get_family("protlingo").build_model(cfg.model).eval()
    (tmp_path / "esm").mkdir()
    save_file(protlingo_hf.esm_state_dict(net.state_dict(), cfg.model), str(tmp_path / "esm" / "model.safetensors"),
              metadata={"format": "pt"})
    hf.hf_config(cfg).save_pretrained(str(tmp_path / "esm"))
    esm, info = EsmForMaskedLM.from_pretrained(str(tmp_path / "esm"), output_loading_info=True)
    assert not any(info.values()), info  # nothing missing, unexpected or mismatched
    ids = torch.tensor([[0, 5, 6, 7, 32, 9, 10, 2], [0, 11, 12, 13, 2, 1, 1, 1]])
    mask = ids != 1
    with torch.no_grad():
        diff = (esm.eval()(input_ids=ids, attention_mask=mask.long()).logits - net(ids, mask).logits)[mask]
    assert diff.abs().max() <= 1e-6
