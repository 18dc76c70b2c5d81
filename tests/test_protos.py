"""The wire contract: generated code is current, the codec round-trips and refuses bad bytes."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from protos import codec
from protos import expert_pb2 as pb
from protos.placement import Placement, choose_replicas

ROOT = Path(__file__).resolve().parents[1]
PROTOS_PYTHON = ROOT / ".venv-protos" / "bin" / "python"
GENERATED = ("expert_pb2.py", "expert_pb2.pyi", "expert_pb2_grpc.py")


def test_generated_code_is_current(tmp_path):
    assert PROTOS_PYTHON.exists(), "the pinned generator is missing: `make protos` installs it"
    (tmp_path / "protos").mkdir()
    (tmp_path / "protos" / "expert.proto").write_bytes((ROOT / "protos" / "expert.proto").read_bytes())
    subprocess.run(
        [str(PROTOS_PYTHON), "-m", "grpc_tools.protoc", "-I.", "--python_out=.", "--pyi_out=.",
         "--grpc_python_out=.", "protos/expert.proto"],
        cwd=tmp_path, check=True,
    )  # fmt: skip
    for name in GENERATED:
        fresh = (tmp_path / "protos" / name).read_text()
        assert fresh == (ROOT / "protos" / name).read_text(), f"protos/{name} is stale: run `make protos`"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("shape", [(0,), (5,), (3, 7), (2, 0, 4)])
def test_codec_round_trip_is_bitwise(dtype, shape):
    t = (torch.randn(shape) * 100).to(dtype)
    back = codec.decode(pb.Tensor.FromString(codec.encode(t).SerializeToString()))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8) if back.numel() else back, t.view(torch.uint8) if t.numel() else t)


def test_codec_keeps_nan_and_noncontiguous_rows():
    t = torch.randn(6, 4, dtype=torch.bfloat16)
    t[2, 1] = float("nan")
    view = t[::2]
    back = codec.decode(codec.encode(view))
    assert torch.equal(back.view(torch.int16), view.contiguous().view(torch.int16))


def test_codec_refuses_wrong_byte_count_and_unknown_dtype():
    msg = codec.encode(torch.zeros(4, 4))
    msg.data = msg.data[:-1]
    with pytest.raises(codec.CodecError, match="needs 64 bytes, got 63"):
        codec.decode(msg)
    with pytest.raises(codec.CodecError, match="unknown wire dtype"):
        codec.decode(pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=b"\0" * 4))
    with pytest.raises(codec.CodecError, match="no wire encoding"):
        codec.encode(torch.zeros(2, dtype=torch.uint8))


def test_placement_is_contiguous_and_covers_every_expert():
    p = Placement(128, 8)
    assert [p.shard_range(w) for w in (0, 1, 7)] == [(0, 16), (16, 32), (112, 128)]
    uneven = Placement(10, 4)
    ranges = [uneven.shard_range(w) for w in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 8), (8, 10)]
    shards = uneven.shard_table()
    assert [int(shards[e]) for e in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert [uneven.worker_ranges(w) for w in range(4)] == [[r] for r in ranges], "R = 1: worker w holds shard w"
    with pytest.raises(ValueError, match="outside"):
        p.shard_range(8)
    with pytest.raises(ValueError, match="cannot be spread"):
        Placement(4, 8)


@pytest.mark.parametrize("workers, replicas", [(8, 2), (8, 3), (5, 2), (4, 4), (3, 1)])
def test_replicas_hold_every_shard_on_r_distinct_workers(workers, replicas):
    p = Placement(40, workers, replicas)
    holders = {s: [w for w in range(workers) if s in p.worker_shards(w)] for s in range(workers)}
    assert all(len(h) == replicas for h in holders.values()), holders
    assert all(len(p.worker_shards(w)) == replicas for w in range(workers)), "every worker holds R shards"
    for turn in range(2 * replicas):
        order = {s: p.replica_workers(s, turn) for s in range(workers)}
        assert all(sorted(o) == holders[s] for s, o in order.items()), "the order lists exactly the holders"
        firsts = [o[0] for o in order.values()]
        assert sorted(firsts) == list(range(workers)), f"turn {turn}: each worker is first for one shard"
    assert {p.replica_workers(0, t)[0] for t in range(replicas)} == set(holders[0]), "turns rotate over every replica"
    with pytest.raises(ValueError, match="expert replicas must be 1 to"):
        Placement(40, workers, workers + 1)


def test_default_replicas_are_two_where_they_fit():
    assert choose_replicas(8 << 30, 8, 4 << 30)[0] == 2  # 1 GiB shards, 3.2 GiB usable
    r, reason = choose_replicas(8 << 30, 8, 2 << 30)
    assert r == 1 and "do not fit" in reason
    assert choose_replicas(1 << 20, 1, 1 << 40)[0] == 1
