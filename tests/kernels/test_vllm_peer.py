"""The vLLM kernel copied for bench_kernel stays a benchmark: nothing else imports it, and its
torch alignment reproduces vLLM's documented example (the bench checks the whole peer against our
reference on the GPU)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[2]


def test_only_benchmarks_import_the_vllm_peer():
    importers = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in (".venv", "benchmarks") or "site-packages" in rel.parts or path == Path(__file__):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            if any(name.startswith("benchmarks.vllm_peer") for name in names):
                importers.append(str(rel))
    assert not importers, f"outside benchmarks/: {importers}"


def test_align_matches_vllms_example():
    """moe_align_block_size's docstring example (vLLM 0.32.0), experts renumbered from 0."""
    pytest.importorskip("triton")
    from benchmarks.vllm_peer.layer import moe_align_block_size

    topk_ids = torch.tensor([[2, 3, 4], [1, 2, 4], [1, 3, 4], [1, 2, 3]]) - 1
    align = moe_align_block_size(topk_ids, block_size=4, num_experts=4)
    expected = [3, 6, 9, 12, 0, 4, 10, 12, 1, 7, 11, 12, 2, 5, 8, 12]
    assert align.sorted_token_ids[:16].tolist() == expected
    assert (align.sorted_token_ids[16:] == 12).all()  # the rest of the worst-case buffer is padding
    assert align.num_tokens_post_padded.tolist() == [16]
    assert align.expert_ids[:4].tolist() == [0, 1, 2, 3]
