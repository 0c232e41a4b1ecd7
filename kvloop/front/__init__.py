"""What every HTTP front shares (the API server and the router, two peer processes): the
OpenAI schemas and body -> token ids, the tokenizers and their loader, output processing,
API keys, body and time limits and their middleware, the bound socket and its uvicorn server,
the `/metrics` parser, and the launcher that starts, watches and stops their processes.
Nothing here imports `kvloop.server` (the API-server process) nor `kvloop.router`."""
