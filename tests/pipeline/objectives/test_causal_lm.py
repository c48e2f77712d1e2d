import dataclasses

from pipeline.config import SourceConfig, load_config
from pipeline.data.tokenizer import SPM_NAME
from pipeline.objectives.causal_lm import spm_model_path


def test_the_sentencepiece_model_is_found_beside_the_first_mixture_source(sample_shards, tmp_path):
    """Word counting (train.max_words, checkpoint.at_words) reads the model beside the shards actually trained on:
    data.train_shards is ignored when data.sources is set, and a brace URL names its folder by its pattern."""
    cfg = load_config(None, [f"data.train_shards={tmp_path / 'unused'}"])
    mixed = dataclasses.replace(cfg, data=dataclasses.replace(
        cfg.data, sources=[SourceConfig("rfam", str(sample_shards), weight=1.0)]))
    assert spm_model_path(mixed) == sample_shards / SPM_NAME
    braces = load_config(None, [f"data.train_shards={sample_shards}/rnacentral-{{000000..000001}}.tar"])
    assert spm_model_path(braces) == sample_shards / SPM_NAME
