"""Tasks and collections: the JSONL task format, BEIR import, validation splits, mixtures, synthetic data."""
