"""Shared fixtures: small checkpoints made once per session, and loaded jobs reused across
assertions (a 2-rank spawn costs seconds, mostly importing torch)."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from tpviz.models.demo import make_checkpoint

REPO = Path(__file__).resolve().parents[1]
_SCRATCH = pytest.StashKey[Path]()


def pytest_configure(config) -> None:
    """Keep the suite's own files out of $TMPDIR after it ends: pytest's temp dirs and the
    cache directory torch creates whenever this process imports torch._dynamo (transformers'
    models do) live in one directory removed at exit, unless --basetemp chose another."""
    if config.option.basetemp is None:
        config.option.basetemp = Path(tempfile.mkdtemp(prefix="tpviz-tests-")) / "tmp"
        config.stash[_SCRATCH] = config.option.basetemp.parent
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(config.stash[_SCRATCH] / "inductor"))


def pytest_unconfigure(config) -> None:
    scratch = config.stash.get(_SCRATCH, None)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session")
def tiny(checkpoints) -> Path:
    """The tiny preset, float32, sharded over several files with an index."""
    return make_checkpoint(checkpoints / "tiny", "tiny", max_shard_size=600_000)


@pytest.fixture(scope="session")
def small(checkpoints) -> Path:
    """The small preset (150 MB): where memory figures are large enough to compare."""
    return make_checkpoint(checkpoints / "small", "small")


@pytest.fixture(scope="session")
def tiny_tied(checkpoints) -> Path:
    return make_checkpoint(checkpoints / "tiny-tied", "tiny", tie_embeddings=True, seed=1)


@pytest.fixture(scope="session")
def uneven3(checkpoints) -> Path:
    """Heads split over 3 ranks; a vocab (1001) and an MLP (352) that do not."""
    return make_checkpoint(
        checkpoints / "uneven3",
        "tiny",
        hidden=96,
        heads=6,
        kv_heads=3,
        vocab=1001,
        tie_embeddings=True,
        seed=2,
    )


@pytest.fixture(scope="session")
def config_only(checkpoints, tiny) -> Path:
    out = checkpoints / "config-only"
    out.mkdir()
    (out / "config.json").write_text((tiny / "config.json").read_text())
    return out


def write_config(directory: Path, **config) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture
def cli(capsys, monkeypatch):
    """Run `tpviz ...` in this process (`cli.main(argv)`); returns what `run_cli` returns.
    Use `run_cli` only where a fresh interpreter proves something more."""
    import subprocess

    from tpviz.cli import main

    def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as e:  # argparse: --help, usage errors
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["tpviz", *args], code, out, err)

    return run


def run_cli(*args: str, timeout: float = 300, env: dict | None = None):
    """Run `python -m tpviz ...` in a fresh process; returns the CompletedProcess."""
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "tpviz", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
    )


def pytest_collection_modifyitems(config, items) -> None:
    """Start the forkserver that ranks fork from as soon as a selected test may start ranks
    (the slow ones), so that its imports overlap collection and the first tests."""
    if any(item.get_closest_marker("slow") for item in items):
        from tpviz.rankserver import start_server

        start_server()
