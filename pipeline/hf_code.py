"""The modeling code an export ships, so that ``from_pretrained(EXPORT, trust_remote_code=True)`` works where this
repository is not installed (transformers' remote code, the way recurrent-depth models such as Huginn ship theirs).

A family's HF classes live in one module (``HFExport.modeling``, e.g. pipeline/families/modeling_eco_rna.py) that
imports only torch, transformers and other first-party modules that do the same (pipeline/models/*.py,
pipeline/families/hf_base.py). ``shipped_sources`` copies that module and every first-party module it reaches into
flat files of one directory, each first-party import rewritten to the relative form transformers' dynamic-module
loader follows (``from pipeline.models.layers import X`` -> ``from .layers import X``); nothing else changes, so the
shipped code is the package's code, line for line (tests/tools/test_export_remote_code.py checks both). config.json's
``auto_map`` then names the classes in the shipped files.

Names: the modeling module keeps its name (``modeling_eco_rna.py``); the others take their last name component
(``layers.py``, ``eco_rna.py``, ``hf_base.py``). A first-party import of a whole module (``from pipeline.models import
eco_rna``) or of a module outside pipeline.models / pipeline.families is refused: the shipped code could not follow
it (transformers' loader reads ``from .name import ...`` only).
"""
from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

FIRST_PARTY = "pipeline"
SHIPPABLE = ("pipeline.models.", "pipeline.families.")  # what shipped code may import from this repository


def _source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"{module}: not found")
    return Path(spec.origin).read_text()


def _first_party_imports(module: str, text: str) -> list[tuple[ast.ImportFrom, str]]:
    """(node, imported module) of every first-party import anywhere in ``text`` (function-local ones too)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == FIRST_PARTY for a in node.names):
            raise ValueError(f"{module}:{node.lineno}: `import {node.names[0].name}`: shipped code imports names "
                             "(from MODULE import NAME)")
        if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module.split(".")[0] == FIRST_PARTY):
            continue
        for alias in node.names:
            if _is_package(node.module) and importlib.util.find_spec(f"{node.module}.{alias.name}") is not None:
                raise ValueError(f"{module}:{node.lineno}: `from {node.module} import {alias.name}` imports a module; "
                                 f"shipped code imports names (from {node.module}.{alias.name} import ...)")
        if not (node.module + ".").startswith(SHIPPABLE) or _is_package(node.module):
            raise ValueError(f"{module}:{node.lineno}: imports {node.module}, which an export does not ship (shipped "
                             f"code reaches the modules of {' and '.join(p.rstrip('.') for p in SHIPPABLE)} only)")
        out.append((node, node.module))
    return out


def _is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


def _rewrite(text: str, imports: list, names: dict) -> str:
    """``text`` with each first-party import made relative (``from .layers import ...``), on as many lines as
    before (a multi-line import becomes one line and blank ones), a trailing comment kept."""
    lines = text.splitlines(keepends=True)
    for node, target in sorted(imports, key=lambda x: -x[0].lineno):  # bottom-up: line numbers stay valid
        names_ = ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in node.names)
        last = lines[node.end_lineno - 1].rstrip("\n")
        comment = "  " + last[last.index("#"):] if "#" in last else ""
        new = f"{' ' * node.col_offset}from .{names[target][:-3]} import {names_}{comment}\n"
        lines[node.lineno - 1:node.end_lineno] = [new] + ["\n"] * (node.end_lineno - node.lineno)
    return "".join(lines)


def shipped_sources(modeling: str) -> dict[str, str]:
    """{file name: text} of the modeling module ``modeling`` and every first-party module it reaches, imports
    rewritten (module docstring). ValueError naming the module and line of an import that cannot be shipped."""
    todo, found = [modeling], {}
    while todo:
        module = todo.pop()
        if module not in found:
            text = _source(module)
            found[module] = (text, _first_party_imports(module, text))
            todo += [target for _, target in found[module][1]]
    names: dict[str, str] = {}
    for module in found:
        name = module.rsplit(".", 1)[-1] + ".py"
        clash = next((m for m, n in names.items() if n == name), None)
        if clash:
            raise ValueError(f"{module} and {clash} would both ship as {name}")
        names[module] = name
    return {names[m]: _rewrite(text, imports, names) for m, (text, imports) in found.items()}


def auto_map(export) -> dict[str, str]:
    """config.json's auto_map: each Auto class (and AutoConfig) -> "<shipped module>.<class>"."""
    mod = export.modeling.rsplit(".", 1)[-1]
    return {"AutoConfig": f"{mod}.{export.config_cls.__name__}",
            **{auto: f"{mod}.{cls.__name__}" for auto, cls in export.models}}


def write_modeling_code(out: Path, export) -> list[str]:
    """Write the shipped files into export directory ``out`` and config.json's auto_map (config.json must exist).
    Returns the file names."""
    files = shipped_sources(export.modeling)
    for name, text in files.items():
        (Path(out) / name).write_text(text)
    cfg_file = Path(out) / "config.json"
    doc = json.loads(cfg_file.read_text())
    doc["auto_map"] = auto_map(export)
    cfg_file.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return sorted(files)
