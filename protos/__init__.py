"""The contract between the pools: wire schema, tensor codec, placement, checkpoint identity."""

# Bump on incompatible changes. The proto package (hetero_moe.expert.v2) moves only when the
# RPCs themselves change, so that a peer of another version still reads Info and is told this.
# 2: data planes (frames over TCP, shared memory and a gRPC stream) advertised in Info.
# 3: replicated placement: a worker holds R shards (Info.expert_replicas, Info.expert_ranges).
# 4: TCP and shared-memory connections open with a HELLO frame carrying the cluster token.
PROTOCOL_VERSION = 4

# gRPC's default 4 MiB message cap is far below one prefill micro-batch
# (2048 tokens x 4096 hidden x bf16 = 16 MiB); both ends raise it to this.
MAX_MESSAGE_BYTES = 1 << 30

GRPC_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
