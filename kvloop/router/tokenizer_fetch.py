"""The fleet's tokenizer, made ready before a prompt is tokenized: which model the workers
serve, and its tokenizer fetched from a live worker (`GET /kvloop/tokenizer`, bounded in
size) when the router has no local copy (`kvloop.router.prompts`, source 3).

Both fronts (the HTTP proxy and the ext_proc picker) call `tokenizing_model` before they
build a `RoutingRequest`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any

import httpx
import msgspec

from kvloop.front.tokenizer_files import MAX_TOKENIZER_FILES_BYTES, tokenizer_from_files
from kvloop.router.poller import BadWorkerAnswer
from kvloop.router.prompts import Fetch, PromptTokenizer
from kvloop.router.router import Router
from kvloop.wire import TOKENIZER_FILES_PATH, TokenizerFiles

log = logging.getLogger("kvloop.router")


async def tokenizing_model(router: Router, prompts: PromptTokenizer,
                           client: httpx.AsyncClient | None) -> str | None:
    """The fleet's model, its tokenizer made ready first (local, the flag's, or fetched
    from a worker with `client`: `PromptTokenizer.ensure`)."""
    model = fleet_model(router)
    await prompts.ensure(model, tokenizer_fetch(router, client, model))
    return model


def fleet_model(router: Router) -> str | None:
    """The model whose tokenizer the workers use (its path when they report one)."""
    for w in router.registry.all():
        d = w.description
        if w.up and d is not None and (d.model_path or d.model):
            return d.model_path or d.model
    return None


def tokenizer_fetch(router: Router, client: httpx.AsyncClient | None,
                    model: str | None) -> Fetch | None:
    """Fetches `model`'s tokenizer from a live worker serving it (None: none is up)."""
    if client is None:
        return None
    for w in router.registry.all():
        d = w.description
        if w.up and d is not None and model in (d.model_path, d.model):
            return functools.partial(fetch_tokenizer, client, w.spec.url)
    return None


async def fetch_tokenizer(client: httpx.AsyncClient, url: str) -> Any:
    """`GET {url}/kvloop/tokenizer` with the router's worker key, bounded in size."""
    async with client.stream("GET", url + TOKENIZER_FILES_PATH) as r:
        if r.status_code != 200:
            await r.aread()
            raise BadWorkerAnswer(f"{url}{TOKENIZER_FILES_PATH} answered "
                                  f"{r.status_code}: {r.text[:200]}")
        body = bytearray()
        async for chunk in r.aiter_bytes():
            body += chunk
            if len(body) > MAX_TOKENIZER_FILES_BYTES:
                raise BadWorkerAnswer(f"{url}{TOKENIZER_FILES_PATH} answered more than "
                                      f"{MAX_TOKENIZER_FILES_BYTES} bytes")
    try:
        files = msgspec.json.decode(bytes(body), type=TokenizerFiles)
    except msgspec.DecodeError as e:
        raise BadWorkerAnswer(f"{url}{TOKENIZER_FILES_PATH}: {e}") from e
    log.info("tokenizer of model %r fetched from %s", files.model, url)
    return await asyncio.to_thread(tokenizer_from_files, files)
