"""python -m attention_server.load URL [--total] [--json | --png FILE]

The expert load of a running attention server (URL: its OpenAI base, e.g. http://127.0.0.1:8000):
per MoE layer, the tokens routed over the window, the balance (busiest expert or shard over the
mean) and the busiest experts; --json prints the full per-expert view as the server sent it,
--png FILE draws it as a layer x expert heat map. --total: since the server started, not the window.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from attention_server.load.route import PATH
from attention_server.load.window import BALANCE_OVER, LoadView

TOP_N = 5


def fetch(url: str, timeout_s: float = 30.0) -> dict:
    """The server's JSON view; SystemExit naming the reason when it has none."""
    try:
        with urllib.request.urlopen(url.rstrip("/") + PATH, timeout=timeout_s) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as err:
        raise SystemExit(f"{url}: {err.code} {json.loads(err.read()).get('error', err.reason)}") from None
    except urllib.error.URLError as err:
        raise SystemExit(f"{url}: {err.reason}") from None


def table(view: LoadView, total: bool, span: str) -> str:
    counts = view.total if total else view.window
    balance = {over: view.balance(over, total) for over in BALANCE_OVER}
    ids, shares = view.top(counts, TOP_N)
    lines = [f"tokens per MoE layer {span}; balance: busiest over mean (1 = even); top {TOP_N} experts "
             f"with their share of the layer's tokens (each token picks {view.top_k})",
             f"{'layer':>5} {'tokens':>10} {'experts':>8} {'shards':>7}  busiest experts"]  # fmt: skip
    for i, layer in enumerate(view.layers):
        hot = set(view.hot.get(layer, ()))
        top = ("  ".join(f"{e:>3}{'*' if e in hot else ' '}{s:4.0%}" for e, s in zip(ids[i], shares[i]))
               if counts[i].any() else "-")  # fmt: skip
        lines.append(f"{layer:>5} {view.tokens(counts)[i]:>10} {balance['expert'][i]:>8.2f} "
                     f"{balance['shard'][i]:>7.2f}  {top}")  # fmt: skip
    if view.hot:
        lines.append("* computed on the attention node (hot experts), which the shard balance leaves out")
    return "\n".join(lines)


def heat_map(view: LoadView, counts: np.ndarray, span: str, path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--png draws with matplotlib, which is not installed: pip install -e '.[bench]'") from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shares = counts / np.maximum(view.tokens(counts), 1)[:, None]  # [L, E] share of each layer's tokens
    fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * counts.shape[1] + 2), max(2.5, 0.3 * len(view.layers) + 1.5)))
    image = ax.imshow(shares, aspect="auto", cmap="viridis", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(np.arange(len(view.layers)))
    ax.set_yticklabels([str(layer) for layer in view.layers])
    ax.set_title(f"expert load, {span}")
    fig.colorbar(image, ax=ax, label="share of the layer's tokens")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m attention_server.load", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("url", help="the attention server's base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--total", action="store_true", help="since the server started, not over the window")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the server's JSON view (window and total) as is")
    out.add_argument("--png", type=Path, metavar="FILE", help="write a layer x expert heat map to FILE")
    a = p.parse_args(argv)
    data = fetch(a.url)
    if a.json:
        json.dump(data, sys.stdout)
        print()
        return
    view = LoadView.from_json(data)
    span = "since the server started" if a.total else f"over the last {view.covered_s:.0f} s"
    if a.png:
        heat_map(view, view.total if a.total else view.window, span, a.png)
        print(a.png)
    else:
        print(table(view, a.total, span))


if __name__ == "__main__":
    main()
