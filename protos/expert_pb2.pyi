from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Iterable as _Iterable, Mapping as _Mapping, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
    INT32: _ClassVar[DType]
    INT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType
INT32: DType
INT64: DType

class Tensor(_message.Message):
    __slots__ = ("dtype", "shape", "data")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    dtype: DType
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, dtype: _Optional[_Union[DType, str]] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class InfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ExpertRange(_message.Message):
    __slots__ = ("start", "end")
    START_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    start: int
    end: int
    def __init__(self, start: _Optional[int] = ..., end: _Optional[int] = ...) -> None: ...

class InfoResponse(_message.Message):
    __slots__ = ("protocol_version", "model_fingerprint", "model_type", "num_hidden_layers", "moe_layers", "num_experts", "hidden_size", "worker_index", "num_workers", "expert_ranges", "activation_dtype", "weight_format", "kernel_backend", "activation", "data_planes", "expert_replicas", "load_format", "group_size", "placement_epoch")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_HIDDEN_LAYERS_FIELD_NUMBER: _ClassVar[int]
    MOE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_RANGES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_DTYPE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    KERNEL_BACKEND_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANES_FIELD_NUMBER: _ClassVar[int]
    EXPERT_REPLICAS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FORMAT_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_fingerprint: str
    model_type: str
    num_hidden_layers: int
    moe_layers: _containers.RepeatedScalarFieldContainer[int]
    num_experts: int
    hidden_size: int
    worker_index: int
    num_workers: int
    expert_ranges: _containers.RepeatedCompositeFieldContainer[ExpertRange]
    activation_dtype: DType
    weight_format: str
    kernel_backend: str
    activation: str
    data_planes: _containers.RepeatedCompositeFieldContainer[DataPlane]
    expert_replicas: int
    load_format: str
    group_size: int
    placement_epoch: int
    def __init__(self, protocol_version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., model_type: _Optional[str] = ..., num_hidden_layers: _Optional[int] = ..., moe_layers: _Optional[_Iterable[int]] = ..., num_experts: _Optional[int] = ..., hidden_size: _Optional[int] = ..., worker_index: _Optional[int] = ..., num_workers: _Optional[int] = ..., expert_ranges: _Optional[_Iterable[_Union[ExpertRange, _Mapping]]] = ..., activation_dtype: _Optional[_Union[DType, str]] = ..., weight_format: _Optional[str] = ..., kernel_backend: _Optional[str] = ..., activation: _Optional[str] = ..., data_planes: _Optional[_Iterable[_Union[DataPlane, _Mapping]]] = ..., expert_replicas: _Optional[int] = ..., load_format: _Optional[str] = ..., group_size: _Optional[int] = ..., placement_epoch: _Optional[int] = ...) -> None: ...

class DataPlane(_message.Message):
    __slots__ = ("kind", "port", "address", "host_id")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    HOST_ID_FIELD_NUMBER: _ClassVar[int]
    kind: str
    port: int
    address: str
    host_id: str
    def __init__(self, kind: _Optional[str] = ..., port: _Optional[int] = ..., address: _Optional[str] = ..., host_id: _Optional[str] = ...) -> None: ...

class ForwardRequest(_message.Message):
    __slots__ = ("layer", "hidden", "pair_rows", "pair_experts", "pair_weights")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_FIELD_NUMBER: _ClassVar[int]
    PAIR_ROWS_FIELD_NUMBER: _ClassVar[int]
    PAIR_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    PAIR_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    hidden: Tensor
    pair_rows: Tensor
    pair_experts: Tensor
    pair_weights: Tensor
    def __init__(self, layer: _Optional[int] = ..., hidden: _Optional[_Union[Tensor, _Mapping]] = ..., pair_rows: _Optional[_Union[Tensor, _Mapping]] = ..., pair_experts: _Optional[_Union[Tensor, _Mapping]] = ..., pair_weights: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class ForwardResponse(_message.Message):
    __slots__ = ("partial",)
    PARTIAL_FIELD_NUMBER: _ClassVar[int]
    partial: Tensor
    def __init__(self, partial: _Optional[_Union[Tensor, _Mapping]] = ...) -> None: ...

class LayerExperts(_message.Message):
    __slots__ = ("layer", "experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., experts: _Optional[_Iterable[int]] = ...) -> None: ...

class PlaceRequest(_message.Message):
    __slots__ = ("epoch", "layers")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerExperts]
    def __init__(self, epoch: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerExperts, _Mapping]]] = ...) -> None: ...

class PlaceResponse(_message.Message):
    __slots__ = ("epoch", "extra_experts", "extra_bytes")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXTRA_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXTRA_BYTES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    extra_experts: int
    extra_bytes: int
    def __init__(self, epoch: _Optional[int] = ..., extra_experts: _Optional[int] = ..., extra_bytes: _Optional[int] = ...) -> None: ...
