"""Ping-pong's pieces without a server: the vLLM internals it relies on, its configuration, and
the micro-batch threads passing vLLM's baton (UBatchContext) round the ring, also when one fails.
Parity with m = 1 under load is in test_cluster.py (the ping-pong cases)."""
from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from attention_server.config import AttentionConfig

pytestmark = pytest.mark.vllm

LAYERS = 4


def test_the_vllm_internals_pingpong_uses_are_where_it_expects_them():
    from attention_server import vllm_internals

    assert vllm_internals.check() == []


@pytest.mark.parametrize("m", [0, 5])
def test_microbatches_outside_one_to_four_are_refused(m):
    with pytest.raises(ValueError, match="ping-pong micro-batches must be 1 to 4"):
        AttentionConfig(("127.0.0.1:1",), pingpong_microbatches=m)


def test_pingpong_without_workers_is_an_error_not_stock_vllm():
    run = subprocess.run([sys.executable, "-m", "attention_server", "--model", "unused", "--pingpong-microbatches", "2"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert run.returncode == 2 and "--pingpong-microbatches needs --expert-endpoints" in run.stderr


def _run(threads, m: int, fail_at: tuple[int, int] | None = None) -> tuple[list, list[tuple[int, int]]]:
    """Micro-batches that each yield once per layer, as the combine op does; returns their results
    and the (micro-batch, layer) order in which they ran. fail_at: (micro-batch, layer) raises."""
    from attention_server.vllm_internals import dbo_current_ubatch_id, dbo_yield, make_ubatch_contexts

    order: list[tuple[int, int]] = []
    contexts = make_ubatch_contexts(num_micro_batches=m, compute_stream=None, comm_stream=None,
                                    forward_contexts=[object() for _ in range(m)],
                                    ready_barrier=threading.Barrier(m + 1))  # fmt: skip

    def forward(i: int):
        def run():
            assert dbo_current_ubatch_id() == i
            for layer in range(LAYERS):
                order.append((i, layer))
                if (i, layer) == fail_at:
                    raise RuntimeError(f"micro-batch {i} failed at layer {layer}")
                dbo_yield()
            return i

        return run

    return threads.run(contexts, [forward(i) for i in range(m)]), order


@pytest.mark.parametrize("m", [2, 3, 4])
def test_microbatches_take_turns_layer_by_layer(m):
    from attention_server.pingpong import MicroBatchThreads

    threads = MicroBatchThreads(m)
    for _ in range(2):  # the threads persist across steps
        results, order = _run(threads, m)
        assert results == list(range(m))
        assert order == [(i, layer) for layer in range(LAYERS) for i in range(m)]


@pytest.mark.parametrize("fail_at", [(0, 0), (1, 2), (2, 3)])
def test_a_failing_microbatch_fails_the_step_without_stalling_the_others(fail_at):
    from attention_server.pingpong import MicroBatchThreads

    threads = MicroBatchThreads(3)
    outcome: list[BaseException] = []

    def step():
        try:
            _run(threads, 3, fail_at)
        except RuntimeError as err:
            outcome.append(err)

    runner = threading.Thread(target=step)
    runner.start()
    runner.join(timeout=30)
    assert not runner.is_alive(), "the step hung"
    assert [str(e) for e in outcome] == [f"micro-batch {fail_at[0]} failed at layer {fail_at[1]}"]
    results, order = _run(threads, 3)  # and the next step runs as usual
    assert results == [0, 1, 2] and order == [(i, layer) for layer in range(LAYERS) for i in range(3)]
