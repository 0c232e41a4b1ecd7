"""The import rules of docs/architecture.md, enforced by walking every module's imports (AST,
not runtime)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvloop"

# What each part of kvloop may import besides the standard library and itself: a whitelist
# (docs/architecture.md's table and rules say the same in words). The most specific entry
# (longest prefix) of a module applies. Two lists per entry: kvloop modules (prefixes) and
# third-party packages. None means anything (the benchmarks drive every layer).
CORE_KVLOOP = ("kvloop.config", "kvloop.wire", "kvloop.events.types")
CORE_3P = ("msgspec", "cbor2", "xxhash")
ALLOWED: dict[str, tuple[tuple[str, ...] | None, tuple[str, ...] | None]] = {
    "kvloop": (("kvloop.core.request", "kvloop.llm"), ()),        # the package's __init__
    "kvloop.__main__": (("kvloop.cli",), ()),
    "kvloop.cli": (("kvloop", "kvloop.sim.replay"), ()),   # subcommands' cli_args: by name
    "kvloop.config": ((), ()),
    "kvloop.locate": ((), ()),
    "kvloop.trust": ((), ("zmq",)),
    "kvloop.wire": (("kvloop.config", "kvloop.core.request", "kvloop.events.config",
                     "kvloop.trust"),
                    ("msgspec",)),
    "kvloop.llm": (("kvloop.config", "kvloop.core", "kvloop.model", "kvloop.front.processor",
                    "kvloop.front.tokenizer", "kvloop.structured", "kvloop.wire",
                    "kvloop.kv_transfer", "kvloop.trust"), ("tqdm",)),
    "kvloop.core": (CORE_KVLOOP, CORE_3P),
    "kvloop.core.engine_proc": ((*CORE_KVLOOP, "kvloop.events.config", "kvloop.events.publisher",
                                 "kvloop.kv_transfer", "kvloop.events.nats_publisher",
                                 "kvloop.trust"),
                                (*CORE_3P, "zmq")),
    "kvloop.kv_transfer": (("kvloop.config", "kvloop.wire", "kvloop.core.kv_connector",
                            "kvloop.core.outputs", "kvloop.core.request", "kvloop.trust"),
                           ("msgspec", "zmq", "xxhash")),
    "kvloop.events": (("kvloop.trust",), ("msgspec", "zmq", "nats", "xxhash")),
    "kvloop.model": (("kvloop.config", "kvloop.locate", "kvloop.core.outputs", "kvloop.core.runner",
                      "kvloop.core.request", "kvloop.core.trace", "kvloop.core.hashing",
                      "kvloop.core.kv_connector"),
                     ("torch", "gguf", "numpy", "safetensors")),
    "kvloop.sim": (("kvloop.config", "kvloop.core.engine", "kvloop.core.outputs",
                    "kvloop.core.request", "kvloop.core.scheduler", "kvloop.core.spec_decode",
                    "kvloop.core.kv_connector"),
                   ("msgspec", "numpy")),
    "kvloop.front": (("kvloop.locate", "kvloop.wire", "kvloop.core.request",
                      "kvloop.sim.byte_vocab"),
                     ("starlette", "uvicorn", "h11", "pydantic", "typing_extensions", "httpx",
                      "jinja2", "tokenizers", "msgspec")),
    "kvloop.server": (("kvloop", "kvloop.config", "kvloop.wire", "kvloop.front",
                       "kvloop.core.request", "kvloop.events.cli_args", "kvloop.events.config",
                       "kvloop.events.nats_plane", "kvloop.sim.byte_vocab", "kvloop.trust",
                       "kvloop.kv_transfer.params"),
                      ("fastapi", "starlette", "pydantic", "msgspec", "prometheus_client", "zmq")),
    "kvloop.router": (("kvloop.config", "kvloop.locate", "kvloop.wire", "kvloop.core.hashing",
                       "kvloop.events", "kvloop.sim.latency", "kvloop.trust", "kvloop.front"),
                      ("httpx", "starlette", "anyio", "msgspec", "prometheus_client", "zmq",
                       "redis")),
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


def _imports(path: Path, modname: str) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    out = []
    pkg = modname if path.name == "__init__.py" else modname.rsplit(".", 1)[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append(mod)
            out.extend(f"{mod}.{a.name}" for a in node.names)
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
    assert _violations("kvloop.core.engine_proc", ["zmq", "kvloop.events.publisher"]) == []
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
