"""The CLI explains itself: every option has a help text, and `tpviz --version` answers."""

from __future__ import annotations

import argparse
import json

import pytest

import tpviz
from tpviz.cli import build_parser, main


def _parsers(parser: argparse.ArgumentParser):
    yield parser.prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_argument_and_command_has_a_help_text():
    missing = []
    for prog, parser in _parsers(build_parser()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                missing += [f"{prog} {c.dest}" for c in action._choices_actions if not c.help]
            elif not action.help or action.help == argparse.SUPPRESS:
                missing.append(f"{prog} {action.dest}")
    assert missing == []


def test_defaults_are_stated(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["make-checkpoint", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default tiny)" in text and "(default float32)" in text


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"tpviz {tpviz.__version__}"


def test_the_choices_mirror_their_registries():
    """The CLI and the Dashboard take their choices from tpviz.choices, spelled out so that
    `--help` stays free of torch; they must be the registries', in their order."""
    from tpviz import choices
    from tpviz.models.demo import PRESETS
    from tpviz.safetensors_header import torch_dtype
    from tpviz.strategies import STRATEGIES

    assert choices.STRATEGIES == tuple(STRATEGIES)
    assert choices.PRESETS == tuple(PRESETS)
    assert all(torch_dtype(d).is_floating_point for d in choices.TARGET_DTYPES)


def test_arguments_the_parser_refuses_are_json_too_under_json(capsys):
    """--json promises JSON on stdout also on failure: a usage error is no exception."""
    assert main(["load", "ck", "--strategy", "fastest", "--json"]) == 2
    out, err = capsys.readouterr()
    (error,) = json.loads(out)["errors"]
    assert error["code"] == "UsageError" and "invalid choice: 'fastest'" in error["message"]
    assert err.startswith("tpviz load: error: argument --strategy: invalid choice") and (
        err.strip().count("\n") == 0 and err.strip().endswith("(see tpviz load --help)")
    )
    assert main(["plan", "ck", "--world-size", "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "must be a positive integer, not '0'" in err
    for flag in ("--events", "--report", "--profile", "--plan", "--model"):  # not "not given"
        assert main(["load", "ck", flag, ""]) == 2
        assert f"argument {flag}: must not be empty" in capsys.readouterr().err
    # a flag the subcommand lacks points at its help, which lists its flags (tpviz's does not)
    assert main(["plan", "ck", "--strategy", "sliced"]) == 2
    assert capsys.readouterr().err == (
        "tpviz plan: error: unrecognized arguments: --strategy sliced (see tpviz plan --help)\n"
    )
