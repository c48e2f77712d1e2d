"""Hugging Face ``transformers`` registration and export configs for the pipeline's model families.

    import pipeline.hf  # registers every family's classes with the Auto classes
    from transformers import AutoModelForMaskedLM
    model = AutoModelForMaskedLM.from_pretrained("exports/eco_rna_demo")

(Without this repository: ``from_pretrained(EXPORT, trust_remote_code=True)`` runs the copy of the same classes the
export ships, pipeline/hf_code.py.)

An export of ``tools/convert_checkpoint.py`` holds ``config.json`` (a family's config, or a foreign library's such
as transformers' own ``EsmConfig`` for a dense ProtLingo) beside ``model.safetensors``. The classes themselves are
the families' (pipeline/families/modeling_*.py, declared by each spec's ``hf``: an HFExport with the config class, the model
classes per Auto class and config.json's architectures); this module only asks the specs. A family without HF
classes (spec ``hf`` None, e.g. the fixed-depth control) exports the pipeline's files only. Nothing here imports
DeepSpeed or torch.distributed.
"""
from __future__ import annotations

import transformers

from pipeline.families import FAMILIES, get_family
from pipeline.families.base import load_hf
from pipeline.tasks import training_spec


def hf_config(cfg, num_loops: int | None = None):
    """The Hugging Face config of a RunConfig (the one config.json of its export holds): the foreign format's when
    the family writes this model in one, else the family's own HF config, or an adapted model's (a task: section;
    ``num_loops``: the depth it runs at by default, default the family's Depth.default). ValueError for a family
    without HF classes."""
    export = training_spec(cfg).hf_export()
    if export is None:
        known = sorted(name for name, spec in FAMILIES.items() if spec.hf is not None)
        raise ValueError(f"family: {cfg.family} has no Hugging Face classes (known: {', '.join(known)})")
    foreign = export.foreign(cfg)
    if foreign is not None:
        return foreign[1]
    return export.config(cfg, num_loops)


def export_format(cfg) -> str:
    """export.json's "format": the foreign library's name when the family writes this model in one, else
    "pipeline" (the pipeline's own tensor names)."""
    export = training_spec(cfg).hf_export()
    foreign = export.foreign(cfg) if export is not None else None
    return foreign[0] if foreign is not None else "pipeline"


_REGISTERED: set = set()


def register():
    """Make AutoConfig and the Auto model classes know every registered family's HF classes (idempotent; run on
    ``import pipeline.hf``, and again by anyone registering a family afterwards)."""
    for name, spec in list(FAMILIES.items()):
        if name in _REGISTERED:
            continue
        adapted = load_hf(spec.adapt.hf) if spec.adapt is not None else None  # its adapted models' classes
        for export in (e for e in (spec.hf_export(), adapted) if e is not None):
            transformers.AutoConfig.register(export.config_cls.model_type, export.config_cls, exist_ok=True)
            for auto, model_cls in export.models:
                getattr(transformers, auto).register(export.config_cls, model_cls, exist_ok=True)
        _REGISTERED.add(name)



register()
