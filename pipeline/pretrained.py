"""Load an exported model for use outside training: ``load_pretrained(DIR) -> (model, tokenizer)``.

An export is what ``tools/convert_checkpoint.py`` writes: ``model.safetensors`` + ``config.yaml`` (+ ``export.json``,
``config.json`` for the transformers Auto classes, and ``tokenizer.model`` for the text families). A dense ProtLingo
(an ESM2) is written under transformers' EsmForMaskedLM names, mapped back here; a ``--dtype bf16`` export loads as a
bf16 model. Only safetensors are read, so loading runs no code from the file: a
directory holding pickled weights (a DeepSpeed checkpoint, ``pytorch_model.bin``, ``*.pt``) is refused with the
command that exports it. The weights must fit the config exactly; the first tensor that does not (missing, of another
shape or dtype, or not in the model) is named in one ConfigError.

Tokenizers: Eco-RNA and its control use the nucleotide tokenizer of the run's molecule (``data.molecule``), ProtLingo
the ESM-2 alphabet, the text families the export's sentencepiece model.
"""
from __future__ import annotations

from pathlib import Path

import torch

from pipeline.checkpoint import EXPORTED_WEIGHTS, export_state_names
from pipeline.config import ConfigError, build_config, load_yaml
from pipeline.families import get_family

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


def load_pretrained(path: str | Path, device: str | torch.device = "cpu"):
    """(model in eval mode on ``device``, tokenizer) from an export directory."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"{d}: not a directory (load_pretrained reads an export of tools/convert_checkpoint.py)")
    weights = d / EXPORTED_WEIGHTS
    if not weights.is_file():
        pickled = sorted(p.name for p in d.rglob("*") if p.suffix in PICKLE_SUFFIXES)
        if pickled or (d / "latest").is_file() or (d / "checkpoints").is_dir():
            raise ConfigError(f"{d}: holds pickled weights ({pickled[0] if pickled else 'a DeepSpeed checkpoint'}), "
                              "which load_pretrained does not unpickle; export them first: python "
                              f"tools/convert_checkpoint.py --checkpoint {d} --output EXPORT")
        raise ConfigError(f"{d}: no {EXPORTED_WEIGHTS} (not an export of tools/convert_checkpoint.py)")
    if not (d / "config.yaml").is_file():
        raise ConfigError(f"{d}: no config.yaml beside {EXPORTED_WEIGHTS}")
    cfg = build_config(load_yaml(d / "config.yaml"))
    from pipeline.tasks import training_spec  # an adapted model (a task: section) is its backbone and head

    model = training_spec(cfg).build_model(cfg.model)
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{weights}: cannot be read as safetensors ({str(e).splitlines()[0]})") from None
    state = export_state_names(state, d)  # an ESM-format export (a dense ProtLingo) holds transformers' names
    if state and all(v.dtype == torch.bfloat16 for v in state.values() if v.is_floating_point()):
        model = model.to(torch.bfloat16)  # a --dtype bf16 export: the model in the dtype it was written in
    check_weights_fit(model, state, weights)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval(), tokenizer_for(cfg, d)


def check_weights_fit(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path):
    """ConfigError naming the first tensor of ``model`` (in its own order) that ``state`` lacks or holds with another
    shape or dtype, else the first tensor of ``state`` the model does not have."""
    ours = model.state_dict()
    for name, want in ours.items():
        got = state.get(name)
        if got is None:
            raise ConfigError(f"{source}: tensor {name} of the config's model is missing from the weights "
                              "(config.yaml and model.safetensors are not from the same export?)")
        if got.shape != want.shape or got.dtype != want.dtype:
            raise ConfigError(f"{source}: tensor {name} is {got.dtype} {tuple(got.shape)} in the weights but the "
                              f"config's model needs {want.dtype} {tuple(want.shape)}")
    extra = [name for name in state if name not in ours]
    if extra:
        raise ConfigError(f"{source}: tensor {extra[0]} is not a parameter of the config's model "
                          f"({len(extra)} such tensors)")


def tokenizer_for(cfg, export_dir: Path):
    """The tokenizer the exported model was trained with (module docstring): the family's ``make_tokenizer``."""
    return get_family(cfg.family).make_tokenizer(cfg, export_dir)
