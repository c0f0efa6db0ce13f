"""Request body size limit, enforced before the body reaches JSON parsing (413 Payload Too Large).

A graph is parsed in memory, so an unbounded body is an unbounded allocation. This is a plain ASGI
middleware rather than a dependency because the limit must hold before FastAPI reads the body: a
declared Content-Length over the limit is refused at once, and a body sent without one (chunked) is
counted while it is received and refused as soon as it passes the limit.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["BodySizeLimit"]


class BodySizeLimit:
    """Answer 413 to any HTTP request whose body exceeds `max_body_bytes`."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(send, f"the request body is {int(declared)} bytes")
            return
        messages: list[Message] = []
        received_bytes = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            received_bytes += len(message.get("body", b""))
            if received_bytes > self.max_body_bytes:
                await self._refuse(send, f"the request body is over {received_bytes} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return messages.pop(0) if messages else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send, what: str) -> None:
        body = json.dumps(
            {
                "detail": [
                    {
                        "loc": ["body"],
                        "msg": f"{what}, more than the limit of {self.max_body_bytes} bytes "
                        "(PLANNER_MAX_BODY_BYTES); send a smaller graph or raise the limit",
                        "type": "body_too_large",
                    }
                ]
            }
        ).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})
