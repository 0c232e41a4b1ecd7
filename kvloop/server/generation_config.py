"""The default sampling parameters of `kvloop serve`: vLLM's `--generation-config` and
`--override-generation-config`.

A request's own field always wins; a field it leaves out takes the default here, and only
then vLLM's neutral value (temperature 1, top_p 1, top_k and min_p off, no repetition
penalty). Where the defaults come from (`--generation-config`):

- `auto` (vLLM's default): the model's `generation_config.json`: a Hugging Face folder's
  own; for the embedded SmolLM2-135M-Instruct, the copy kvloop ships
  (`smollm2_generation_config.json`: its model card's recommended temperature 0.2,
  top_p 0.9); none for a bare GGUF file (vLLM reads none either);
- `vllm`: none, vLLM's neutral values;
- a folder: its `generation_config.json` (an error when it has none).

`--override-generation-config JSON` is laid over whichever applies (with `vllm` too, as vLLM
does). Only vLLM's keys are read: `temperature`, `top_p`, `top_k`, `min_p`,
`repetition_penalty`, and `max_new_tokens` (vLLM's `max_tokens`: it caps every request's
output); other keys (token ids, `do_sample`, ...) are ignored, as vLLM ignores them.
`kvloop serve` says at start-up, in one line, which defaults apply (`DefaultSampling.describe`).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvloop.sampling_params import SamplingParams

AUTO = "auto"
VLLM = "vllm"
FILE_NAME = "generation_config.json"
EMBEDDED_COPY = Path(__file__).with_name("smollm2_generation_config.json")
MAX_FILE_BYTES = 1 << 20   # a generation config is a few hundred bytes


@dataclass(frozen=True)
class DefaultSampling:
    """What a request that leaves a sampling field out gets (None: vLLM's neutral value),
    and `source`, where these came from (said at start-up)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    source: str = "vLLM's neutral defaults"

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)
                                  or not math.isfinite(v)):
                raise ValueError(f"generation config: {name} must be a finite number, got {v!r}")
        for name in ("top_k", "max_tokens"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
                raise ValueError(f"generation config: {name} must be an integer, got {v!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"generation config: max_new_tokens must be >= 1, got "
                             f"{self.max_tokens}")
        try:  # the engine's own checks, once, here rather than on every request
            SamplingParams(**{k: v for k, v in self.values().items() if k != "max_tokens"})
        except ValueError as e:
            raise ValueError(f"generation config: {e}") from None

    def values(self) -> dict[str, Any]:
        """The defaults that are set, by vLLM's SamplingParams names."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) is not None}

    def pick(self, name: str, asked: Any, neutral: Any) -> Any:
        """The request's value when it sent one, else this default, else `neutral`."""
        if asked is not None:
            return asked
        default = getattr(self, name)
        return neutral if default is None else default

    def cap(self, max_tokens: int) -> int:
        """A request's output length under the generation config's max_new_tokens."""
        return max_tokens if self.max_tokens is None else min(max_tokens, self.max_tokens)

    def describe(self) -> str:
        """The start-up line: which defaults apply and how to change them."""
        values = self.values()
        if not values:
            return (f"default sampling parameters: {self.source} (temperature 1.0, top_p 1.0); "
                    f"a request's fields apply as sent")
        text = ", ".join(f"{k}={v}" for k, v in values.items())
        return (f"default sampling parameters: {text} ({self.source}); a request's own fields "
                f"win; --generation-config vllm for vLLM's neutral defaults")


def default_sampling(setting: str, model: str | None,
                     override: str | None = None) -> DefaultSampling:
    """`--generation-config SETTING` for `model` (None: the embedded model; a GGUF file or a
    Hugging Face folder) with `--override-generation-config`'s JSON text laid over it.
    ValueError naming the flag for a folder without the file, bad JSON or a bad value."""
    config, source = _generation_config(setting, model)
    extra = _override(override)
    if extra:
        had = any(config.get(k) is not None for k in _KEYS)
        source = f"{source}, --override-generation-config" if had \
            else "--override-generation-config"
        config = {**config, **extra}
    picked = {k: config[k] for k in _KEYS if config.get(k) is not None}
    if not picked:
        return DefaultSampling()
    if "max_new_tokens" in picked:
        picked["max_tokens"] = picked.pop("max_new_tokens")
    return DefaultSampling(**picked, source=source)


_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def _generation_config(setting: str, model: str | None) -> tuple[dict[str, Any], str]:
    """The generation config's keys and a phrase saying where they came from."""
    if setting == VLLM:
        return {}, "vLLM's neutral defaults"
    if setting == AUTO:
        if model is None:
            return _read(EMBEDDED_COPY), "the embedded model's recommended settings"
        path = Path(model).expanduser() / FILE_NAME
        if Path(model).expanduser().is_dir() and path.is_file():
            return _read(path), f"the model's {path}"
        return {}, "vLLM's neutral defaults (the model has no generation_config.json)"
    path = Path(setting).expanduser() / FILE_NAME
    if not path.is_file():
        raise ValueError(f"--generation-config {setting!r}: no {FILE_NAME} there; pass "
                         f"'auto', 'vllm' or a folder holding {FILE_NAME}")
    return _read(path), f"{path}"


def _read(path: Path) -> dict[str, Any]:
    if path.stat().st_size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: over {MAX_FILE_BYTES} bytes; not a generation config")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a generation config is a JSON object")
    return data


def _override(text: str | None) -> dict[str, Any]:
    if text is None:
        return {}
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--override-generation-config: not JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError("--override-generation-config: a JSON object, e.g. "
                         "'{\"temperature\": 0.5}'")
    return data
