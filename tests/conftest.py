"""Shared fixtures: tiny checkpoints built once per session, and the processes tests start."""
from __future__ import annotations

from pathlib import Path

import pytest

import tiny_models
from tests.support import Processes


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch, preset="tiny", seed=0) -> checkpoint directory, built once per session."""
    root = tmp_path_factory.mktemp("models")

    def make(arch: str, preset: str = "tiny", seed: int = 0) -> Path:
        return tiny_models.make(arch, root / f"{arch}-{preset}-{seed}", preset=preset, seed=seed)

    return make


@pytest.fixture(scope="session")
def processes(tmp_path_factory):
    procs = Processes(tmp_path_factory.mktemp("logs"))
    yield procs
    procs.stop()
