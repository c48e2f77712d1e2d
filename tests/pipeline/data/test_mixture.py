"""Mixture schedules: weights per optimizer step, config validation, realized source fractions in the loader."""
import itertools
import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from conftest import REPO, HELDOUT_FASTA, SHARED_DATA
from pipeline.config import ConfigError, load_config
from pipeline.data.loader import ShardStream, make_loader
from pipeline.data.mixture import MixtureSchedule
from pipeline.data.streams import Source
from pipeline.objectives.eco_rna import make_transform

PHIX = SHARED_DATA / "genome" / "phiX174_variants_134_genomes.fna"


@pytest.fixture(scope="session")
def mix_sources(sample_shards, tmp_path_factory) -> dict:
    """Three shard dirs built by the real data_prep CLI: Rfam train sample, Rfam held-out sample, phiX174 genomes."""
    root = tmp_path_factory.mktemp("mix")
    dirs = {"rfam": sample_shards}
    jobs = [("heldout", ["rnacentral", "--input", str(HELDOUT_FASTA), "--shard-size", "25"])]
    if PHIX.is_file():
        jobs.append(("phix", ["fasta", "--alphabet", "dna", "--input", str(PHIX), "--shard-size", "16"]))
    else:  # without ../shared/data: a second view of the train sample with other shard boundaries
        jobs.append(("phix", ["rnacentral", "--input", str(REPO / "data/samples/rfam_nrc_train_sample.fasta.gz"),
                              "--shard-size", "250"]))
    for name, args in jobs:
        out = root / name
        subprocess.run([sys.executable, "-m", "data_prep", *args, "--output", str(out)], cwd=REPO, check=True,
                       capture_output=True)
        dirs[name] = out
    return dirs


def mixture_stream(dirs, schedule, *, rank=0, world=1, workers=0, mb=8, accum=1, max_tokens=None):
    cfg = load_config(None, ["data.context_length=32"])
    return ShardStream([Source(n, d) for n, d in dirs.items()], rank=rank, world_size=world, num_workers=workers,
                       micro_batch_size=mb, seed=5, transform=make_transform(cfg), pad_id=0, mixture=schedule,
                       grad_accum_steps=accum, max_tokens=max_tokens)


def test_schedule_constant_linear_stepped_and_after_the_end():
    names = ["a", "b"]
    m = MixtureSchedule.from_stages(names, [
        {"until_step": 10, "weights": {"a": 3, "b": 1}},
        {"until_step": 20, "weights": {"a": 1, "b": 0}, "ramp": "linear", "end_weights": {"b": 1}},
        {"until_step": 28, "weights": {"a": 1}, "ramp": "stepped", "end_weights": {"b": 1}, "ramp_levels": 4}])
    assert np.allclose(m.weights(0), [0.75, 0.25]) and np.allclose(m.weights(9), [0.75, 0.25])
    assert np.allclose(m.weights(10), [1, 0])  # switch exactly at until_step
    assert np.allclose(m.weights(15), [0.5, 0.5]) and np.allclose(m.weights(19), [0.1, 0.9])
    # stepped: 4 plateaus of 2 steps at t = 0, 1/3, 2/3, 1
    assert [round(float(m.weights(s)[1]), 4) for s in range(20, 28)] == [0, 0, .3333, .3333, .6667, .6667, 1, 1]
    assert np.allclose(m.weights(28), [0, 1]) and np.allclose(m.weights(10**6), [0, 1])  # final weights persist


def test_config_yaml_and_errors_name_the_field(tmp_path):
    f = tmp_path / "mix.yaml"
    f.write_text("""data:
  sources:
    - {name: dna, shards: d1, molecule: dna}
    - {name: rna, shards: d2}
  schedule:
    - {until_step: 100, weights: {dna: 0.8, rna: 0.2}}
    - {until_step: 200, ramp: linear, weights: {dna: 0.8, rna: 0.2}, end_weights: {dna: 0.2, rna: 0.8}}
    - {weights: {rna: 1}}
""")
    cfg = load_config(f)
    m = cfg.data.mixture()
    assert m.names == ["dna", "rna"] and np.allclose(m.weights(150), [0.5, 0.5]) and m.as_dict(500)["rna"] == 1
    bad = {
        "data.schedule[1].until_step: 50 must be > the stage's start step 100":
            "data.schedule=[{until_step: 100, weights: {a: 1}}, {until_step: 50, weights: {a: 1}}]",
        "data.schedule[0].weights: unknown source 'c'": "data.schedule=[{weights: {c: 1}}]",
        "data.schedule[0].end_weights: a linear ramp needs":
            "data.schedule=[{until_step: 9, ramp: linear, weights: {a: 1}}]",
        "data.schedule[0].ramp: must be one of": "data.schedule=[{until_step: 9, ramp: cosine, weights: {a: 1}}]",
        "data.schedule.weights.a: expected a number >= 0": "data.schedule=[{weights: {a: -1}}]",
        "data.sources.weight: every source needs a weight": "data.schedule=[]",
    }
    for msg, override in bad.items():
        with pytest.raises(ConfigError, match=msg.replace("[", r"\[").replace("]", r"\]")):
            load_config(None, ["data.sources=[{name: a, shards: x}, {name: b, shards: y}]", override])
    with pytest.raises(ConfigError, match="train.max_tokens_per_microbatch: 64 < data.context_length 128"):
        load_config(None, ["train.max_tokens_per_microbatch=64", "data.context_length=128"])


def test_two_stage_schedule_switches_ramps_and_realizes_the_weights(mix_sources):
    """Acceptance 4: stage 1 constant (10k samples), stage 2 linear ramp (10k samples), realized within 2 points."""
    mb, accum, workers = 8, 2, 2  # rank-local microbatch j -> step j // accum; workers rotate the streams
    steps = 10_000 // (mb * accum)  # 625 steps per stage
    stage1 = {"rfam": 0.5, "heldout": 0.2, "phix": 0.3}
    ramp_from, ramp_to = {"rfam": 0.6, "heldout": 0.3, "phix": 0.1}, {"rfam": 0.1, "heldout": 0.3, "phix": 0.6}
    names = list(mix_sources)
    m = MixtureSchedule.from_stages(names, [
        {"until_step": steps, "weights": stage1},
        {"until_step": 2 * steps, "ramp": "linear", "weights": ramp_from, "end_weights": ramp_to},
        {"weights": {"heldout": 1}}])
    ds = mixture_stream(mix_sources, m, workers=workers, mb=mb, accum=accum)
    per_step = [Counter() for _ in range(2 * steps + 3)]
    for j, b in enumerate(itertools.islice(make_loader(ds, workers), accum * len(per_step))):
        per_step[j // accum].update(b.sources)
    first = sum(per_step[:steps], Counter())
    ramp = sum(per_step[steps:2 * steps], Counter())
    assert sum(first.values()) == sum(ramp.values()) == 10_000
    for n in names:
        assert abs(first[n] / 10_000 - stage1[n]) < 0.02, (n, first)
        want = np.mean([m.weights(s)[names.index(n)] for s in range(steps, 2 * steps)])  # the ramp's average
        assert abs(ramp[n] / 10_000 - want) < 0.02, (n, ramp, want)
    # the ramp moves: its first and last quarters differ as configured (rfam 0.6 -> 0.1, phix 0.1 -> 0.6)
    q = steps // 4
    early, late = sum(per_step[steps:steps + q], Counter()), sum(per_step[2 * steps - q:2 * steps], Counter())
    assert early["rfam"] > 2 * late["rfam"] and late["phix"] > 2 * early["phix"]
    # switch exactly at the configured step: after 2 * steps only 'heldout' is drawn
    assert all(set(c) == {"heldout"} for c in per_step[2 * steps:])
    assert set(per_step[2 * steps - 1]) != {"heldout"}


def test_source_fractions_hold_on_every_rank_and_ids_name_the_source(mix_sources):
    w = {"rfam": 0.25, "heldout": 0.25, "phix": 0.5}
    m = MixtureSchedule.constant(list(mix_sources), w)
    for rank in (0, 1):
        c = Counter()
        for b in itertools.islice(make_loader(mixture_stream(mix_sources, m, rank=rank, world=2), 0), 500):
            c.update(b.sources)
            assert all(sid.startswith(f"{src}:") for sid, src in zip(b.sample_ids, b.sources))
        assert all(abs(c[n] / 4000 - w[n]) < 0.03 for n in w), c
