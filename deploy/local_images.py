"""python deploy/local_images.py — what `docker compose build` needs where no image registry is reachable.

The compose files name public images (`python:3.11-slim` as Dockerfile.cpu's BASE_IMAGE,
`prom/prometheus` as PROMETHEUS_IMAGE). Where they cannot be pulled (CI, air-gapped clusters),
this makes local equivalents from Debian's packages, and a wheelhouse so that the image installs
its Python dependencies without an index:

  hetero-moe/python:3.11-bookworm  Debian bookworm minbase + python3 (3.11), python3-venv, libnuma1, g++
  hetero-moe/prometheus:debian     Debian's prometheus with the public image's contract: ENTRYPOINT
                                   /bin/prometheus, the same default flags, USER nobody, /prometheus
  deploy/wheelhouse/               wheels of pyproject's dependencies (and the build backend), made
                                   by this interpreter's pip, which must be the image's Python (3.11)

Use them with the wheelhouse served on loopback (python3 -m http.server --bind 127.0.0.1
--directory deploy/wheelhouse 8765) and  BASE_IMAGE=hetero-moe/python:3.11-bookworm PIP_NO_INDEX=1
PIP_FIND_LINKS=http://127.0.0.1:8765/ BUILD_NETWORK=host PROMETHEUS_IMAGE=hetero-moe/prometheus:debian
docker compose ... build  (deploy/README.md).

Each is made again only when its inputs changed (a hash kept in an image label or beside the
wheels), so a second run takes seconds. Needs root (debootstrap), debootstrap and a Docker engine.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from runtime_requirements import PYPROJECT, runtime_requirements

logger = logging.getLogger("local_images")

DEPLOY = Path(__file__).resolve().parent
WHEELHOUSE = DEPLOY / "wheelhouse"
SUITE = "bookworm"  # its python3 is 3.11, the public base's version
PYTHON_VERSION = (3, 11)
INPUTS_LABEL = "org.hetero-moe.inputs"
# The wheel the image's `pip wheel` of this package needs offline (pyproject's build-system).
BUILD_REQUIREMENTS = ("setuptools>=68",)
# The public prom/prometheus image's contract, which the compose files rely on.
PROMETHEUS_CHANGES = (
    'ENTRYPOINT ["/bin/prometheus"]',
    'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]',
    "USER nobody",
    "WORKDIR /prometheus",
    'VOLUME ["/prometheus"]',
    "EXPOSE 9090",
)


class LocalImageError(RuntimeError):
    pass


@dataclass(frozen=True)
class RootfsImage:
    """A Debian minbase root filesystem with `packages`, imported as `name`."""

    name: str
    packages: tuple[str, ...]
    changes: tuple[str, ...] = ()
    writable_dirs: tuple[str, ...] = ()  # made and given to nobody (65534), as the public image has them

    @property
    def inputs(self) -> str:
        return _digest({"suite": SUITE, "packages": self.packages, "changes": self.changes, "dirs": self.writable_dirs})


# g++ and the Python headers: torch inductor compiles vLLM's CPU kernels at run time.
PYTHON_BASE = RootfsImage("hetero-moe/python:3.11-bookworm", ("python3", "python3-venv", "python3-dev", "libnuma1", "g++"))
PROMETHEUS = RootfsImage("hetero-moe/prometheus:debian", ("prometheus",), PROMETHEUS_CHANGES, ("/prometheus",))


def _digest(obj: object) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    logger.info("$ %s", " ".join(cmd))
    r = subprocess.run(cmd, **kw)
    if r.returncode != 0:
        raise LocalImageError(f"{cmd[0]} {cmd[1]} exited with {r.returncode}")
    return r


def _image_inputs(name: str) -> str | None:
    r = subprocess.run(["docker", "image", "inspect", "--format", f'{{{{index .Config.Labels "{INPUTS_LABEL}"}}}}', name],
                       capture_output=True, text=True)  # fmt: skip
    return r.stdout.strip() if r.returncode == 0 else None


def make_rootfs_image(image: RootfsImage, workdir: Path) -> bool:
    """Import `image` unless one made from the same inputs exists; True when it was made."""
    if _image_inputs(image.name) == image.inputs:
        logger.info("%s: up to date", image.name)
        return False
    if shutil.which("debootstrap") is None:
        raise LocalImageError("debootstrap is not installed (apt-get install -y debootstrap)")
    with tempfile.TemporaryDirectory(dir=workdir, prefix="rootfs-") as tmp:
        root = Path(tmp)
        _run(["debootstrap", "--variant=minbase", f"--include={','.join(image.packages)}", SUITE, str(root)],
             stdout=subprocess.DEVNULL)  # fmt: skip
        # What a container never needs: downloaded packages, package lists, docs.
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "usr/share/doc", "usr/share/man"):
            for p in (root / junk).glob("*"):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                elif p.name != "lock":
                    p.unlink()
        for d in image.writable_dirs:
            path = root / d.lstrip("/")
            path.mkdir(parents=True, exist_ok=True)
            shutil.chown(path, 65534, 65534)
        changes = [f"LABEL {INPUTS_LABEL}={image.inputs}", *image.changes]
        tar = subprocess.Popen(["tar", "-C", str(root), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE)
        _run(["docker", "import", *(a for c in changes for a in ("--change", c)), "-", image.name],
             stdin=tar.stdout, stdout=subprocess.DEVNULL)  # fmt: skip
        if tar.wait() != 0:
            raise LocalImageError(f"tar of {root} exited with {tar.returncode}")
    return True


def make_wheelhouse(wheelhouse: Path) -> bool:
    """Wheels of every dependency in pyproject.toml plus the build backend; True when made."""
    if sys.version_info[:2] != PYTHON_VERSION:
        raise LocalImageError(f"the wheelhouse is for Python {'.'.join(map(str, PYTHON_VERSION))} (the images' Python); "
                              f"run this with such an interpreter, not {sys.version.split()[0]}")  # fmt: skip
    requirements = [*runtime_requirements(PYPROJECT, ()), *BUILD_REQUIREMENTS]
    stamp = wheelhouse / ".inputs"
    inputs = _digest({"requirements": requirements, "python": sys.version_info[:2]})
    if stamp.is_file() and stamp.read_text() == inputs:
        logger.info("%s: up to date", wheelhouse)
        return False
    for old in wheelhouse.glob("*.whl"):
        old.unlink()
    # pip's own configuration applies (index, find-links, cache): whatever this host installs from.
    _run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(wheelhouse), *requirements])
    wheels = [p.name for p in wheelhouse.glob("*.whl")]
    # The image wants PyTorch's CPU build; PyPI's torch of the same version is the CUDA one.
    if not any(w.startswith("torch-") and "+cpu" in w for w in wheels) or any(w.startswith("nvidia_") for w in wheels):
        raise LocalImageError(f"{wheelhouse} has no CPU build of torch or has CUDA wheels: configure pip to find "
                              "torch's +cpu wheel (e.g. --extra-index-url https://download.pytorch.org/whl/cpu)")  # fmt: skip
    stamp.write_text(inputs)
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python deploy/local_images.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--wheelhouse", type=Path, default=WHEELHOUSE, help="default: %(default)s")
    p.add_argument("--workdir", type=Path, default=Path("/var/tmp"), help="where debootstrap builds root filesystems")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    a.wheelhouse.mkdir(parents=True, exist_ok=True)
    jobs = {image.name: functools.partial(make_rootfs_image, image, a.workdir) for image in (PYTHON_BASE, PROMETHEUS)}
    jobs[str(a.wheelhouse)] = functools.partial(make_wheelhouse, a.wheelhouse)
    # Independent, and each waits on the network or the disk part of the time: made at once.
    with ThreadPoolExecutor(len(jobs)) as pool:
        for future in [pool.submit(_timed, name, job) for name, job in jobs.items()]:
            future.result()  # an error raises once the others have ended


def _timed(name: str, make: Callable[[], bool]) -> None:
    start = time.monotonic()
    if make():
        logger.info("%s: made in %.0f s", name, time.monotonic() - start)


if __name__ == "__main__":
    try:
        main()
    except LocalImageError as err:
        sys.exit(f"local_images: {err}")
