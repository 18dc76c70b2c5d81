"""How decisive greedy decoding is on a checkpoint, measured with stock vLLM.

    python -m tiny_models.margins DIR [DIR ...] [--max-tokens 32]

For each greedy step of 8 ordinary English prompts this records the top-1 minus top-2 logit
margin (from vLLM's top-2 logprobs). Token-parity tests are only meaningful when few margins are
near bf16 rounding of the logits (vLLM computes the lm_head in bf16: ulp 0.0625 for logits in
[8, 16)).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

PROMPTS = (
    "The weather is nice today, so we",
    "My favorite food is",
    "At the market on Saturday, we bought",
    "The children walked to school and",
    "How do you make a good cup of coffee?",
    "In the evening the house grows quiet.",
    "Learning a new language takes",
    "The doctor asked how I was feeling.",
)


@dataclass(frozen=True, slots=True)
class MarginReport:
    model: str
    startup_s: float
    steps: int
    p10: float
    p25: float
    median: float
    minimum: float
    below_0_05: int
    exact_ties: int
    distinct_tokens: int
    sample: str


def summarize(
    model: str, startup_s: float, margins: list[float], token_ids: list[int], sample: str
) -> MarginReport:
    ordered = sorted(margins)
    return MarginReport(
        model=model,
        startup_s=round(startup_s, 1),
        steps=len(ordered),
        p10=round(ordered[len(ordered) // 10], 4),
        p25=round(ordered[len(ordered) // 4], 4),
        median=round(statistics.median(ordered), 4),
        minimum=round(ordered[0], 4),
        below_0_05=sum(m < 0.05 for m in ordered),
        exact_ties=sum(m == 0.0 for m in ordered),
        distinct_tokens=len(set(token_ids)),
        sample=sample,
    )


def measure(model_dir: Path, max_tokens: int = 32) -> MarginReport:
    """Start vLLM (eager, bf16) on model_dir, decode PROMPTS greedily, return the margin summary."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default would claim far more RAM
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_model_len=512, enforce_eager=True, seed=0)
    startup_s = time.perf_counter() - start
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2)
    margins, token_ids = [], []
    outputs = llm.generate(list(PROMPTS), params)
    for out in outputs:
        completion = out.outputs[0]
        token_ids += completion.token_ids
        for step in completion.logprobs:
            top = sorted((lp.logprob for lp in step.values()), reverse=True)
            margins.append(top[0] - top[1])
    return summarize(str(model_dir), startup_s, margins, token_ids, outputs[0].outputs[0].text)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m tiny_models.margins", description=__doc__)
    parser.add_argument("models", nargs="+", type=Path)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    for model in args.models:
        print(json.dumps(asdict(measure(model, args.max_tokens))), flush=True)


if __name__ == "__main__":
    main()
