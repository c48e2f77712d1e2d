"""The benches measure the batch their docstrings state: the configuration each builds, read through the real loader.
(bench/engine.py's P4 once inherited eco_rna_80m.yaml's token budget, so its "8 rows" were 64 and a step took 25-40 s;
its scaling launch ran the default d-768 model where its docstring says the d-128 demo.)"""
import itertools

from bench import engine as engine_bench
from pipeline.config import load_config
from pipeline.data.loader import make_loader
from pipeline.train import RunPlan


def first_batches(cfg, n: int = 6) -> list:
    plan = RunPlan(cfg, "ds_configs/zero2.json", resume="never")  # config and shard checks only, no DeepSpeed
    return list(itertools.islice(make_loader(plan.build_dataset(rank=0), 0), n))


def test_engine_p4_steps_are_one_microbatch_of_8_rows_of_at_most_256_tokens(sample_shards, tmp_path):
    cfg = engine_bench.p4_config(sample_shards, tmp_path / "run")
    assert (cfg.model.d_model, cfg.model.n_prelude, cfg.model.n_core, cfg.model.n_coda) == (256, 1, 2, 1)
    assert cfg.train.grad_accum_steps == 1
    for b in first_batches(cfg):
        assert b.input_ids.shape[0] == 8 and b.input_ids.shape[1] <= 256, b.input_ids.shape


def test_engine_scaling_runs_the_d128_demo_with_2_microbatches_of_8_rows(sample_shards, tmp_path):
    cfg = load_config(engine_bench.SCALING_CONFIG, engine_bench.scaling_overrides(sample_shards, tmp_path, 30))
    assert (cfg.model.d_model, cfg.data.context_length, cfg.train.grad_accum_steps) == (128, 128, 2)
    for b in first_batches(cfg):
        assert b.input_ids.shape[0] == 8 and b.input_ids.shape[1] <= 128, b.input_ids.shape
