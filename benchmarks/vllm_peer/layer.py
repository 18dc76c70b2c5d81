"""One MoE layer the way vLLM 0.32.0's fused_experts runs W4A16 through its Triton kernel.

    align:   pairs sorted by expert, each expert padded to BLOCK_SIZE_M   (moe_align_block_size)
    gate_up: fused_moe_kernel_gptq_awq, x[token] @ w1[e]^T               [T, k, 2I] bf16
    act:     silu(gate) * up                                              [T*k, I]   bf16
    down:    fused_moe_kernel_gptq_awq, act @ w2[e]^T * router weight     [T, k, H]  bf16
    sum:     over the k experts of each token                             [T, H]     bf16
Weights as vLLM's int4_w4a16 path takes them: qweight [E, N, K/2] uint8, k even in the low nibble,
zero point 8 (symmetric), scales [E, N, K/G] in the activation dtype. Launch parameters: vLLM's
defaults for int4_w4a16 (get_default_config, then get_moe_wna16_block_config's Triton branch), the
ones it uses where no tuned file exists (it ships none for the H200 and this dtype).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from benchmarks.vllm_peer.fused_moe_gptq_awq import fused_moe_kernel_gptq_awq
from kernels.quant import Int4Weights, W4A16ExpertWeights


@dataclass(frozen=True, slots=True)
class Alignment:
    """moe_align_block_size's outputs (vLLM's names)."""

    sorted_token_ids: torch.Tensor  # [P + E*(BM-1)] int32 pair indices by expert, padding = P
    expert_ids: torch.Tensor  # [blocks] int32 expert of each BM-row block
    num_tokens_post_padded: torch.Tensor  # [1] int32


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int, num_experts: int) -> Alignment:
    """topk_ids [T, k] -> pairs grouped by expert, each expert's run padded to block_size; no host sync."""
    flat = topk_ids.flatten().long()  # [P]
    p = flat.numel()
    ones = torch.ones(p, dtype=torch.int64, device=flat.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, ones)  # [E]
    padded = (counts + block_size - 1) // block_size * block_size  # [E]
    ends = torch.cumsum(padded, 0)  # [E] padded run ends
    order = torch.sort(flat, stable=True).indices  # [P]
    expert = flat[order]
    rank = torch.arange(p, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert]  # within the expert
    size = p + num_experts * (block_size - 1)
    if p < num_experts:
        size = min(p * block_size, size)
    sorted_ids = torch.full((size,), p, dtype=torch.int32, device=flat.device)
    sorted_ids[(ends - padded)[expert] + rank] = order.to(torch.int32)
    block_starts = torch.arange(triton.cdiv(size, block_size), device=flat.device) * block_size
    expert_ids = torch.searchsorted(ends, block_starts, right=True).clamp_(max=num_experts - 1).to(torch.int32)
    return Alignment(sorted_ids, expert_ids, ends[-1:].to(torch.int32))


def vllm_default_config(num_tokens: int, top_k: int) -> dict[str, int]:
    """vLLM 0.32.0's launch parameters for int4_w4a16 without a tuned file, M = tokens (rows)."""
    block_m = 16 if num_tokens <= 20 else 32 if num_tokens <= 40 else 64
    block_n, block_k = (32, 64) if num_tokens == 1 else (64, 32)
    return {"BLOCK_SIZE_M": block_m, "BLOCK_SIZE_N": block_n, "BLOCK_SIZE_K": block_k, "GROUP_SIZE_M": 1, "SPLIT_K": 1}


def vllm_int4(weights: Int4Weights, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 weights -> (qweight [E, N, K/2] uint8, k even in the low nibble; scales [E, N, K/G])."""
    q = torch.stack([weights.unpacked(e) for e in range(weights.num_experts)]).to(device)  # [E, N, K] 0..15
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8).contiguous()
    return packed, weights.scales.to(device=device, dtype=dtype).contiguous()


class VllmTritonMoe:
    """Called like a PreparedExperts; pairs must be row-major with top_k per row (bench_kernel's problems), so
    rows_ascending holds whatever the caller says."""

    def __init__(self, weights: W4A16ExpertWeights, top_k: int, device: torch.device,
                 config: dict[str, int] | None = None, dtype: torch.dtype = torch.bfloat16) -> None:
        self.w1, self.s1 = vllm_int4(weights.w13, device, dtype)
        self.w2, self.s2 = vllm_int4(weights.w2, device, dtype)
        self.group = weights.w13.group_size
        self.num_experts, self.top_k, self.config = weights.num_experts, top_k, config

    def __call__(self, hidden, pair_rows, pair_experts, pair_weights, *, rows_ascending=False) -> torch.Tensor:
        t, k = hidden.shape[0], self.top_k
        x = hidden.to(self.s1.dtype).contiguous()
        topk_ids = pair_experts.view(t, k)
        topk_weights = pair_weights.view(t, k).float()
        cfg = self.config or vllm_default_config(t, k)
        align = moe_align_block_size(topk_ids, cfg["BLOCK_SIZE_M"], self.num_experts)
        inter2 = self.w1.shape[1]
        gate_up = torch.empty(t, k, inter2, dtype=x.dtype, device=x.device)
        self._invoke(x, self.w1, self.s1, gate_up, topk_weights, align, False, k, cfg)
        gate, up = gate_up.view(t * k, inter2).float().chunk(2, dim=-1)
        act = (torch.nn.functional.silu(gate) * up).to(x.dtype)  # [T*k, I]
        down = torch.empty(t, k, self.w2.shape[1], dtype=x.dtype, device=x.device)
        self._invoke(act, self.w2, self.s2, down, topk_weights, align, True, 1, cfg)
        return down.sum(dim=1)

    def _invoke(self, a, b, b_scale, c, topk_weights, align: Alignment, mul_routed_weight, top_k, cfg) -> None:
        """vLLM's invoke_fused_moe_wna16_triton_kernel, int4 without zero points."""
        em = align.sorted_token_ids.numel()
        if a.shape[0] < cfg["BLOCK_SIZE_M"]:
            em = min(em, a.shape[0] * top_k * cfg["BLOCK_SIZE_M"])
        launch = {key: value for key, value in cfg.items() if key in ("num_warps", "num_stages")}
        meta = {key: value for key, value in cfg.items() if key not in launch}
        grid = (triton.cdiv(em, meta["BLOCK_SIZE_M"]) * triton.cdiv(b.shape[1], meta["BLOCK_SIZE_N"]),)
        fused_moe_kernel_gptq_awq[grid](
            a, b, c, b_scale, None, topk_weights, align.sorted_token_ids, align.expert_ids,
            align.num_tokens_post_padded, b.shape[1], a.shape[1], em, topk_weights.numel(),
            a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1), c.stride(1), c.stride(2),
            b_scale.stride(0), b_scale.stride(2), b_scale.stride(1), 0, 0, 0,
            block_k_diviable=a.shape[1] % meta["BLOCK_SIZE_K"] == 0, group_size=self.group,
            MUL_ROUTED_WEIGHT=mul_routed_weight, top_k=top_k,
            compute_type=tl.bfloat16 if a.dtype == torch.bfloat16 else tl.float16,
            has_zp=False, use_int4_w4a16=True, use_int8_w8a16=False, **meta, **launch,
        )
