"""Adapted models without a launch: the training forward reads the features the sweep reads, the reactivity head's
difference is exactly zero at K = 1, a sweep's K = 4 numbers are a K = 4 evaluation's bit for bit, the adapted spec
starts from a pretrained backbone with a seeded head (or keeps an adapted source whole), a frozen backbone has no
optimizer state, the task: section's errors name their key, and the three Hugging Face classes load where the
repository is not installed and give the pipeline's predictions."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import REPO
from pipeline.checkpoint.read import TrainedModel
from pipeline.config import ConfigError, dump_yaml, load_config
from pipeline.data.tokenizer import NucleotideTokenizer
from pipeline.objectives.eco_rna import eval_state
from pipeline.tasks import training_spec

TASKS_DATA = REPO / "data" / "samples" / "tasks"
TINY = ["model.d_model=32", "model.n_heads=2", "model.n_kv_heads=1", "model.d_ff=64", "model.n_prelude=1",
        "model.n_coda=1", "data.context_length=96", "eval.batch_size=8"]
CHANNELS = {"nrc": ["task.hidden=16"], "ssp": ["task.channels=8"], "reactivity": ["task.channels=8"]}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and on a machine shared with other jobs two OpenMP threads
    waiting on each other made a 3 s sweep take 40 s."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def task_cfg(name: str, *more: str):
    return load_config(REPO / "launchers" / "configs" / "eco_rna_demo.yaml",
                       [*TINY, f"task.name={name}", *CHANNELS[name], *more])


def built(name: str, seed: int = 0, *more: str):
    cfg = task_cfg(name, *more)
    torch.manual_seed(seed)
    model = training_spec(cfg).build_model(cfg.model).eval()
    with torch.no_grad():  # a head that is not at its initialization (its outputs spread)
        for p in model.head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    return cfg, model


def tokens(seqs):
    enc = NucleotideTokenizer("rna")(seqs)
    return enc["input_ids"], enc["attention_mask"].bool()


SEQS = ["GGGAAACCCUUCGAGGCU", "GGCUAGCUCAGUUGGUAGAGCAGCGGAC", "ACGU", "UUAGCCGGAUCCAUAGC"]


def test_training_forward_reads_the_sweep_features_and_the_difference_is_zero_at_k1():
    cfg, model = built("reactivity")
    ids, mask = tokens(SEQS)
    s0 = eval_state(cfg, mask, 0)
    for k in (1, 3):
        with torch.no_grad():
            train = model(ids, mask, [k] * len(SEQS), s0, k_max=k, backward_window=2).prediction
            sweep = model.at_depths(ids, mask, [k], s0)[k]
        assert torch.allclose(train, sweep, atol=1e-5), k
    # K = 1: the head's second input (h_K - h_1) is exactly zero, in training (rows at K = 1 beside deeper rows)
    # and in the sweep
    seen = []
    real = model.head.forward
    model.head.forward = lambda h, h1, m: seen.append((h - h1).abs().amax(dim=(1, 2))) or real(h, h1, m)
    with torch.no_grad():
        model(ids, mask, [1, 3, 1, 2], s0, k_max=3, backward_window=2)
        model.at_depths(ids, mask, [1, 2], s0)
    assert seen[0].tolist()[0] == 0.0 and seen[0].tolist()[2] == 0.0 and seen[0][1] > 0 and seen[0][3] > 0
    assert float(seen[1].max()) == 0.0 and float(seen[2].min()) > 0  # the sweep at K = 1, then at K = 2


@pytest.mark.parametrize("task, data", [("ssp", TASKS_DATA / "bprna_ts0_sample.csv"),
                                        ("nrc", REPO / "data" / "samples" / "rfam_nrc_heldout_sample.fasta.gz")])
def test_a_sweep_at_k4_equals_a_k4_evaluation_bit_for_bit(tmp_path, task, data):
    from pipeline.eval.task_sweeps import sweep

    cfg, model = built(task)
    trained = TrainedModel(cfg, model, tmp_path, {})
    full = sweep(trained, task, data, list(range(1, 9)), seed=3)
    alone = sweep(trained, task, data, [4], seed=3)
    assert full["per_depth"][4] == alone["per_depth"][4]
    assert full["entries"][4] == alone["entries"][4]  # every sequence's prediction, not only the totals
    assert full["per_depth"][1] != full["per_depth"][8]  # the depth changes the predictions of this model
    if task == "nrc":  # longer than the window (94 residues): one seeded window each, counted
        assert full["cropped"] == sum(len(r.sequence) > 94 for r in _nrc_records(data)) > 0
        assert full["sequences"] == 211


def _nrc_records(path):
    from pipeline.tasks import get_task

    return get_task("nrc").read(path, get_task("nrc").config_cls())


def test_the_adapted_spec_starts_from_a_backbone_with_a_seeded_head():
    cfg, _ = built("ssp", 0, "seed=11")
    spec = training_spec(cfg)
    torch.manual_seed(5)
    source = spec.build_model(cfg.model).backbone.state_dict()  # a pretraining run's model
    state = spec.init_state(cfg, {"family": "eco_rna", "task": None}, lambda: source)
    torch.manual_seed(cfg.seed)  # what the Trainer does before it builds the model
    fresh = spec.build_model(cfg.model).state_dict()
    assert all(torch.equal(state[f"backbone.{k}"], v) for k, v in source.items())
    assert all(torch.equal(state[k], fresh[k]) for k in fresh if k.startswith("head."))
    assert set(state) == set(fresh)
    assert spec.init_state(cfg, {"task": {"name": "ssp"}}, lambda: pytest.fail("read")) is None  # same task: whole
    other = {f"backbone.{k}": v for k, v in source.items()} | {"head.out.weight": torch.zeros(3, 3)}
    state = spec.init_state(cfg, {"task": {"name": "nrc"}}, lambda: other)  # another task: its backbone only
    assert torch.equal(state["head.out.weight"], fresh["head.out.weight"])
    with pytest.raises(ConfigError, match="not this task model's backbone"):
        spec.init_state(cfg, {}, lambda: {**source, "extra.weight": torch.zeros(1)})


def test_a_frozen_backbone_has_no_gradient_and_no_optimizer_state():
    from pipeline.train.optim import param_groups

    cfg, model = built("nrc", 0, "task.backbone=frozen", "optim.lr_scale={head: 4.0}")
    groups = param_groups(model, cfg.optim)
    names = {id(p): n for n, p in model.named_parameters()}
    held = [names[id(p)] for g in groups for p in g["params"]]
    assert held and all(n.startswith("head.") for n in held)
    assert {g["lr"] for g in groups} == {cfg.optim.lr * 4.0}
    assert not any(p.requires_grad for p in model.backbone.parameters())


@pytest.mark.parametrize("sets, key", [
    (["task.name=structure"], "task.name: unknown task 'structure'"),
    (["task.backbone=half"], "task.backbone: must be one of full, frozen"),
    (["task.name=nrc", "task.classes=[a, a]"], "task.classes"),
    (["task.name=ssp", "task.pos_weight=0"], "task.pos_weight"),
    (["task.name=reactivity", "task.kernel=4"], "task.kernel"),
    (["task.name=nrc", "task.depth=4"], "task.depth: unknown config key"),
    (["task.name=nrc", "train.max_tokens_per_microbatch=auto", "train.global_batch_tokens=4096",
      "train.grad_accum_steps=1"],
     "train.max_tokens_per_microbatch: auto"),
])
def test_task_section_errors_name_their_key(sets, key):
    base = [] if any(s.startswith("task.name=") for s in sets) else ["task.name=ssp"]
    with pytest.raises(ConfigError) as e:
        load_config(REPO / "launchers" / "configs" / "eco_rna_demo.yaml", [*TINY, *base, *sets])
    assert key in str(e.value) and "\n" not in str(e.value)


def write_export(directory, cfg, model):
    """What tools/convert_checkpoint.py writes for an adapted run (tests/tools/test_finetune runs the tool itself on
    a trained checkpoint): the weights, config.yaml, config.json with auto_map, the shipped code, the tokenizer."""
    from safetensors.torch import save_file

    from pipeline import hf
    from pipeline.hf_code import write_modeling_code

    directory.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(directory / "model.safetensors"))
    (directory / "config.yaml").write_text(dump_yaml(cfg))
    hf.hf_config(cfg).save_pretrained(str(directory))
    export = training_spec(cfg).hf_export()
    write_modeling_code(directory, export)
    export.write_tokenizer(directory, cfg)
    return directory


def test_adapted_exports_load_with_auto_classes_where_the_repository_is_not_installed(tmp_path):
    """nRC with AutoModelForSequenceClassification, secondary structure and reactivity with
    AutoModelForTokenClassification, in one process that cannot import this repository: the pipeline's predictions
    at K = 1 and 4 (the depth chosen per call), the class names as id2label, another Auto class refused."""
    import pipeline.pretrained

    cases = {"nrc": "AutoModelForSequenceClassification", "ssp": "AutoModelForTokenClassification",
             "reactivity": "AutoModelForTokenClassification"}
    requests, models = [], {}
    for task, auto in cases.items():
        cfg, model = built(task, 1)
        models[task] = (cfg, model, write_export(tmp_path / task, cfg, model))
        requests.append({"export": str(tmp_path / task), "auto": auto, "inputs": SEQS, "depths": [1, 4],
                         "wrong": "AutoModelForSequenceClassification" if task == "ssp" else None})
        loaded, _ = pipeline.pretrained.load_pretrained(tmp_path / task)  # the repository's own loader
        assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    (tmp_path / "req.json").write_text(json.dumps(requests))
    r = subprocess.run([sys.executable, str(REPO / "tests" / "tools" / "isolated_task_hf.py"),
                        str(tmp_path / "req.json"), str(tmp_path / "res.json")], cwd=tmp_path, capture_output=True,
                       text=True, timeout=300, env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                                                    "OMP_NUM_THREADS": "1"})  # this process's thread count: equal bits
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads((tmp_path / "res.json").read_text())
    for (task, auto), res in zip(cases.items(), results):
        cfg, model, _ = models[task]
        assert res["module"].startswith("transformers_modules")  # the export's shipped code, not this repository
        ids, mask = torch.tensor(res["input_ids"]), torch.tensor(res["attention_mask"]).bool()
        assert torch.equal(ids, tokens(SEQS)[0])
        with torch.no_grad():
            want = model.at_depths(ids, mask, [1, 4], eval_state(cfg, mask, 0))
        for k in (1, 4):
            got = torch.tensor(res["logits"][str(k)])
            assert torch.equal(got, want[k].float()), (task, k, float((got - want[k]).abs().max()))
        assert not torch.equal(want[1], want[4])
    assert results[0]["class"] == "EcoRNAForSequenceClassification"
    from pipeline.tasks.nrc import NRC_CLASSES

    labels = {int(k): v for k, v in results[0]["id2label"].items()}  # JSON keys are strings
    assert [labels[i] for i in range(len(labels))] == NRC_CLASSES
    assert results[1]["class"] == results[2]["class"] == "EcoRNAForTokenClassification"
    assert {int(k): v for k, v in results[2]["id2label"].items()} == {0: "DMS", 1: "2A3"}
    assert "head is 'PairHead'" in results[1]["wrong"]  # loaded with another Auto class: refused, saying why
    assert np.array(results[1]["logits"]["4"]).shape == (len(SEQS), ids.shape[1], ids.shape[1])
