"""Stage 3: send each worker its slice without blocking; `Pending.wait()` collects."""
from __future__ import annotations

from dataclasses import dataclass

import grpc
import torch

from attention_server.partition import DispatchPlan
from protos import GRPC_OPTIONS, codec
from protos import expert_pb2 as pb
from protos import expert_pb2_grpc as pb_grpc


class ExpertWorkerError(RuntimeError):
    """A worker failed a Forward call: unreachable, too slow, or refused the request."""

    def __init__(self, worker: int, endpoint: str, code: grpc.StatusCode, details: str):
        super().__init__(f"expert worker {worker} at {endpoint}: {code.name}: {details}")
        self.worker, self.endpoint, self.code = worker, endpoint, code


class ExpertClient:
    """One gRPC channel to one worker."""

    def __init__(self, worker: int, endpoint: str, timeout_s: float):
        self.worker, self.endpoint, self.timeout_s = worker, endpoint, timeout_s
        self.channel = grpc.insecure_channel(endpoint, options=GRPC_OPTIONS)
        self.stub = pb_grpc.ExpertServiceStub(self.channel)

    def forward_async(self, request: pb.ForwardRequest) -> grpc.Future:
        return self.stub.Forward.future(request, timeout=self.timeout_s)

    def close(self) -> None:
        self.channel.close()


@dataclass(slots=True)
class Pending:
    """In-flight Forward calls of one layer, one per slice of `plan`."""

    plan: DispatchPlan
    calls: list[tuple[ExpertClient, grpc.Future]]

    def wait(self) -> list[torch.Tensor]:
        """[T_w, H] float32 partials in plan order; raises ExpertWorkerError."""
        partials = []
        for client, call in self.calls:
            try:
                response = call.result()
            except grpc.RpcError as err:
                raise ExpertWorkerError(client.worker, client.endpoint, err.code(), err.details()) from None
            partials.append(codec.decode(response.partial))
        return partials


def dispatch(clients: list[ExpertClient], layer: int, x: torch.Tensor, plan: DispatchPlan) -> Pending:
    """x: [T, H] layer input. Only workers with pairs get a message."""
    x = x.detach().cpu()
    calls = []
    for part in plan.slices:
        request = pb.ForwardRequest(
            layer=layer,
            hidden=codec.encode(x[part.rows]),
            pair_rows=codec.encode(part.pair_rows),
            pair_experts=codec.encode(part.pair_experts),
            pair_weights=codec.encode(part.pair_weights),
        )
        client = clients[part.worker]
        calls.append((client, client.forward_async(request)))
    return Pending(plan, calls)
