"""The API server process: HTTP, tokenization, detokenization, metrics (no torch)."""
