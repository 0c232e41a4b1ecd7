"""kvloop's KV-cache-aware router: a global prefix index fed by every worker's KV events,
a cost model over prefix hits and load, and an HTTP front that forwards and streams.

No torch here; see docs/router.md.
"""
