"""Eco-RNA's Hugging Face export (tools/convert_checkpoint.py): the classes of modeling_eco_rna.py, config.json's extra
fields, the export's tokenizer (pipeline/data/hf_tokenizers.py) and its README lines."""
from __future__ import annotations

from pipeline.families.base import HFExport
from pipeline.families.eco_rna import training_depth
from pipeline.families.modeling_eco_rna import (EcoRNAConfig, EcoRNAForMaskedLM, EcoRNAForSequenceClassification,
                                                EcoRNAForTokenClassification, EcoRNAModel, EcoRNATaskConfig)


def config_kwargs(cfg, depth: int | None) -> dict:
    """num_loops (default the trained mean depth, rounded), the evaluation table (data.context_length, state seed 0
    as launchers/evaluate.py's default --seed) and the nucleotide tokenizer."""
    from pipeline.data.tokenizer import NucleotideTokenizer as Tok

    return {"num_loops": depth or training_depth(cfg), "context_length": cfg.data.context_length,
            "molecule": cfg.data.molecule, "state_seed": 0,
            "tokenizer": {"class": "pipeline.data.tokenizer.NucleotideTokenizer", "alphabet": cfg.data.molecule,
                          "vocab": list(Tok.vocab), "pad_id": Tok.pad_id, "cls_id": Tok.cls_id, "eos_id": Tok.eos_id,
                          "unk_id": Tok.unk_id, "mask_id": Tok.mask_id}}


def card(hf_cfg) -> tuple[list, list]:
    return ([f"- default depth (config.json num_loops): {hf_cfg.num_loops} core iterations (the trained mean depth, "
             f"rounded); initial state: the evaluation table, seed {hf_cfg.state_seed}"],
            ["out = model(input_ids, attention_mask, num_loops=8, output_hidden_states=True)"])


def write_tokenizer(out, cfg, spm=None) -> None:
    """The nucleotide tokenizer of the run's molecule as a transformers fast tokenizer (AutoTokenizer)."""
    from pipeline.data.hf_tokenizers import nucleotide_tokenizer

    nucleotide_tokenizer(cfg.data.molecule, cfg.data.context_length).save_pretrained(str(out))


EXPORT = HFExport(config_cls=EcoRNAConfig, models=(("AutoModel", EcoRNAModel), ("AutoModelForMaskedLM", EcoRNAForMaskedLM)),
                  architectures=("EcoRNAForMaskedLM",), modeling="pipeline.families.modeling_eco_rna",
                  config_kwargs=config_kwargs, card=card, write_tokenizer=write_tokenizer,
                  example="ACGUAGC<mask>UUAGGC")


# ---- adapted models (docs/adaptation.md): the backbone and its task head ----------------------------------------------
_AUTO = {"SequenceClassifier": EcoRNAForSequenceClassification, "PairHead": EcoRNAForTokenClassification,
         "ReactivityHead": EcoRNAForTokenClassification}


def task_config_kwargs(cfg, depth: int | None) -> dict:
    """config_kwargs and the task's head (its config's ``head``: what builds it) and output names."""
    labels = cfg.task.outputs()
    named = {"id2label": dict(enumerate(labels)), "label2id": {n: i for i, n in enumerate(labels)}} if labels else {}
    return {**config_kwargs(cfg, depth), "task": cfg.task.name, "head": cfg.task.head(cfg.model.d_model), **named}


def task_card(hf_cfg) -> tuple[list, list]:
    cls = _AUTO[hf_cfg.head["name"]]
    auto = "AutoModelForSequenceClassification" if cls is EcoRNAForSequenceClassification else \
        "AutoModelForTokenClassification"
    return ([f"- task: {hf_cfg.task} ({hf_cfg.head['name']}); default depth (config.json num_loops): "
             f"{hf_cfg.num_loops} core iterations, any other at each call; initial state: the evaluation table, seed "
             f"{hf_cfg.state_seed}"],
            [f"from transformers import {auto}, AutoTokenizer",
             f"model = {auto}.from_pretrained(\"EXPORT_DIR\", trust_remote_code=True)",
             "tokenizer = AutoTokenizer.from_pretrained(\"EXPORT_DIR\", trust_remote_code=True)",
             "out = model(**tokenizer([\"GGCUAGCUCAGUUGG\"], return_tensors=\"pt\"), num_loops=4)  # out.logits"])


TASK_EXPORT = HFExport(config_cls=EcoRNATaskConfig,
                       models=(("AutoModelForSequenceClassification", EcoRNAForSequenceClassification),
                               ("AutoModelForTokenClassification", EcoRNAForTokenClassification)),
                       architectures=lambda cfg: (_AUTO[cfg.task.head(cfg.model.d_model)["name"]].__name__,),
                       modeling="pipeline.families.modeling_eco_rna", config_kwargs=task_config_kwargs,
                       card=task_card, write_tokenizer=write_tokenizer)
