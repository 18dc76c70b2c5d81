"""GET /hetero_moe/expert_load on vLLM's OpenAI server: the expert load view as JSON (window.py).

The counts live in the engine's worker, the HTTP server in the API server process. The route asks
the worker through vLLM's collective_rpc (the way vLLM's own dev routes reach the engine); the
plugin's CPU worker (attention_server/pingpong.py) answers RPC_METHOD. vLLM 0.32 adds routes from
`vllm.endpoint_plugins` entry points, which load only when VLLM_PLUGINS names them; this is an
ASGI middleware instead, which `python -m attention_server` hands to vLLM's --middleware flag.
Like /metrics it sits outside the API key's /v1 prefix.
"""
from __future__ import annotations

import json
import logging

logger = logging.getLogger(__name__)

PATH = "/hetero_moe/expert_load"
RPC_METHOD = "hetero_moe_expert_load"
MIDDLEWARE = f"{__name__}.ExpertLoadRoute"  # vLLM's --middleware takes an import path


class ExpertLoadRoute:
    """Pure ASGI: answers PATH and hands every other request to the app untouched."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "GET":
            await _answer(send, 405, {"error": f"{PATH} takes GET"})
            return
        engine = scope["app"].state.engine_client
        try:
            (view,) = await engine.collective_rpc(RPC_METHOD)
        except Exception as err:  # the process edge: any failure of the RPC becomes the answer
            logger.warning("expert load: the engine's worker did not answer %s: %r", RPC_METHOD, err)
            await _answer(send, 501, {"error": f"the engine's worker cannot report expert load: {err!r}"})
            return
        if view is None:
            await _answer(send, 404, {"error": "expert load accounting is off (--expert-load-window 0)"})
            return
        await _answer(send, 200, view)


async def _answer(send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]})
    await send({"type": "http.response.body", "body": payload})
