"""Exports of real 2-process DeepSpeed checkpoints (ZeRO-1, 2, 3; ProtLingo with expert parallelism 2 on ZeRO-2) of
every family load with pipeline.load_pretrained and with the transformers Auto classes (an ESM2 in EsmForMaskedLM),
and give the logits of the model the DeepSpeed engine held after its last step, on the same input (fp32, <= 1e-6;
measured: 0 for the pipeline-format exports, <= 2.4e-7 for EsmForMaskedLM, which computes attention its own way).

export_worker.py trains every model for 2 steps through pipeline.train.Trainer and writes the engine's logits;
tools/convert_checkpoint.py runs in this process (DeepSpeed is imported once). Fast tests below need no training:
the HF classes against the pipeline modules, Eco-RNA's hidden states, generate, the trained mean depth.
"""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, launch_env, run_launch, torchrun

sys.path.insert(0, str(REPO / "tests" / "pipeline" / "parallel"))
from test_expert_parallel import protein_shards  # noqa: E402,F401  (a fixture)

WORDS = "the cat dog sat ran on a mat log red big small fox jumped over lazy river".split()
TOL = 1e-6


def load_tool():
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "tools" / "convert_checkpoint.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.fixture(scope="module")
def text_shards(tmp_path_factory) -> Path:
    """Sentencepiece text shards (tokenizer.model beside them), by data_prep train-spm + babylm."""
    tmp = tmp_path_factory.mktemp("text")
    g = torch.Generator().manual_seed(0)
    lines = [" ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (8,), generator=g).tolist()) for _ in range(300)]
    (tmp / "text.train").write_text("\n".join(lines) + "\n")
    spm, shards = tmp / "spm" / "tiny", tmp / "shards"
    for cmd in (["train-spm", "--input", str(tmp / "text.train"), "--output", str(spm), "--vocab-size", "320"],
                ["babylm", "--spm", f"{spm}.model", "--input", str(tmp / "text.train"), "--output", str(shards),
                 "--shard-size", "50"]):
        proc = subprocess.run([sys.executable, "-m", "data_prep", *cmd], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    return shards


@pytest.fixture(scope="module")
def trained(tmp_path_factory, sample_shards, protein_shards, text_shards):  # noqa: F811
    """stage -> folder of one export_worker launch (2 processes), run once per module."""
    cache = {}

    def run(stage: int) -> Path:
        if stage not in cache:
            out = tmp_path_factory.mktemp(f"zero{stage}")
            args = ["--stage", str(stage), "--out", str(out), "--rna", str(sample_shards), "--protein",
                    str(protein_shards), "--text", str(text_shards)] + (["--ep", "--mlflow"] if stage == 2 else [])
            proc = run_launch(torchrun(2, REPO / "tests" / "tools" / "export_worker.py", args), timeout=400)
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            cache[stage] = out
        return cache[stage]

    return run


def pipeline_logits(model, family, ref):
    ids, mask = ref["input_ids"], ref["attention_mask"]
    with torch.no_grad():
        if family == "eco_rna":
            from pipeline.eval.reconstruction import state_table
            from pipeline.models.eco_rna import initial_state

            cfg = model.cfg
            s0 = initial_state(cfg, mask, table=state_table(cfg, ref["context_length"], 0))
            return model(ids, mask, ref["num_loops"], s0).logits
        out = model(ids, mask)
        return out if family in ("recursive_gpt", "standard_gpt") else out.logits


def hf_logits(export: Path, family: str, ref, cls=None):
    import pipeline.hf  # noqa: F401  (registers the Auto classes)
    from transformers import AutoModelForCausalLM, AutoModelForMaskedLM

    cls = cls or (AutoModelForCausalLM if family in ("recursive_gpt", "standard_gpt") else AutoModelForMaskedLM)
    model = cls.from_pretrained(str(export)).eval()
    with torch.no_grad():
        return model(input_ids=ref["input_ids"], attention_mask=ref["attention_mask"].long()).logits, model


def max_real_diff(a, b, mask) -> float:
    return float((a.float() - b.float())[mask].abs().max())


EXPECTED = {"eco_rna": "EcoRNAForMaskedLM", "recursive_gpt": "RecursiveGPTForCausalLM",
            "protlingo": "ProtLingoForMaskedLM", "esm2": "EsmForMaskedLM", "protlingo_ep2": "ProtLingoForMaskedLM"}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_exports_give_the_engines_logits(trained, stage, tmp_path):
    from pipeline import load_pretrained
    from pipeline.config import build_config, load_yaml

    tool = load_tool()
    out = trained(stage)
    runs = sorted(p.name for p in out.iterdir() if (p / "engine_logits.pt").is_file())
    assert runs == sorted(["eco_rna", "recursive_gpt", "protlingo", "esm2"] + (["protlingo_ep2"] if stage == 2 else []))
    diffs = {}
    for name in runs:
        run = out / name
        export = tmp_path / name
        assert tool.main(["--checkpoint", str(run), "--output", str(export)]) == 0  # own checkpoints: no flag
        ref = torch.load(run / "engine_logits.pt", weights_only=True)
        cfg = build_config(load_yaml(export / "config.yaml"))
        ref["context_length"] = cfg.data.context_length
        mask, want = ref["attention_mask"], ref["logits"]
        model, _ = load_pretrained(export)
        got_pipeline = pipeline_logits(model, cfg.family, ref)
        got_hf, hf_model = hf_logits(export, cfg.family, ref)
        assert type(hf_model).__name__ == EXPECTED[name]
        diffs[name] = (max_real_diff(got_pipeline, want, mask), max_real_diff(got_hf, want, mask))
        meta = json.loads((export / "export.json").read_text())
        assert meta["step"] == 2 and meta["world_size"] == 2 and meta["format"] == ("esm" if name == "esm2"
                                                                                     else "pipeline")
        if name == "esm2":  # a standard ESM-2 directory: transformers' own class and tokenizer
            from transformers import AutoTokenizer, EsmForMaskedLM

            direct, _ = hf_logits(export, cfg.family, ref, cls=EsmForMaskedLM)
            assert max_real_diff(direct, want, mask) <= TOL
            from pipeline.data.protein_tokenizer import ProteinTokenizer

            tok = AutoTokenizer.from_pretrained(str(export))
            seq = "MKTAYIAKQRQISFVKSHFSRQLEERLGXBUZO"
            assert tok(seq)["input_ids"] == ProteinTokenizer().encode(seq, add_special=True).tolist()
        if name == "protlingo_ep2":
            assert any((run / "checkpoints" / "step00000002").glob("layer_*_expert_*")), "not an EP checkpoint"
    print(f"zero{stage} max |logits - engine's| (load_pretrained, Auto class):", diffs)
    assert all(a <= TOL and b <= TOL for a, b in diffs.values()), diffs


@pytest.mark.slow
def test_export_flags_card_and_a_wrong_tensor(trained, tmp_path, capsys):
    """--tag, --force, --dtype bf16 and the model card on the ZeRO-2 Eco-RNA run (tracked in MLflow); and the
    mutation check: the same comparison fails for an export with one tensor changed."""
    from safetensors.torch import load_file, save_file

    from pipeline import load_pretrained

    tool = load_tool()
    run = trained(2) / "eco_rna"
    tag = run / "checkpoints" / "step00000002"
    ref = torch.load(run / "engine_logits.pt", weights_only=True)
    ref["context_length"] = 48
    (tag / "eval-reconstruction.json").write_text(json.dumps(  # launchers/evaluate.py's result layout
        {"task": "reconstruction", "data": "heldout.fasta", "seed": 0, "columns": ["K", "loss", "accuracy"],
         "table": [[1, 3.1, 0.25], [4, 2.9, 0.3]]}))
    export = tmp_path / "export"
    args = ["--checkpoint", str(run), "--output", str(export), "--trust-checkpoint"]
    assert tool.main([*args, "--tag", "step00000002"]) == 0
    from pipeline.config import load_yaml
    from pipeline.data.shards import sha256_file

    card = (export / "README.md").read_text()
    client = json.loads((tag / "client_state.json").read_text())
    shards = Path(load_yaml(export / "config.yaml")["data"]["train_shards"])
    assert client["mlflow_run_id"] and f"`{client['mlflow_run_id']}`" in card and client["mlflow_tracking_uri"] in card
    assert f"`{run}`" in card and "(step 2, written by 2 processes, ZeRO stage 2)" in card
    assert f"sha256 `{sha256_file(shards / 'manifest.json')}`" in card
    assert "| 4 | 2.9000 | 0.3000 |" in card and "--trust-checkpoint" in card and "AutoModelForMaskedLM" in card

    # refused without --force: one line naming the path and the flag; the export is untouched
    before = (export / "model.safetensors").read_bytes()
    proc = subprocess.run([sys.executable, str(REPO / "tools/convert_checkpoint.py"), *args], cwd=REPO,
                          env=launch_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        f"error: {export} already holds an export; pass --force to replace it"]
    capsys.readouterr()
    assert tool.main([*args, "--force", "--tag", "step00000007"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (f"error: {run / 'checkpoints'}: --tag step00000007: no such "
                                                        "checkpoint (tags there: step00000002)")

    # --force --dtype bf16: replaced by a complete bf16 export (no temporary or old directory left)
    assert tool.main([*args, "--force", "--dtype", "bf16"]) == 0
    assert (export / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    state = load_file(str(export / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in state.values())
    model, _ = load_pretrained(export)
    assert model.embed.weight.dtype == torch.bfloat16
    got_hf, hf_model = hf_logits(export, "eco_rna", ref)
    assert hf_model.embed.weight.dtype == torch.bfloat16
    assert max_real_diff(got_hf, ref["logits"], ref["attention_mask"]) < 0.5  # bf16 rounding, not another model

    # mutation: one tensor changed in the fp32 export (the injection B by 1%) -> the comparison fails
    assert tool.main([*args, "--force"]) == 0
    state = load_file(str(export / "model.safetensors"))
    good, _ = hf_logits(export, "eco_rna", ref)
    assert max_real_diff(good, ref["logits"], ref["attention_mask"]) <= TOL
    state["core.inject.B.weight"] = state["core.inject.B.weight"] * 1.01
    save_file(state, str(export / "model.safetensors"), metadata={"format": "pt"})
    bad, _ = hf_logits(export, "eco_rna", ref)
    assert max_real_diff(bad, ref["logits"], ref["attention_mask"]) > 10 * TOL  # measured 7e-5: B is 1% off


@pytest.mark.slow
def test_exports_load_pipelines_and_tokenizers_where_the_repository_is_not_installed(trained, tmp_path):
    """Issue 28's first line, on the ZeRO-2 runs: in a process that cannot import this repository
    (tests/tools/isolated_hf.py), each family's export loads with trust_remote_code=True (the shipped modeling code),
    its tokenizer with AutoTokenizer, and transformers' fill-mask / text-generation pipelines run. Their outputs equal
    pipeline.inference's masked predictions (Eco-RNA, ProtLingo) and a greedy decode of the pipeline model with
    sentencepiece (RecursiveGPT), <= 1e-5; the logits equal the training engine's; the tokenizers give the pipeline
    tokenizers' ids. The shipped files are the package's modules with relative imports (pipeline/hf_code.py);
    EsmForMaskedLM refuses the ProtLingo (MoE) export instead of returning random weights."""
    import sentencepiece as spm
    from transformers import EsmForMaskedLM

    from pipeline import load_pretrained
    from pipeline.data.protein_tokenizer import ProteinTokenizer
    from pipeline.data.tokenizer import NucleotideTokenizer
    from pipeline.families import get_family
    from pipeline.hf_code import shipped_sources
    from pipeline.inference import Inference

    tool = load_tool()
    cases = {"eco_rna": ("fill-mask", ["ACGUAGC<mask>UUAGGCAU", "<mask>GGaaCUt<mask>AC"]),
             "protlingo": ("fill-mask", ["MKTAYIAKQRQISFVKSH<mask>SRQ", "MA<mask>LLVV<mask>"]),
             "recursive_gpt": ("text-generation", ["the cat sat", "a big red fox"])}
    exports, requests = {}, []
    for name, (kind, inputs) in cases.items():
        run, export = trained(2) / name, tmp_path / name
        assert tool.main(["--checkpoint", str(run), "--output", str(export)]) == 0
        exports[name] = export
        spec = get_family(json.loads((export / "config.json").read_text())["model_type"]).hf_export()
        shipped = sorted(p.name for p in export.glob("*.py"))
        assert {n: (export / n).read_text() for n in shipped} == shipped_sources(spec.modeling)
        ref = torch.load(run / "engine_logits.pt", weights_only=True)
        requests.append({"export": str(export), "kind": kind, "inputs": inputs, "max_new_tokens": 6,
                         "targets": None, "input_ids": ref["input_ids"].tolist(),
                         "attention_mask": ref["attention_mask"].long().tolist()})
    inf = {n: Inference.from_pretrained(exports[n]) for n in ("eco_rna", "protlingo")}
    for req, name in zip(requests, cases):
        if name in inf:
            req["targets"] = [inf[name].tokenizer.vocab[int(i)] for i in inf[name].residue_ids]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    env = {k: v for k, v in launch_env().items() if k != "PYTHONPATH"}
    env["HF_HOME"] = str(tmp_path / "hf_home")  # transformers copies the remote code under HF_HOME/modules
    work = tmp_path / "elsewhere"
    work.mkdir()
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "tools" / "isolated_hf.py"),
                           str(tmp_path / "requests.json"), str(tmp_path / "results.json")], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = dict(zip(cases, json.loads((tmp_path / "results.json").read_text())))

    for name, res in results.items():
        assert res["module"].startswith("transformers_modules."), res["module"]  # the shipped code, not pipeline.hf
        ref = torch.load(trained(2) / name / "engine_logits.pt", weights_only=True)
        mask = ref["attention_mask"]
        assert max_real_diff(torch.tensor(res["logits"]), ref["logits"], mask) <= 1e-5, name
    # fill-mask = pipeline.inference (the whole-vocabulary softmax at each <mask>, every residue)
    for name in ("eco_rna", "protlingo"):
        kind, inputs = cases[name]
        depth = inf[name].default_depth("predict_masked")
        want = inf[name].predict_masked(inputs, depth=depth, top_k=len(inf[name].residue_ids)).predictions
        flat_got = [mask for seq in results[name]["pipeline"] for mask in seq]
        flat_want = [p for seq in want for p in seq]
        assert len(flat_got) == len(flat_want) == 3, (name, flat_got)
        for g, w in zip(flat_got, flat_want):
            for tok, p in zip(w.tokens, w.probs):
                assert abs(g[tok] - p) <= 1e-5, (name, tok, g[tok], p)
    # the tokenizers give the pipeline's ids (<mask> where the text has one)
    nuc = NucleotideTokenizer("rna")
    for text, ids in zip(cases["eco_rna"][1], results["eco_rna"]["ids"]):
        body = [nuc.mask_id if c == "<mask>" else int(nuc.encode(c)[0]) for c in _chars(text)]
        assert ids == [nuc.cls_id, *body, nuc.eos_id], text
    prot = ProteinTokenizer()
    for text, ids in zip(cases["protlingo"][1], results["protlingo"]["ids"]):
        body = [prot.mask_id if c == "<mask>" else int(prot.encode(c)[0]) for c in _chars(text)]
        assert ids == [prot.cls_id, *body, prot.eos_id], text
    # text-generation = greedy decoding of the pipeline model on sentencepiece's ids
    model, _ = load_pretrained(exports["recursive_gpt"])
    sp = spm.SentencePieceProcessor(model_file=str(exports["recursive_gpt"] / "tokenizer.model"))
    for text, ids, got in zip(cases["recursive_gpt"][1], results["recursive_gpt"]["ids"],
                              results["recursive_gpt"]["pipeline"]):
        assert ids == [1] + sp.encode(text)
        seq = list(ids)
        with torch.no_grad():
            for _ in range(6):
                seq.append(int(model(torch.tensor([seq]), None).argmax(-1)[0, -1]))
        assert got == seq or got == seq[len(ids):], (text, got, seq)
    # honest model types: an ESM class refuses the MoE export
    with pytest.raises(Exception, match="not an ESM-2"):
        EsmForMaskedLM.from_pretrained(str(exports["protlingo"]))


def _chars(text: str) -> list[str]:
    """Characters of ``text`` with each ``<mask>`` as one item."""
    parts = text.split("<mask>")
    out = list(parts[0])
    for p in parts[1:]:
        out += ["<mask>", *p]
    return out
