"""The checkpoint reader (protos/checkpoint.py): every spelling transformers accepts for a config
field serves the same experts, and a config it cannot serve is refused by name.

Re-spelled copies link the original's tensors and change config.json only: one written by
`save_pretrained` of the installed transformers (what a checkpoint re-saved today looks like),
one edited by hand to the other accepted names. Real workers serve each copy; their partials
must be bitwise those of the workers serving the original.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from protos import codec
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc
from protos.checkpoint import CheckpointError, read_checkpoint
from protos.placement import Placement
from tests.support import Processes, python_module, start_workers

ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral"]
NUM_WORKERS = 2

# The other name transformers accepts for a field, per architecture (attribute_map, legacy keys).
HAND_SPELLINGS = {
    "qwen3_moe": {"num_experts": "num_local_experts", "torch_dtype": "dtype"},
    "qwen2_moe": {"torch_dtype": "dtype"},
    "mixtral": {"num_local_experts": "num_experts", "torch_dtype": "dtype"},
}


def linked_copy(model: Path, out: Path, config: dict) -> Path:
    """The checkpoint's files linked into `out`, with `config` as its config.json."""
    out.mkdir()
    for f in model.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def resaved(model: Path, out: Path) -> Path:
    """What `save_pretrained` of the installed transformers writes for the checkpoint's config."""
    copy = linked_copy(model, out, {})
    AutoConfig.from_pretrained(model).save_pretrained(copy)
    return copy


def hand_spelled(model: Path, out: Path, arch: str) -> Path:
    """config.json with HAND_SPELLINGS' names, and rope_theta as a rope_parameters dict."""
    config = json.loads((model / "config.json").read_text())
    for old, new in HAND_SPELLINGS[arch].items():
        config[new] = config.pop(old)
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": config.pop("rope_theta")}
    return linked_copy(model, out, config)


def forward(stub, layer: int, hidden: torch.Tensor, rows, experts, weights) -> torch.Tensor:
    request = pb.ForwardRequest(
        layer=layer,
        hidden=codec.encode(hidden),
        pair_rows=codec.encode(rows.to(torch.int32)),
        pair_experts=codec.encode(experts.to(torch.int32)),
        pair_weights=codec.encode(weights.to(torch.float32)),
    )
    return codec.decode(stub.Forward(request, timeout=30).partial)


@pytest.mark.parametrize("arch", ARCHS)
def test_respelled_config_is_served_bitwise_like_the_original(arch, model_dir, tmp_path):
    model = model_dir(arch)
    original = json.loads((model / "config.json").read_text())
    copies = {"re-saved": resaved(model, tmp_path / "resaved"), "hand-spelled": hand_spelled(model, tmp_path / "hand", arch)}
    saved = json.loads((copies["re-saved"] / "config.json").read_text())
    assert saved.keys() != original.keys(), "save_pretrained wrote the original spelling: the test would show nothing"
    for old, new in HAND_SPELLINGS[arch].items():
        assert old not in json.loads((copies["hand-spelled"] / "config.json").read_text())

    ckpt = read_checkpoint(model)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, ckpt.hidden_size, generator=g).to(torch.bfloat16)
    weights, ids = torch.softmax(torch.randn(7, ckpt.num_experts, generator=g), -1).topk(ckpt.top_k, dim=-1)
    placement = Placement(ckpt.num_experts, NUM_WORKERS)

    procs = Processes(tmp_path)
    try:
        served = {}  # name -> (Info of each worker, {(layer, worker): partial})
        for name, path in {"original": model, **copies}.items():
            workers = start_workers(procs, path, NUM_WORKERS, tag=f"ck-{arch}-{name}")
            infos, partials = [], {}
            for worker, endpoint in enumerate(workers.endpoints):
                with workers.security.channel(endpoint) as channel:
                    stub = pb_grpc.ExpertServiceStub(channel)
                    infos.append(stub.Info(pb.InfoRequest(), timeout=10))
                    start, end = placement.shard_range(worker)
                    rows, ks = ((ids >= start) & (ids < end)).nonzero(as_tuple=True)
                    for layer in ckpt.moe_layers:
                        partials[layer, worker] = forward(stub, layer, x, rows, ids[rows, ks], weights[rows, ks])
            served[name] = infos, partials
    finally:
        procs.stop()

    infos, partials = served["original"]
    assert [i.model_fingerprint for i in infos] == [ckpt.fingerprint] * NUM_WORKERS
    assert all(p.abs().sum() > 0 for p in partials.values()), "every worker computed something"
    for name in copies:
        copy_infos, copy_partials = served[name]
        for worker, (want, got) in enumerate(zip(infos, copy_infos)):
            # the handshake's view: same model, same layout, same shard
            assert got.model_fingerprint == want.model_fingerprint, f"{name} worker {worker}"
            assert got.model_type == want.model_type and list(got.moe_layers) == list(want.moe_layers)
            assert [(r.start, r.end) for r in got.expert_ranges] == [(r.start, r.end) for r in want.expert_ranges]
            assert (got.activation, got.activation_dtype) == (want.activation, want.activation_dtype)
        for key, partial in partials.items():
            assert torch.equal(copy_partials[key], partial), f"{name}: layer {key[0]} worker {key[1]}"


# ---- what the fingerprint is about ---------------------------------------------------------------


def edited(model: Path, out: Path, **fields) -> Path:
    return linked_copy(model, out, json.loads((model / "config.json").read_text()) | fields)


def test_fingerprint_follows_what_the_workers_compute(model_dir, tmp_path):
    model = model_dir("qwen3_moe")
    ckpt = read_checkpoint(model)
    # rope is the attention pool's alone: the experts' outputs do not depend on it
    assert read_checkpoint(edited(model, tmp_path / "rope", rope_theta=10_000.0)).fingerprint == ckpt.fingerprint
    assert read_checkpoint(edited(model, tmp_path / "top2", num_experts_per_tok=2)).fingerprint != ckpt.fingerprint
    assert read_checkpoint(edited(model, tmp_path / "gelu", hidden_act="gelu")).fingerprint != ckpt.fingerprint
    assert read_checkpoint(model_dir("qwen3_moe", seed=1)).fingerprint != ckpt.fingerprint


# ---- configs that cannot be served ---------------------------------------------------------------


def with_config_text(model: Path, out: Path, text: str) -> Path:
    copy = linked_copy(model, out, {})
    (copy / "config.json").write_text(text)
    return copy


def without(model: Path, out: Path, *keys: str) -> Path:
    config = json.loads((model / "config.json").read_text())
    return linked_copy(model, out, {k: v for k, v in config.items() if k not in keys})


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda m, out: with_config_text(m, out, '{"model_type": "qwen3_moe",'), "is not valid JSON"),
        (lambda m, out: with_config_text(m, out, "[1, 2]"), "holds a list, not a JSON object"),
        (lambda m, out: without(m, out, "model_type"), "model_type None is not supported"),
        (lambda m, out: edited(m, out, model_type="llama"), "model_type 'llama' is not supported"),
        (lambda m, out: edited(m, out, num_experts="sixteen"), "is not a qwen3_moe config transformers accepts"),
        # a field left out takes the config class's default, a real model's size: the tensors refuse it
        (lambda m, out: without(m, out, "num_experts"), "holds experts [0, 1, 2, 3]... (16); config says 128"),
        (lambda m, out: without(m, out, "hidden_size"), "config says hidden_size 2048"),
        (lambda m, out: edited(m, out, dtype="int8", torch_dtype="int8"), "checkpoint dtype torch.int8 is not one of"),
    ],
    ids=["broken-json", "not-an-object", "no-model-type", "unsupported-type", "wrong-type", "no-num-experts",
         "no-hidden-size", "int8"],
)  # fmt: skip
def test_unservable_config_is_refused_by_name(model_dir, tmp_path, make, reason):
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(make(model_dir("qwen3_moe"), tmp_path / "bad"))
    assert reason in str(err.value)


def test_worker_on_an_unservable_config_exits_with_the_reason(model_dir, tmp_path):
    bad = without(model_dir("qwen3_moe"), tmp_path / "bad", "num_experts")
    procs = Processes(tmp_path)
    cmd = python_module("expert_server", "--model", str(bad), "--worker-index", "0", "--num-workers", "1",
                        "--port", "0", "--plaintext")  # fmt: skip
    assert procs.start("bad", cmd).wait(timeout=120) == 2
    log = procs.log("bad")
    assert "cannot serve: layer 0 holds experts" in log and "Traceback" not in log, log[-2000:]
