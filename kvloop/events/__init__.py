"""KV-cache events: vLLM-compatible structs and frames, publisher, subscriber, cache view.

Modules are imported explicitly (`kvloop.events.publisher`, ...); importing this package
loads nothing.
"""
