"""The generation endpoints as plain ASGI, ahead of FastAPI's stack.

Why: every message of a request routed by FastAPI crosses about a dozen ASGI layers (its
middleware, exception wrappers, the router, ``StreamingResponse``'s task group watching for a
disconnect), and a streamed answer sends one message per engine step. The two endpoints that
carry the load are served here instead, with the same answers: ``serve``'s front spends less CPU
per request (``benchmarks/results/serve_fast_path.md``). Every other route (models, health,
metrics, unknown paths) stays on FastAPI.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
Handler = Callable[[dict, Receive, Send], Awaitable[None]]

JSON = "application/json"
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]


class ClientGone(Exception):
    """The client closed the connection before its request body arrived."""


class BodyStalled(Exception):
    """The request body stopped arriving (a Content-Length promising more than the client sent):
    ``size`` bytes came, then nothing for the stall bound."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


async def read_body(receive: Receive, limit: int, drain: int, stall_s: float | None = None) -> tuple[bytes, int]:
    """The request body and its size in bytes. Past ``limit`` the body is not kept (``b""``) but
    read on, so that the client is still there to get the answer, up to ``drain`` bytes more
    (then reading stops and the reported size is ``limit + drain`` or more). A body whose next
    part (the first one too: headers, then nothing) does not come within ``stall_s`` seconds
    raises :class:`BodyStalled`."""
    parts: list[bytes] = []
    size = 0
    while True:
        if stall_s is None:
            message = await receive()
        else:
            try:
                message = await asyncio.wait_for(receive(), stall_s)
            except asyncio.TimeoutError:
                raise BodyStalled(size) from None
        if message["type"] == "http.disconnect":
            raise ClientGone
        part = message.get("body", b"")
        size += len(part)
        if size <= limit:
            parts.append(part)
        if not message.get("more_body", False) or size > limit + drain:
            break
    return (b"".join(parts) if size <= limit else b""), size


async def send_body(send: Send, status: int, body: bytes, content_type: str = JSON, headers=()) -> None:
    """A whole response in two messages."""
    head = [(b"content-type", content_type.encode()), (b"content-length", str(len(body)).encode()), *headers]
    await send({"type": "http.response.start", "status": status, "headers": head})
    await send({"type": "http.response.body", "body": body})


def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> asyncio.Task:
    """Call ``on_disconnect`` (on the event loop) when the client goes away; cancel the task when
    the answer is complete. Read only after the body: the next message is the disconnect."""

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        on_disconnect()

    return asyncio.get_running_loop().create_task(watch())


async def redirect_without_slash(scope: dict, send: Send) -> None:
    """A 307 to the path without its trailing slash (``/v1/completions/`` -> ``/v1/completions``),
    as FastAPI's ``redirect_slashes`` answers for its own routes: 307 keeps the method and body."""
    location = scope["path"].rstrip("/")
    if scope.get("query_string"):
        location += "?" + scope["query_string"].decode("latin-1")
    headers = [(b"location", location.encode("latin-1")), (b"content-length", b"0")]
    await send({"type": "http.response.start", "status": 307, "headers": headers})
    await send({"type": "http.response.body", "body": b""})


def without_body(send: Send) -> Send:
    """``send`` for a HEAD request: the status and headers (``content-length`` included) a GET
    gets, and an empty body (load balancers probe ``/health`` with HEAD)."""

    async def head(message: dict) -> None:
        if message["type"] == "http.response.body":
            if message.get("more_body", False):
                return
            message = {"type": "http.response.body", "body": b""}
        await send(message)

    return head


def fast_path_app(base: type, routes: dict[str, Handler], error_body: Callable[[int, str], bytes], **kwargs):
    """An application of class ``base`` (FastAPI) built with ``kwargs``, whose POST ``routes``
    (path -> handler) are served before its stack; another method on those paths is a 405, the path
    with a trailing slash a 307 to the route (as FastAPI's own routes answer); HEAD on any other
    path is answered as GET without the body (``without_body``). A
    handler's exception is logged and answered with a 500 (``error_body(status, message)`` makes
    the bodies) when nothing was sent yet; else the connection closes, as uvicorn does."""
    log = logging.getLogger("uvicorn.error")

    class FastPaths(base):
        async def __call__(self, scope, receive, send) -> None:
            if scope["type"] == "http" and scope["method"] == "HEAD":  # a GET without its body
                send = without_body(send)
                if scope["path"] not in routes:  # (the POST routes answer HEAD with their 405)
                    scope = {**scope, "method": "GET"}
            handler = routes.get(scope["path"]) if scope["type"] == "http" else None
            if handler is None:
                path = scope.get("path", "")
                if scope["type"] == "http" and path.endswith("/") and path.rstrip("/") in routes:
                    return await redirect_without_slash(scope, send)
                return await super().__call__(scope, receive, send)
            if scope["method"] != "POST":
                body = error_body(405, f"method not allowed: {scope['method']} {scope['path']}")
                return await send_body(send, 405, body, headers=[(b"allow", b"POST")])
            started = False

            async def tracked(message: dict) -> None:
                nonlocal started
                started = True
                await send(message)

            try:
                await handler(scope, receive, tracked)
            except Exception as e:
                log.exception("dinfer-rt: POST %s failed", scope["path"])
                if started:
                    raise
                await send_body(send, 500, error_body(500, f"internal error: {type(e).__name__}: {e}"))

    return FastPaths(**kwargs)
