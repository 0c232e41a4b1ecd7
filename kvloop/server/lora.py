"""LoRA on the OpenAI server: vLLM's flags, the adapter names a request's `model` may name;
vLLM's two routes that load and unload adapters at run time are `kvloop.server.lora_routes`.

Flags (vLLM's): `--enable-lora`, `--lora-modules name=path ...` (or vLLM's JSON form
`{"name": ..., "path": ..., "base_model_name": ...}`), `--max-loras`, `--max-lora-rank`,
`--max-cpu-loras`; kvloop's `--lora-allowed-dirs DIR ...`: the folders runtime loads may read
from (without it runtime loading is refused; vLLM's switch is the environment variable
VLLM_ALLOW_RUNTIME_LORA_UPDATING, which lets an admin load any path the process can read).

Security: `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` are admin routes
(`kvloop.front.auth`: --admin-api-key, refused when none is set). A path to load must
resolve (symlinks followed) to a directory inside one of `--lora-allowed-dirs`, so even an
admin caller cannot make the server open files elsewhere; names are bounded and plain;
the runner then reads only `adapter_config.json` and `adapter_model.safetensors`, bounded in
size (`kvloop.model.lora`).

Owner: `LoRANames` (one per API process, in `ServerContext`) holds the adapters this
process believes loaded (name -> path); it changes at start-up (the `--lora-modules`) and in
the routes, each time after the engine accepted the change.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass

from kvloop.config import LoRAConfig, peft_folder_problem

MAX_NAME_CHARS = 128
MAX_PATH_CHARS = 4096
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")


@dataclass(frozen=True)
class LoRAModule:
    """One `--lora-modules` entry."""

    name: str
    path: str
    base_model_name: str | None = None


@dataclass(frozen=True)
class LoRAServe:
    """The API process's LoRA settings: the adapters loaded at start-up and the folders
    runtime loads may read from (empty: runtime loading refused)."""

    modules: tuple[LoRAModule, ...] = ()
    allowed_dirs: tuple[str, ...] = ()

    def allowed_path(self, path: str) -> str | None:
        """`path` resolved (symlinks followed) if it is a directory inside an allowed
        folder, else None."""
        if "\x00" in path:
            return None
        real = os.path.realpath(path)
        for root in self.allowed_dirs:
            top = os.path.realpath(root)
            if os.path.commonpath([top, real]) == top and os.path.isdir(real):
                return real
        return None


def check_name(name: str) -> str:
    """ValueError unless `name` is a plain adapter name (what hashes, events and metric
    labels carry)."""
    if not (0 < len(name) <= MAX_NAME_CHARS and _NAME.fullmatch(name)):
        raise ValueError(f"a LoRA name is 1-{MAX_NAME_CHARS} characters of letters, digits "
                         f"and ._:/@+- (starting with a letter or digit), got {name[:200]!r}")
    return name


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form (argparse type of --lora-modules)."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
            module = LoRAModule(str(obj["name"]), str(obj["path"]),
                                obj.get("base_model_name"))
        except (ValueError, KeyError, TypeError) as e:
            raise argparse.ArgumentTypeError(
                f"--lora-modules JSON needs 'name' and 'path': {e}") from e
    else:
        name, sep, path = text.partition("=")
        if not sep or not path:
            raise argparse.ArgumentTypeError(f"--lora-modules takes name=path, got {text!r}")
        module = LoRAModule(name, path)
    try:
        check_name(module.name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    return module


def add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters (PEFT folders) on the base model")
    g.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None,
                   help="adapters loaded at start-up: name=path, or JSON "
                        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'")
    g.add_argument("--max-loras", type=int, default=1,
                   help="adapters resident at once (at most this many in one step)")
    g.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters kept decoded in host memory (default: --max-loras)")
    g.add_argument("--lora-allowed-dirs", nargs="+", default=None,
                   help="folders POST /v1/load_lora_adapter may load from (default: none, "
                        "runtime loading refused)")


def lora_config(args: argparse.Namespace) -> LoRAConfig | None:
    """The runner's LoRA settings (None without --enable-lora); ValueError for LoRA flags
    given without it."""
    if not args.enable_lora:
        if args.lora_modules or args.lora_allowed_dirs:
            raise ValueError("--lora-modules and --lora-allowed-dirs need --enable-lora")
        return None
    return LoRAConfig(max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                      max_cpu_loras=args.max_cpu_loras)


def lora_serve(args: argparse.Namespace) -> LoRAServe | None:
    if not args.enable_lora:
        return None
    modules = tuple(args.lora_modules or ())
    if len({m.name for m in modules}) != len(modules):
        raise ValueError("--lora-modules names must be distinct")
    for m in modules:   # before the model loads, not after it
        problem = peft_folder_problem(m.path)
        if problem is not None:
            raise ValueError(f"--lora-modules {m.name}: {problem} (a PEFT adapter folder: "
                             f"docs/serving.md \"LoRA adapters\" says how to make one)")
    return LoRAServe(modules, tuple(args.lora_allowed_dirs or ()))


class LoRANames:
    """The adapters loaded, as this API process knows them: name -> path."""

    def __init__(self, serve: LoRAServe | None):
        self.serve = serve
        self.paths: dict[str, str] = {}

    @property
    def enabled(self) -> bool:
        return self.serve is not None

    def __contains__(self, name: object) -> bool:
        return name in self.paths

    def forget(self, name: str) -> None:
        """The engine unloaded `name` (it could not be read): no longer listed or served."""
        self.paths.pop(name, None)
