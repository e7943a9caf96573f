"""Load test of the tool server: many concurrent clients for a fixed time, on this machine only.

    python -m benchmarks.bench_tool_server --clients 200 --seconds 30
    python -m benchmarks.bench_tool_server --clients 200 --seconds 30 --baseline 5640f97 --rounds 2

Starts ``mtrl_jax.search.server`` on 127.0.0.1 over the synthetic collection, then ``--clients``
threads each send search requests back to back (a fresh connection per request, as the tool
client does) for ``--seconds``. Prints requests/s, p50/p99 latency and the errors (connection
resets, timeouts, non-200 replies). Side by side in the same run it measures the baseline: the same
tools called in-process with the same concurrency, so the ratio is the cost of the HTTP hop.

``--baseline REV``: instead, the server of this checkout against the server of commit ``REV`` (a git worktree),
each in a child process, alternated ``--rounds`` times; prints each side's requests/s and errors per round, the
medians and their ratio (5640f97: the hand-written asyncio server, before aiohttp).
"""

import argparse
import json
import statistics
import threading
import time
import urllib.error
import urllib.request

import os
import pathlib
import subprocess
import sys

from benchmarks.common import REPO, machine_line, worktree
from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.search.build import SearchSettings, make_tools
from mtrl_jax.search.server import make_server, serve_in_background


def hammer(call, clients: int, seconds: float, queries: list[str]) -> dict:
    latencies, errors, lock = [], {}, threading.Lock()
    stop_at = time.perf_counter() + seconds

    def client(index: int):
        i = index
        while time.perf_counter() < stop_at:
            start = time.perf_counter()
            try:
                call(queries[i % len(queries)])
                with lock:
                    latencies.append(time.perf_counter() - start)
            except Exception as e:  # noqa: BLE001 - every failure is counted and reported
                key = f"{type(e).__name__}: {getattr(e, 'code', '')}".strip(": ")
                with lock:
                    errors[key] = errors.get(key, 0) + 1
            i += clients

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    begin = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - begin
    latencies.sort()
    q = lambda p: latencies[min(len(latencies) - 1, int(p * len(latencies)))] * 1000 if latencies else float("nan")  # noqa: E731
    return {
        "requests": len(latencies),
        "requests_per_s": len(latencies) / elapsed,
        "p50_ms": q(0.50),
        "p99_ms": q(0.99),
        "mean_ms": statistics.fmean(latencies) * 1000 if latencies else float("nan"),
        "errors": errors,
    }


def serve_and_hammer(clients: int, seconds: float, tool: str, baseline: bool = True) -> dict:
    """Start this checkout's ``mtrl_jax`` server, hammer it, and (with ``baseline``) the in-process tools too."""
    collection = make_synthetic_collection(0)
    tools = {t.name: t for t in make_tools(collection, SearchSettings(tfidf_dim=32))}
    queries = [t.query for t in collection.tasks]
    server = make_server({collection.name: tools})
    serve_in_background(server)
    url = f"http://127.0.0.1:{server.server_address[1]}/{collection.name}/search"

    def over_http(query: str):
        body = json.dumps({"tool": tool, "query": query, "top_k": 5}).encode()
        request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            if response.status != 200:
                raise urllib.error.HTTPError(url, response.status, "not 200", response.headers, None)
            json.loads(response.read())["results"]

    def in_process(query: str):
        tools[tool]({"query": query, "top_k": 5})

    try:
        results = {"http": hammer(over_http, clients, seconds, queries)}
        if baseline:
            results["local"] = hammer(in_process, clients, seconds, queries)
    finally:
        server.shutdown()
        server.server_close()
    return results


def against_revision(args) -> None:
    """This checkout's server against ``args.baseline``'s, each in a child, alternated ``args.rounds`` times."""
    script = pathlib.Path(__file__).resolve()
    child = [sys.executable, str(script), "--child", "--clients", str(args.clients), "--seconds", str(args.seconds)]
    sides: dict = {"this tree": [], args.baseline: []}
    with worktree(args.baseline) as tree:
        for round_ in range(args.rounds):
            for side, root in (("this tree", REPO), (args.baseline, tree)):
                env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO}"}
                done = subprocess.run(child, cwd=root, env=env, capture_output=True, text=True)
                if done.returncode:
                    raise RuntimeError(f"{side}: the child failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
                r = json.loads(done.stdout.strip().splitlines()[-1])
                sides[side].append(r)
                print(
                    f"round {round_ + 1} {side:>10}: {r['requests_per_s']:8.1f} req/s, p50 {r['p50_ms']:7.2f} ms, "
                    f"p99 {r['p99_ms']:7.2f} ms, errors {sum(r['errors'].values())} {r['errors'] or ''}",
                    flush=True,
                )
    median = {side: statistics.median(r["requests_per_s"] for r in runs) for side, runs in sides.items()}
    errors = {side: sum(sum(r["errors"].values()) for r in runs) for side, runs in sides.items()}
    print(
        f"median requests/s: this tree {median['this tree']:.1f} (errors {errors['this tree']}), "
        f"{args.baseline} {median[args.baseline]:.1f} (errors {errors[args.baseline]}); "
        f"this tree / {args.baseline} throughput: {median['this tree'] / median[args.baseline]:.2f}x"
        f" ({args.clients} concurrent clients, {args.seconds:.0f} s each, {args.rounds} rounds)"
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--tool", default="bm25_search")
    parser.add_argument("--baseline", default="", help="a commit whose server to measure side by side")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:  # one side of --baseline: the HTTP figures as a JSON line
        print(json.dumps(serve_and_hammer(args.clients, args.seconds, args.tool, baseline=False)["http"]))
        return
    print(machine_line(peak=False), flush=True)
    if args.baseline:
        against_revision(args)
        return
    results = serve_and_hammer(args.clients, args.seconds, args.tool)
    http, local = results["http"], results["local"]
    for label, r in (("HTTP tool server", http), ("in-process (baseline)", local)):
        print(
            f"{label:>22}: {r['requests']:>7} requests, {r['requests_per_s']:8.1f} req/s, p50 {r['p50_ms']:7.2f} ms, "
            f"p99 {r['p99_ms']:7.2f} ms, errors {sum(r['errors'].values())} {r['errors'] or ''}"
        )
    print(
        f"HTTP / in-process throughput: {http['requests_per_s'] / local['requests_per_s']:.3f}x "
        f"({args.clients} concurrent clients, {args.seconds:.0f} s each)"
    )
    print(f"dropped requests: {sum(http['errors'].values())}")


if __name__ == "__main__":
    main()
