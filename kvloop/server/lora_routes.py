"""vLLM's routes that load and unload LoRA adapters at run time (see `kvloop.server.lora`
for the flags and the security rules these apply)."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from kvloop.server.lora import MAX_NAME_CHARS, MAX_PATH_CHARS, LoRANames, check_name

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
ROUTES = frozenset({("POST", LOAD_PATH), ("POST", UNLOAD_PATH)})

logger = logging.getLogger("kvloop.server")


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(max_length=MAX_NAME_CHARS)
    lora_path: str = Field(max_length=MAX_PATH_CHARS)
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(max_length=MAX_NAME_CHARS)
    lora_int_id: int | None = None


EngineCall = Callable[..., Awaitable[Any]]
ErrorOf = Callable[[int, str, str | None], Exception]


def add_lora_routes(app: FastAPI, names: LoRANames, served: tuple[str, ...],
                    call: EngineCall, error: ErrorOf) -> None:
    """The two admin routes (only with --enable-lora). `call(method, *args)` calls the
    engine (an engine refusal raises RuntimeError with its message); `error(status,
    message, param)` builds the APIError answered."""

    @app.post(LOAD_PATH, response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        name = _checked_name(body.lora_name, served, error)
        if name in names and not body.load_inplace:
            raise error(400, f"The lora adapter '{name}' has already been loaded.",
                        "lora_name")
        assert names.serve is not None
        if not names.serve.allowed_dirs:
            raise error(403, "runtime LoRA loading is off: start the server with "
                             "--lora-allowed-dirs", "lora_path")
        path = names.serve.allowed_path(body.lora_path)
        if path is None:
            raise error(400, "lora_path must be a directory inside --lora-allowed-dirs",
                        "lora_path")
        if name in names:
            await _engine(call, error, "remove_lora", name)
            names.paths.pop(name, None)
        await _engine(call, error, "add_lora", name, path)
        names.paths[name] = path
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post(UNLOAD_PATH, response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        name = body.lora_name
        if name not in names:
            raise error(404, f"The lora adapter '{name[:MAX_NAME_CHARS]}' cannot be found.",
                        "lora_name")
        await _engine(call, error, "remove_lora", name)
        names.paths.pop(name, None)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


def _checked_name(name: str, served: tuple[str, ...], error: ErrorOf) -> str:
    try:
        check_name(name)
    except ValueError as e:
        raise error(400, str(e), "lora_name") from e
    if name in served:
        raise error(400, f"'{name}' is the base model's name", "lora_name")
    return name


async def _engine(call: EngineCall, error: ErrorOf, method: str, *args: str) -> None:
    """An engine refusal (a bad adapter, one in use, too many) is the client's 400."""
    try:
        await call(method, *args)
    except RuntimeError as e:
        raise error(400, str(e).removeprefix("LoRAError: ").removeprefix("ValueError: "),
                    "lora_name") from e


async def load_startup_modules(names: LoRANames, call: EngineCall) -> None:
    """Register the --lora-modules with the engine (an adapter refused stops the start)."""
    if names.serve is None:
        return
    for module in names.serve.modules:
        path = os.path.realpath(module.path)
        await call("add_lora", module.name, path)
        names.paths[module.name] = path
        logger.info("LoRA adapter %r loaded from %s (model=%s selects it)", module.name,
                    path, module.name)
