"""Model families: each one's spec (pipeline/families/base.py: Family) and the registry that names them.

Importing the package registers the shipped families (one module each: eco_rna.py for Eco-RNA and its fixed-depth
control, protlingo.py, gpt.py for RecursiveGPT and its standard baseline); ``register_family`` adds more.
"""
from pipeline.families.base import (FAMILIES, Activations, Depth, Family, HFExport, MaskedLMInference, Proxies,
                                    Scaling, get_family, objective_validation, register_family)
from pipeline.families import eco_rna, gpt, protlingo  # noqa: F401,E402 - each registers its families

__all__ = ["FAMILIES", "Activations", "Depth", "Family", "HFExport", "MaskedLMInference", "Proxies", "Scaling",
           "get_family", "objective_validation", "register_family"]
