"""Every private vLLM API the ping-pong schedule uses, in one place, for the pinned vLLM.

vLLM micro-batches a step only for its GPU dual-batch overlap (DBO) with data parallelism; on CPU
it is switched off (DESIGN.md §4). `attention_server.pingpong` runs the same machinery on CPU
through the names below. They are not a public interface: `check()` names what an upgrade moved,
and a test calls it, so an upgrade fails there and not in a serving process.
"""
from __future__ import annotations

import inspect

import vllm
from vllm.config import ParallelConfig
from vllm.forward_context import ForwardContext, create_forward_context, get_forward_context
from vllm.v1.worker import cpu_worker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm.v1.worker.ubatching import UBatchContext, dbo_current_ubatch_id, dbo_yield, make_ubatch_contexts
from vllm.utils.torch_utils import current_stream

PINNED_VLLM = "0.32.0"

__all__ = [
    "CPUModelRunner", "CPUWorker", "ParallelConfig", "ForwardContext", "UBatchContext", "create_forward_context", "cpu_worker",
    "current_stream", "dbo_current_ubatch_id", "dbo_yield", "get_forward_context", "make_ubatch_contexts",
]  # fmt: skip

# What pingpong relies on, beyond the imports above succeeding.
_METHODS = {
    CPUModelRunner: ("execute_model", "_determine_batch_execution_and_padding", "_model_forward"),
    UBatchContext: ("__enter__", "__exit__"),
}
_PARAMETERS = {
    # execute_model passes these by keyword; the override reads allow_microbatching
    CPUModelRunner._determine_batch_execution_and_padding: ("num_tokens", "num_reqs", "allow_microbatching"),
    CPUModelRunner._model_forward: ("input_ids", "positions", "intermediate_tensors", "inputs_embeds"),
    create_forward_context: ("attn_metadata", "vllm_config", "cudagraph_runtime_mode", "batch_descriptor",
                             "slot_mapping"),
    make_ubatch_contexts: ("num_micro_batches", "compute_stream", "comm_stream", "forward_contexts", "ready_barrier"),
}  # fmt: skip
# Set on every UBatchContext, or read from vLLM's forward context and parallel config.
_CONTEXT_ATTRIBUTES = ("compute_stream", "comm_stream", "current_stream", "cpu_wait_event", "cpu_signal_event")
_FORWARD_CONTEXT_FIELDS = ("attn_metadata", "slot_mapping", "ubatch_slices", "batch_descriptor",
                           "cudagraph_runtime_mode", "no_compile_layers")  # fmt: skip
_PARALLEL_CONFIG_FIELDS = ("ubatch_size", "use_ubatching", "num_ubatches")


def check() -> list[str]:
    """What the installed vLLM lacks of the above; empty when pingpong can run on it."""
    problems = []
    if vllm.__version__ != PINNED_VLLM:
        problems.append(f"vLLM {vllm.__version__} is installed; pingpong was written against {PINNED_VLLM}")
    if getattr(cpu_worker, "CPUModelRunner", None) is not CPUModelRunner:
        problems.append("vllm.v1.worker.cpu_worker no longer builds its runner from the name CPUModelRunner")
    for cls, names in _METHODS.items():
        problems += [f"{cls.__name__}.{n} is gone" for n in names if not callable(getattr(cls, n, None))]
    for fn, names in _PARAMETERS.items():
        params = inspect.signature(fn).parameters
        problems += [f"{fn.__qualname__} lost its parameter {n!r}" for n in names if n not in params]
    init = inspect.signature(UBatchContext.__init__).parameters
    problems += [f"UBatchContext no longer takes {n!r}" for n in ("compute_stream", "comm_stream") if n not in init]
    source = inspect.getsource(UBatchContext.__init__)
    problems += [f"UBatchContext has no attribute {n!r}" for n in _CONTEXT_ATTRIBUTES if f"self.{n} =" not in source]
    # --pingpong-microbatches auto sets ubatch_size per step, before execute_model cuts the batch
    if "self.parallel_config.num_ubatches" not in inspect.getsource(CPUModelRunner.execute_model):
        problems.append("execute_model no longer reads parallel_config.num_ubatches when it cuts a step")
    fields = ForwardContext.__dataclass_fields__
    problems += [f"ForwardContext has no field {n!r}" for n in _FORWARD_CONTEXT_FIELDS if n not in fields]
    problems += [f"ParallelConfig has no {n!r}" for n in _PARALLEL_CONFIG_FIELDS if not hasattr(ParallelConfig, n)]
    return problems
