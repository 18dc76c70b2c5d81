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
        AttentionConfig(("127.0.0.1:1",), pingpong_microbatches=m, tls_dir=None)


def test_microbatches_flag_takes_a_count_or_auto():
    import argparse

    from attention_server.config import microbatches_flag

    assert microbatches_flag("3") == 3 and microbatches_flag("auto") is None
    with pytest.raises(argparse.ArgumentTypeError, match="expected a number of micro-batches or auto, got 'two'"):
        microbatches_flag("two")
    assert AttentionConfig(("127.0.0.1:1",), tls_dir=None).pingpong_microbatches is None, "auto is the default"


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


class LayerModel:
    """A cluster that behaves as MegaScale's model says, ms per MoE layer: node time b, overhead o
    per extra micro-batch, round trip r of which c does not shrink with the rows; plus `unmodelled`
    ms per layer at every m > 1 that the model leaves out (fill and drain, hand-offs)."""

    def __init__(self, b: float, o: float, r: float, c: float, unmodelled: float = 0.0):
        self.b, self.o, self.r, self.c, self.unmodelled = b, o, r, c, unmodelled

    def step(self, m: int, layers: int = 4) -> tuple[float, float]:
        """(forward s, expert wait s) of one step."""
        node = self.b + (m - 1) * self.o + (self.unmodelled if m > 1 else 0.0)
        layer = max(node, node / m + self.c + (self.r - self.c) / m)
        return layers * layer / 1e3, layers * (layer - node) / 1e3

    def best(self, limit: int = 4) -> int:
        return min(range(1, limit + 1), key=lambda m: self.step(m)[0])


def _drive(auto, cluster: LayerModel, steps: int, num_reqs: int = 16) -> list[int]:
    chosen = []
    for _ in range(steps):
        m = auto.choose(num_reqs, num_reqs)
        auto.observe(m, num_reqs, 4, *cluster.step(m))
        chosen.append(m)
    return chosen


@pytest.mark.parametrize(
    "cluster",
    [
        LayerModel(b=1.0, o=0.1, r=1.0, c=0.1),  # expert time = attention time: m = 2
        LayerModel(b=1.0, o=0.3, r=2.0, c=0.5),  # transport-heavy: m = 3
        LayerModel(b=1.0, o=0.05, r=4.0, c=0.2),  # experts dominate: m = 4
        LayerModel(b=1.0, o=1.5, r=1.0, c=0.5),  # a micro-batch costs more than it hides: m = 1
        LayerModel(b=1.0, o=0.2, r=1.2, c=0.2, unmodelled=1.0),  # the model promises what a split does not give
    ],
    ids=["m2", "m3", "m4", "m1", "m1-unmodelled"],
)
def test_auto_settles_on_the_m_the_model_predicts(cluster):
    from attention_server.pingpong_auto import EXPIRE_STEPS, MIN_GAIN, MIN_SAMPLES, AutoMicroBatches

    chosen = _drive(AutoMicroBatches(4), cluster, 2 * EXPIRE_STEPS)
    best = cluster.best()
    assert chosen[: 2 * MIN_SAMPLES] == [1] * MIN_SAMPLES + [2] * MIN_SAMPLES, "first whole, then m = 2"
    # apart from the steps that measure the others, now, when measured afresh and once expired;
    # an m as fast as the best (within MIN_GAIN) is as good a choice
    as_fast = {m for m in range(1, 5) if cluster.step(m)[0] <= (1 + MIN_GAIN) * cluster.step(best)[0]}
    assert sum(m in as_fast for m in chosen) >= 0.95 * len(chosen), (best, chosen)
    spent = sum(cluster.step(m)[0] for m in chosen)
    assert spent <= 1.05 * len(chosen) * cluster.step(best)[0], (best, chosen)


@pytest.mark.parametrize(
    "small",
    [
        LayerModel(b=0.5, o=0.3, r=1.25, c=0.5),  # m = 3, where the neighbour runs
        LayerModel(b=0.5, o=0.3, r=1.6, c=0.5),  # m = 3, its steps wait for the experts
        LayerModel(b=0.5, o=0.3, r=3.0, c=0.5),  # m = 4: more remote work than the neighbour's
        LayerModel(b=0.5, o=0.3, r=0.6, c=0.5),  # m = 2: little remote work at this size
    ],
    ids=["m3", "m3-waiting", "m4", "m2"],
)
def test_a_new_batch_size_starts_where_its_neighbour_runs(small):
    """Half the rows of a transport-heavy batch (same node and transport: same o and c): auto
    starts at the neighbour's m and is near the best from the first steps, with no steps whole
    and at m = 2 to learn what the neighbour's steps already told it."""
    from attention_server.pingpong_auto import MIN_GAIN, MIN_SAMPLES, AutoMicroBatches

    auto, large = AutoMicroBatches(4), LayerModel(b=1.0, o=0.3, r=2.0, c=0.5)
    assert _drive(auto, large, 60)[-10:] == [3] * 10
    chosen = _drive(auto, small, 60, num_reqs=8)
    assert chosen[:MIN_SAMPLES] == [3] * MIN_SAMPLES, chosen
    best = small.step(small.best())[0]
    as_fast = {m for m in range(1, 5) if small.step(m)[0] <= (1 + MIN_GAIN) * best}
    assert sum(m in as_fast for m in chosen) >= 0.9 * len(chosen), (small.best(), chosen)  # with re-measurements
    # the first 12 steps: three of the neighbour's m, at most three of a smaller m, then the best
    assert sum(small.step(m)[0] for m in chosen[:12]) <= 1.2 * 12 * best, (small.best(), chosen)


def test_a_new_batch_size_unlike_its_neighbour_still_finds_its_m():
    """A batch size whose split overhead differs from the pooled one (the model's premise fails):
    the seeded start costs a few steps, and auto still settles on the best m."""
    from attention_server.pingpong_auto import AutoMicroBatches

    auto, large = AutoMicroBatches(4), LayerModel(b=1.0, o=0.3, r=2.0, c=0.5)
    _drive(auto, large, 60)
    small = LayerModel(b=0.5, o=1.5, r=0.75, c=0.5)  # m = 1
    assert _drive(auto, small, 40, num_reqs=8)[-20:] == [1] * 20


def test_a_neighbour_where_splitting_does_not_pay_does_not_keep_a_batch_size_whole():
    """Prefill steps (many tokens, a split costs more than it hides) come first; the decode batch
    size after them starts whole, like its neighbour, measures a split once instead of trusting
    the neighbour's figures for m = 1, and settles on its own best m (in the 2026-12-04 bench run,
    before this, auto ran 233 of 234 decode steps whole where m = 3 was 1.5x faster)."""
    from attention_server.pingpong_auto import MIN_GAIN, AutoMicroBatches

    auto, prefill = AutoMicroBatches(4), LayerModel(b=10.0, o=8.0, r=2.0, c=1.0)  # m = 1
    for _ in range(30):
        m = auto.choose(4096, 16)
        auto.observe(m, 4096, 4, *prefill.step(m))
    decode = LayerModel(b=1.0, o=0.1, r=1.0, c=0.1)  # m = 2
    chosen = _drive(auto, decode, 60, num_reqs=128)
    best = decode.step(decode.best())[0]
    as_fast = {m for m in range(1, 5) if decode.step(m)[0] <= (1 + MIN_GAIN) * best}
    assert sum(m in as_fast for m in chosen[12:]) >= 0.9 * len(chosen[12:]), (decode.best(), chosen)


def test_one_slow_step_does_not_move_auto():
    from attention_server.pingpong_auto import AutoMicroBatches

    auto, cluster = AutoMicroBatches(4), LayerModel(b=1.0, o=1.5, r=1.0, c=0.5)  # m = 1 is best
    for i in range(12):
        m = auto.choose(16, 16)
        forward, wait = cluster.step(m)
        auto.observe(m, 16, 4, forward * (6 if i == 1 else 1), wait * (6 if i == 1 else 1))  # a pause
    assert _drive(auto, cluster, 50) == [1] * 50


def test_auto_runs_small_batches_whole():
    from attention_server.pingpong_auto import AutoMicroBatches

    auto = AutoMicroBatches(4)
    cluster = LayerModel(b=1.0, o=0.05, r=4.0, c=0.2)
    assert set(_drive(auto, cluster, 20, num_reqs=1)) == {1}
    assert max(_drive(auto, cluster, 20, num_reqs=2)) == 2, "never more micro-batches than requests"


@pytest.mark.parametrize("reprobe", [True, False], ids=["reprobe", "without-reprobe"])
def test_auto_recovers_from_a_busy_moment(reprobe, monkeypatch):
    """A few slow steps of m = 2 (a busy moment of the host) send auto to m = 1; an m that does not
    run is not measured, so only measuring it afresh (REPROBE_STEPS) brings m = 2 back. Without
    that, auto stays on m = 1: the test shows what the re-measurement is for."""
    from attention_server import pingpong_auto

    period = pingpong_auto.REPROBE_STEPS
    if not reprobe:
        monkeypatch.setattr(pingpong_auto, "REPROBE_STEPS", 10**9)
    auto, cluster = pingpong_auto.AutoMicroBatches(4), LayerModel(b=1.0, o=0.2, r=1.0, c=0.3)  # m = 2
    assert _drive(auto, cluster, 30)[-10:] == [2] * 10
    for _ in range(12):  # m = 2's steps take 1.6x as long meanwhile: slower than m = 1's
        m = auto.choose(16, 16)
        forward, wait = cluster.step(m)
        slow = 1.6 if m == 2 else 1.0
        auto.observe(m, 16, 4, forward * slow, wait * slow)
    assert auto.choose(16, 16) == 1
    after = _drive(auto, cluster, 3 * period)
    if reprobe:
        assert after[-2 * period :].count(2) >= 0.95 * 2 * period, after
    else:
        assert set(after) == {1}, after
