"""fair-esm ESM2 checkpoints (the ``esm2_t*_UR50D.pt`` files most ESM2 users have): tools/upcycle_esm2.py --esm
reads them with ``weights_only=True`` (argparse.Namespace, the one class they pickle, allowed explicitly) and the
result computes what the fair-esm package's own ESM2 computes. No weights can be downloaded here: the checkpoint is a
small random ESM2 built with the fair-esm package and saved in its on-disk format, which fair-esm's own loader reads
back first (so the format is the package's, not a guess)."""
import argparse
import gzip

import pytest
import torch

from conftest import REPO
from pipeline.checkpoint import load_fair_esm, load_trained_model
from pipeline.config import ConfigError
from tools import upcycle_esm2

esm = pytest.importorskip("esm", reason="the fair-esm package (a dev dependency) is the reference")
SAMPLE = REPO / "data" / "samples" / "uniref90_clusters_sample.fasta.gz"


@pytest.fixture(scope="module")
def fair_checkpoint(tmp_path_factory):
    """(path of a fair-esm-format ESM2 .pt, the fair-esm model it holds)."""
    from esm.model.esm2 import ESM2

    torch.manual_seed(0)
    model = ESM2(num_layers=2, embed_dim=64, attention_heads=4, alphabet="ESM-1b", token_dropout=True).eval()
    with torch.no_grad():  # fair-esm zero-inits some biases: random ones so that a swapped name cannot hide
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.05)
    cfg = argparse.Namespace(encoder_layers=2, encoder_embed_dim=64, encoder_attention_heads=4, token_dropout=True)
    path = tmp_path_factory.mktemp("fair") / "esm2_t2_64_test.pt"
    torch.save({"cfg": {"model": cfg}, "model": {f"encoder.sentence_encoder.{k}": v
                                                  for k, v in model.state_dict().items()}}, path)
    # fair-esm's own loader reads the file back into an identical model: the format is the package's
    loaded, _ = esm.pretrained.load_model_and_alphabet_core("esm2_t2_64_test", torch.load(path, weights_only=False))
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), k
    return path, model


def real_batch(alphabet, n=5, length=80):
    seqs = [r.split("\n", 1)[1].replace("\n", "") for r in gzip.decompress(SAMPLE.read_bytes()).decode().split(">")[1:]]
    converter = alphabet.get_batch_converter()
    _, _, tokens = converter([(str(i), s[:length - 5 * i]) for i, s in enumerate(seqs[:n])])  # unequal lengths
    return tokens


@pytest.mark.parametrize("moe", ["none", "0-1"])
def test_an_upcycled_fair_esm_checkpoint_computes_what_fair_esm_computes(fair_checkpoint, tmp_path, moe):
    """Dense (no MoE, no memory) and upcycled (MoE in both blocks: shared + routed copies equal the dense FFN)."""
    path, ref = fair_checkpoint
    out = tmp_path / "export"
    assert upcycle_esm2.main(["--esm", str(path), "--out", str(out), "--moe-layers", moe, "--memory-layers",
                              "none"]) == 0
    model = load_trained_model(out).model.eval()
    tokens = real_batch(esm.data.Alphabet.from_architecture("ESM-1b"))
    mask = tokens != 1  # fair-esm pads with 1, as the project's ESM alphabet
    with torch.no_grad():
        want = ref(tokens)["logits"]
        got = model(tokens, mask).logits
    # real positions (padding logits are never read); measured: at most 1.2e-5 at logits up to 29 (float32 roundoff
    # of two attention implementations), i.e. 4e-7 relative
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-5, atol=1e-5)


def test_a_pickle_with_code_is_refused(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    path = tmp_path / "esm2_bad.pt"
    torch.save({"cfg": {"model": Payload()}, "model": {}}, path)
    with pytest.raises(ConfigError, match="not loaded: it holds objects other than tensors"):
        load_fair_esm(path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="not a readable torch checkpoint"):
        load_fair_esm(path)


@pytest.mark.slow
def test_init_from_a_fair_esm_checkpoint_starts_where_its_upcycled_export_does(fair_checkpoint, tmp_path):
    """train.init_from a fair-esm .pt (the family's import_weights: backbone copied, MoE upcycled exactly, routers and
    memory fresh from the run's seed) trains step for step as train.init_from the export tools/upcycle_esm2.py
    writes from the same file (seed 0, no perturbation); a config that is not the file's backbone is refused."""
    from conftest import losses, run_single
    from golden.cases import CASES, REL

    path, _ = fair_checkpoint
    config = tmp_path / "protlingo_t2.yaml"  # the demo's choices on the file's backbone (2 blocks of 64)
    config.write_text(f"inherit: {REPO / CASES['protlingo_zero2'][0]}\nmodel:\n  d_model: 64\n  n_layers: 2\n"
                      "  n_heads: 4\n  d_ff: 256\n  moe_shared_hidden: 128\n  moe_layers: [0, 1]\n  num_experts: 4\n"
                      "  memory_layers: [1]\n")
    export = tmp_path / "export"
    assert upcycle_esm2.main(["--esm", str(path), "--out", str(export), "--config", str(config), "--seed", "0"]) == 0
    over = [f"data.train_shards={REL}/data/protein", "data.context_length=64", "train.micro_batch_size=4",
            "optim.warmup_steps=2", "train.max_steps=3", "train.log_every=1", "checkpoint.every_steps=3",
            "tracking.enabled=false", "seed=0"]
    got = {}
    for name, src in (("export", export), ("fair", path)):
        r = run_single("ds_configs/zero2.json", [*over, f"run_dir={tmp_path / name}", f"train.init_from={src}"],
                       ["--config", str(config)])
        assert r.returncode == 0, r.stderr[-3000:]
        got[name] = losses(tmp_path / name)
    assert got["fair"] == got["export"] and len(got["fair"]) == 3, got
    r = run_single("ds_configs/zero2.json", [*over, "model.d_ff=128", "model.moe_shared_hidden=64",
                                              f"run_dir={tmp_path / 'bad'}", f"train.init_from={path}"],
                   ["--config", str(config)])
    assert r.returncode == 2 and "model.d_ff is 128 but the checkpoint gives 256" in r.stderr, r.stderr[-2000:]
