"""The product end to end: `python -m cluster up` against stock vLLM on the same checkpoint.

Each case gets one stock vLLM server (vLLM's own entry point, plugin off) and
one cluster (eight real workers + the attention server, started the way
`make up` starts them). Greedy tokens must match; a token may differ only
where stock vLLM's own top-2 margin is within bf16 rounding noise. The W4A16
case serves a compressed-tensors checkpoint whose experts the workers run
with the CPU int4 kernel, against stock vLLM on the dequantized weights.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass

from pathlib import Path

import psutil
import pytest
import torch
from openai import OpenAI
from transformers import AutoModelForCausalLM, AutoTokenizer

from cluster.launcher import wait_http_ready
from tests.support import HOST, VLLM_CPU_ARGS, free_ports, python_module
from tiny_models.w4a16 import quantize_experts

pytestmark = pytest.mark.vllm

PROMPTS = [
    "The weather today is",
    "My favourite food is",
    "Once upon a time, a little dog",
    "The train to the city leaves at",
    "In the garden we planted",
    "She opened the book and read",
    "The best way to learn is",
    "After school the children",
]
MAX_TOKENS = 32


@dataclass(frozen=True)
class Case:
    """One stock-vs-cluster comparison."""

    arch: str
    vllm_args: tuple[str, ...] = ()  # compiled mode is vLLM's default and `make up`'s
    w4a16: bool = False  # cluster serves W4A16 experts; stock serves them dequantized


CASES = {
    "qwen3_moe": Case("qwen3_moe"),
    "qwen2_moe": Case("qwen2_moe"),  # shared expert on pool A
    "mixtral": Case("mixtral", ("--enforce-eager",)),
    "qwen3_moe-w4a16": Case("qwen3_moe", w4a16=True),
}


@dataclass
class Generation:
    tokens: list[int]
    margins: list[float]  # top-1 minus top-2 logprob per step
    runner_up: list[int]  # the top-2 token per step


def generate(base_url: str) -> list[Generation]:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    response = client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0, logprobs=2,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    out = [None] * len(PROMPTS)
    for choice in response.choices:
        lp = choice.logprobs
        tokens = [int(t.removeprefix("token_id:")) for t in lp.tokens]
        margins, runner_up = [], []
        for top in lp.top_logprobs:
            (first, lp1), (second, lp2) = sorted(top.items(), key=lambda kv: -kv[1])[:2]
            margins.append(lp1 - lp2)
            runner_up.append(int(second.removeprefix("token_id:")))
        out[choice.index] = Generation(tokens, margins, runner_up)
    return out


def bf16_noise(model: Path, generations: list[Generation]) -> float:
    """How far bf16 arithmetic moves a top-2 margin of this model, per HF transformers.

    Teacher-forces stock's greedy sequences through transformers in float32 and
    in bfloat16 and returns the largest change of the (top-1, top-2) logit
    margin over all steps: the size of a tie that bf16 rounding can break.
    """
    tokenizer = AutoTokenizer.from_pretrained(model)
    models = {dt: AutoModelForCausalLM.from_pretrained(model, dtype=dt) for dt in (torch.float32, torch.bfloat16)}
    noise = 0.0
    for prompt, gen in zip(PROMPTS, generations):
        ids = tokenizer(prompt).input_ids
        seq = torch.tensor([ids + gen.tokens[:-1]])
        steps = slice(len(ids) - 1, len(ids) - 1 + len(gen.tokens))
        top1, top2 = torch.tensor(gen.tokens), torch.tensor(gen.runner_up)
        margins = {}
        with torch.no_grad():
            for dt, hf in models.items():
                logits = hf(seq).logits[0, steps].float()  # [S, V]
                margins[dt] = logits.gather(1, top1[:, None]) - logits.gather(1, top2[:, None])
        noise = max(noise, (margins[torch.float32] - margins[torch.bfloat16]).abs().max().item())
    return noise


def group_pids(pgid: int) -> set[int]:
    return {p.pid for p in psutil.process_iter() if _pgid(p.pid) == pgid}


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.fixture(scope="module", params=list(CASES))
def servers(request, model_dir, tmp_path_factory):
    """(case name, stock's model, stock generations, cluster base url, launcher) with the cluster up.

    Stock vLLM runs first and is stopped before the cluster starts.
    """
    arch, case = request.param, CASES[request.param]
    logs = tmp_path_factory.mktemp(f"cluster-{arch}")
    model = cluster_model = model_dir(case.arch)
    if case.w4a16:  # experts packed by compressed-tensors; stock gets the dequantized twin
        cluster_model, model = quantize_experts(model, logs / "w4a16", logs / "dequantized", group_size=32)
    http_stock, http_cluster, worker_base = free_ports(3)
    vllm_args = [*VLLM_CPU_ARGS, *case.vllm_args]

    stock_log = logs / "stock.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETERO_MOE_")}
    with open(stock_log, "wb") as log:
        stock = subprocess.Popen(
            python_module("vllm.entrypoints.openai.api_server", "--model", str(model), "--host", HOST,
                          "--port", str(http_stock), *vllm_args),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env,
        )  # fmt: skip
    try:
        wait_http_ready(f"http://{HOST}:{http_stock}", [stock], timeout_s=900)
        stock_generations = generate(f"http://{HOST}:{http_stock}")
    finally:
        os.killpg(stock.pid, signal.SIGTERM)
        stock.wait(timeout=60)

    cluster_log = logs / "cluster.log"
    with open(cluster_log, "wb") as log:
        launcher = subprocess.Popen(
            python_module("cluster", "up", "--model", str(cluster_model), "--host", HOST, "--port", str(http_cluster),
                          "--worker-base-port", str(worker_base), "--run-dir", str(logs / "run"), "--", *vllm_args),
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base_url = f"http://{HOST}:{http_cluster}"
    try:
        wait_http_ready(base_url, [launcher], timeout_s=900)
        yield arch, model, stock_generations, base_url, launcher
    finally:
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGINT)
            launcher.wait(timeout=120)


def test_greedy_tokens_match_stock_vllm(servers, capsys):
    """Tokens may differ only at a step whose stock margin is within bf16 noise."""
    arch, model, stock, base_url, _ = servers
    cluster = generate(base_url)
    noise = bf16_noise(model, stock)
    report = [f"bf16 noise of top-2 margins (transformers fp32 vs bf16): {noise:.3f}"]
    for prompt, s, c in zip(PROMPTS, stock, cluster):
        diverged = next((i for i, (a, b) in enumerate(zip(s.tokens, c.tokens)) if a != b), None)
        shared = range(diverged if diverged is not None else len(s.tokens))
        drift = max((abs(s.margins[i] - c.margins[i]) for i in shared), default=0.0)
        report.append(f"{prompt!r}: min stock margin {min(s.margins):.3f}, max margin drift {drift:.3f}, "
                      + ("identical" if diverged is None else f"diverges at {diverged}, margin {s.margins[diverged]:.4f}"))  # fmt: skip
        if diverged is not None:
            assert s.margins[diverged] <= noise, f"{arch}: a token differs where stock is sure:\n" + "\n".join(report)
    with capsys.disabled():  # the margins are the evidence: show them in every run
        print(f"\n{arch}:\n  " + "\n  ".join(report))


def test_every_step_agrees_when_teacher_forced(servers, capsys):
    """On stock's own sequences, the cluster picks stock's token at every step where stock is sure.

    Free-running sequences stop being comparable at their first difference;
    feeding stock's tokens back as the prompt checks all 8 x 32 steps.
    """
    arch, model, stock, base_url, _ = servers
    noise = bf16_noise(model, stock)
    tokenizer = AutoTokenizer.from_pretrained(model)
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    model_id = client.models.list().data[0].id
    prompts = [tokenizer(p).input_ids + s.tokens for p, s in zip(PROMPTS, stock)]
    response = client.completions.create(
        model=model_id, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True,
        extra_body={"return_tokens_as_token_ids": True},
    )  # fmt: skip
    agree, unsure_flips = 0, []
    for choice in response.choices:
        s, prompt_len = stock[choice.index], len(prompts[choice.index]) - MAX_TOKENS
        for step in range(MAX_TOKENS):
            top = choice.logprobs.top_logprobs[prompt_len + step]
            picked = int(max(top, key=top.get).removeprefix("token_id:"))
            if picked == s.tokens[step]:
                agree += 1
                continue
            assert s.margins[step] <= noise, (
                f"{arch} prompt {choice.index} step {step}: cluster picks {picked}, stock {s.tokens[step]} "
                f"with margin {s.margins[step]:.3f} > bf16 noise {noise:.3f}"
            )
            unsure_flips.append(round(s.margins[step], 4))
    with capsys.disabled():
        print(f"\n{arch}: teacher-forced agreement {agree}/{len(PROMPTS) * MAX_TOKENS}; "
              f"flips only at stock margins {sorted(unsure_flips)} (bf16 noise {noise:.3f})")  # fmt: skip


def test_openai_client_endpoints(servers):
    _, _, _, base_url, _ = servers
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    (model,) = [m.id for m in client.models.list().data]
    text = client.completions.create(model=model, prompt="Hello", max_tokens=8, temperature=0)
    assert text.choices[0].text and text.usage.completion_tokens == 8
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "How are you?"}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=8, temperature=0, stream=True
    )
    pieces = [ch.choices[0].delta.content for ch in stream if ch.choices and ch.choices[0].delta.content]
    assert len(pieces) >= 2
    batch = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "How are you?"}], max_tokens=8, temperature=0
    )
    assert batch.choices[0].message.content == chat.choices[0].message.content, "greedy is repeatable"


def test_ctrl_c_leaves_no_process(servers):
    """Last test of each module instance: interrupt the launcher and look for survivors."""
    _, _, _, base_url, launcher = servers
    session = [launcher.pid, *(c.pid for c in psutil.Process(launcher.pid).children(recursive=True))]
    groups = {_pgid(pid) for pid in session} - {None}
    assert len(groups) >= 10, "launcher, 8 workers and the attention server each lead a group"
    launcher.send_signal(signal.SIGINT)
    assert launcher.wait(timeout=120) == 0
    deadline = time.monotonic() + 10
    while (alive := [pid for pid in session if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not alive, f"still running after Ctrl-C: {alive}"
    assert not any(group_pids(g) for g in groups), "a process group outlived Ctrl-C"
