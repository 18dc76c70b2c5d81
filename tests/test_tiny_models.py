"""tiny_models: deterministic, idempotent, loadable by transformers, canonical tensor names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch

import tiny_models
from tiny_models import tokenizer
from tiny_models.build import STAMP

ARCHS = tiny_models.ARCHS


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: tiny_models.make(arch, root / arch) for arch in ARCHS}


def test_same_spec_gives_same_bytes(built, tmp_path):
    again = tiny_models.make("qwen3_moe", tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json", STAMP):
        assert _sha256(again / name) == _sha256(built["qwen3_moe"] / name), name
    other_seed = tiny_models.make("qwen3_moe", tmp_path / "seed1", seed=1)
    assert _sha256(other_seed / "model.safetensors") != _sha256(again / "model.safetensors")


# tokenizer.json of every tiny checkpoint, as trained on tiny_models/corpus.txt: `tokenizers` or its
# trainer changing behaviour shows here, not as a fingerprint mismatch between pools.
TOKENIZER_SHA256 = "eca72dc090c9d03f4ca8a387b051db0bf44d625a21798522e708c4ffa78ccb8f"


def test_tokenizer_bytes_are_pinned(built):
    for arch in ARCHS:
        assert _sha256(built[arch] / "tokenizer.json") == TOKENIZER_SHA256, arch


def test_make_is_idempotent_and_replaces_only_its_own_stale_output(tmp_path):
    out = tmp_path / "m"
    tiny_models.make("mixtral", out)
    before = (out / "model.safetensors").stat()
    assert tiny_models.make("mixtral", out) == out.absolute()
    after = (out / "model.safetensors").stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)

    tiny_models.make("mixtral", out, seed=3)  # a different spec replaces the old checkpoint
    assert json.loads((out / STAMP).read_text())["seed"] == 3
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no temp or old dirs left behind

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        tiny_models.make("mixtral", foreign)


def test_default_model_dir_follows_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tiny_models.default_model_dir() == tmp_path / "hetero-moe" / "models" / "tiny-qwen3-moe"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tiny_models.default_model_dir() == Path.home() / ".cache" / "hetero-moe" / "models" / "tiny-qwen3-moe"


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_every_key_and_runs(built, arch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = built[arch]
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == arch
    assert config["torch_dtype"] == "bfloat16" and config["tie_word_embeddings"] is False
    assert config["max_position_embeddings"] >= 2048
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}
    assert type(model).__name__ == config["architectures"][0]
    assert model.dtype == torch.bfloat16

    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= config["vocab_size"] and config["vocab_size"] % 64 == 0
    ids = tok("The children walked to school and", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits.float()  # [1, T, V]
    assert logits.shape == (1, ids.shape[1], config["vocab_size"]) and torch.isfinite(logits).all()
    top2 = logits[0].topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).median() > 0.3  # decisive, not flat random logits
    dead = logits[0, :, : len(tokenizer.SPECIAL_TOKENS)]
    assert (dead == 0).all()  # special tokens have zero lm_head rows: greedy never emits them


def test_tokenizer_round_trips_and_has_chat_template(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built["qwen3_moe"])
    for text in ("Hello! The bakery opens at 6:30, and the bread costs $2.50.\nSee you there?", "naïve café ☕"):
        assert tok.decode(tok(text).input_ids) == text
    sentence = "The children walked to school with their friends in the morning."
    assert len(tok(sentence).input_ids) < len(sentence) / 3  # merges were learned
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|endoftext|>", "<|im_end|>", "<|pad|>")
    assert tok.eos_token_id == tokenizer.SPECIAL_IDS.eos
    chat = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.train().to_str() == tokenizer.train().to_str()


EXPERT_NAMES = {
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
}


@pytest.mark.parametrize("arch", ARCHS)
def test_expert_tensors_use_canonical_per_expert_names(built, arch):
    spec = tiny_models.spec_for(arch)
    shapes = tiny_models.read_shapes(built[arch] / "model.safetensors")
    block, (gate, up, down) = EXPERT_NAMES[arch]
    h, i, e = spec.hidden_size, spec.expert_intermediate, spec.num_experts
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}.{block}"
        assert shapes[f"{p}.gate.weight"] == (e, h)
        for x in range(e):
            assert shapes[f"{p}.experts.{x}.{gate}.weight"] == (i, h)
            assert shapes[f"{p}.experts.{x}.{up}.weight"] == (i, h)
            assert shapes[f"{p}.experts.{x}.{down}.weight"] == (h, i)
        assert f"{p}.experts.{e}.{gate}.weight" not in shapes
        if arch == "qwen2_moe":
            s = spec.shared_expert_intermediate
            assert shapes[f"{p}.shared_expert.gate_proj.weight"] == (s, h)
            assert shapes[f"{p}.shared_expert.down_proj.weight"] == (h, s)
            assert shapes[f"{p}.shared_expert_gate.weight"] == (1, h)
    assert ("model.layers.0.self_attn.q_norm.weight" in shapes) == (arch == "qwen3_moe")
    assert ("model.layers.0.self_attn.q_proj.bias" in shapes) == (arch == "qwen2_moe")
    assert "lm_head.weight" in shapes


@pytest.mark.parametrize("arch", ARCHS)
def test_large_preset_is_dominated_by_routed_experts(arch):
    spec = tiny_models.spec_for(arch, "large")
    split = tiny_models.param_split({t.name: t.shape for t in tiny_models.tensor_specs(spec, [])})
    assert split.routed_fraction >= 0.85, split.describe()
    assert split.routed_experts >= 250e6


def test_header_split_matches_spec(built):
    spec = tiny_models.spec_for("qwen2_moe")
    from_specs = tiny_models.param_split({t.name: t.shape for t in tiny_models.tensor_specs(spec, [])})
    from_file = tiny_models.param_split(tiny_models.read_shapes(built["qwen2_moe"] / "model.safetensors"))
    assert from_file == from_specs
    assert from_file.shared_experts > 0 and from_file.routers == spec.num_layers * spec.num_experts * spec.hidden_size
