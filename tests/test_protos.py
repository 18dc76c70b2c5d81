"""The wire contract: generated code is current, the codec round-trips and refuses bad bytes."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from protos import codec
from protos import expert_pb2 as pb
from protos.placement import Placement

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
    assert [p.expert_range(w) for w in (0, 1, 7)] == [(0, 16), (16, 32), (112, 128)]
    uneven = Placement(10, 4)
    ranges = [uneven.expert_range(w) for w in range(4)]
    assert ranges == [(0, 3), (3, 6), (6, 8), (8, 10)]
    owners = uneven.owner_table()
    assert [int(owners[e]) for e in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    with pytest.raises(ValueError, match="outside"):
        p.expert_range(8)
    with pytest.raises(ValueError, match="cannot be spread"):
        Placement(4, 8)
