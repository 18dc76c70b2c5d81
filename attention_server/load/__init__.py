"""Expert load: tokens routed to each (MoE layer, expert), seen from the attention node.

    window.py   ExpertLoad: a ring of per-bucket [L, E] counts in the engine process, fed by every
                MoE layer's DispatchPlan.expert_pairs; LoadView, the snapshot it hands out
    route.py    GET /hetero_moe/expert_load on vLLM's OpenAI server, answered through vLLM's
                collective_rpc by the plugin's worker
    __main__.py python -m attention_server.load URL [--json | --png FILE]: the view as a table,
                JSON or a layer x expert heat map

The bounded Prometheus gauges drawn from the same view are in attention_server/metrics.py.
"""
