"""Every command line's --help explains each flag, and each data_prep subcommand's help shows an example.

Parsers: launchers/*.py, tools/*.py (their ``build_parser()``, or the parser pretrain.py's ``parse_args`` builds) and
``python -m data_prep`` with each subcommand."""
import argparse
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_documented_commands import ROOT, _tokens, check_segment, script_parser  # noqa: E402

SCRIPTS = sorted(str(p.relative_to(ROOT)) for d in ("launchers", "tools") for p in (ROOT / d).glob("*.py"))


def data_prep_parsers() -> dict:
    """'python -m data_prep' and 'python -m data_prep SUB' -> parser."""
    from data_prep.__main__ import build_parser

    top = build_parser()
    subs = next(a for a in top._actions if isinstance(a, argparse._SubParsersAction))
    return {"python -m data_prep": top, **{f"python -m data_prep {n}": p for n, p in subs.choices.items()}}


def undocumented(parser: argparse.ArgumentParser) -> list[str]:
    """The flags and positionals of ``parser`` without help text (-h and hidden ones aside)."""
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or action.help == argparse.SUPPRESS:
            continue
        if isinstance(action, argparse._SubParsersAction):
            helped = {c.dest for c in action._choices_actions if c.help}
            out += [f"subcommand {n}" for n in action.choices if n not in helped]
            continue
        if not (action.help or "").strip():
            out.append("/".join(action.option_strings) or action.dest)
    return out


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_flag_has_help(script):
    parser, _ = script_parser(script)
    assert not undocumented(parser), f"{script}: no help text for {undocumented(parser)}"


def test_every_data_prep_flag_has_help():
    missing = {name: undocumented(p) for name, p in data_prep_parsers().items() if undocumented(p)}
    assert not missing, f"no help text: {missing}"


def test_every_data_prep_subcommand_shows_an_example():
    """Each subcommand's description or epilog has an ``Example`` line running ``python -m data_prep SUB``, and that
    example parses."""
    for name, parser in data_prep_parsers().items():
        if name == "python -m data_prep":
            continue
        text = f"{parser.description or ''}\n{parser.epilog or ''}"
        found = re.search(rf"Example.*\n?\s*({re.escape(name)}\b.*)", text)
        assert found, f"{name}: no example in its --help"
        errors = [e for words in _tokens(found.group(1)) if (e := check_segment(words))]
        assert not errors, f"{name}: its example does not parse: {errors}"
