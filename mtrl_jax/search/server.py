"""An HTTP JSON endpoint serving the search tools of one or more collections.

``POST /{collection}/search`` with ``{"tool": name, "query": str, "top_k": int}`` returns
``{"results": [{"doc_id", "score", "title", "text"}, ...]}``; ``GET /{collection}/tools`` returns
the tool schemas; ``GET /health`` returns ``{"ok": true}``. Requests over ``max_request_bytes``
get 413, malformed ones (headers included) 400 with a reason. Each connection has a read timeout, so
half-sent requests and idle keep-alive connections cannot hold a thread forever, and the listen
backlog is sized for many concurrent clients.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from mtrl_jax.rollout.interfaces import ToolError


def make_server(
    tools_by_collection: dict[str, dict],
    host: str = "127.0.0.1",
    port: int = 0,
    max_request_bytes: int = 16_384,
    read_timeout_s: float = 10.0,
    backlog: int = 1024,
) -> ThreadingHTTPServer:
    """``tools_by_collection``: collection name -> {tool name -> SearchTool}."""

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = read_timeout_s  # socket timeout of each connection: slow or idle clients are dropped

        def log_message(self, *args):  # quiet by default
            pass

        def _send(self, code: int, payload: dict):
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _collection(self, suffix: str):
            parts = self.path.strip("/").split("/")
            if len(parts) != 2 or parts[1] != suffix or parts[0] not in tools_by_collection:
                self._send(404, {"error": f"unknown path {self.path!r}; collections: {sorted(tools_by_collection)}"})
                return None
            return tools_by_collection[parts[0]]

        def do_GET(self):
            if self.path == "/health":
                return self._send(200, {"ok": True})
            tools = self._collection("tools")
            if tools is not None:
                self._send(200, {"tools": [t.schema() for t in tools.values()]})

        def do_POST(self):
            try:
                length = int(self.headers.get("Content-Length") or 0)
                if length < 0:
                    raise ValueError
            except ValueError:
                self.close_connection = True
                return self._send(400, {"error": f"invalid Content-Length {self.headers.get('Content-Length')!r}"})
            if length > max_request_bytes:
                self.close_connection = True
                return self._send(413, {"error": f"request of {length} bytes exceeds the limit of {max_request_bytes}"})
            try:
                raw = self.rfile.read(length)
            except (TimeoutError, OSError):  # a half-sent body: give the thread back
                self.close_connection = True
                return
            tools = self._collection("search")
            if tools is None:
                return
            try:
                request = json.loads(raw)
                if not isinstance(request, dict):
                    raise ValueError("body must be a JSON object")
                name = request.get("tool")
                if name not in tools:
                    raise ToolError("unknown_tool", f"unknown tool {name!r}; available: {sorted(tools)}")
                tool = tools[name]
                query = request.get("query")
                if not isinstance(query, str):
                    raise ToolError("bad_arguments", "'query' must be a string")
                top_k = request.get("top_k")
                if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool)):
                    raise ToolError("bad_arguments", "'top_k' must be an integer")
                results = tool.hits(query, tool.check(query, top_k))
            except (ValueError, ToolError) as e:
                return self._send(400, {"error": str(e)})
            self._send(200, {"results": results})

    class Server(ThreadingHTTPServer):
        request_queue_size = backlog  # the listen backlog (socketserver's default of 5 resets bursts of clients)
        daemon_threads = True

    return Server((host, port), Handler)


def serve_in_background(server: ThreadingHTTPServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return thread
