"""Pretraining pipeline for Eco-RNA, ProtLingo and RecursiveGPT."""


def __getattr__(name: str):
    # pipeline.load_pretrained, imported on first use: ``import pipeline`` (every data_prep job does) stays free of
    # torch and the model code.
    if name == "load_pretrained":
        from pipeline.pretrained import load_pretrained

        return load_pretrained
    raise AttributeError(f"module 'pipeline' has no attribute {name!r}")
