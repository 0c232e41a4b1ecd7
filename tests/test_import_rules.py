"""The import rules of docs/architecture.md, enforced by walking every module's imports (AST,
not runtime): the layering (a whitelist per package) and no import circle anywhere."""

from __future__ import annotations

import ast
import functools
import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvloop"

# What each part of kvloop may import besides the standard library and itself: a whitelist
# (docs/architecture.md's table and rules say the same in words). The most specific entry
# (longest prefix) of a module applies. Two lists per entry: kvloop modules (prefixes) and
# third-party packages. None means anything (the benchmarks drive every layer).
CORE_KVLOOP = ("kvloop.config", "kvloop.wire", "kvloop.events.types")
CORE_3P = ("msgspec", "cbor2", "xxhash")
ROUTER_KVLOOP = ("kvloop.config", "kvloop.locate", "kvloop.wire", "kvloop.core.hashing",
                 "kvloop.events", "kvloop.sim.latency", "kvloop.trust", "kvloop.front",
                 "kvloop.batch", "kvloop.tracing")
ROUTER_3P = ("httpx", "starlette", "anyio", "msgspec", "prometheus_client", "zmq", "redis",
             "yaml")
ALLOWED: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...] | None]] = {
    # the package's __init__
    "kvloop": (("kvloop.sampling_params", "kvloop.pooling_params", "kvloop.lora_request",
                "kvloop.version", "kvloop.llm"), ()),
    "kvloop.__main__": (("kvloop.cli",), ()),
    # subcommands' cli_args: by name; yaml: --config FILE
    "kvloop.cli": (("kvloop", "kvloop.sim.replay"), ("yaml",)),
    "kvloop.config": ((), ()),
    "kvloop.sampling_params": ((), ("msgspec",)),
    "kvloop.pooling_params": ((), ("msgspec",)),   # beside sampling_params, for the same reasons
    "kvloop.lora_request": ((), ()),   # vLLM's LoRARequest for `LLM.generate`: a plain dataclass
    "kvloop.locate": ((), ()),
    "kvloop.gguf_format": ((), ()),   # the GGUF header, read with the standard library
    "kvloop.version": ((), ()),
    "kvloop.trust": ((), ("zmq",)),
    # OpenTelemetry only inside functions that run with --otlp-traces-endpoint
    "kvloop.tracing": ((), ("opentelemetry",)),
    "kvloop.wire": (("kvloop.config", "kvloop.sampling_params", "kvloop.pooling_params",
                     "kvloop.events.config",
                     "kvloop.trust", "kvloop.tracing"),
                    ("msgspec",)),
    "kvloop.llm": (("kvloop.config", "kvloop.core", "kvloop.engine", "kvloop.front.processor",
                    "kvloop.front.tokenizer", "kvloop.wire", "kvloop.trust",
                    "kvloop.lora_request"), ("tqdm",)),
    "kvloop.core": (CORE_KVLOOP, CORE_3P),
    # the engine's one assembly (build: by factory name, never the model) and its process
    "kvloop.engine": (("kvloop.config", "kvloop.wire", "kvloop.core", "kvloop.events.config",
                       "kvloop.events.publisher", "kvloop.events.nats_publisher",
                       "kvloop.kv_transfer", "kvloop.trust", "kvloop.tracing"),
                      ("msgspec", "zmq")),
    "kvloop.core.request": ((*CORE_KVLOOP, "kvloop.sampling_params", "kvloop.pooling_params"),
                            CORE_3P),  # re-exports them
    # events.types: the offloading connector publishes its tiers' KV events (vLLM's
    # connector `take_events`); redis: the shared tier's client
    "kvloop.kv_transfer": (("kvloop.config", "kvloop.wire", "kvloop.core.kv_connector",
                            "kvloop.core.outputs", "kvloop.core.request", "kvloop.trust",
                            "kvloop.events.types"),
                           ("msgspec", "zmq", "xxhash", "redis")),
    "kvloop.events": (("kvloop.trust",), ("msgspec", "zmq", "nats", "xxhash")),
    "kvloop.model": (("kvloop.config", "kvloop.locate", "kvloop.gguf_format",
                      "kvloop.core.outputs", "kvloop.core.runner",
                      "kvloop.core.request", "kvloop.core.trace", "kvloop.core.hashing",
                      "kvloop.core.kv_connector", "kvloop.core.kv_cache_groups",
                      "kvloop.core.lora_slots"),   # the adapter slots' LRU, shared with sim
                     ("torch", "gguf", "numpy", "safetensors")),
    "kvloop.sim": (("kvloop.config", "kvloop.core.engine", "kvloop.core.outputs",
                    "kvloop.core.request", "kvloop.core.scheduler", "kvloop.core.spec_decode",
                    "kvloop.core.kv_connector", "kvloop.core.lora_slots",
                    # simulated tiers publish the wire's events, with its tier names
                    "kvloop.events.types"),
                   ("msgspec", "numpy")),
    "kvloop.front": (("kvloop.locate", "kvloop.gguf_format", "kvloop.wire", "kvloop.core.request",
                      "kvloop.sim.byte_vocab"),
                     ("starlette", "uvicorn", "h11", "pydantic", "typing_extensions", "httpx",
                      "jinja2", "tokenizers", "msgspec")),
    "kvloop.server": (("kvloop.version", "kvloop.sampling_params", "kvloop.pooling_params",
                       "kvloop.config", "kvloop.wire",
                       "kvloop.locate",   # the supported architectures, checked at start
                       "kvloop.gguf_format",
                       "kvloop.front",
                       "kvloop.core.request", "kvloop.events.cli_args", "kvloop.events.config",
                       "kvloop.events.nats_plane", "kvloop.sim.byte_vocab", "kvloop.trust",
                       "kvloop.kv_transfer.params", "kvloop.batch", "kvloop.tracing"),
                      ("fastapi", "starlette", "pydantic", "msgspec", "prometheus_client", "zmq")),
    "kvloop.router": (ROUTER_KVLOOP, ROUTER_3P),
    # ray only inside functions that run with `kvloop fleet --ray` (the ray extra)
    "kvloop.router.ray_fleet": (ROUTER_KVLOOP, (*ROUTER_3P, "ray")),
    # the endpoint picker behind Envoy: gRPC and Envoy's protobuf stubs (the gateway extra)
    "kvloop.router.ext_proc": (ROUTER_KVLOOP,
                               (*ROUTER_3P, "grpc", "grpc_health", "envoy", "google")),
    # the Batch API: below the router and the API server, on the shared front package
    "kvloop.batch": (("kvloop.front",), ("starlette", "httpx", "redis")),
    "kvloop.structured": (("kvloop.config", "kvloop.core.request", "kvloop.front.tokenizer"),
                          ("xgrammar", "numpy")),
    "kvloop.viz": ((), ("matplotlib",)),
    "kvloop.bench": (None, None),
}
STDLIB = set(sys.stdlib_module_names) | {"__future__"}


def _modules():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(rel.parts).removesuffix(".__init__")
        yield name, path


def _all_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Every statement of `body` and of the blocks nested in it (functions, classes, if, try,
    with, loops, match cases), never an expression's inside: an import is always a statement,
    and skipping expressions (most of a module's nodes) makes this 5-10x faster than
    `ast.walk`."""
    for node in body:
        yield node
        for field in ("body", "orelse", "finalbody", "handlers", "cases"):
            for child in getattr(node, field, ()):
                yield from _all_statements(child.body if isinstance(
                    child, (ast.ExceptHandler, ast.match_case)) else [child])


def _parse(path: Path) -> ast.Module:
    """`path`'s syntax tree, parsed with the cyclic garbage collector paused: a tree holds no
    reference cycle, and in a worker that has collected the suite (torch in memory) the
    collector's passes over the growing trees were a fifth of the first parsing test's CPU
    (0.72 s, 0.57 s without)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(path.read_text(), str(path))
    finally:
        if enabled:
            gc.enable()


@functools.cache   # every test reads every module: parse each once per session
def _statements(path: Path, modname: str) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(module, names) of every import statement of the module, wherever it stands (function
    bodies and `if TYPE_CHECKING:` blocks included): `import a.b` -> ("a.b", ()),
    `from .x import y` -> ("<package>.x", ["y"])."""
    tree = _parse(path)
    out: list[tuple[str, tuple[str, ...]]] = []
    pkg = modname if path.name == "__init__.py" else modname.rsplit(".", 1)[0]
    for node in _all_statements(tree.body):
        if isinstance(node, ast.Import):
            out.extend((a.name, ()) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, tuple(a.name for a in node.names)))
    return tuple(out)


def _imports(path: Path, modname: str) -> list[str]:
    """Every name the module imports: modules, and `module.name` for each `from` import."""
    out = []
    for mod, names in _statements(path, modname):
        out.append(mod)
        out.extend(f"{mod}.{name}" for name in names)
    return out


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _rule(mod: str) -> tuple[str, tuple[tuple[str, ...] | None, tuple[str, ...] | None]]:
    """The most specific whitelist entry of `mod` (its own package is always allowed)."""
    best = max((p for p in ALLOWED if _matches(mod, p)), key=len)
    return best, ALLOWED[best]


def _own_package(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2]) if (ROOT / parts[1]).is_dir() else mod


@functools.cache   # asked for every name of every `from` import, by several tests
def _is_module(name: str) -> bool:
    path = ROOT.parent / Path(*name.split("."))
    return path.is_dir() or path.with_suffix(".py").exists()


def _violations(mod: str, imports: list[str]) -> list[str]:
    _, (kvloop_ok, third_ok) = _rule(mod)
    own = _own_package(mod) if mod != "kvloop" else "kvloop.__init__"
    bad = []
    for imp in imports:
        root = imp.split(".")[0]
        if not imp or root in STDLIB:
            continue
        if root == "kvloop":
            if imp != "kvloop" and not _is_module(imp):
                continue      # `from kvloop.x import Name`: the module kvloop.x is checked
            if (kvloop_ok is None or _matches(imp, own)
                    or any(_matches(imp, p) if p != "kvloop" else imp == p for p in kvloop_ok)):
                continue
            bad.append(f"{mod} imports {imp}")
        elif third_ok is not None and root not in third_ok:
            bad.append(f"{mod} imports {imp} (third-party)")
    return bad


def _kvloop_deps(path: Path, modname: str) -> set[str]:
    """The kvloop modules the module imports: `from p import m` names the module p.m when
    there is one, else p (a package's `__init__` is a module like any other)."""
    deps = set()
    for mod, names in _statements(path, modname):
        targets = [f"{mod}.{n}" if _is_module(f"{mod}.{n}") else mod for n in names] or [mod]
        deps.update(t for t in targets if t.split(".")[0] == "kvloop")
    deps.discard(modname)
    return deps


def _module_graph() -> dict[str, set[str]]:
    """kvloop's modules and what each imports, explicitly: an import anywhere in a module
    counts (a function-level import is a dependency made lazy for start-up time, not a
    different structure; a type-only import is a dependency for the reader), the implicit
    import of a submodule's parent package does not."""
    return {mod: _kvloop_deps(path, mod) for mod, path in _modules()}


def _package_graph(modules: dict[str, set[str]]) -> dict[str, set[str]]:
    """kvloop's parts and which others each one's modules import: its subpackages (core,
    model, server, router, events, kv_transfer, ...) and its top-level modules (config, wire,
    sampling_params, llm, ...), each one part. The package's own `__init__`, the
    users' facade (`from kvloop import LLM, SamplingParams`), is no part: it stands above all
    of them (a module that imports it is still seen in the module graph)."""
    def package(mod: str) -> str | None:
        parts = mod.split(".")
        return ".".join(parts[:2]) if len(parts) > 1 else None

    graph: dict[str, set[str]] = {}
    for mod, deps in modules.items():
        src = package(mod)
        if src is not None:
            graph.setdefault(src, set()).update(
                p for d in deps if (p := package(d)) is not None and p != src)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` as a path `[a, b, ..., a]`, or None: a depth-first search that
    meets a node still on its own path has found one."""
    done: set[str] = set()
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                return path[path.index(nxt):] + [nxt]
            if nxt not in done and (found := visit(nxt)) is not None:
                return found
        path.pop()
        done.add(node)
        return None

    for node in sorted(graph):
        if node not in done and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_circle_between_modules():
    cycle = find_cycle(_module_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_no_import_circle_between_packages():
    cycle = find_cycle(_package_graph(_module_graph()))
    assert cycle is None, "import circle between packages: " + " -> ".join(cycle or [])


def test_the_cycle_finder_names_the_circle(tmp_path):
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]
    p = tmp_path / "x.py"
    p.write_text("from kvloop.model import cpu_ops, load_runner\n"
                 "def f():\n    from kvloop.router import index\n")
    assert _kvloop_deps(p, "kvloop.core.x") == {
        "kvloop.model.cpu_ops", "kvloop.model", "kvloop.router.index"}
    modules = {"kvloop.core.a": {"kvloop.wire", "kvloop.model.b", "kvloop"},
               "kvloop.model.b": {"kvloop.core.c"}, "kvloop.wire": {"kvloop.config"},
               "kvloop": {"kvloop.core.a"}}
    assert _package_graph(modules) == {"kvloop.core": {"kvloop.wire", "kvloop.model"},
                                       "kvloop.model": {"kvloop.core"},
                                       "kvloop.wire": {"kvloop.config"}}


def test_layering():
    bad = []
    for mod, path in _modules():
        bad += _violations(mod, _imports(path, mod))
    assert not bad, "\n".join(bad)


def test_only_the_cli_imports_the_api_server():
    """`kvloop.server` is the API-server process: the router, `llm.py`, `structured/` and the
    benchmarks stand on the shared HTTP front package (`kvloop.front`), never on it."""
    importers = {mod for mod, path in _modules() if not _matches(mod, "kvloop.server")
                 and any(_matches(imp, "kvloop.server") for imp in _imports(path, mod))}
    assert importers <= {"kvloop.cli"}, sorted(importers)
    assert not any(_matches(imp, "kvloop.server") for p in ALLOWED if p != "kvloop.server"
                   for imp in ALLOWED[p][0] or ())


def test_every_module_has_a_rule_and_the_rules_catch_violations():
    assert all(_rule(mod)[0] for mod, _ in _modules())
    assert _violations("kvloop.core.block_pool", ["torch"]) == [
        "kvloop.core.block_pool imports torch (third-party)"]
    assert _violations("kvloop.core.scheduler", ["kvloop.front.openai"]) == [
        "kvloop.core.scheduler imports kvloop.front.openai"]
    assert _violations("kvloop.router.proxy", ["kvloop.server.serving"]) == [
        "kvloop.router.proxy imports kvloop.server.serving"]
    assert _violations("kvloop.core.engine", ["zmq"]) != []
    assert _violations("kvloop.core.engine_proc", ["zmq"]) != []
    assert _violations("kvloop.core.scheduler", ["kvloop.kv_transfer"]) != []
    assert _violations("kvloop.engine.proc", ["zmq", "kvloop.events.publisher"]) == []
    assert _violations("kvloop.engine.build", ["kvloop.model"]) != []
    assert _violations("kvloop.server.api", ["kvloop.cli"]) != []
    assert _violations("kvloop.bench.offline", ["torch", "kvloop.model"]) == []


def test_the_map_names_every_third_party_package_a_package_may_import():
    """docs/architecture.md's package table lists, per package, what it may import."""
    table = (ROOT.parent / "docs" / "architecture.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line.split("|")[3]
            for line in table.splitlines() if line.startswith("| `")}
    for pkg, (_, third) in ALLOWED.items():
        row = rows.get(pkg.removeprefix("kvloop.").replace(".", "/") + "/")
        if row is None or third is None:
            continue
        missing = [t for t in third if t not in row]
        assert not missing, f"docs/architecture.md's row for {pkg} lacks {missing}"


@pytest.mark.processes
def test_import_kvloop_is_light():
    code = ("import sys, kvloop, kvloop.core.engine, kvloop.sim.replay; "
            "bad = [m for m in ('torch', 'fastapi', 'transformers') if m in sys.modules]; "
            "print(bad); assert not bad")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_checker_sees_a_violation(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import torch\nfrom ..model import llama\n")
    imps = _imports(p, "kvloop.core.x")
    assert "torch" in imps and "kvloop.model.llama" in imps
