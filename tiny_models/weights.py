"""Tensor names, shapes and deterministic random values of a checkpoint.

Names are the per-expert ones real hub checkpoints use (what vLLM's model files and transformers'
checkpoint converters expect). Values come from a torch.Generator seeded from (seed, tensor name),
drawn as integers and scaled to a uniform distribution in float64, so the bytes depend neither on
the CPU's vector units (as torch.randn's would) nor on any global RNG state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import torch

from protos.checkpoint import read_header

from .spec import ModelSpec

_UNIFORM_BITS = 24


@dataclass(frozen=True, slots=True)
class ColumnShift:
    """`value` added to column `column` of `rows` (None: every row) of a 2-D tensor."""

    column: int
    value: float
    rows: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One checkpoint tensor. std None means a norm weight (all ones)."""

    name: str
    shape: tuple[int, ...]
    std: float | None
    zero_rows: tuple[int, ...] = ()
    shift: ColumnShift | None = None


def _linear(name: str, out_features: int, in_features: int, gain: float) -> TensorSpec:
    """[out, in] weight with std gain / sqrt(in)."""
    return TensorSpec(f"{name}.weight", (out_features, in_features), gain / math.sqrt(in_features))


def _mlp(
    prefix: str, names: tuple[str, str, str], hidden: int, inter: int, spec: ModelSpec
) -> list[TensorSpec]:
    """SwiGLU weights; names = (gate, up, down) as the checkpoint spells them."""
    gate, up, down = names
    return [
        _linear(f"{prefix}.{gate}", inter, hidden, spec.init.expert),
        _linear(f"{prefix}.{up}", inter, hidden, spec.init.expert),
        _linear(f"{prefix}.{down}", hidden, inter, spec.init.expert_down),
    ]


def _attention(prefix: str, spec: ModelSpec) -> list[TensorSpec]:
    h, g = spec.hidden_size, spec.init.attn
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    tensors = [
        _linear(f"{prefix}.q_proj", q, h, g),
        _linear(f"{prefix}.k_proj", kv, h, g),
        _linear(f"{prefix}.v_proj", kv, h, g),
        _linear(f"{prefix}.o_proj", h, q, g),
    ]
    if spec.arch == "qwen3_moe":
        tensors += [TensorSpec(f"{prefix}.{n}.weight", (spec.head_dim,), None) for n in ("q_norm", "k_norm")]
    if spec.arch == "qwen2_moe":
        tensors += [
            TensorSpec(f"{prefix}.{n}.bias", (size,), spec.init.bias)
            for n, size in (("q_proj", q), ("k_proj", kv), ("v_proj", kv))
        ]
    return tensors


def _moe(prefix: str, spec: ModelSpec) -> list[TensorSpec]:
    h, e = spec.hidden_size, spec.num_experts
    if spec.arch == "mixtral":
        block, names = f"{prefix}.block_sparse_moe", ("w1", "w3", "w2")
    else:
        block, names = f"{prefix}.mlp", ("gate_proj", "up_proj", "down_proj")
    router = _linear(f"{block}.gate", e, h, spec.init.router)
    if spec.skew is not None:
        shift = ColumnShift(0, spec.skew.router_gain / math.sqrt(h), spec.skew.hot_experts)
        router = dataclasses.replace(router, shift=shift)
    tensors = [router]
    for i in range(e):
        tensors += _mlp(f"{block}.experts.{i}", names, h, spec.expert_intermediate, spec)
    if spec.shared_expert_intermediate:
        tensors += _mlp(f"{block}.shared_expert", names, h, spec.shared_expert_intermediate, spec)
        tensors.append(_linear(f"{block}.shared_expert_gate", 1, h, 1.0))
    return tensors


def tensor_specs(spec: ModelSpec, dead_token_ids: Sequence[int]) -> list[TensorSpec]:
    """All tensors of the checkpoint, in a fixed order.

    dead_token_ids: ids whose lm_head row is zero (special tokens and vocab padding), so greedy
    decoding never picks them: their logit is exactly 0 while the top logit is several stds up.
    """
    h, v = spec.hidden_size, spec.vocab_size
    embed = TensorSpec("model.embed_tokens.weight", (v, h), spec.init.embed)
    if spec.skew is not None:
        embed = dataclasses.replace(embed, shift=ColumnShift(0, spec.skew.embed_offset))
    tensors = [embed]
    for layer in range(spec.num_layers):
        p = f"model.layers.{layer}"
        tensors += [
            TensorSpec(f"{p}.input_layernorm.weight", (h,), None),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (h,), None),
            *_attention(f"{p}.self_attn", spec),
            *_moe(p, spec),
        ]
    lm_head = _linear("lm_head", v, h, spec.init.lm_head)
    tensors += [
        TensorSpec("model.norm.weight", (h,), None),
        TensorSpec(lm_head.name, lm_head.shape, lm_head.std, tuple(sorted(dead_token_ids))),
    ]
    return tensors


def _generator(seed: int, name: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def materialize(t: TensorSpec, seed: int) -> torch.Tensor:
    """bf16 tensor of shape t.shape: ones, or uniform with std t.std (integer draws, exact scaling)."""
    if t.std is None:
        return torch.ones(t.shape, dtype=torch.bfloat16)
    half = 1 << (_UNIFORM_BITS - 1)
    ints = torch.randint(-half, half, t.shape, generator=_generator(seed, t.name), dtype=torch.int64)
    # (ints + 0.5) / half is uniform on (-1, 1) with std 1/sqrt(3).
    values = (ints.to(torch.float64) + 0.5) * (t.std * math.sqrt(3.0) / half)
    if t.shift is not None:
        rows = list(t.shift.rows) if t.shift.rows is not None else slice(None)
        values[rows, t.shift.column] += t.shift.value
    if t.zero_rows:
        values[list(t.zero_rows)] = 0.0
    return values.to(torch.bfloat16)


def iter_tensors(specs: Sequence[TensorSpec], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    for t in specs:
        yield t.name, materialize(t, seed)


# -- reading back, without loading the data ----------------------------------------------------


def read_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors file's header, without reading the data."""
    return {name: entry.shape for name, entry in read_header(path).tensors.items()}


@dataclass(frozen=True, slots=True)
class ParamSplit:
    routed_experts: int
    shared_experts: int  # shared expert MLPs and their gates
    routers: int
    attention: int
    embeddings: int  # embed_tokens + lm_head
    norms: int

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in dataclasses.fields(self))

    @property
    def routed_fraction(self) -> float:
        return self.routed_experts / self.total

    def describe(self) -> str:
        parts = ", ".join(
            f"{name} {count / 1e6:.2f}M"
            for name, count in (
                ("routed experts", self.routed_experts),
                ("shared experts", self.shared_experts),
                ("routers", self.routers),
                ("attention", self.attention),
                ("embeddings", self.embeddings),
                ("norms", self.norms),
            )
        )
        return f"{self.total / 1e6:.2f}M params ({self.routed_fraction:.1%} routed experts): {parts}"


def _category(name: str) -> str:
    if ".shared_expert" in name:
        return "shared_experts"
    if ".experts." in name:
        return "routed_experts"
    if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
        return "routers"
    if ".self_attn." in name and "_norm." not in name:
        return "attention"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "embeddings"
    return "norms"


def param_split(shapes: Mapping[str, Sequence[int]]) -> ParamSplit:
    """Parameter counts by role, from {tensor name: shape} (see read_shapes, tensor_specs)."""
    counts = {f.name: 0 for f in dataclasses.fields(ParamSplit)}
    for name, shape in shapes.items():
        counts[_category(name)] += math.prod(shape)
    return ParamSplit(**counts)
