"""The X-Edge-LLM-Node response header: which board of a fleet answered (docs/fleet.md).

A tiny ASGI middleware that adds the configured `node_name` to every HTTP response, the gate's
early 400/401/413 and the streams included, so a client, a proxy's log or a test behind a load
balancer sees which board served it.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

NODE_HEADER = "X-Edge-LLM-Node"


class NodeHeaderMiddleware:
    """Adds `X-Edge-LLM-Node: <node_name>` to every HTTP response start."""

    def __init__(self, app: ASGIApp, node_name: str):
        self.app = app
        self.header = (NODE_HEADER.lower().encode("latin-1"), node_name.encode("ascii"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_node(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_with_node)
