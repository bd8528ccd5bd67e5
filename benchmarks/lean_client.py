"""A lean HTTP/1.1 client for the serving benchmarks: streamed chat requests on one asyncio loop.

Why not httpx from a thread per request: on a 2-core machine the load generator shares the cores
with the server it measures, and httpx's pure-Python stack (h11, its decoders, a thread per
stream waking once per SSE chunk) took ~3 ms of CPU per streamed request, more than the server's
HTTP front (~2 ms, ``results/serve_fast_path.md``): the measurement took cores from the thing
measured. Here every request is a coroutine on one loop thread: the request is written in one
call, the chunked body is split into SSE lines by hand and only the ``data:`` lines are parsed.
Keep-alive connections are pooled per host, as a real client (the openai SDK) keeps them.

``stream_chat(url, body, timeout)`` blocks the calling thread (sleeping on a future) until the
answer is complete; callers keep their own thread per request for open-loop arrivals.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections import defaultdict
from urllib.parse import urlsplit


class HTTPError(Exception):
    """The server's answer could not be read as HTTP/1.1 (the message says where)."""


class _Loop:
    """One asyncio loop on a daemon thread, with a keep-alive pool of connections per host."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.idle: dict[tuple[str, int], list] = defaultdict(list)
        threading.Thread(target=self.loop.run_forever, name="lean-client", daemon=True).start()

    def run(self, coro, timeout: float):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop).result()


_LOOP: _Loop | None = None
_LOCK = threading.Lock()


def _shared_loop() -> _Loop:
    global _LOOP
    with _LOCK:
        if _LOOP is None:
            _LOOP = _Loop()
        return _LOOP


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("the server closed the connection before answering")
    parts = status_line.split(b" ", 2)
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
        raise HTTPError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            return int(parts[1]), headers
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()


async def _body_parts(reader: asyncio.StreamReader, headers: dict[str, str]):
    """The body's bytes as they arrive (chunked, by length, or up to the connection's end)."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readline()
            try:
                size = int(size_line.split(b";", 1)[0], 16)
            except ValueError:
                raise HTTPError(f"bad chunk size line {size_line[:40]!r}") from None
            if size == 0:
                while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
                    pass
                return
            yield await reader.readexactly(size)
            await reader.readexactly(2)  # the chunk's CRLF
    elif "content-length" in headers:
        yield await reader.readexactly(int(headers["content-length"]))
    else:
        yield await reader.read()


async def _stream(client: _Loop, url: str, path: str, body: dict, record: dict) -> None:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    key = (host, port)
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"accept: text/event-stream\r\ncontent-length: {len(payload)}\r\n\r\n"
    ).encode()
    pool = client.idle[key]
    while pool and pool[-1][0].at_eof():  # closed by the server while idle (its keep-alive timeout)
        pool.pop()[1].close()
    pooled = bool(pool)
    reader, writer = pool.pop() if pooled else await asyncio.open_connection(host, port)
    reusable = False
    try:
        t0 = record["start"]
        writer.write(head + payload)
        try:
            status, headers = await _read_head(reader)
        except (ConnectionError, asyncio.IncompleteReadError):
            if not pooled:
                raise
            writer.close()  # a kept connection the server closed as we sent: once more on a new one
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head + payload)
            status, headers = await _read_head(reader)
        if status != 200:
            raw = b"".join([p async for p in _body_parts(reader, headers)])
            record["error"] = f"{status}: {raw[:200]!r}"
            reusable = headers.get("connection", "").lower() != "close"
            return
        pending = b""
        async for chunk in _body_parts(reader, headers):
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if not line.startswith(b"data: {"):
                    continue
                ev = json.loads(line[6:])
                if ev.get("usage"):
                    record["usage"] = ev["usage"]
                for ch in ev["choices"]:
                    piece = ch["delta"].get("content") or ""
                    if piece and record["ttft"] is None:
                        record["ttft"] = time.perf_counter() - t0
                    record["text"] += piece
        reusable = headers.get("connection", "").lower() != "close"
    finally:
        if reusable:
            pool.append((reader, writer))
        else:
            writer.close()


def stream_chat(url: str, body: dict, record: dict, timeout: float) -> None:
    """One streamed chat request (``body`` as sent, ``stream`` set by the caller) into ``record``:
    ``start``, the text, ``ttft`` (time to the first text), ``usage``; ``error`` on a refused
    request. Blocks until the answer is complete or ``timeout`` s have passed (TimeoutError)."""
    record.update(start=time.perf_counter(), text="", ttft=None)
    client = _shared_loop()
    client.run(_stream(client, url, "/v1/chat/completions", body, record), timeout)
