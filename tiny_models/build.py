"""Write a checkpoint directory atomically, and skip the work when it is already there."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from . import tokenizer
from .spec import ModelSpec, generation_config, hf_config, spec_for
from .weights import iter_tensors, tensor_specs

log = logging.getLogger(__name__)

STAMP = "tiny_models.json"
MODEL_FILE = "model.safetensors"
FILES = (
    "config.json",
    "generation_config.json",
    MODEL_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    STAMP,
)
DEFAULT_ARCH, DEFAULT_PRESET, DEFAULT_SEED = "qwen3_moe", "tiny", 0


def default_model_dir() -> Path:
    """Where `make up` keeps the embedded default model: $XDG_CACHE_HOME (or ~/.cache)/hetero-moe/..."""
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "hetero-moe" / "models" / "tiny-qwen3-moe"


def make(arch: str, out_dir: Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Build the (arch, preset, seed) checkpoint in out_dir and return its path.

    Idempotent: a directory that already holds this exact checkpoint is returned untouched. The
    checkpoint is written to a temporary sibling and renamed into place, so out_dir never holds a
    partial checkpoint. A non-empty out_dir that this package did not write is never replaced.
    """
    spec = spec_for(arch, preset)
    out_dir = Path(out_dir).expanduser().absolute()
    fingerprint = spec.fingerprint(seed, tokenizer.corpus_sha256())
    if is_complete(out_dir, fingerprint):
        log.info("%s already holds %s/%s seed %d", out_dir, arch, preset, seed)
        return out_dir
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / STAMP).exists():
        raise FileExistsError(f"{out_dir} is not empty and was not written by tiny_models; not replacing it")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        os.chmod(tmp, 0o755)
        _write_checkpoint(spec, seed, fingerprint, tmp)
        _move_into_place(tmp, out_dir, fingerprint)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("wrote %s/%s seed %d to %s", arch, preset, seed, out_dir)
    return out_dir


def is_complete(path: Path, fingerprint: str) -> bool:
    """True when path holds every file of the checkpoint whose fingerprint is given."""
    try:
        stamp = json.loads((path / STAMP).read_text())
    except (OSError, ValueError):
        return False
    return stamp.get("fingerprint") == fingerprint and all((path / f).is_file() for f in FILES)


def _write_checkpoint(spec: ModelSpec, seed: int, fingerprint: str, out: Path) -> None:
    tok = tokenizer.train()
    specials = tokenizer.SPECIAL_IDS.as_dict()
    tok_size = tok.get_vocab_size()
    assert tok_size <= spec.vocab_size, (tok_size, spec.vocab_size)
    # Greedy decoding never emits these: special tokens, vocab padding, bytes that are not text.
    dead_ids = {
        *range(len(tokenizer.SPECIAL_TOKENS)),
        *tokenizer.unprintable_ids(tok),
        *range(tok_size, spec.vocab_size),
    }
    tensors = dict(iter_tensors(tensor_specs(spec, dead_ids), seed))
    save_file(tensors, out / MODEL_FILE, metadata={"format": "pt"})
    os.chmod(out / MODEL_FILE, 0o644)  # safetensors creates it owner-only
    texts = {
        **tokenizer.files(tok, spec.max_position_embeddings),
        "config.json": _to_json(hf_config(spec, specials)),
        "generation_config.json": _to_json(generation_config(specials)),
    }
    for name, text in texts.items():
        (out / name).write_text(text, encoding="utf-8")
    stamp = {
        "fingerprint": fingerprint,
        "seed": seed,
        "spec": dataclasses.asdict(spec),
        "model_sha256": _sha256(out / MODEL_FILE),
    }
    (out / STAMP).write_text(_to_json(stamp))  # last: its presence marks the directory complete


def _move_into_place(tmp: Path, out_dir: Path, fingerprint: str) -> None:
    """Rename tmp to out_dir, replacing an older checkpoint (or an empty directory) there."""
    old = None
    if out_dir.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, old / "checkpoint")
    try:
        os.rename(tmp, out_dir)
    except OSError:
        # Another process renamed its copy in first; fine if it is the same checkpoint.
        if not is_complete(out_dir, fingerprint):
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _to_json(obj: dict) -> str:
    return json.dumps(obj, indent=2) + "\n"
