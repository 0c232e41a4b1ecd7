"""The API-server process: FastAPI routes, the engine client, metrics, logs (no torch). Only
the CLI imports it; what it shares with the router is `kvloop.front`."""
