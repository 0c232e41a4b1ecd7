"""Every file a docstring, comment or doc names is a file of this repository.

Scanned: `kvloop/**/*.py` and `tests/*.py` (their comments, and the string literals that
read as prose, i.e. hold a space: docstrings, help texts, messages), `docs/*.md` and
`README.md`. In that text:

- a path with a folder ending in .md, .json or .py names a file of the repository, relative
  to the repository root, to the citing file's folder, or to `kvloop/` (the package tables
  of docs/architecture.md name `core/engine.py`);
- a bare name (`serving.md`, `protocol.py`, `hash_vectors.json`) is the name of a file of
  the repository, unless it is in `RUN_TIME_NAMES`: files that exist only when kvloop runs
  (what it writes, what a model folder holds), not references;
- a cited `FILE.md#anchor` and a markdown link's `#anchor` name a heading of that file
  (GitHub's anchor of the heading); a markdown link's relative target exists;
- no file names the team's shared folder or the documents that lived only there: what
  kvloop relies on is summarised in docs/vllm-facts.md and docs/benchmarking.md.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SELF = Path(__file__).resolve()   # names the outside documents to forbid them: not scanned

# Outside the repository: the shared folder and the documents that lived only there.
FORBIDDEN = ("/work/shared", "shared/specs", "BENCHMARKS.md", "vllm-engine.md")

# Names of files that exist only at run time: written by kvloop (`--json-out`, the figures),
# read from a model folder or a request, or placeholders in a usage line.
RUN_TIME_NAMES = frozenset({
    "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
    "special_tokens_map.json",   # a Hugging Face tokenizer folder (kvloop export-tokenizer)
    "adapter_config.json",   # a PEFT LoRA adapter folder's config (kvloop/model/lora.py)
    "figures.md", "c8.json", "TRACE.json", "STEPLOG.json",
    "test_inner.py",   # a module tests/test_markers.py writes into pytester's folder
    "build-info.json",   # what `python -m kvloop.bench.llamacpp build` writes
    "cmake-flags.txt",   # likewise: the flags its binaries were built with
    "routers.json", "routers-model.json",   # what `python -m kvloop.bench.routers` writes
})

REF = re.compile(
    r"(?<![\w./:~-])"                       # not inside a longer path, URL or dotted name
    r"((?:[\w.-]+/)*[\w-][\w.-]*\.(?:md|json|py))"
    r"(?:#([\w-]+))?"
    r"(?![\w/-]|\.\w|\()")                  # not `.jsonl`, `msgspec.json.encode`, `r.json()`
# Every reference ends in one of these, so a file without any holds none (short of a string
# that spells the dot as an escape, "\x2emd"): 151 of the 376 Python files scanned.
SUFFIX = re.compile(r"\.(?:md|json|py)")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def scanned_files() -> list[Path]:
    files = [*sorted((ROOT / "kvloop").rglob("*.py")), *sorted((ROOT / "tests").glob("*.py")),
             *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    return [f for f in files if f.resolve() != SELF]


def repo_files() -> dict[str, Path]:
    """Every file of the repository by its name (build and tool folders left out)."""
    found: dict[str, Path] = {}
    for top in (ROOT / "kvloop", ROOT / "tests", ROOT / "docs"):
        for p in top.rglob("*"):
            if p.is_file() and not any(part.startswith((".", "__pycache__"))
                                       for part in p.relative_to(ROOT).parts):
                found.setdefault(p.name, p)
    for p in ROOT.iterdir():
        if p.is_file():
            found.setdefault(p.name, p)
    return found


BY_NAME = repo_files()


# Python's comments and string literals (with their prefix), as `tokenize` reads them in a
# file that parses: the pure-Python tokenizer took most of this check's second of CPU, this
# regex a seventh of it. test_the_lexer_reads_what_tokenize_reads holds the two together.
_BODIES = (
    r'"""[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*"""',   # triple double quotes
    r"'''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''",   # triple single quotes
    r'"[^\n"\\]*(?:\\.[^\n"\\]*)*"',               # double quotes
    r"'[^\n'\\]*(?:\\.[^\n'\\]*)*'",               # single quotes
)
LEXEME = re.compile(r"#[^\n]*|(?:(?<!\w)[bBrRuUfF]{1,2})?(?:" + "|".join(_BODIES) + ")", re.S)


def lexemes(text: str) -> list[tuple[int, str]]:
    """(line, source) of every comment and string literal of Python source `text`."""
    out, line, pos = [], 1, 0
    for m in LEXEME.finditer(text):
        line += text.count("\n", pos, m.start())
        pos = m.start()
        out.append((line, m.group()))
    return out


def prose(path: Path, text: str) -> list[tuple[int, str]]:
    """(line, text) of what a reader reads: a Python file's comments and prose strings, or a
    markdown file's lines."""
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    if not SUFFIX.search(text):   # no reference can be in it
        return []
    out = []
    for line, source in lexemes(text):
        if source.startswith("#"):
            out.append((line, source))
            continue
        if " " not in source and "\\" not in source:   # its value has no space either
            continue
        try:
            value = ast.literal_eval(source)
        except (ValueError, SyntaxError):   # an f-string: read its template
            value = source
        if isinstance(value, str) and " " in value:
            out.append((line, value))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    seen: dict[str, int] = {}
    in_code = False
    for line in md.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        m = None if in_code else HEADING.match(line)
        if m:
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            if n:
                seen[f"{base}-{n}"] = 1
    return set(seen)


def resolve(ref: str, citing: Path) -> Path | None:
    """The repository file `ref` names from `citing`, or None."""
    if "/" not in ref:
        local = citing.parent / ref
        return local if local.is_file() else BY_NAME.get(ref)
    for base in (ROOT, citing.parent, ROOT / "kvloop"):
        p = (base / ref).resolve()
        if p.is_file() and ROOT in p.parents:
            return p
    return None


def check_anchor(target: Path, anchor: str | None, where: str) -> list[str]:
    if not anchor or target.suffix != ".md" or anchor in anchors(target):
        return []
    return [f"{where}: no heading #{anchor} in {target.relative_to(ROOT)}"]


def problems_in(path: Path, text: str) -> list[str]:
    """Every reference of `text` (the content of `path`) that does not resolve."""
    rel = path.relative_to(ROOT) if ROOT in path.parents else path
    problems = [f"{rel}:{n}: names {name!r}, outside the repository"
                for n, line in enumerate(text.splitlines(), 1)
                for name in FORBIDDEN if name in line]
    for first_line, chunk in prose(path, text):
        for m in REF.finditer(chunk):
            ref, anchor = m.group(1), m.group(2)
            where = f"{rel}:{first_line + chunk.count(chr(10), 0, m.start())}"
            if "/" not in ref and ref in RUN_TIME_NAMES:
                continue
            target = resolve(ref, path)
            if target is None:
                problems.append(f"{where}: {ref!r} is not a file of the repository")
            else:
                problems += check_anchor(target, anchor, where)
    if path.suffix == ".md":
        for line_no, line in enumerate(text.splitlines(), 1):
            for m in MD_LINK.finditer(line):
                problems += _link_problems(m.group(1), path, f"{rel}:{line_no}")
    return list(dict.fromkeys(problems))   # a link is also a reference: report it once


def _link_problems(link: str, doc: Path, where: str) -> list[str]:
    if re.match(r"[a-z]+:", link):   # http:, https:, mailto:
        return []
    target_s, _, anchor = link.partition("#")
    target = (doc.parent / target_s).resolve() if target_s else doc
    if not target.is_file():
        return [f"{where}: link target {target_s!r} does not exist"]
    return check_anchor(target, anchor or None, where)


def test_every_reference_resolves_inside_the_repository() -> None:
    problems = [p for f in scanned_files() for p in problems_in(f, f.read_text())]
    assert not problems, "\n".join(problems)


def test_the_cited_facts_pages_exist() -> None:
    # what the code cites most: vLLM's facts and the conformance format
    for name in ("docs/vllm-facts.md", "tests/data/conformance/README.md"):
        assert (ROOT / name).is_file(), name
    assert {"scheduler", "kv-cache", "hashing", "kv-events", "stop-strings", "metrics",
            "openai-server", "conformance-scenarios"} <= anchors(ROOT / "docs/vllm-facts.md")


BAD = [
    ("see docs/nowhere.md for it", "'docs/nowhere.md' is not a file"),
    ("rules of docs/vllm-facts.md#no-such-heading", "no heading #no-such-heading"),
    ("the layering of DESIGN.md", "'DESIGN.md' is not a file"),
    ("the trace format of " + "shared/" + "specs/conformance", "outside the repository"),
    ("targets of " + "BENCHMARKS" + ".md", "outside the repository"),
]


@pytest.mark.parametrize("line,expected", BAD)
def test_a_planted_bad_reference_is_reported(line: str, expected: str) -> None:
    for name, text in (("planted.py", f'"""{line}."""\n'), ("planted.md", f"{line}.\n")):
        problems = problems_in(ROOT / "docs" / name, text)
        assert any(expected in p for p in problems), (name, problems)


@pytest.mark.parametrize("text", [
    "see docs/vllm-facts.md#scheduler and [KV events](vllm-facts.md#kv-events).",
    "`kvloop/core/scheduler.py`, `core/engine.py`, `protocol.py`, `hash_vectors.json`",
    "writes `figures.md`; `r.json()`, `msgspec.json.encode`, `steps.jsonl`, /openapi.json",
])
def test_good_references_pass(text: str) -> None:
    assert problems_in(ROOT / "docs" / "planted.md", text) == []


def test_markdown_link_targets_and_anchors() -> None:
    doc = ROOT / "docs" / "vllm-facts.md"   # a real page: its own headings are the anchors
    text = ("[a](serving.md) [b](#scheduler) [c](https://x.org/y.md) [d](#nope)\n"
            "[e](missing.png) [f](benchmarking.md#workloads-and-targets) [g](router.md#nope)")
    assert sorted(problems_in(doc, text)) == [
        "docs/vllm-facts.md:1: no heading #nope in docs/vllm-facts.md",
        "docs/vllm-facts.md:2: link target 'missing.png' does not exist",
        "docs/vllm-facts.md:2: no heading #nope in docs/router.md",
    ]


TRICKY = '''\
x = rb"a\\"#" + Rf'{y!r}#' "" ''  # a 'quoted' "#" comment
z = x in"abc" or verb"q"
s = """one "two" ""three"" \\""" four
five""" + \'\'\'a \'\' b\'\'\'
t = "line \\
continued" # docs/x.md
'''


def tokenized(text: str) -> list[tuple[int, str]]:
    return [(tok.start[0], tok.string)
            for tok in tokenize.generate_tokens(io.StringIO(text).readline)
            if tok.type in (tokenize.COMMENT, tokenize.STRING)]


@pytest.mark.parametrize("text", [TRICKY, SELF.read_text()], ids=["tricky", "this-file"])
def test_the_lexer_reads_what_tokenize_reads(text: str) -> None:
    assert lexemes(text) == tokenized(text)
