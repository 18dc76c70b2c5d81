"""The contract between the pools: wire schema, tensor codec, placement, checkpoint identity."""

# Bump with the proto package version (hetero_moe.expert.v2) on incompatible changes.
# 2: data planes (frames over TCP, shared memory and a gRPC stream) advertised in Info.
PROTOCOL_VERSION = 2

# gRPC's default 4 MiB message cap is far below one prefill micro-batch
# (2048 tokens x 4096 hidden x bf16 = 16 MiB); both ends raise it to this.
MAX_MESSAGE_BYTES = 1 << 30

GRPC_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)
