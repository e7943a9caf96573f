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
from mtrl_jax.search.build import SearchSettings, index_description, make_tools
from mtrl_jax.search.server import make_server


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", action="append", default=[], help="a BEIR-layout folder (repeatable)")
    parser.add_argument("--synthetic", action="store_true", help="also serve the synthetic collection")
    parser.add_argument("--synthetic-seed", type=int, default=0, help="the run's data.synthetic_seed")
    parser.add_argument("--encoder", default="tfidf", help="the run's search.encoder")
    parser.add_argument("--tfidf-dim", type=int, default=None, help="search.tfidf_dim (128; 32 for --synthetic)")
    parser.add_argument("--index", default="flat", help="search.index_type: flat | ivf | hnsw")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--max-request-bytes", type=int, default=16_384)
    args = parser.parse_args(argv)
    if not args.data and not args.synthetic:
        parser.error("give at least one --data folder or --synthetic")
    tools, indexes = {}, {}
    collections = [(load_beir(folder), SearchSettings.tfidf_dim) for folder in args.data]
    if args.synthetic:
        collections.append((make_synthetic_collection(args.synthetic_seed), SYNTHETIC_TFIDF_DIM))
    for collection, dim in collections:
        settings = SearchSettings(
            encoder=args.encoder, tfidf_dim=args.tfidf_dim or dim, index_type=args.index, cache_dir=args.cache_dir
        )
        tools[collection.name] = {t.name: t for t in make_tools(collection, settings)}
        indexes[collection.name] = index_description(collection, settings)  # checked by a run at start-up
    server = make_server(tools, args.host, args.port, max_request_bytes=args.max_request_bytes, descriptions=indexes)
    print(f"serving {sorted(tools)} on http://{args.host}:{server.server_address[1]}")
    server.serve_forever()


if __name__ == "__main__":
    main()
