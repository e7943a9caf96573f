"""Search tools the agent calls: in-process over a retriever, or remote over HTTP."""

from __future__ import annotations

import dataclasses
import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional, Sequence

from mtrl_jax.data.collection import Collection
from mtrl_jax.rollout.interfaces import ServiceDown, Tool, ToolError, ToolOutput
from mtrl_jax.search.results import render_results
from mtrl_jax.search.retrievers import reciprocal_rank_fusion


class SearchTool(Tool):
    """``{name}(query, top_k: int = default)`` over a local retriever. ``query`` is one string, or with
    ``max_queries > 1`` also a list of up to that many: each is searched for ``top_k`` results, and the lists are
    fused by reciprocal rank fusion (k = 60, as the answer fallback fuses searches), the fused top ``top_k``
    returned."""

    def __init__(
        self,
        name: str,
        description: str,
        retriever,
        collection: Collection,
        top_k: int = 5,
        max_top_k: int = 20,
        max_doc_chars: int = 200,
        max_queries: int = 1,
    ):
        self.name, self.description = name, description
        self.retriever, self.collection = retriever, collection
        self.top_k, self.max_top_k, self.max_doc_chars = top_k, max_top_k, max_doc_chars
        self.max_queries = max_queries
        query = {"type": "string", "description": "the search query"}
        if max_queries > 1:
            query = {
                "type": ["string", "array"],
                "items": {"type": "string"},
                "description": f"the search query, or a list of up to {max_queries} queries whose results are "
                "fused (reciprocal rank fusion)",
            }
        self.parameters = {
            "type": "object",
            "properties": {
                "query": query,
                "top_k": {"type": "integer", "description": f"number of results (1-{max_top_k}, default {top_k})"},
            },
            "required": ["query"],
        }

    def hits(self, query: str, top_k: int) -> list[dict]:
        docs = self.collection.documents
        out = []
        for doc_id, score in self.retriever.search(query, top_k):
            d = docs[self.collection.index[doc_id]]
            out.append({"doc_id": doc_id, "score": score, "title": d.title, "text": d.text})
        return out

    def check(self, query, top_k: Optional[int]) -> tuple[list[str], int]:
        """``(the queries, top_k)`` of a call, or the model's error."""
        queries = [query] if isinstance(query, str) else list(query)
        if not 1 <= len(queries) <= self.max_queries:
            raise ToolError("bad_arguments", f"{self.name}: give 1 to {self.max_queries} queries, not {len(queries)}")
        if any(not q.strip() for q in queries):
            raise ToolError("empty_query", f"{self.name}: the query is empty")
        top_k = self.top_k if top_k is None else top_k
        if not 1 <= top_k <= self.max_top_k:
            raise ToolError("bad_arguments", f"{self.name}: top_k must be between 1 and {self.max_top_k}")
        return queries, top_k

    def run(self, query, top_k: Optional[int] = None) -> ToolOutput:
        queries, top_k = self.check(query, top_k)
        if len(queries) == 1:
            hits = self.hits(queries[0], top_k)
        else:
            found = [self.hits(q, top_k) for q in queries]
            by_id = {h["doc_id"]: h for hits in found for h in hits}
            fused = reciprocal_rank_fusion([[h["doc_id"] for h in hits] for hits in found], depth=top_k)
            hits = [{**by_id[doc_id], "score": score} for doc_id, score in fused]
        shown = query if isinstance(query, str) else queries
        return ToolOutput(
            render_results(self.name, shown, hits, self.max_doc_chars), [h["doc_id"] for h in hits], len(queries)
        )


class ServiceHealth:
    """The calls in a row that failed on one tool service, shared by its tools and threads: at
    ``max_failures`` the next failure raises ``ServiceDown`` naming the server and the last error, which
    stops the run (a service that hangs or fails every search would otherwise feed the model error
    messages, or spin for hours in silence)."""

    def __init__(self, url: str, max_failures: int = 5):
        self.url, self.max_failures = url, max_failures
        self.in_a_row, self.lock = 0, threading.Lock()

    def success(self) -> None:
        with self.lock:
            self.in_a_row = 0

    def failure(self, error: str) -> None:
        with self.lock:
            self.in_a_row += 1
            down = self.in_a_row >= self.max_failures
        if down:
            raise ServiceDown(
                f"search.remote_url={self.url}: {self.in_a_row} tool calls in a row failed "
                f"(search.remote_max_failures={self.max_failures}); last error: {error}"
            )


class ReplyTooLarge(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class HttpLimits:
    """A remote call's limits: a connection's timeout, retries with backoff, an overall deadline and a reply cap."""

    timeout_s: float = 10.0
    retries: int = 2
    backoff_s: float = 0.2
    deadline_s: float = 30.0
    max_reply_bytes: int = 8 << 20


class RemoteSearchTool(SearchTool):
    """The same tool served by ``tools/serve_tools.py``: POST ``{url}/search`` with
    ``{"tool", "query", "top_k"}``. Each call has an overall deadline (``deadline_s``, retries and a reply
    dripped slowly included: a watchdog closes the connection when it passes) and a reply-size cap
    (``max_reply_bytes``); overloaded or failed replies are retried with backoff within the deadline. A call
    that still fails is a ``service_error`` the model sees, and counts on the service's ``ServiceHealth``:
    too many in a row stop the run. Only a 400 whose JSON body says ``"kind": "bad_arguments"`` (the server found
    the model's query or top_k wrong) is the model's ``bad_arguments``; any other 4xx (413, 401, 403, 404, a body
    that is not the protocol) is the service refusing the request: a ``service_error``, counted on its health."""

    def __init__(
        self,
        name: str,
        description: str,
        url: str,
        top_k: int = 5,
        max_top_k: int = 20,
        max_doc_chars: int = 200,
        health: Optional[ServiceHealth] = None,
        max_queries: int = 1,
        **limits,
    ):
        """``limits``: the fields of ``HttpLimits`` (``timeout_s``, ``retries``, ``backoff_s``, ``deadline_s``,
        ``max_reply_bytes``)."""
        super().__init__(name, description, None, None, top_k, max_top_k, max_doc_chars, max_queries)
        self.url = url.rstrip("/")
        self.timeout_s, self.retries, self.backoff_s, self.deadline_s, self.max_reply_bytes = dataclasses.astuple(
            HttpLimits(**limits)
        )
        self.health = health or ServiceHealth(self.url)

    def _post(self, body: bytes, deadline: float) -> tuple[int, str, bytes]:
        """``(status, Retry-After header, body)`` of one POST, all of it received before ``deadline``."""
        parts = urllib.parse.urlsplit(f"{self.url}/search")
        kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
        remaining = deadline - time.monotonic()
        connection = kind(parts.hostname, parts.port, timeout=max(min(self.timeout_s, remaining), 1e-3))
        watchdog = None
        try:
            connection.connect()
            # the overall deadline: the socket itself is shut (http.client lets go of it once a reply says "close")
            watchdog = threading.Timer(max(deadline - time.monotonic(), 0.0), _shut, (connection.sock,))
            watchdog.start()
            connection.request("POST", parts.path, body, {"Content-Type": "application/json"})
            response = connection.getresponse()
            declared = response.getheader("Content-Length")
            if declared and declared.isdigit() and int(declared) > self.max_reply_bytes:
                raise ReplyTooLarge(f"a reply of {declared} bytes (over {self.max_reply_bytes})")
            raw = bytearray()
            while chunk := response.read1(65536):
                raw += chunk
                if len(raw) > self.max_reply_bytes:
                    raise ReplyTooLarge(f"a reply of more than {self.max_reply_bytes} bytes")
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no complete reply within the {self.deadline_s:g} s deadline")
            return response.status, response.getheader("Retry-After"), bytes(raw)
        except OSError as e:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"no complete reply within the {self.deadline_s:g} s deadline") from None
            raise e
        finally:
            if watchdog is not None:
                watchdog.cancel()
            connection.close()

    def hits(self, query: str, top_k: int) -> list[dict]:
        body = json.dumps({"tool": self.name, "query": query, "top_k": top_k}).encode()
        deadline = time.monotonic() + self.deadline_s
        last_error = "no attempt"
        for attempt in range(self.retries + 1):
            if time.monotonic() >= deadline:
                break
            wait = self.backoff_s * 2**attempt
            try:
                status, retry_after, raw = self._post(body, deadline)
            except ReplyTooLarge as e:
                last_error = str(e)
                break
            except (OSError, http.client.HTTPException, ValueError) as e:
                last_error = f"{type(e).__name__}: {e}"
            else:
                detail = raw[:200].decode(errors="replace")
                if status == 200:
                    try:
                        results = parse_results(raw, top_k)
                    except MalformedReply as e:
                        last_error = f"malformed reply from the search service ({e})"
                        break
                    self.health.success()
                    return results
                if 400 <= status < 500 and status not in RETRIED_STATUS:
                    message = _model_error(status, raw)
                    if message is not None:  # the server read the call and found the model's arguments wrong
                        self.health.success()
                        raise ToolError("bad_arguments", f"{self.name}: {message}")
                    last_error = f"HTTP {status}: {detail}"  # the service refuses the request: not the model's fault
                    break
                last_error = f"HTTP {status}: {detail}"
                wait = max(wait, _retry_after(retry_after, self.timeout_s))
            if attempt < self.retries:
                time.sleep(max(min(wait, deadline - time.monotonic()), 0.0))
        if time.monotonic() >= deadline:
            last_error = f"no reply within the {self.deadline_s:g} s deadline ({last_error})"
        self.health.failure(f"{self.name}: {last_error}")
        raise ToolError("service_error", f"{self.name}: search service unavailable ({last_error})")


def _shut(sock: socket.socket) -> None:
    """Wake a read blocked on ``sock`` (the watchdog of the call's deadline)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


RETRIED_STATUS = (429, 503)  # overloaded: retried with backoff (5xx are retried too)


def _model_error(status: int, raw: bytes) -> Optional[str]:
    """The server's message when a 4xx reply says the model's arguments were wrong (a 400 with the protocol's
    ``{"error": ..., "kind": "bad_arguments"}``); None for any other refusal."""
    if status != 400:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("kind") == "bad_arguments" and isinstance(body.get("error"), str):
        return body["error"]
    return None


def _retry_after(value: Optional[str], cap: float) -> float:
    try:
        return min(max(float(value), 0.0), cap)
    except (TypeError, ValueError):
        return 0.0


class MalformedReply(ValueError):
    pass


def parse_results(raw: bytes, top_k: int) -> list[dict]:
    """The ``results`` of a search reply, checked field by field (a 200 reply with a body the client
    cannot use is an error of the service, not a crash of the rollout)."""
    try:
        reply = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise MalformedReply(f"invalid JSON: {type(e).__name__}") from None
    results = reply.get("results") if isinstance(reply, dict) else None
    if not isinstance(results, list):
        raise MalformedReply("'results' must be a list")
    if len(results) > top_k:
        raise MalformedReply(f"{len(results)} results for top_k={top_k}")
    for i, hit in enumerate(results):
        if not isinstance(hit, dict):
            raise MalformedReply(f"results[{i}] must be an object")
        for field, kind in (("doc_id", str), ("text", str), ("title", (str, type(None))), ("score", (int, float))):
            if field in ("doc_id", "text") and field not in hit:
                raise MalformedReply(f"results[{i}] has no {field!r}")
            if field in hit and not isinstance(hit[field], kind):
                raise MalformedReply(f"results[{i}].{field} has the wrong type")
    return results


def check_service(
    url: str, collections: Sequence[str] = (), tools: Sequence[str] = (), timeout_s: float = 5.0, indexes=None
) -> None:
    """Fail fast (``ConnectionError`` naming ``url``) when the tool server does not answer ``/health``,
    or does not serve one of ``collections`` with all of ``tools`` (a server started on other data would
    answer every search with 404), or, with ``indexes`` (collection -> ``build.index_description``), serves
    a collection of that name whose documents or index settings are not the run's."""
    base = url.rstrip("/")

    def get(path: str):
        with urllib.request.urlopen(f"{base}{path}", timeout=timeout_s) as response:
            return json.loads(response.read(1 << 20))

    try:
        if get("/health").get("ok") is not True:
            raise ValueError("health check did not answer ok")
    except (urllib.error.URLError, TimeoutError, OSError, ValueError, AttributeError) as e:
        raise ConnectionError(
            f"search.remote_url={url}: the tool server is unreachable or unhealthy "
            f"({type(e).__name__}: {e}); start it with tools/serve_tools.py"
        ) from None
    for collection in collections:
        try:
            reply = get(f"/{collection}/tools")
            served = {t["function"]["name"] for t in reply["tools"]}
        except urllib.error.HTTPError as e:
            detail = e.read(500).decode(errors="replace")
            raise ConnectionError(
                f"search.remote_url={url}: the tool server does not serve the collection {collection!r} "
                f"(HTTP {e.code}: {detail}); start it with --data for that collection"
            ) from None
        except (urllib.error.URLError, TimeoutError, OSError, ValueError, AttributeError, KeyError, TypeError) as e:
            raise ConnectionError(
                f"search.remote_url={url}: GET /{collection}/tools failed ({type(e).__name__}: {e})"
            ) from None
        if missing := sorted(set(tools) - served):
            raise ConnectionError(
                f"search.remote_url={url}: the collection {collection!r} there has no tool {missing} "
                f"(it serves {sorted(served)})"
            )
        if indexes is not None and reply.get("index") != indexes[collection]:
            theirs, ours = reply.get("index") or {}, indexes[collection]
            if not theirs:
                differs = "it does not say which documents and index it serves"
            elif theirs.get("sha256") != ours["sha256"]:
                differs = (
                    f"its {theirs.get('documents')} documents are not the run's {ours['documents']} (another hash)"
                )
            else:
                differs = f"its index settings {theirs.get('index')} are not the run's {ours['index']}"
            raise ConnectionError(
                f"search.remote_url={url}: the collection {collection!r} there is not the run's: {differs}; start "
                "the server on the run's data and search settings"
            )
