"""The numerical oracle for routed experts: plain PyTorch, float32 math.

Shape legend: T rows (unique tokens sent to this worker), H hidden, I expert
intermediate size, E experts held locally, P (row, expert) pairs.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kernels.activations import ACTIVATIONS
from kernels.quant import W4A16ExpertWeights


@dataclass(frozen=True, slots=True)
class DenseExpertWeights:
    """One MoE layer's local experts in the checkpoint dtype.

    w13: [E, 2I, H], gate rows then up rows (as vLLM's w13).
    w2:  [E, H, I], the down projection.
    """

    w13: torch.Tensor
    w2: torch.Tensor

    def __post_init__(self) -> None:
        assert self.w13.dim() == 3 and self.w2.dim() == 3, "expert weights are [E, N, K]"
        assert self.w13.shape[0] == self.w2.shape[0], "w13 and w2 hold different expert counts"
        assert self.w13.shape[1] == 2 * self.w2.shape[2], "w13 is not [E, 2I, H] for w2 [E, H, I]"
        assert self.w13.shape[2] == self.w2.shape[1], "w13 and w2 disagree on H"

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w13.shape[2]


def moe_experts_reference(
    hidden: torch.Tensor,
    pair_rows: torch.Tensor,
    pair_experts: torch.Tensor,
    pair_weights: torch.Tensor,
    weights: DenseExpertWeights,
    activation: str = "silu",
) -> torch.Tensor:
    """Sum of router-weighted expert MLPs per row, in float32.

    hidden:       [T, H] any float dtype
    pair_rows:    [P] int, row of `hidden` for each pair
    pair_experts: [P] int, local expert index in [0, E)
    pair_weights: [P] float32 router weight
    returns       [T, H] float32: out[t] = sum_p w_p * down(act(gate x_t) * up x_t)
    """
    return moe_sum(
        hidden, pair_rows, pair_experts, pair_weights, weights.hidden_size,
        lambda e: (weights.w13[e].float(), weights.w2[e].float()), activation,
    )


def moe_experts_w4a16_reference(
    hidden: torch.Tensor,
    pair_rows: torch.Tensor,
    pair_experts: torch.Tensor,
    pair_weights: torch.Tensor,
    weights: W4A16ExpertWeights,
    activation: str = "silu",
) -> torch.Tensor:
    """moe_experts_reference for int4 experts: dequantize each used expert, fp32 matmul.

    Handles every scheme the loaders produce (asymmetric zeros, act-order g_idx).
    Same arguments and result as moe_experts_reference.
    """
    return moe_sum(
        hidden, pair_rows, pair_experts, pair_weights, weights.hidden_size,
        lambda e: (weights.w13.dequantize(e), weights.w2.dequantize(e)), activation,
    )


def pairs_by_expert(pair_experts: torch.Tensor) -> list[tuple[int, list[int]]]:
    """[(expert, its pair indices in order)] by ascending expert; one host sync (decode requests
    hold a few pairs)."""
    by_expert: dict[int, list[int]] = {}
    for p, e in enumerate(pair_experts.tolist()):
        by_expert.setdefault(e, []).append(p)
    return sorted(by_expert.items())


def moe_sum(
    hidden: torch.Tensor,
    pair_rows: torch.Tensor,
    pair_experts: torch.Tensor,
    pair_weights: torch.Tensor,
    hidden_size: int,
    expert_weights: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    activation: str,
) -> torch.Tensor:
    """The float32 loop of every reference path; expert_weights(e) -> (w13 [2I, H], w2 [H, I]) float32."""
    act = ACTIVATIONS[activation]
    x = hidden.float()
    out = torch.zeros(hidden.shape[0], hidden_size, dtype=torch.float32, device=hidden.device)
    for e, pairs in pairs_by_expert(pair_experts):
        sel = torch.tensor(pairs, device=hidden.device)
        rows = pair_rows[sel]
        w13, w2 = expert_weights(e)  # [2I, H], [H, I] float32
        gate_up = x[rows] @ w13.t()  # [R, 2I]
        gate, up = gate_up.chunk(2, dim=-1)
        y = (act(gate) * up) @ w2.t()  # [R, H]
        out.index_add_(0, rows, y * pair_weights[sel].float().unsqueeze(-1))
    return out
