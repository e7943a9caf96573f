"""Search tools the agent calls: in-process over a retriever, or remote over HTTP."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Optional

from mtrl_jax.data.collection import Collection
from mtrl_jax.rollout.interfaces import Tool, ToolError, ToolOutput


def render_results(tool: str, query: str, hits: list[dict], max_doc_chars: int) -> str:
    if not hits:
        return f"{tool} found no documents for {query!r}."
    lines = [f"{tool} results for {query!r}:"]
    for rank, h in enumerate(hits, start=1):
        text = " ".join(h["text"].split())
        if len(text) > max_doc_chars:
            text = text[:max_doc_chars].rstrip() + "..."
        title = f" | {h['title']}" if h.get("title") else ""
        lines.append(f"[{rank}] {h['doc_id']}{title} | {text}")
    return "\n".join(lines)


class SearchTool(Tool):
    """``{name}(query: str, top_k: int = default)`` over a local retriever."""

    def __init__(
        self,
        name: str,
        description: str,
        retriever,
        collection: Collection,
        top_k: int = 5,
        max_top_k: int = 20,
        max_doc_chars: int = 200,
    ):
        self.name, self.description = name, description
        self.retriever, self.collection = retriever, collection
        self.top_k, self.max_top_k, self.max_doc_chars = top_k, max_top_k, max_doc_chars
        self.parameters = {
            "type": "object",
            "properties": {
                "query": {"type": "string", "description": "the search query"},
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

    def check(self, query: str, top_k: Optional[int]) -> int:
        if not query.strip():
            raise ToolError("empty_query", f"{self.name}: the query is empty")
        top_k = self.top_k if top_k is None else top_k
        if not 1 <= top_k <= self.max_top_k:
            raise ToolError("bad_arguments", f"{self.name}: top_k must be between 1 and {self.max_top_k}")
        return top_k

    def run(self, query: str, top_k: Optional[int] = None) -> ToolOutput:
        hits = self.hits(query, self.check(query, top_k))
        return ToolOutput(render_results(self.name, query, hits, self.max_doc_chars), [h["doc_id"] for h in hits])


class RemoteSearchTool(SearchTool):
    """The same tool served by ``tools/serve_tools.py``: POST ``{url}/search`` with
    ``{"tool", "query", "top_k"}``. Timeouts and bounded retries; a service that stays down
    becomes a tool error the model sees, never an exception in the rollout loop."""

    def __init__(
        self,
        name: str,
        description: str,
        url: str,
        top_k: int = 5,
        max_top_k: int = 20,
        max_doc_chars: int = 200,
        timeout_s: float = 10.0,
        retries: int = 2,
        backoff_s: float = 0.2,
    ):
        super().__init__(name, description, None, None, top_k, max_top_k, max_doc_chars)
        self.url, self.timeout_s, self.retries, self.backoff_s = url.rstrip("/"), timeout_s, retries, backoff_s

    def hits(self, query: str, top_k: int) -> list[dict]:
        body = json.dumps({"tool": self.name, "query": query, "top_k": top_k}).encode()
        last_error = None
        for attempt in range(self.retries + 1):
            request = urllib.request.Request(
                f"{self.url}/search", data=body, headers={"Content-Type": "application/json"}
            )
            wait = self.backoff_s * 2**attempt
            try:
                with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                    return parse_results(response.read(), top_k)
            except urllib.error.HTTPError as e:
                detail = e.read().decode(errors="replace")[:200]
                if 400 <= e.code < 500 and e.code not in RETRIED_STATUS:  # the request itself is wrong
                    raise ToolError("bad_arguments", f"{self.name}: {detail}") from None
                last_error = f"HTTP {e.code}: {detail}"
                wait = max(wait, _retry_after(e.headers.get("Retry-After"), self.timeout_s))
            except MalformedReply as e:
                raise ToolError(
                    "service_error", f"{self.name}: malformed reply from the search service ({e})"
                ) from None
            except (urllib.error.URLError, TimeoutError, OSError, ValueError) as e:
                last_error = f"{type(e).__name__}: {e}"
            if attempt < self.retries:
                time.sleep(wait)
        raise ToolError("service_error", f"{self.name}: search service unavailable ({last_error})")


RETRIED_STATUS = (429, 503)  # overloaded: retried with backoff (5xx are retried too)


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


def check_service(url: str, timeout_s: float = 5.0) -> None:
    """Fail fast (``ConnectionError`` naming ``url``) when the tool server does not answer ``/health``."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as response:
            if json.loads(response.read()).get("ok") is not True:
                raise ValueError("health check did not answer ok")
    except (urllib.error.URLError, TimeoutError, OSError, ValueError, AttributeError) as e:
        raise ConnectionError(
            f"search.remote_url={url}: the tool server is unreachable or unhealthy "
            f"({type(e).__name__}: {e}); start it with tools/serve_tools.py"
        ) from None
