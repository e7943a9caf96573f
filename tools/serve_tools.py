"""Serve the search tools of one or more BEIR-layout collections over HTTP (JSON bodies).

    python -m tools.serve_tools --data ../shared/data/scifact --data ../shared/data/cranfield --port 8900
    python -m tools.serve_tools --synthetic --port 8900

Endpoints: ``POST /<collection>/search`` ``{"tool", "query", "top_k"}``, ``GET /<collection>/tools``,
``GET /health``. Binds to 127.0.0.1 unless ``--host`` says otherwise. Point an environment at it
with ``--config.search.remote_url=http://127.0.0.1:8900``.
"""

import argparse

from mtrl_jax.data.collection import load_beir
from mtrl_jax.data.synthetic import SYNTHETIC_TFIDF_DIM, make_synthetic_collection
from mtrl_jax.search.build import SearchSettings, make_tools
from mtrl_jax.search.server import make_server


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", default=[], help="a BEIR-layout folder (repeatable)")
    parser.add_argument("--synthetic", action="store_true", help="also serve the synthetic collection")
    parser.add_argument("--encoder", default="tfidf")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--max-request-bytes", type=int, default=16_384)
    args = parser.parse_args(argv)
    if not args.data and not args.synthetic:
        parser.error("give at least one --data folder or --synthetic")
    tools = {}
    for folder in args.data:
        collection = load_beir(folder)
        tools[collection.name] = {
            t.name: t for t in make_tools(collection, SearchSettings(encoder=args.encoder, cache_dir=args.cache_dir))
        }
    if args.synthetic:
        collection = make_synthetic_collection()
        tools[collection.name] = {
            t.name: t for t in make_tools(collection, SearchSettings(tfidf_dim=SYNTHETIC_TFIDF_DIM))
        }
    server = make_server(tools, args.host, args.port, max_request_bytes=args.max_request_bytes)
    print(f"serving {sorted(tools)} on http://{args.host}:{server.server_address[1]}")
    server.serve_forever()


if __name__ == "__main__":
    main()
