"""Configuration errors of the Eco-RNA objective, each naming its key."""
import pytest


def test_displacement_needs_a_backward_window_of_two():
    from pipeline.config import ConfigError
    from pipeline.objectives.eco_rna import EcoRNAObjectiveConfig

    with pytest.raises(ConfigError, match=r"^objective.backward_window: must be >= 2 when lambda_fp > 0"):
        EcoRNAObjectiveConfig(backward_window=1, lambda_fp=0.1)
    EcoRNAObjectiveConfig(backward_window=1, lambda_fp=0.0)  # no displacement: a window of 1 is fine
