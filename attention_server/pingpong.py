"""Ping-pong (MegaScale-Infer): a step's batch in m micro-batches, so that the attention of one
runs while the routed rows of another are in the experts.

    micro-batch 0  attn L0, send ┐yield                     ┌ wait, combine, attn L1, send ┐yield
    micro-batch 1                └ attn L0, send ┐yield     │                              └ ...
    micro-batch m-1                              └ ... ─────┘

Each micro-batch runs on its own persistent thread, strictly one at a time: vLLM's UBatchContext
passes the baton round the ring, and the remote experts' combine op hands it on (`dbo_yield`)
just before it waits for the workers. A step that is not split has no context, and there the
yield does nothing.

Built from vLLM's own micro-batching (its GPU dual-batch overlap), which vLLM switches off on CPU;
every private name used is in attention_server/vllm_internals.py. PingPongCPUWorker (vLLM's
`--worker-cls` whenever the plugin is on, on CPU) builds PingPongCPUModelRunner and, for m > 1,
asks for m attention-metadata builders (`ubatch_size = m`) before the KV cache is made. Per step
the runner decides whether to split (`_determine_batch_execution_and_padding`); vLLM's
execute_model then cuts the batch into m token-balanced slices and builds each slice's attention
metadata, as for DBO; the runner's `_model_forward` runs the slices, and times every step's
forward for the attention node's metrics (hetero_moe_step_*), split or not. With m = auto the
runner asks for MAX_MICROBATCHES builders and sets vLLM's `ubatch_size` per step to the m that
pingpong_auto.py chose, which execute_model reads when it cuts the batch.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.forward_context import override_forward_context

from attention_server import metrics
from attention_server.config import MAX_MICROBATCHES, AttentionConfig
from attention_server.pingpong_auto import AutoMicroBatches
from attention_server.routed_experts import pool_of
from attention_server.vllm_internals import (
    CPUModelRunner, CPUWorker, UBatchContext, cpu_worker, create_forward_context, current_stream, get_forward_context,
    make_ubatch_contexts,
)  # fmt: skip
from expert_server.config import BENCHMARK_ENV

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _Outcome:
    micro_batch: int
    result: torch.Tensor | None = None
    error: BaseException | None = None


class MicroBatchThreads:
    """m persistent threads; `run` gives micro-batch i to thread i and returns the results in order.

    A micro-batch that raises leaves the ring, and the others would wait for its baton forever:
    its thread stays on as a relay, handing the baton on until the rest have finished.
    """

    def __init__(self, count: int):
        self.count = count
        self._jobs: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in range(count)]
        self._outcomes: queue.SimpleQueue[_Outcome] = queue.SimpleQueue()
        self._relaying = threading.Event()
        self._relayed: queue.SimpleQueue[int] = queue.SimpleQueue()
        for i in range(count):
            threading.Thread(target=self._serve, args=(i,), name=f"hetero-moe-microbatch-{i}", daemon=True).start()

    def _serve(self, i: int) -> None:
        # This thread's stream placeholder: a context that starts on any other would ask the
        # (absent) CUDA runtime to switch streams.
        stream = current_stream()
        while True:
            context, forward = self._jobs[i].get()
            context.compute_stream = context.comm_stream = context.current_stream = stream
            try:
                # inference mode is per thread: vLLM's step has it, this thread must set it
                with context, torch.inference_mode():
                    outcome = _Outcome(i, result=forward())
            except BaseException as exc:  # reported to the step's thread, which raises it
                self._outcomes.put(_Outcome(i, error=exc))
                self._relay(context)
            else:
                self._outcomes.put(outcome)

    def _relay(self, context: UBatchContext) -> None:
        while True:
            context.cpu_wait_event.wait()
            context.cpu_wait_event.clear()
            if self._relaying.is_set():
                break
            context.cpu_signal_event.set()
        self._relayed.put(context.id)

    def run(self, contexts: list[UBatchContext], forwards: list[Callable[[], torch.Tensor]]) -> list[torch.Tensor]:
        """Run forwards[i] under contexts[i] on thread i; contexts come from make_ubatch_contexts
        with a barrier of m + 1 parties (the threads and this one)."""
        assert len(contexts) == len(forwards) <= self.count
        for i, (context, forward) in enumerate(zip(contexts, forwards)):
            self._jobs[i].put((context, forward))
        contexts[0].ready_barrier.wait()
        contexts[0].cpu_wait_event.set()
        outcomes = [self._outcomes.get() for _ in contexts]
        failed = [o for o in outcomes if o.error is not None]
        if failed:  # every micro-batch has stopped: release the relays, then report
            self._relaying.set()
            for o in failed:
                contexts[o.micro_batch].cpu_wait_event.set()
            for _ in failed:
                self._relayed.get()
            self._relaying.clear()
            raise failed[0].error
        return [o.result for o in sorted(outcomes, key=lambda o: o.micro_batch)]


class PingPongCPUModelRunner(CPUModelRunner):
    """vLLM's CPU model runner, running a split step's micro-batches in ping-pong."""

    def __init__(self, vllm_config, device: torch.device):
        super().__init__(vllm_config, device)
        self.max_microbatches = max(1, self.parallel_config.ubatch_size)  # the most a step is cut into
        self.microbatches = self.max_microbatches  # the fixed m, when auto is None
        cfg = AttentionConfig.from_env()
        self.auto = AutoMicroBatches(self.max_microbatches) if cfg and cfg.pingpong_microbatches is None else None
        self._auto = self.auto  # kept while a benchmark fixes m (fix_microbatches)
        self._threads: MicroBatchThreads | None = None
        self._in_step = False  # inside execute_model; vLLM's dummy runs are never split
        self._times: metrics.StepTimes | None = None  # found once the model is loaded
        self._moe_layers = 0

    def execute_model(self, *args, **kwargs):
        self._in_step = True
        try:
            return super().execute_model(*args, **kwargs)
        finally:
            self._in_step = False

    def _determine_batch_execution_and_padding(self, num_tokens: int, num_reqs: int, *args, **kwargs):
        mode, descriptor, split, across_dp, stats = super()._determine_batch_execution_and_padding(
            num_tokens, num_reqs, *args, **kwargs
        )
        if self._in_step:
            m = self.microbatches if self.auto is None else self.auto.choose(num_tokens, num_reqs)
            # allow_microbatching is vLLM's own veto (a prefix-cache reader split from its writer).
            split = m > 1 and kwargs.get("allow_microbatching", True) and num_reqs >= m
            if split:
                self.parallel_config.ubatch_size = m  # execute_model cuts the batch into num_ubatches
        return mode, descriptor, split, across_dp, stats

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None, inputs_embeds=None,
                       **model_kwargs):  # fmt: skip
        if self._times is None:
            pool = pool_of(self.vllm_config)
            self._times = pool.times if pool else metrics.StepTimes()
            self._moe_layers = pool.moe_layers if pool else 0
        start = time.perf_counter()
        step = get_forward_context()
        if step.ubatch_slices is None:
            out = super()._model_forward(input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
        else:
            out = self._pingpong(step, input_ids, positions, intermediate_tensors, inputs_embeds, model_kwargs)
        forward_s, m = time.perf_counter() - start, 1 if step.ubatch_slices is None else len(step.ubatch_slices)
        if self.auto is not None and self._in_step:
            self.auto.observe(m, input_ids.shape[0], self._moe_layers, forward_s, self._times.expert_wait_s)
        self._times.publish(forward_s, m)
        return out

    def _pingpong(self, step, input_ids, positions, intermediate_tensors, inputs_embeds, model_kwargs) -> torch.Tensor:
        # What vLLM's own micro-batching splits (token ids and positions) is all these models take.
        assert intermediate_tensors is None and inputs_embeds is None and not model_kwargs, "ping-pong splits token ids only"
        slices = step.ubatch_slices
        per_slice_mapping = isinstance(step.slot_mapping, list)
        contexts = make_ubatch_contexts(
            num_micro_batches=len(slices),
            compute_stream=None,  # each thread puts its own stream in (MicroBatchThreads._serve)
            comm_stream=None,
            forward_contexts=[
                create_forward_context(
                    step.attn_metadata[i], self.vllm_config, cudagraph_runtime_mode=step.cudagraph_runtime_mode,
                    batch_descriptor=step.batch_descriptor,
                    slot_mapping=step.slot_mapping[i] if per_slice_mapping else None,
                    is_padding=None if step.is_padding is None else step.is_padding[s.token_slice],
                )  # fmt: skip
                for i, s in enumerate(slices)
            ],
            ready_barrier=threading.Barrier(len(slices) + 1),
        )
        forwards = [self._slice_forward(input_ids[s.token_slice], positions[..., s.token_slice]) for s in slices]
        if self._threads is None:
            self._threads = MicroBatchThreads(self.max_microbatches)
        with override_forward_context(step):  # the step's own again once the slices are done
            return torch.cat(self._threads.run(contexts, forwards))

    def fix_microbatches(self, m: int | None) -> None:
        """Benchmarks only: every step from the next at m micro-batches (at most the configured
        most; steps with fewer requests run whole), or None: auto again, with what it learned so
        far (it learns only from its own steps)."""
        if m is None and self._auto is None:
            raise ValueError("auto is not on: this server was started with a fixed m")
        if m is not None and not 1 <= m <= self.max_microbatches:
            raise ValueError(f"m must be 1 to {self.max_microbatches} on this server, got {m}")
        self.auto = self._auto if m is None else None
        self.microbatches = self.max_microbatches if m is None else m

    def _slice_forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Callable[[], torch.Tensor]:
        def forward() -> torch.Tensor:
            return self.model(input_ids=input_ids, positions=positions, intermediate_tensors=None, inputs_embeds=None)

        return forward


@contextlib.contextmanager
def _builds_runner(runner_cls: type[CPUModelRunner]):
    """Have vLLM's CPUWorker.init_device construct `runner_cls` where it names CPUModelRunner."""
    cpu_worker.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = CPUModelRunner


class PingPongCPUWorker(CPUWorker):
    """vLLM's CPU worker with the ping-pong runner (`--worker-cls attention_server.pingpong.PingPongCPUWorker`)."""

    def init_device(self) -> None:
        cfg = AttentionConfig.from_env()
        assert cfg is not None, "the ping-pong worker runs with the plugin on"
        if cfg.pingpong_microbatches is None or cfg.pingpong_microbatches > 1:
            # vLLM refuses micro-batching without DeepEP/NIXL when it builds the config, so m is set here,
            # after that check and before the KV cache makes one metadata builder per micro-batch.
            self.parallel_config.ubatch_size = cfg.pingpong_microbatches or MAX_MICROBATCHES
            if cfg.pingpong_microbatches is None:
                logger.info("hetero-moe: ping-pong with 1 to %d micro-batches, chosen per step", MAX_MICROBATCHES)
            else:
                logger.info("hetero-moe: ping-pong with %d micro-batches on steps of at least that many requests",
                            cfg.pingpong_microbatches)  # fmt: skip
        with _builds_runner(PingPongCPUModelRunner):
            super().init_device()

    def hetero_moe_bench_microbatches(self, value: str) -> str:
        """Benchmarks only (HETERO_MOE_BENCHMARK=1, through vLLM's dev-mode collective_rpc):
        "1" to the configured most, or "auto", from the next step on; make bench-pingpong measures
        every m in one server process, since on a VM one process keeps its own speed for its life."""
        if os.environ.get(BENCHMARK_ENV) != "1":
            raise PermissionError(f"changing m at run time is for benchmarks only ({BENCHMARK_ENV}=1)")
        self.model_runner.fix_microbatches(None if value == "auto" else int(value))
        return value

    def hetero_moe_expert_load(self) -> dict | None:
        """The expert load view as JSON (attention_server/load/route.py asks through vLLM's
        collective_rpc; the name is route.RPC_METHOD); None when the accounting is off."""
        pool = pool_of(self.vllm_config)
        view = pool.load_view() if pool is not None else None
        return view.to_json() if view is not None else None
