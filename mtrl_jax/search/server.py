"""An HTTP JSON endpoint serving the search tools of one or more collections, on aiohttp.

``POST /{collection}/search`` with ``{"tool": name, "query": str, "top_k": int}`` returns
``{"results": [{"doc_id", "score", "title", "text"}, ...]}``; ``GET /{collection}/tools`` returns
the tool schemas and the index's description; ``GET /health`` returns ``{"ok": true}``. Requests over
``max_request_bytes`` get 413, malformed ones (headers included, and JSON nested too deep to parse) 400 with
a reason.

aiohttp parses HTTP/1.1 (request lines, headers, ``Content-Length``, keep-alive) on one ``asyncio`` event loop,
whatever the number of connections: a client that trickles its request costs a coroutine, never a thread.
The limits are this module's: a request body must arrive within ``read_timeout_s``; a connection that has not
completed a request for ``request_deadline_s`` is closed (a trickler), and an idle keep-alive one after
``read_timeout_s``; beyond ``max_connections`` open connections a request gets 503 with ``Retry-After``; only
complete requests reach the bounded pool of ``workers`` threads that run the searches; the listen backlog is
sized for many concurrent clients. docs/decisions.md says why aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

from aiohttp import web

from mtrl_jax.rollout.interfaces import ToolError

MAX_HEADER_BYTES = 65_536


class _OneLine(logging.Filter):
    """aiohttp logs a request it cannot parse (a bad header, a bad ``Content-Length``) with a traceback, though it
    answers it with 400: one warning line instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
            record.args, record.exc_info, record.exc_text = (), None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


HTTP_LOG = logging.getLogger("mtrl_jax.tool_server")
HTTP_LOG.addFilter(_OneLine())


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
        self._active: dict = {}  # connection (aiohttp's protocol) -> when it last began or completed a request
        app = web.Application(client_max_size=max_request_bytes)
        app.router.add_get("/health", self._health)
        app.router.add_get("/{collection}/tools", self._tools)
        app.router.add_post("/{collection}/search", self._search)
        app.router.add_route("*", "/{tail:.*}", self._unknown)
        self.runner = web.AppRunner(
            app,
            access_log=None,
            keepalive_timeout=read_timeout_s,
            max_line_size=MAX_HEADER_BYTES,
            max_field_size=MAX_HEADER_BYTES,
            handle_signals=False,
            logger=HTTP_LOG,
        )
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, host, port, backlog=backlog)
        self.loop.run_until_complete(site.start())
        self.server_address = self.runner.addresses[0][:2]
        self._sweeper = self.loop.create_task(self._sweep())
        self.stopped = threading.Event()

    @property
    def connections(self) -> int:
        """Open connections (tricklers included)."""
        server = self.runner.server
        return len(server.connections) if server is not None else 0

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
            self._sweeper.cancel()
            self.loop.run_until_complete(self.runner.cleanup())
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            self.loop.run_until_complete(_settle(tasks))
            self.loop.close()
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def _sweep(self) -> None:
        """Close the connections that have not completed a request for ``request_deadline_s``."""
        while True:
            await asyncio.sleep(min(1.0, self.request_deadline_s / 4))
            now = time.monotonic()
            open_now = set(self.runner.server.connections) if self.runner.server is not None else set()
            for connection in list(self._active):
                if connection not in open_now:
                    del self._active[connection]
            for connection in open_now:
                if now - self._active.setdefault(connection, now) > self.request_deadline_s:
                    connection.force_close()
                    if connection.transport is not None:
                        connection.transport.close()

    # ------------------------------------------------------------------ the endpoints

    def _reply(self, status: int, payload: dict, request: web.Request) -> web.Response:
        self._active[request.protocol] = time.monotonic()
        headers = {"Retry-After": "1"} if status == 503 else None
        return web.json_response(payload, status=status, headers=headers)

    async def _health(self, request: web.Request) -> web.Response:
        return self._reply(200, {"ok": True}, request)

    async def _unknown(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "POST"):
            return self._reply(405, {"error": f"method {request.method} not allowed"}, request)
        return self._reply(404, {"error": f"unknown path {request.path!r}; collections: {sorted(self.tools)}"}, request)

    def _collection(self, request: web.Request) -> Optional[dict]:
        return self.tools.get(request.match_info["collection"])

    async def _tools(self, request: web.Request) -> web.Response:
        tools = self._collection(request)
        if tools is None:
            return await self._unknown(request)
        name = request.match_info["collection"]
        return self._reply(
            200, {"tools": [t.schema() for t in tools.values()], "index": self.descriptions.get(name)}, request
        )

    async def _search(self, request: web.Request) -> web.Response:
        self._active[request.protocol] = time.monotonic()
        tools = self._collection(request)
        if tools is None:
            return await self._unknown(request)
        if self.connections > self.max_connections:
            return self._reply(503, {"error": "the tool server is at capacity; retry"}, request)
        length = request.content_length or 0
        if length > self.max_request_bytes:
            return self._reply(
                413, {"error": f"request of {length} bytes exceeds the limit of {self.max_request_bytes}"}, request
            )
        try:
            body = await asyncio.wait_for(request.read(), self.read_timeout_s)
        except asyncio.TimeoutError:  # a body that stalls: the connection is dropped, with no reply
            request.protocol.force_close()
            request.transport.close()
            raise asyncio.CancelledError from None
        status, payload = await self.loop.run_in_executor(self.pool, _search, tools, body)
        return self._reply(status, payload, request)


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
        (query,), top_k = tool.check(query, top_k)  # one query a request: a call's list is fused by the client
        return 200, {"results": tool.hits(query, top_k)}
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
