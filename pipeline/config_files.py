"""Config files read strictly, for the run config (pipeline/config.py) and the DeepSpeed config
(pipeline/ds_config.py): one-line YAML errors with file, line and column, a key given twice refused, non-finite
numbers refused, ``inherit:`` chains, and ``--set key.path=value`` overrides; and ``--config``, a file path or the
bare name of a run config in launchers/configs."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from pipeline.errors import ConfigError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "launchers" / "configs"


def resolve_config(spec: str) -> Path:
    """A config file path, or the bare name of one in launchers/configs (``standard_h384``)."""
    p = Path(spec)
    if p.is_file():
        return p
    if p.parent == Path(".") and (CONFIG_DIR / f"{p.name}.yaml").is_file() and not p.suffix:
        return CONFIG_DIR / f"{p.name}.yaml"
    known = ", ".join(sorted(f.stem for f in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"--config {spec}: no such file, nor a config name of launchers/configs (known: {known})")


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """``a.b=c`` sets raw['a']['b'] to YAML-parsed 'c' (so numbers, booleans, lists and null work)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        node = raw
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {key}: {p} is not a section")
        node[parts[-1]] = yaml.safe_load(text)
    return raw


INHERIT = "inherit"  # top-level key: path of a parent YAML (relative to this file) that this one overrides


def _merge(base: dict, over: dict) -> dict:
    """``over`` on top of ``base``: mappings merge key by key, anything else (lists included) is replaced."""
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _yaml_error(path: Path, e: yaml.YAMLError) -> ConfigError:
    """One line with the file, line and column of a YAML syntax error (PyYAML's own message spans five lines)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and cmark is not None and (mark is None or cmark.line != mark.line):
        problem += f" ({context} started at line {cmark.line + 1})"
    elif context:
        problem += f" ({context})"
    return ConfigError(f"{where}: invalid YAML: {problem}")


def _check_duplicate_keys(node, path: Path, key: str = "", seen: set | None = None):
    """Refuse a key given twice in one mapping, at any depth: PyYAML would silently keep the last one."""
    seen = set() if seen is None else seen
    if id(node) in seen:  # an alias of a node already checked
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first = {}
        for k, v in node.value:
            if isinstance(k, yaml.ScalarNode) and k.tag != "tag:yaml.org,2002:merge":
                name = k.value
                if name in first:
                    raise ConfigError(f"{path}:{k.start_mark.line + 1}: {key + name}: duplicate key (first given at "
                                      f"line {first[name] + 1})")
                first[name] = k.start_mark.line
                _check_duplicate_keys(v, path, f"{key}{name}.", seen)
            else:
                _check_duplicate_keys(v, path, key, seen)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _check_duplicate_keys(v, path, f"{key.rstrip('.')}[{i}].", seen)


def check_finite(value, key: str = "", where: str = ""):
    """``.nan`` / ``.inf`` are YAML (and Python JSON) floats; no config value means them (null means "none"). The
    error names the dotted key, after ``where`` (a file) when given."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{where + ': ' if where else ''}{key.rstrip('.') or 'value'}: expected a finite number, "
                          f"got {value!r}")
    if isinstance(value, dict):
        for k, v in value.items():
            check_finite(v, f"{key}{k}.", where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_finite(v, f"{key.rstrip('.')}[{i}].", where)


def read_config_text(path: Path) -> str:
    """A config file's text; one ConfigError naming it when it is unreadable or not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror or e})") from None


def read_yaml(path: str | Path) -> Any:
    """The document of one YAML file, strictly: errors carry the file and line, a duplicate key is refused."""
    path = Path(path)
    text = read_config_text(path)
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is None:
            return None
        _check_duplicate_keys(node, path)
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _yaml_error(path, e) from None


def load_yaml(path: str | Path, _chain: tuple = ()) -> dict:
    """A YAML mapping; ``inherit: parent.yaml`` makes it the parent's mapping with this file's keys merged on top
    (so a Stage-B or control config states only what differs from its Stage-A config)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    raw = read_yaml(path)
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    parent = raw.pop(INHERIT, None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigError(f"{path}: {INHERIT}: expected a file path, got {parent!r}")
    parent_path = (path.parent / parent).resolve()
    if parent_path in _chain or parent_path == path.resolve():
        raise ConfigError(f"{path}: {INHERIT}: {parent} forms a cycle")
    return _merge(load_yaml(parent_path, _chain + (path.resolve(),)), raw)
