"""pipeline.load_pretrained: exports load with their tokenizer and the exact weights; pickles and mismatches are
refused with one line naming what is wrong."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from checkpoint_factory import tiny_config, write_deepspeed_like, write_export  # noqa: E402

from pipeline.config import ConfigError, dump_yaml  # noqa: E402
from pipeline.data.tokenizer import NucleotideTokenizer  # noqa: E402
from pipeline.families import get_family  # noqa: E402
from pipeline.models.eco_rna import initial_state  # noqa: E402
from pipeline.pretrained import load_pretrained  # noqa: E402


def test_eco_rna_export_loads_with_its_weights_and_tokenizer(tmp_path):
    import pipeline

    cfg = tiny_config(tmp_path)
    export = write_export(tmp_path / "export", cfg, seed=3)
    model, tok = pipeline.load_pretrained(export)
    torch.manual_seed(3)
    reference = get_family(cfg.family).build_model(cfg.model).eval()  # the model write_export saved
    assert not model.training
    assert isinstance(tok, NucleotideTokenizer) and tok.alphabet == NucleotideTokenizer(cfg.data.molecule).alphabet
    ids = torch.from_numpy(tok.encode("GGCUAGCUAACGU", add_special=True)).long()[None]
    mask = torch.ones_like(ids, dtype=torch.bool)
    s0 = initial_state(cfg.model, mask, torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids, mask, 4, s0).logits, reference(ids, mask, 4, s0).logits
    assert torch.equal(got, want)


def test_pickled_weights_are_refused_without_unpickling(tmp_path):
    cfg = tiny_config(tmp_path)
    marker = tmp_path / "unpickled"
    run = write_deepspeed_like(tmp_path / "run", cfg, marker=marker)
    with pytest.raises(ConfigError, match="pickled weights .*convert_checkpoint.py"):
        load_pretrained(run)
    bin_dir = tmp_path / "hf_bin"
    bin_dir.mkdir()
    (bin_dir / "config.yaml").write_text(dump_yaml(cfg))
    torch.save({"w": torch.zeros(1)}, bin_dir / "pytorch_model.bin")
    with pytest.raises(ConfigError, match=r"pickled weights \(pytorch_model.bin\)"):
        load_pretrained(bin_dir)
    assert not marker.exists()


def test_config_weights_mismatch_names_the_first_tensor(tmp_path):
    cfg = tiny_config(tmp_path)
    export = write_export(tmp_path / "export", cfg)
    wider = tiny_config(tmp_path, "eco_rna")
    wider.model.d_ff = 48
    (export / "config.yaml").write_text(dump_yaml(wider))
    with pytest.raises(ConfigError, match=r"tensor core\.stack\.blocks\.0\.mlp\.gate_proj\.weight is torch.float32 "
                                          r"\(32, 16\) in the weights but the config's model needs torch.float32 "
                                          r"\(48, 16\)"):
        load_pretrained(export)

    from safetensors.torch import load_file, save_file

    state = load_file(str(export / "model.safetensors"))
    (export / "config.yaml").write_text(dump_yaml(cfg))
    save_file({**state, "stray.weight": torch.zeros(2)}, str(export / "model.safetensors"))
    with pytest.raises(ConfigError, match="tensor stray.weight is not a parameter"):
        load_pretrained(export)
    del state["embed.weight"]
    save_file(state, str(export / "model.safetensors"))
    with pytest.raises(ConfigError, match="tensor embed.weight of the config's model is missing"):
        load_pretrained(export)


def test_not_an_export(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        load_pretrained(tmp_path / "absent")
    with pytest.raises(ConfigError, match="no model.safetensors"):
        load_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not safetensors")
    (tmp_path / "config.yaml").write_text(dump_yaml(tiny_config(tmp_path)))
    with pytest.raises(ConfigError, match="cannot be read as safetensors"):
        load_pretrained(tmp_path)


def test_text_export_without_its_sentencepiece_model_is_refused(tmp_path):
    export = write_export(tmp_path / "export", tiny_config(tmp_path, "recursive_gpt"))
    with pytest.raises(ConfigError, match="no tokenizer.model"):
        load_pretrained(export)


def test_text_export_loads_its_sentencepiece_model(tmp_path):
    import subprocess

    words = "the cat dog sat ran on a mat log red big small fox jumped over lazy river".split()
    g = torch.Generator().manual_seed(0)
    text = tmp_path / "text.train"
    text.write_text("".join(" ".join(words[i] for i in torch.randint(0, len(words), (8,), generator=g).tolist())
                            + "\n" for _ in range(300)))
    repo = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-m", "data_prep", "train-spm", "--input", str(text), "--output",
                           str(tmp_path / "tiny"), "--vocab-size", "320"], cwd=repo, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    cfg = tiny_config(tmp_path, "recursive_gpt")
    export = write_export(tmp_path / "export", cfg)
    (export / "tokenizer.model").write_bytes((tmp_path / "tiny.model").read_bytes())
    model, sp = load_pretrained(export)
    assert sp.get_piece_size() == cfg.model.vocab_size == 320
    torch.manual_seed(0)
    reference = get_family(cfg.family).build_model(cfg.model).eval()  # the model write_export saved (seed 0)
    ids = torch.tensor([sp.encode("the cat sat on a mat")])
    with torch.no_grad():
        assert torch.equal(model(ids), reference(ids))


def test_protlingo_export_loads_with_the_esm2_alphabet(tmp_path):
    """MoE and memory included: the routed experts and memory tables come back exactly (the logits equal)."""
    from pipeline.config import load_config
    from pipeline.data.protein_tokenizer import ProteinTokenizer

    repo = Path(__file__).resolve().parents[2]
    cfg = load_config(repo / "launchers/configs/protlingo_demo.yaml",
                      ["model.d_model=32", "model.n_heads=2", "model.n_layers=2", "model.d_ff=64",
                       "model.moe_layers=[1]", "model.moe_shared_hidden=32", "model.memory_layers=[0]",
                       f"run_dir={tmp_path / 'run'}", f"data.train_shards={tmp_path / 'no_shards'}"])
    export = write_export(tmp_path / "export", cfg, seed=5)
    model, tok = load_pretrained(export)
    assert isinstance(tok, ProteinTokenizer)
    torch.manual_seed(5)
    reference = get_family(cfg.family).build_model(cfg.model).eval()
    ids = torch.from_numpy(tok.encode("MKTAYIAKQRQISFVKSHFSRQ", add_special=True)).long()[None]
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(model(ids, mask).logits, reference(ids, mask).logits)
