"""The one place where exceptions of a request become gRPC status codes, for every plane."""
from __future__ import annotations

import grpc

from expert_server.experts import RequestError
from expert_server.extras import EpochConflict
from protos import codec, frames
from protos.security import Unauthenticated

_STATUS = {
    RequestError: grpc.StatusCode.INVALID_ARGUMENT,
    EpochConflict: grpc.StatusCode.FAILED_PRECONDITION,
    codec.CodecError: grpc.StatusCode.INVALID_ARGUMENT,
    frames.FrameError: grpc.StatusCode.INVALID_ARGUMENT,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
}


def status_for(exc: Exception) -> grpc.StatusCode:
    for kind, code in _STATUS.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL
