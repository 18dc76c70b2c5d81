"""vLLM's Triton int4 MoE kernel as a bench_kernel peer (benchmarks only: nothing outside benchmarks/ imports it).

fused_moe_gptq_awq.py is vLLM 0.32.0's kernel (Apache-2.0, LICENSE here); layer.py is ours: the weight
layout it expects, moe_align_block_size in plain torch (a CUDA custom op in vLLM), and vLLM's call sequence.
"""
