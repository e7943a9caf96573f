"""An HTTP JSON endpoint serving the search tools of one or more collections.

``POST /{collection}/search`` with ``{"tool": name, "query": str, "top_k": int}`` returns
``{"results": [{"doc_id", "score", "title", "text"}, ...]}``; ``GET /{collection}/tools`` returns
the tool schemas; ``GET /health`` returns ``{"ok": true}``. Requests over ``max_request_bytes``
get 413, malformed ones (headers included, and JSON nested too deep to parse) 400 with a reason.

Connections are read by one ``asyncio`` event loop, whatever their number: each request must arrive
whole within ``request_deadline_s`` (and each read within ``read_timeout_s``), or the connection is
dropped, so a client that trickles its request a byte at a time costs a coroutine, never a thread,
and never delays the others. Only complete requests reach the bounded pool of ``workers`` threads that
run the searches. Beyond ``max_connections`` open connections a new one gets 503 with ``Retry-After``.
Keep-alive connections are served (HTTP/1.1), and dropped after ``read_timeout_s`` idle.
The listen backlog is sized for many concurrent clients.
"""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Optional
from concurrent.futures import ThreadPoolExecutor
from http import HTTPStatus

from mtrl_jax.rollout.interfaces import ToolError

MAX_HEADER_BYTES = 65_536


class _Reject(Exception):
    """A request answered with ``status`` and ``error``, and the connection closed."""

    def __init__(self, status: int, error: str):
        super().__init__(error)
        self.status = status


class ToolServer:
    """The endpoint; ``serve_forever()`` blocks, ``serve_in_background(server)`` runs it in a thread, and
    ``shutdown()`` / ``server_close()`` stop it (as ``socketserver`` servers do)."""

    def __init__(
        self,
        tools_by_collection: dict[str, dict],
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int = 16_384,
        read_timeout_s: float = 10.0,
        backlog: int = 1024,
        workers: int = 32,
        request_deadline_s: float = 30.0,
        max_connections: int = 10_000,
        descriptions: Optional[dict] = None,
    ):
        self.tools = tools_by_collection
        self.descriptions = descriptions or {}  # collection -> build.index_description, sent with its tools
        self.max_request_bytes, self.read_timeout_s = max_request_bytes, read_timeout_s
        self.request_deadline_s, self.max_connections = request_deadline_s, max_connections
        self.request_queue_size = backlog
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="tool-server")
        self.loop = asyncio.new_event_loop()
        self.connections = 0
        self.server = self.loop.run_until_complete(
            asyncio.start_server(self._connection, host, port, backlog=backlog, limit=MAX_HEADER_BYTES)
        )
        self.server_address = self.server.sockets[0].getsockname()[:2]
        self.stopped = threading.Event()

    # ------------------------------------------------------------------ life cycle

    def serve_forever(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.stopped.set()

    def shutdown(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.stopped.wait(10)

    def server_close(self) -> None:
        if not self.loop.is_closed():
            self.server.close()
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(_settle(tasks))
            self.loop.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ one connection

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            if self.connections > self.max_connections:
                return await self._send(writer, 503, {"error": "the tool server is at capacity; retry"}, close=True)
            while True:
                try:
                    request = await asyncio.wait_for(self._read(reader), self.request_deadline_s)
                except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError):
                    return  # idle, trickling, or gone: dropped
                except _Reject as e:
                    return await self._send(writer, e.status, {"error": str(e)}, close=True)
                if request is None:  # closed between requests
                    return
                method, path, body, keep_alive = request
                status, payload = await self._answer(method, path, body)
                await self._send(writer, status, payload, close=not keep_alive)
                if not keep_alive:
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self.connections -= 1
            writer.close()

    async def _read(self, reader: asyncio.StreamReader):
        """``(method, path, body, keep_alive)`` of the next request, or None at a clean end of the stream."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.read_timeout_s)
        except asyncio.IncompleteReadError as e:
            if not e.partial:
                return None
            raise
        except asyncio.LimitOverrunError:
            raise _Reject(431, f"request headers over {MAX_HEADER_BYTES} bytes") from None
        try:
            lines = head.decode("latin-1").split("\r\n")
            method, path, version = lines[0].split(" ")
            headers = {}
            for line in lines[1:]:
                if line:
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
        except ValueError:
            raise _Reject(400, f"malformed request line {lines[0][:100]!r}") from None
        raw_length = headers.get("content-length", "0")
        if not (raw_length.isascii() and raw_length.isdigit()):  # "²" is a digit to str.isdigit, not to int()
            raise _Reject(400, f"invalid Content-Length {raw_length!r}")
        length = int(raw_length)
        if length > self.max_request_bytes:
            raise _Reject(413, f"request of {length} bytes exceeds the limit of {self.max_request_bytes}")
        body = await asyncio.wait_for(reader.readexactly(length), self.read_timeout_s) if length else b""
        connection = headers.get("connection", "").lower()
        keep_alive = connection != "close" if version == "HTTP/1.1" else connection == "keep-alive"
        return method, path, body, keep_alive

    async def _send(self, writer: asyncio.StreamWriter, status: int, payload: dict, close: bool) -> None:
        body = json.dumps(payload).encode()
        head = f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
        head += f"Content-Length: {len(body)}\r\n" + ("Retry-After: 1\r\n" if status == 503 else "")
        head += "Connection: close\r\n\r\n" if close else "\r\n"
        writer.write(head.encode() + body)
        await asyncio.wait_for(writer.drain(), self.read_timeout_s)

    # ------------------------------------------------------------------ the endpoints

    async def _answer(self, method: str, path: str, body: bytes) -> tuple[int, dict]:
        if method == "GET" and path == "/health":
            return 200, {"ok": True}
        parts = path.strip("/").split("/")
        if method not in ("GET", "POST"):
            return 405, {"error": f"method {method} not allowed"}
        suffix = "tools" if method == "GET" else "search"
        if len(parts) != 2 or parts[1] != suffix or parts[0] not in self.tools:
            return 404, {"error": f"unknown path {path!r}; collections: {sorted(self.tools)}"}
        tools = self.tools[parts[0]]
        if method == "GET":
            return 200, {"tools": [t.schema() for t in tools.values()], "index": self.descriptions.get(parts[0])}
        return await self.loop.run_in_executor(self.pool, _search, tools, body)


async def _settle(tasks) -> None:
    await asyncio.gather(*tasks, return_exceptions=True)


def _search(tools: dict, body: bytes) -> tuple[int, dict]:
    """One search request (in a worker thread)."""
    try:
        request = json.loads(body)
        if not isinstance(request, dict):
            raise ValueError("body must be a JSON object")
        name = request.get("tool")
        if not isinstance(name, str) or name not in tools:
            raise ToolError("unknown_tool", f"unknown tool {name!r}; available: {sorted(tools)}")
        tool = tools[name]
        query = request.get("query")
        if not isinstance(query, str):
            raise ToolError("bad_arguments", "'query' must be a string")
        top_k = request.get("top_k")
        if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool)):
            raise ToolError("bad_arguments", "'top_k' must be an integer")
        return 200, {"results": tool.hits(query, tool.check(query, top_k))}
    except RecursionError:
        return 400, {"error": "the JSON body is nested too deeply"}
    except ToolError as e:  # about the call's arguments: "kind" tells the client the model's fault from the service's
        return 400, {"error": str(e), "kind": e.kind}
    except ValueError as e:
        return 400, {"error": str(e)}


def make_server(tools_by_collection: dict[str, dict], host: str = "127.0.0.1", port: int = 0, **options) -> ToolServer:
    """``tools_by_collection``: collection name -> {tool name -> SearchTool}; ``options``: ``ToolServer``'s."""
    return ToolServer(tools_by_collection, host, port, **options)


def serve_in_background(server: ToolServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True, name="tool-server")
    thread.start()
    return thread
