"""One family, one place (pipeline/families): (a) the code that trains, checkpoints, evaluates, infers, exports and
models scaling asks a family's spec and never names a family; (b) a toy fourth family, defined and registered here
only, goes through the real launchers (dry run, a 2-process training, a resume, an export and its loader) with no
other file changed.

The rule of (a), read from the AST of each file in ``ASKS_THE_SPEC``:

* no string constant equal to a registered family's name (or "standard", the baseline's short name): that is a
  branch (``cfg.family == "eco_rna"``, ``family in ("eco_rna", ...)``) or a table keyed by family. Prose is fine:
  docstrings, comments and messages that mention a model in a longer string are not equal to a name;
* no import of a module with a family's name as a dotted component (``pipeline.models.eco_rna``,
  ``pipeline.objectives.protlingo``) nor of a family's own module in pipeline.families: what such a module holds is
  reached through the spec.
"""
from __future__ import annotations

import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.families import Depth, Family, Scaling, register_family  # noqa: E402
from pipeline.families.base import Activations, nucleotide_tokenizer  # noqa: E402
from pipeline.families.eco_rna import sandwich_block_bytes  # noqa: E402
from pipeline.models.layers import RMSNorm, SandwichBlock, rope_cache  # noqa: E402
from pipeline.objectives import eco_rna as eco_objective  # noqa: E402

ASKS_THE_SPEC = ["pipeline/train", "pipeline/checkpoint", "pipeline/validation.py", "pipeline/pretrained.py",
                 "pipeline/eval/cli.py", "pipeline/inference.py", "pipeline/hf.py", "tools/scaling.py",
                 "tools/convert_checkpoint.py"]
SHORT_NAMES = {"standard"}


# ---- (a) nobody branches on a family name ---------------------------------------------------------------------------
def scanned_files() -> list[Path]:
    out = []
    for rel in ASKS_THE_SPEC:
        p = REPO / rel
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p] if p.is_file() else []
    return out


def violations(path: Path, names: set, root: Path = REPO) -> list[str]:
    """'file:line: what' for every family name constant and family-module import of one file (module docstring)."""
    from pipeline.families import FAMILIES

    family_modules = {"pipeline.families." + m for m in ("eco_rna", "gpt", "protlingo")}
    family_modules |= {spec.hf.partition(":")[0] for spec in FAMILIES.values() if spec.hf}
    rel = path.relative_to(root)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            found.append(f"{rel}:{node.lineno}: the family name {node.value!r}")
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            modules = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        bad = [m for m in modules if set(m.split(".")) & names or m in family_modules]
        if bad:  # one line per import statement
            found.append(f"{rel}:{node.lineno}: imports {bad[0]} (ask the family's spec)")
    return found


def test_the_pipeline_asks_the_spec_and_never_names_a_family():
    from pipeline.families import FAMILIES

    names = set(FAMILIES) | SHORT_NAMES
    files = scanned_files()
    assert len(files) >= 7, files
    found = [v for f in files for v in violations(f, names)]
    assert not found, "\n".join(found)


def test_the_rule_catches_a_branch_and_a_family_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""eco_rna in prose is fine."""\nfrom pipeline.models.eco_rna import EcoRNA\n'
                   'def f(cfg):\n    return cfg.family == "eco_rna"  # eco_rna in a comment is fine\n')
    found = violations(bad, {"eco_rna"}, root=tmp_path)
    assert [v.split(": ", 1)[1] for v in found] == ["imports pipeline.models.eco_rna (ask the family's spec)",
                                                     "the family name 'eco_rna'"]


# ---- (b) a toy fourth family ----------------------------------------------------------------------------------------
TOY = "toy_mlm"


@dataclass
class ToyConfig:
    """A 2-block nucleotide masked LM (pipeline.models.layers' sandwich blocks, an untied head)."""

    vocab_size: int = 23
    d_model: int = 32
    n_heads: int = 2
    n_kv_heads: int = 2
    d_ff: int = 64
    n_layers: int = 2
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    attn_backend: str = "sdpa"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def forward_flops(self, length: int, depth=None) -> int:  # tools/scaling.py's default Scaling.train_flops
        d = self.d_model
        return 2 * length * (self.n_layers * (4 * d * d + 3 * d * self.d_ff) + d * self.vocab_size)


class ToyMLM(nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(SandwichBlock(cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.d_ff, cfg.norm_eps,
                                                  cfg.attn_backend) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """tokens, attention_mask [B, L] -> logits [B, L, V]."""
        x = self.embed(tokens)
        rope = rope_cache(tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, x.device, x.dtype)
        for blk in self.blocks:
            x = blk(x, rope, attention_mask.bool())
        return self.head(self.norm(x))


@dataclass
class ToyObjectiveConfig:
    """Plain masked-LM cross-entropy (Eco-RNA's masking, data.masking)."""


@dataclass
class ToyPlan:
    sync_max: dict  # nothing to agree on across ranks


def toy_plan(batch, cfg, *, step: int, stream: int, index: int) -> ToyPlan:
    return ToyPlan({})


def toy_loss(model, batch, cfg, plan) -> eco_objective.LossOutput:
    logits = model(batch.input_ids, batch.attention_mask)
    total = F.cross_entropy(logits.float().transpose(1, 2), batch.labels, ignore_index=-100, reduction="sum")
    m = int((batch.labels != -100).sum())
    return eco_objective.LossOutput(sum_loss=total, num_tokens=m, stats={"mlm_loss": (float(total.detach()), m)})


def register_toy() -> Family:
    """The toy family, registered (the test process and every launched process call this)."""
    return register_family(Family(
        name=TOY, config_cls=ToyConfig, build_model=ToyMLM, objective_cls=ToyObjectiveConfig,
        make_transform=eco_objective.make_transform, plan=toy_plan, loss=toy_loss, tokenizer="nucleotide",
        make_tokenizer=nucleotide_tokenizer, depth=Depth(trained=lambda cfg: (cfg.model.n_layers, "model.n_layers")),
        scaling=Scaling(activations=lambda cfg, a, k_max: Activations(
            block=sandwich_block_bytes(cfg.model, a), blocks=cfg.model.n_layers, block_input=cfg.model.d_model * a,
            other=4 * cfg.model.vocab_size + 2 * cfg.model.d_model * a)),
        blocks=(SandwichBlock,)))


register_toy()

# A launcher the test writes beside the run: register the toy, then the real launchers/pretrain.py main.
LAUNCHER = """import sys
sys.path[:0] = [{repo!r}, {tests!r}]
from test_family_spec import register_toy
register_toy()
from launchers.pretrain import main
sys.exit(main())
"""
TINY_TOY = ["model.d_model=32", "model.d_ff=64", "data.context_length=64", "data.num_workers=0",
            "train.micro_batch_size=4", "train.log_every=1", "optim.warmup_steps=1", "checkpoint.every_steps=2",
            "checkpoint.keep_last=0", "tracking.enabled=false"]


def toy_config(tmp_path: Path, shards: Path) -> Path:
    cfg = tmp_path / "toy.yaml"
    cfg.write_text(f"family: {TOY}\nrun_dir: {tmp_path / 'run'}\nseed: 7\ndata:\n  train_shards: {shards}\n")
    return cfg


def launcher(tmp_path: Path) -> Path:
    script = tmp_path / "toy_pretrain.py"
    script.write_text(LAUNCHER.format(repo=str(REPO), tests=str(REPO / "tests")))
    return script


def test_the_toy_family_loads_its_config_and_plans_a_dry_run(tmp_path, sample_shards):
    from conftest import run_launch
    from pipeline.config import load_config

    config = toy_config(tmp_path, sample_shards)
    cfg = load_config(config, TINY_TOY)
    assert cfg.family == TOY and isinstance(cfg.model, ToyConfig)
    cmd = [sys.executable, str(launcher(tmp_path)), "--config", str(config), "--dry-run", "--world-size", "2",
           "--ds_config", str(REPO / "ds_configs" / "zero2.json")]
    for o in TINY_TOY:
        cmd += ["--set", o]
    r = run_launch(cmd, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "dry run: resolved without starting anything" in r.stdout and "world: 2 ranks" in r.stdout
    assert not (tmp_path / "run").exists()  # planned, nothing written


@pytest.mark.slow
def test_the_toy_family_trains_resumes_exports_and_loads(tmp_path, sample_shards):
    from conftest import losses, run_torchrun
    from pipeline.checkpoint import load_trained_model
    from pipeline.pretrained import load_pretrained
    from tools import convert_checkpoint

    config, run = toy_config(tmp_path, sample_shards), tmp_path / "run"

    def train(steps: int):
        r = run_torchrun(2, "ds_configs/zero2.json", [*TINY_TOY, f"train.max_steps={steps}"],
                         ["--config", str(config)], script=launcher(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]

    train(2)  # 2 steps on 2 processes, a checkpoint at step 2
    assert sorted(losses(run)) == [1, 2]
    assert (run / "checkpoints" / "step00000002").is_dir()
    train(4)  # a second run with more steps resumes from the first's checkpoint (no kill)
    logged = losses(run)
    assert sorted(logged) == [1, 2, 3, 4], logged
    assert json.loads((run / "checkpoints" / "step00000004" / "client_state.json").read_text())["step"] == 4

    export = tmp_path / "export"
    assert convert_checkpoint.main(["--checkpoint", str(run), "--output", str(export), "--trust-checkpoint"]) == 0
    assert json.loads((export / "export.json").read_text())["format"] == "pipeline"
    assert not (export / "config.json").exists()  # the toy has no HF classes: the pipeline's files only
    trained = load_trained_model(run)
    model, tokenizer = load_pretrained(export)
    ids = torch.from_numpy(tokenizer.encode("ACGUAGCUAGGCUA").astype("int64"))[None]
    mask = torch.ones_like(ids, dtype=torch.bool)
    with torch.no_grad():
        assert torch.equal(model(ids, mask), trained.model(ids, mask))
