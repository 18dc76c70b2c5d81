"""Shared fixtures: tiny checkpoints built once per session, and the processes a module's tests start."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

import tiny_models
from tests.support import Processes

# vLLM 0.32's AOT compile cache never loads on this CPU build ("'function' object has no attribute
# 'finalize_loading'"), so every compiled server the tests start would compile again; its older
# cache loads, so that a configuration compiled once starts in seconds afterwards, stock and cluster
# alike (benchmarks/bench_transport.py does the same). Every vLLM the tests start inherits this.
os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """model_dir(arch, preset="tiny", seed=0) -> checkpoint directory, built once per session."""
    root = tmp_path_factory.mktemp("models")

    def make(arch: str, preset: str = "tiny", seed: int = 0) -> Path:
        return tiny_models.make(arch, root / f"{arch}-{preset}-{seed}", preset=preset, seed=seed)

    return make


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Servers a module's tests start, stopped when the module ends: a session's worth of them
    (vLLM servers of 1.5 GiB and more each) would fill the machine's memory."""
    procs = Processes(tmp_path_factory.mktemp("logs"))
    yield procs
    procs.stop()
