"""Search: BM25 and dense retrieval, IR metrics, the search environment and its tools."""
