"""The layering of DESIGN.md, enforced by walking every module's imports (AST, not runtime)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "kvloop"

# package prefix -> forbidden import prefixes
FORBIDDEN = {
    "kvloop.core": ["kvloop.model", "kvloop.server", "kvloop.router", "kvloop.bench",
                    "kvloop.cli", "torch", "fastapi", "uvicorn", "starlette"],
    "kvloop.model": ["kvloop.server", "kvloop.router", "kvloop.cli", "kvloop.core.scheduler",
                     "kvloop.core.kv_cache_manager", "kvloop.core.block_pool", "fastapi"],
    "kvloop.server": ["torch", "kvloop.model", "kvloop.router", "kvloop.cli",
                      "kvloop.core.scheduler"],
    "kvloop.router": ["torch", "kvloop.model", "kvloop.cli", "kvloop.core.scheduler",
                      "kvloop.core.block_pool", "kvloop.core.kv_cache_manager",
                      "kvloop.core.engine"],
    "kvloop.events": ["torch", "kvloop.model", "kvloop.server", "kvloop.router", "kvloop.cli"],
    "kvloop.sim": ["torch", "kvloop.model", "kvloop.server", "kvloop.router", "kvloop.cli"],
    "kvloop.bench": ["kvloop.cli"],
    "kvloop.viz": ["torch", "kvloop.cli"],
}
# zmq is allowed in the core only in the engine process module
ZMQ_OK_IN_CORE = {"kvloop.core.engine_proc"}
# the router may use only these parts of the server package (error shapes, the tokenizer,
# the listening socket, and the keys, limits and timeouts every HTTP front shares)
ROUTER_SERVER_OK = ("kvloop.server.openai", "kvloop.server.tokenizer", "kvloop.server.sockets",
                    "kvloop.server.auth", "kvloop.server.http_limits", "kvloop.server.guard")
# the model package may use only the runner contract of the core
MODEL_CORE_OK = ("kvloop.core.outputs", "kvloop.core.runner", "kvloop.core.request",
                 "kvloop.core.trace", "kvloop.core.hashing")


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


def test_layering():
    bad = []
    for mod, path in _modules():
        imports = _imports(path, mod)
        for pkg, forbidden in FORBIDDEN.items():
            if not _matches(mod, pkg):
                continue
            for imp in imports:
                if any(_matches(imp, f) for f in forbidden):
                    bad.append(f"{mod} imports {imp}")
        if _matches(mod, "kvloop.core") and mod not in ZMQ_OK_IN_CORE:
            bad += [f"{mod} imports {i}" for i in imports if _matches(i, "zmq")]
        if _matches(mod, "kvloop.model"):
            bad += [f"{mod} imports {i}" for i in imports
                    if _matches(i, "kvloop.core") and not any(
                        _matches(i, ok) or i == "kvloop.core" for ok in MODEL_CORE_OK)]
        if _matches(mod, "kvloop.router"):
            bad += [f"{mod} imports {i}" for i in imports
                    if _matches(i, "kvloop.server") and not any(
                        _matches(i, ok) for ok in ROUTER_SERVER_OK)]
        if mod != "kvloop.__main__":
            bad += [f"{mod} imports {i}" for i in imports if _matches(i, "kvloop.cli")
                    and mod != "kvloop.cli"]
    assert not bad, "\n".join(bad)


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
