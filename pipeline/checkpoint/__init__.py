"""Checkpoints: what a run directory holds and its safety rules (layout), reading weights from any checkpoint or
export (read), writing and resuming a training's DeepSpeed checkpoints (io, resume), and every compatibility rule
for checkpoints of older code (migrate). docs/checkpoints.md describes the protocol; docs/architecture.md where it
sits. The names below are the readers' public API (evaluation, export, inference, tools)."""
# The readers' names come from read.py on first use (PEP 562): read.py imports torch, the configs and the families,
# which the light modules of this package (layout: the run directory's files and lock) must not pay for.
__all__ = ["EXPERT_FILES", "EXPORTED_WEIGHTS", "TrainedModel", "check_same_model", "export_state_names", "is_export",
           "is_foreign_checkpoint", "latest_tag", "load_esm2", "load_fair_esm", "load_foreign_model",
           "load_hf_directory", "load_state_dict", "load_trained_model", "load_weights_into", "read_client_state",
           "resolve_tag_dir", "zero12_optimizer_state"]


def __getattr__(name: str):
    if name in __all__:
        from pipeline.checkpoint import read

        return getattr(read, name)
    raise AttributeError(f"module 'pipeline.checkpoint' has no attribute {name!r}")
