"""A lean load generator's HTTP client for streamed completions.

httpx with a JSON parse per SSE chunk costs about as much CPU per token as the ingress that
serves it, and on a 2-core host the client's CPU is CPU the server does not get. This one
keeps HTTP/1.1 connections alive, reads the chunked body as bytes and parses one event: the
usage chunk that ends a stream (the request asks for `include_usage`, not usage on every
chunk, as `vllm bench serve` does).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

USAGE_MARK = re.compile(rb'"usage": ?\{"prompt_tokens"')
ID = re.compile(rb'"id": ?"([^"]+)"')
TEXT = re.compile(rb'"(?:text|content)": ?"[^"]')  # an event with some text (or chat content)


@dataclass
class Streamed:
    first_event: float | None  # perf_counter when the first event with text came
    end: float
    tokens: int  # completion tokens, from the usage chunk
    request_id: str | None = None  # the response's id, from its first event


class _Connection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer


class SseClient:
    """Streams POSTs to `base` (http://host:port/v1) on pooled keep-alive connections."""

    def __init__(self, base: str) -> None:
        url = urlsplit(base)
        self.host, self.port = url.hostname or "127.0.0.1", url.port or 80
        self.path = url.path.rstrip("/")
        self._idle: list[_Connection] = []

    async def _connection(self) -> _Connection:
        if self._idle:
            return self._idle.pop()
        return _Connection(*await asyncio.open_connection(self.host, self.port))

    async def stream(self, route: str, body: dict) -> Streamed:
        """POST `body` (streamed) to `route`; raises RuntimeError on a status other than 200."""
        data = json.dumps(body).encode()
        head = (
            f"POST {self.path}{route} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
        ).encode()
        conn = await self._connection()
        conn.writer.write(head + data)
        reader = conn.reader
        headers = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").lower()
        status = int(headers.split(" ", 2)[1])
        if status != 200:
            length = int(headers.split("content-length:", 1)[1].split("\r\n", 1)[0])
            text = await reader.readexactly(length)
            conn.writer.close()
            raise RuntimeError(f"HTTP {status}: {text!r}")
        first, tokens, request_id = None, 0, None
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            chunk = await reader.readexactly(size + 2)
            if first is None and TEXT.search(chunk):
                first = time.perf_counter()
                if found := ID.search(chunk):
                    request_id = found.group(1).decode()
            if USAGE_MARK.search(chunk):
                event = chunk[chunk.index(b"{") : chunk.rindex(b"}") + 1]
                tokens = json.loads(event)["usage"]["completion_tokens"]
        end = time.perf_counter()
        if "connection: close" in headers:
            conn.writer.close()
        else:
            self._idle.append(conn)
        return Streamed(first, end, tokens, request_id)

    async def close(self) -> None:
        for conn in self._idle:
            conn.writer.close()
        self._idle.clear()
