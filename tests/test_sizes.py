"""Sizes a newcomer can read: the training loop is a short list of calls (its side effects are callbacks,
pipeline/train/callbacks.py), the Trainer class fits on a few screens, and no module of the package or of data_prep
grows past 700 lines (split it by responsibility instead)."""
import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 700
MAX_TRAINER_LINES = 300
MAX_FIT_LINES = 60


def test_the_trainer_and_its_loop_stay_short():
    tree = ast.parse((REPO / "pipeline" / "train" / "trainer.py").read_text())
    trainer = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer")
    fit = next(n for n in trainer.body if isinstance(n, ast.FunctionDef) and n.name == "fit")
    assert trainer.end_lineno - trainer.lineno + 1 <= MAX_TRAINER_LINES
    assert fit.end_lineno - fit.lineno + 1 <= MAX_FIT_LINES


def test_no_module_of_the_package_or_data_prep_is_longer_than_700_lines():
    long = {str(p.relative_to(REPO)): n for root in ("pipeline", "data_prep") for p in (REPO / root).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"split these by responsibility: {long}"


def test_no_data_prep_module_is_longer_than_400_lines():
    """data_prep is read by people adding a source or an option: each module fits in one sitting."""
    long = {p.name: n for p in (REPO / "data_prep").glob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"split these by responsibility: {long}"
