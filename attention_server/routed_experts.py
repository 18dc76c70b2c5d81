"""vLLM's routed experts, served by remote expert workers.

One MoE layer, for a micro-batch of T tokens (H hidden, k experts per token):

    [vLLM router] topk_ids, topk_weights [T, k]
         │
         ▼
    partition ──▶ DispatchPlan: per shard, unique rows [T_s] + (row, expert, weight) pairs
         │
         ▼
    transport.send ─▶ a frame per shard with pairs, to one   ─▶ Pending
         │            of its replicas, over its data plane:   │  workers: W4A16/bf16 experts,
         │            shared memory, TCP or a gRPC stream     │  float32 sum over the shard's
    shared experts run here meanwhile (Qwen2-MoE)             │  experts
    dbo_yield: under ping-pong the next micro-batch's         │
         │     attention runs meanwhile (pingpong.py)         ▼
    Pending.wait() ◀──────────────────────────── [T_s, H] float32 partials
         │         (a lost worker's slices go to another replica here)
         ▼
    combine ────▶ float64 sum in shard order ──▶ [T, H] model dtype ──▶ vLLM adds shared output

Dispatch and combine are two opaque custom ops so that vLLM's compiled
(Dynamo, fullgraph) forward can contain a network call; the dispatch op
returns an empty token tensor that the combine op consumes, which keeps them
ordered. The ops find their layer as vLLM's own do, in the forward context's
`no_compile_layers`; work in flight is keyed by (layer, micro-batch). Pool A
never allocates or reads routed-expert weights: the layer's quant method
creates no parameters and the loader skips their tensors.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable

import numpy as np
import torch
from vllm.config import get_current_vllm_config
from vllm.forward_context import get_forward_context
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.fused_moe.config import FusedMoEConfig, FusedMoEQuantConfig
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.runner.shared_experts import SharedExperts, SharedExpertsOrder
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
from vllm.model_executor.models.utils import extract_layer_index
from vllm.utils.torch_utils import direct_register_custom_op

from attention_server import metrics
from attention_server.combine import combine
from attention_server.config import AttentionConfig
from attention_server.hot import HotExperts, HotSet, WorkerFormat, expert_bytes
from attention_server.load.window import ExpertLoad, LoadView
from attention_server.partition import DispatchPlan, Split, partition
from attention_server.replace import STATIC, Replacer
from attention_server.transport import factory
from attention_server.transport.base import Pending
from attention_server.vllm_internals import dbo_current_ubatch_id, dbo_yield
from protos.checkpoint import MoeCheckpoint, read_checkpoint

logger = logging.getLogger(__name__)


class UnsupportedMoEError(ValueError):
    """A MoE layer feature that remote experts do not implement."""


class ExpertPool:
    """This process's connections to the expert workers and the placement over them."""

    def __init__(self, cfg: AttentionConfig, ckpt: MoeCheckpoint, device: torch.device):
        # `python -m attention_server` checked every worker's Info before vLLM started and
        # published the replicas they hold; this process reads Info again for the data planes.
        self.transport, infos = factory.connect_workers(cfg, ckpt)
        placement = self.transport.placement
        self.shards = placement.shard_table()  # [E] home shard of each expert
        self.hot_shard = len(cfg.expert_endpoints)  # hot experts' slices: computed here, added last
        self.epoch = 0  # placements taken (hot sets and worker layouts)
        for gauge in (metrics.PLACEMENT_EPOCH, metrics.HOT_EXPERTS, metrics.HOT_BYTES, metrics.REPLACED_EXPERTS):
            gauge.set(0)  # the gauges exist, at 0, from the start (and with placement changes off)
        workers = WorkerFormat.of(infos) if cfg.hot_expert_bytes or cfg.spare_expert_bytes else None
        self.hot = (HotExperts(ckpt, cfg.hot_expert_bytes, workers, device, self.take_epoch)
                    if cfg.hot_expert_bytes else None)  # fmt: skip
        self.replacer = (Replacer(placement, cfg.expert_endpoints, cfg.security(), cfg.spare_expert_bytes,
                                  expert_bytes(ckpt, workers), cfg.rebalance_above, lambda: bool(self.transport.down),
                                  self.take_epoch, max(info.placement_epoch for info in infos))
                         if cfg.spare_expert_bytes else None)  # fmt: skip
        if self.replacer is not None:
            self.transport.prepare_rejoin = self.replacer.restore
        self.routes: dict[int, tuple[tuple[int, int], np.ndarray, Split | None]] = {}  # per layer, for an epoch pair
        self.counts = metrics.DispatchCounts(len(cfg.expert_endpoints))
        self.load = (ExpertLoad(ckpt.moe_layers, self.shards, ckpt.top_k, cfg.expert_load_window_s)
                     if cfg.expert_load_window_s else None)  # fmt: skip
        self.times = metrics.StepTimes()  # published per step by the model runner (pingpong.py)
        self.last_layer = -1  # the step's last MoE layer publishes its counts
        self.moe_layers = 0  # RemoteRoutedExperts built on this pool

    def take_epoch(self) -> None:
        """A new hot set or worker layout serves from the next layer call on."""
        self.epoch += 1
        metrics.PLACEMENT_EPOCH.set(self.epoch)

    def route(self, layer: int) -> tuple[HotSet | None, np.ndarray, Split | None]:
        """For a layer call starting now: the hot set it takes (None: off), the [E] shard of each
        expert (the hot ones: hot_shard) and the deal of the experts split over several shards."""
        hot = self.hot.current() if self.hot is not None else None
        layout = self.replacer.current() if self.replacer is not None else STATIC
        epochs = (hot.epoch if hot is not None else 0, layout.epoch)
        cached = self.routes.get(layer)
        if cached is not None and cached[0] == epochs:
            return hot, cached[1], cached[2]
        shards, split = layout.route(layer, self.shards)
        if hot is not None and (ids := list(hot.experts.get(layer, ()))):
            shards = shards.copy()
            shards[ids] = self.hot_shard
            if split is not None:  # a hot expert's pairs are all computed here
                dealt = split.split.copy()
                dealt[ids] = False
                split = dataclasses.replace(split, split=dealt) if dealt.any() else None
        self.routes[layer] = (epochs, shards, split)
        return hot, shards, split

    def record(self, layer: int, pending: Pending, width: int, itemsize: int, hot_pairs: int = 0) -> None:
        """A layer call's dispatch (`pending`: answered; `hot_pairs` computed here), for the counters
        and the load window."""
        self.counts.add(layer, pending.plan, width, itemsize, [call.worker for call in pending.calls], hot_pairs)
        if self.load is not None:
            shard_pairs = [(part.shard, part.num_pairs) for part in pending.plan.slices]
            if hot_pairs:
                shard_pairs.append((self.hot_shard, hot_pairs))
            self.load.add(self.load.slots[layer], pending.plan.expert_pairs, shard_pairs)

    def end_step(self) -> None:
        """After the step's last MoE layer (of each micro-batch)."""
        self.counts.publish()
        if self.replacer is not None:
            self.replacer.step_done()
        if self.load is not None and self.load.advance():
            view = self._publish_view()
            if self.hot is not None:
                self.hot.offer(view)
            if self.replacer is not None:
                self.replacer.offer(view.window, view.layers, view.hot)

    def load_view(self) -> LoadView | None:
        """The expert load window as of now, None when it is off; the gauges show the same."""
        if self.load is None:
            return None
        self.load.advance()
        return self._publish_view()

    def _publish_view(self) -> LoadView:
        """The window as of now, with the current hot set, set on the gauges."""
        view = self.load.view()
        if self.hot is not None:
            view = dataclasses.replace(view, hot=self.hot.current().experts)
        metrics.publish_load(view)
        return view


@functools.cache
def expert_pool(model: str, device: torch.device) -> ExpertPool:
    cfg = AttentionConfig.from_env()
    assert cfg is not None, "remote experts built while the plugin is off"
    return ExpertPool(cfg, read_checkpoint(model), device)


class RemoteExpertsMethod(FusedMoEMethodBase):
    """A MoE 'quant method' that holds no weights: the experts live on the workers."""

    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype, **kw):
        pass

    def get_fused_moe_quant_config(self, layer) -> FusedMoEQuantConfig | None:
        return None

    @property
    def mk_can_overlap_shared_experts(self) -> bool:
        # Shared experts run inside forward_modular, between dispatch and combine.
        return True

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        raise AssertionError("RemoteRoutedExperts.forward_modular does not call apply()")


class RemoteRoutedExperts(RoutedExperts):
    """Out-of-tree replacement of vLLM's RoutedExperts for every MoE model it builds."""

    def __init__(self, layer_name: str, *args, **kwargs):
        super().__init__(layer_name, *args, **kwargs)
        unsupported = {
            "apply_router_weight_on_input": self.apply_router_weight_on_input,
            "swiglu_limit": self.swiglu_limit is not None,
            "swiglu_alpha": self.swiglu_alpha is not None,
            "expert parallelism inside vLLM": self.use_ep,
            "non-gated activation": not self.moe_config.is_act_and_mul,
        }
        if reasons := [name for name, present in unsupported.items() if present]:
            raise UnsupportedMoEError(f"{layer_name}: remote experts do not support {', '.join(reasons)}")
        self.layer_index = extract_layer_index(layer_name)
        vllm_config = get_current_vllm_config()
        self.pool = expert_pool(vllm_config.model_config.model, torch.device(vllm_config.device_config.device))
        assert len(self.pool.shards) == self.global_num_experts, (len(self.pool.shards), self.global_num_experts)
        self.pool.last_layer = max(self.pool.last_layer, self.layer_index)
        self.pool.moe_layers += 1
        # Where the custom ops find this layer: vLLM's forward context, as for its own layers.
        self.op_key = f"{layer_name}.remote_experts"
        vllm_config.compilation_config.static_forward_context[self.op_key] = self
        # Per micro-batch in flight: the hot set the call took and its whole plan (hot slice last).
        self.hot_calls: dict[int, tuple[HotSet, DispatchPlan]] = {}

    def _get_quant_method(
        self, prefix: str, quant_config: QuantizationConfig | None, moe_config: FusedMoEConfig
    ) -> FusedMoEMethodBase:
        return RemoteExpertsMethod(moe_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[str]:
        # The loader already skipped the expert weight tensors; this drops the
        # small ones it lets through (scales, zero points) unread by any layer.
        for _ in weights:
            pass
        yield from ()

    def forward_modular(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: SharedExperts | None = None,
        shared_experts_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [T, H]; topk_weights, topk_ids: [T, k]. Returns the routed output [T, H]."""
        token = torch.ops.hetero_moe.dispatch(x, topk_weights, topk_ids, self.op_key)
        if shared_experts is not None:
            shared_experts(shared_experts_input, SharedExpertsOrder.MK_INTERNAL_OVERLAPPED)
        return torch.ops.hetero_moe.combine(token, x, self.op_key)

    def send(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> None:
        start = time.perf_counter()
        micro_batch = dbo_current_ubatch_id()
        hot, shards, split = self.pool.route(self.layer_index)
        plan = partition(topk_ids, topk_weights, shards, split, self.pool.hot_shard + 1)
        if plan.slices and plan.slices[-1].shard == self.pool.hot_shard:
            self.hot_calls[micro_batch] = (hot, plan)
            plan = DispatchPlan(plan.num_tokens, plan.slices[:-1], plan.expert_pairs)
        self.pool.transport.send(self.layer_index, micro_batch, x, plan)
        self.pool.times.dispatch_s += time.perf_counter() - start

    def receive(self, x: torch.Tensor) -> torch.Tensor:
        micro_batch = dbo_current_ubatch_id()
        # Hot experts here while the workers compute the rest.
        hot_partial, (hot, plan) = None, self.hot_calls.pop(micro_batch, (None, None))
        if hot is not None:
            hot_partial = hot.compute(self.layer_index, x, plan.slices[-1]).cpu()
        # Under ping-pong the next micro-batch runs its attention while this one's rows are out.
        dbo_yield()
        pending = self.pool.transport.take(self.layer_index, micro_batch)
        start = time.perf_counter()
        partials = pending.wait()
        waited = time.perf_counter()
        hot_pairs = 0 if hot is None else plan.slices[-1].num_pairs
        self.pool.record(self.layer_index, pending, x.shape[1], x.element_size(), hot_pairs)
        if hot is None:
            out = combine(pending.plan, partials, x.shape[1], x.dtype).to(x.device)
        else:
            out = combine(plan, [*partials, hot_partial], x.shape[1], x.dtype).to(x.device)
        self.pool.times.expert_wait_s += waited - start
        self.pool.times.combine_s += time.perf_counter() - waited
        if self.layer_index == self.pool.last_layer:
            self.pool.end_step()
        return out


def pool_of(vllm_config) -> ExpertPool | None:
    """The expert pool of this process's model, None when it has no remote experts."""
    for layer in vllm_config.compilation_config.static_forward_context.values():
        if isinstance(layer, RemoteRoutedExperts):
            return layer.pool
    return None


def _layer(op_key: str) -> RemoteRoutedExperts:
    return get_forward_context().no_compile_layers[op_key]


def _dispatch(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, op_key: str) -> torch.Tensor:
    _layer(op_key).send(x, topk_weights, topk_ids)
    return x.new_empty(0)


def _dispatch_fake(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, op_key: str) -> torch.Tensor:
    return x.new_empty(0)


def _combine(token: torch.Tensor, x: torch.Tensor, op_key: str) -> torch.Tensor:
    return _layer(op_key).receive(x)


def _combine_fake(token: torch.Tensor, x: torch.Tensor, op_key: str) -> torch.Tensor:
    return torch.empty_like(x)


class ColdExpertSkippingLoader(DefaultModelLoader):
    """vLLM's default loader, skipping every routed-expert weight before it is read."""

    def _init_ep_weight_filter(self, model_config) -> None:
        # The same filter vLLM uses for expert parallelism, with no local experts.
        self.local_expert_ids = set()


_LIBRARY = torch.library.Library("hetero_moe", "DEF")
LOAD_FORMATS = ("auto", "hf", "safetensors")


def install() -> None:
    """Make vLLM build RemoteRoutedExperts and skip expert weights. Idempotent."""
    if op_registry_oot.get(RoutedExperts.__name__) is RemoteRoutedExperts:
        return
    direct_register_custom_op("dispatch", _dispatch, fake_impl=_dispatch_fake, target_lib=_LIBRARY)
    direct_register_custom_op("combine", _combine, fake_impl=_combine_fake, target_lib=_LIBRARY)
    RoutedExperts.register_oot(RemoteRoutedExperts)
    # Replacing vLLM's default loader is the point; its "already registered,
    # will be overwritten" warning would only alarm operators.
    vllm_loader_logger = logging.getLogger("vllm.model_executor.model_loader")
    level = vllm_loader_logger.level
    vllm_loader_logger.setLevel(logging.ERROR)
    try:
        for load_format in LOAD_FORMATS:
            register_model_loader(load_format)(ColdExpertSkippingLoader)
    finally:
        vllm_loader_logger.setLevel(level)
    logger.info("hetero-moe: routed experts are served by remote workers; load formats %s skip them", LOAD_FORMATS)
