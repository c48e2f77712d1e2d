"""Parameters and buffers are counted apart everywhere: tools/params.py prints both (from the config, and from the
built model with --build), and the export line of convert_checkpoint.py gives the parameters transformers'
``num_parameters()`` counts, the buffers (ProtLingo's memory usage flags) beside them. It said 14,487,395 for the
ProtLingo demo where num_parameters() says 14,447,395: the 40,000 were the boolean ``memory.*.addressed`` flags."""
import re

from golden.cases import unpack_checkpoint
from tools import convert_checkpoint, params


def test_params_prints_parameters_and_buffers_apart(capsys):
    assert params.main(["--config", "protlingo_demo", "--set", "train.init_from=null", "--build"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["protlingo: parameters: total 14,447,395 (14.45M), active 7,976,355 (7.98M)",
                   "buffers: 40,000 values (saved state, not parameters)",
                   "built model: 14,447,395 parameters, 40,000 buffer values (matches the config counts)"]


def test_the_export_line_counts_what_num_parameters_counts(tmp_path, capsys):
    """The committed ProtLingo checkpoint (2 MoE blocks, a memory before block 1) exported and loaded back."""
    import pipeline.hf  # noqa: F401 - registers the families with the Auto classes
    from transformers import AutoModelForMaskedLM

    run = tmp_path / "run"
    unpack_checkpoint("protlingo_zero2", run / "checkpoints")
    assert convert_checkpoint.main(["--checkpoint", str(run), "--output", str(tmp_path / "export"),
                                    "--trust-checkpoint"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    m = re.search(r"\(([\d,]+) parameters \+ ([\d,]+) buffer values, fp32, pipeline names\)$", line)
    assert m, line
    model = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "export"))
    assert int(m[1].replace(",", "")) == model.num_parameters()
    names = {n for n, _ in model.named_parameters()}
    assert int(m[2].replace(",", "")) == sum(v.numel() for k, v in model.state_dict().items() if k not in names) > 0
