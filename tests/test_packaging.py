"""Packaging: environment.yml follows pyproject.toml (conda is not available to run it)."""

from __future__ import annotations

import re
import tomllib

from .conftest import REPO


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ \[]", requirement.strip(), maxsplit=1)[0].lower()


def test_environment_yml_lists_the_pyproject_dependencies():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {_name(r): r.replace(" ", "") for r in project["dependencies"]}
    for extra in project["optional-dependencies"].values():
        wanted.update({_name(r): r.replace(" ", "") for r in extra})
    text = (REPO / "environment.yml").read_text()
    lines = text[text.index("dependencies:") :].splitlines()
    listed = {}
    for line in lines:
        m = re.match(r"\s+- (?!pip:)(\S+)\s*$", line)
        if m and m.group(1) not in ("pip", "-e", "."):
            spec = m.group(1)
            listed[_name(spec)] = spec
    torch_spec = wanted.pop("torch")
    assert listed.pop("pytorch") == "pytorch" + torch_spec[len("torch") :], "pytorch pin differs"
    assert listed.pop("python") == "python=3.11"
    assert listed == wanted


def test_console_script_and_module_entry_point():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["tpviz"] == "tpviz.cli:main"
    assert (REPO / "tpviz" / "__main__.py").exists()
