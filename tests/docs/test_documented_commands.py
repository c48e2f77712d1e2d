"""Every command the documentation prints runs as printed: the project file it names exists and its flags parse with
that command line's own argparse parser (nothing runs, nothing trains).

Read: the ```bash / ```sh / ```console and unlabelled fenced blocks and the 4-space indented lines of README.md and
docs/*.md, and the comment lines of launchers/configs/**/*.yaml, scripts/*.sh and launchers/slurm/*.sbatch. A command
(backslash continuations joined, split at ``&&``, ``;``, ``|``, leading ``FOO=1`` assignments dropped) is checked when
it invokes a project file: ``python launchers|tools|bench/X.py``, ``python -m data_prep``, ``bash scripts/X.sh``, or a
script under ``deepspeed`` / ``scripts/launch.sh`` (whose own flags are parsed with DeepSpeed's runner parser first).
Other commands (``cd``, ``pip``, ``git``, ``mlflow``, ``pytest``, ...) are not read. Synopsis brackets
(``[--resume auto|never|DIR]``) count as the flags they hold; a placeholder value (``N``, ``RUN_DIR``, ``<x>``,
``...``) given to a typed option is replaced by a value of its type, so only the flags themselves are judged.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted({ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "launchers" / "configs").rglob("*.yaml"),
                  *(ROOT / "scripts").glob("*.sh"), *(ROOT / "launchers" / "slurm").glob("*.sbatch")})
FENCES = ("bash", "sh", "shell", "console", "")
PYTHON = re.compile(r"^(\S*/)?python(3(\.\d+)?)?$|^\$\{?PY(THON)?\}?$")
DEEPSPEED = re.compile(r"^(\S*/)?deepspeed$")
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDER = re.compile(r"^(<[^>]*>|\.\.\.|[A-Z][A-Z0-9_]*)$")
SEPARATORS = {"&&", "||", ";", "|"}
# Scripts that hand their arguments to launchers/pretrain.py after the arguments they supply themselves.
TO_PRETRAIN = {"scripts/quickstart.sh": ["--ds_config", "ds_configs/zero2.json"],
               "scripts/protlingo_demo.sh": ["--ds_config", "ds_configs/zero2.json"]}


def _starts_command(text: str) -> bool:
    words = text.split()
    while words and ASSIGNMENT.match(words[0]):
        words = words[1:]
    if words and words[0] == "exec":
        words = words[1:]
    return bool(words) and bool(PYTHON.match(words[0]) or DEEPSPEED.match(words[0]) or words[0] in ("bash", "sh"))


def _join(lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(first line, command) with backslash continuations joined."""
    out, start, parts = [], None, []
    for number, text in lines:
        if start is None:
            start = number
        parts.append(text.rstrip().removesuffix("\\"))
        if not text.rstrip().endswith("\\"):
            out.append((start, " ".join(parts)))
            start, parts = None, []
    if parts:
        out.append((start, " ".join(parts)))
    return out


def commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) for every command line the file documents."""
    raw = path.read_text(encoding="utf-8").splitlines()
    picked: list[tuple[int, str]] = []
    if path.suffix == ".md":
        fence = None
        for number, line in enumerate(raw, 1):
            marker = line.lstrip()
            if marker.startswith("```"):
                fence = marker[3:].strip() if fence is None else None
                continue
            if fence is None and line.startswith("    ") and _starts_command(line.strip()):
                picked.append((number, line.strip()))
            elif fence in FENCES:
                text = line.strip().removeprefix("$ ")
                if picked and picked[-1][1].rstrip().endswith("\\") and picked[-1][0] == number - 1:
                    picked.append((number, text))
                elif _starts_command(text):
                    picked.append((number, text))
    else:  # comments of YAML configs and shell scripts
        for number, line in enumerate(raw, 1):
            m = re.match(r"^\s*#+\s?(.*)$", line)
            if not m or line.startswith("#!"):
                continue
            text = m.group(1).strip()
            if picked and picked[-1][1].rstrip().endswith("\\") and picked[-1][0] == number - 1:
                picked.append((number, text))
            elif _starts_command(text):
                picked.append((number, text))
    return _join(picked)


def _tokens(command: str) -> list[list[str]]:
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        words = command.split()
    words = [w.strip("[]") for w in words]
    # "..." repeats what precedes it ("[--set k=v ...]"), except as a flag's value ("--config ...").
    words = [w for i, w in enumerate(words) if w != "..." or (i and words[i - 1].startswith("-"))]
    segments, current = [], []
    for w in words:
        if w in SEPARATORS:
            segments.append(current)
            current = []
        elif w and not re.match(r"^\d?>", w):  # redirections
            current.append(w)
    segments.append(current)
    return [s for s in segments if s]


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def capture_parser(function, *args) -> argparse.ArgumentParser:
    """The parser ``function`` builds and parses with, taken at its parse_args call: nothing after it runs."""
    original = argparse.ArgumentParser.parse_args

    def stop(self, *a, **k):
        raise _Captured(self)

    argparse.ArgumentParser.parse_args = stop
    try:
        function(*args)
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args = original
    raise AssertionError(f"{function} returned without parsing a command line")


def _options(parser: argparse.ArgumentParser, argv: list[str]) -> dict:
    """Option string -> action, the chosen subcommand's included."""
    found = dict(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = next((w for w in argv if w in action.choices), None)
            if chosen:
                found.update(_options(action.choices[chosen], argv))
    return found


def _sample(action: argparse.Action):
    if action.choices:
        return str(next(iter(action.choices)))
    for text in ("1", "1.0", "1-8", "x"):
        try:
            action.type(text)
            return text
        except Exception:  # noqa: BLE001 - any refusal: try the next sample
            continue
    return None


def fill_placeholders(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    options, out = _options(parser, argv), list(argv)
    for i in range(1, len(out)):
        action = options.get(out[i - 1])
        if action is not None and action.nargs != 0 and PLACEHOLDER.match(out[i]) and (action.type or action.choices):
            out[i] = _sample(action) or out[i]
    return out


def parse(parser: argparse.ArgumentParser, argv: list[str], parse_args=None):
    """Parse argv with ``parse_args`` (default: the parser's own); the error argparse prints on failure, else None."""
    argv = fill_placeholders(parser, argv)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            result = (parse_args or parser.parse_args)(argv)
        except SystemExit as e:
            if e.code:
                return err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {e.code}"
            return None
    return result


def script_parser(script: str):
    """(parser, parse function) of a project Python file: its ``build_parser()``, else the parser its ``parse_args``
    or ``main`` builds (taken at the parse, before anything runs)."""
    module = importlib.import_module(script.removesuffix(".py").replace("/", "."))
    if hasattr(module, "build_parser"):
        return module.build_parser(), None
    if hasattr(module, "parse_args"):  # launchers/pretrain.py: its parse_args adds checks of its own
        return capture_parser(module.parse_args, []), module.parse_args
    return capture_parser(module.main, []), None


def deepspeed_runner():
    from deepspeed.launcher import runner

    return capture_parser(runner.parse_args, [])


def check_python_file(script: str, argv: list[str]) -> str | None:
    if not (ROOT / script).is_file():
        return f"{script} does not exist"
    parser, parse_args = script_parser(script)
    error = parse(parser, argv, parse_args)
    return f"{script}: {error}" if isinstance(error, str) else None


def check_launcher(argv: list[str], launcher: str) -> str | None:
    """deepspeed's (or scripts/launch.sh's) own flags by DeepSpeed's runner parser, then the script's by its own."""
    parsed = parse(deepspeed_runner(), argv)
    if isinstance(parsed, str):
        return f"{launcher}: {parsed} (is the script, e.g. launchers/pretrain.py, missing?)"
    return check_segment(["python", parsed.user_script, *parsed.user_args])


def check_segment(words: list[str]) -> str | None:
    """The error of one simple command, or None (also for commands that invoke no project file)."""
    while words and (ASSIGNMENT.match(words[0]) or words[0] == "exec"):
        words = words[1:]
    if not words:
        return None
    program, rest = words[0], words[1:]
    if DEEPSPEED.match(program):
        return check_launcher(rest, "deepspeed")
    if PYTHON.match(program):
        if rest[:2] == ["-m", "data_prep"]:
            from data_prep.__main__ import build_parser

            error = parse(build_parser(), rest[2:])
            return f"python -m data_prep: {error}" if isinstance(error, str) else None
        if rest[:2] == ["-m", "deepspeed.launcher.runner"]:
            return check_launcher(rest[2:], "deepspeed.launcher.runner")
        if rest and rest[0].endswith(".py") and rest[0].split("/")[0] in ("launchers", "tools", "bench"):
            return check_python_file(rest[0], rest[1:])
        return None
    if program in ("bash", "sh") and rest and rest[0].endswith(".sh") and "$" not in rest[0]:
        script, args = rest[0], rest[1:]
        if not (ROOT / script).is_file():
            return f"{script} does not exist"
        if script == "scripts/launch.sh":
            return check_launcher(args, script)
        if script in TO_PRETRAIN:
            return check_segment(["python", "launchers/pretrain.py", *TO_PRETRAIN[script], *args])
        if script == "scripts/prepare_gpu_check.sh":
            known = set(re.findall(r"^\s*([-\w|]+)\)", (ROOT / script).read_text(), re.M))
            known = {flag for pattern in known for flag in pattern.split("|")}
            unknown = [a for a in args if a not in known]
            return f"{script} does not take {unknown}" if unknown else None
    return None


def failures(path: Path) -> list[str]:
    rel = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    out = []
    for line, command in commands(path):
        for words in _tokens(command):
            error = check_segment(words)
            if error:
                out.append(f"{rel}:{line}: {command}\n    -> {error}")
    return out


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_parse(source):
    found = failures(source)
    assert not found, "documented commands that do not run as printed:\n" + "\n".join(found)


def test_the_reader_finds_the_commands():
    """The reader sees the commands it should (a reader that found nothing would pass every page)."""
    readme = [c for _, c in commands(ROOT / "README.md")]
    assert any("launchers/pretrain.py" in c and "--init-from DIR" in c for c in readme), readme
    assert any("tools/convert_checkpoint.py" in c for c in readme), readme
    yaml = [c for _, c in commands(ROOT / "launchers" / "configs" / "esm2_continued.yaml")]
    assert any("launchers/pretrain.py" in c for c in yaml), yaml


def test_a_broken_command_fails(tmp_path):
    """A missing file, an unknown flag and a launcher without its script are each reported with the page's line."""
    page = tmp_path / "page.md"
    page.write_text("x\n\n```bash\n.venv/bin/python tools/no_such_tool.py --x 1\n"
                    ".venv/bin/python tools/params.py --config eco_rna_80m --no-such-flag\n"
                    ".venv/bin/deepspeed --num_gpus 2 --ds_config ds_configs/zero2.json --config x.yaml\n"
                    ".venv/bin/python -m data_prep rnacentral --input a --output b --bogus\n"
                    "bash scripts/quickstart.sh --set train.max_steps=200\n```\n")
    found = failures(page)
    assert len(found) == 4, found
    assert found[0].startswith("page.md:4:") and "no_such_tool.py does not exist" in found[0]
    assert "--no-such-flag" in found[1] and "--ds_config" in found[2] and "--bogus" in found[3]


def script_commands(path: Path) -> list[tuple[int, str]]:
    """(line, command) of every command a shell script runs (not its comments): project files invoked directly,
    through ``$PY`` or through scripts/launch.sh, continuations joined."""
    picked: list[tuple[int, str]] = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        if picked and picked[-1][1].rstrip().endswith("\\") and picked[-1][0] == number - 1:
            picked.append((number, text))
        elif _starts_command(text.replace('"$PY"', "$PY")):
            picked.append((number, text))
    return _join(picked)


@pytest.mark.parametrize("script", ["scripts/adapt_demo.sh"])
def test_a_demo_scripts_own_commands_parse(script):
    """The commands scripts/adapt_demo.sh runs (the comment lines are checked above) parse with their tools' parsers,
    the fine-tunes' through DeepSpeed's runner and launchers/finetune.py: a renamed flag fails here, not 15 minutes
    into the demo. Its configs load (tests/pipeline/test_config.py) and take their backbone from the quickstart's run
    (tests/launchers/test_finetune.py)."""
    found = script_commands(ROOT / script)
    invoked = " ".join(c for _, c in found)
    for tool in ("tools/prepare_task.py", "launchers/finetune.py", "launchers/evaluate.py",
                 "tools/convert_checkpoint.py", "scripts/adapt_demo_load.py"):
        assert tool in invoked, (tool, found)
    errors = [f"{script}:{line}: {command}\n    -> {error}" for line, command in found
              for words in _tokens(command) if (error := check_segment(words))]
    assert not errors, "\n".join(errors)
