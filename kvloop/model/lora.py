"""LoRA adapters on the Llama model: PEFT's files, per-slot weights, the rows of each step.

Scope: read a PEFT adapter folder (adapter_config.json + adapter_model.safetensors), check it
against the base model and the limits, keep it decoded in host memory (at most
`LoRAConfig.cpu_loras`, LRU, reread from its folder when needed again) and copy it into one
of `max_loras` slots of every targeted linear layer; a step's `LoRAStep` then says which rows
use which slot, and each layer adds `x[rows] @ A.T @ B.T` (B already scaled) to its output.

Owner: `LoRASlots` (one per runner) alone writes the slot weights of the layers
(`LinearLoRA`), the registry (name -> folder), the host cache and the name -> slot map.
The scheduler guarantees a step uses at most `max_loras` adapters
(`kvloop.core.waiting.AdapterSlots`), so `activate` always finds a slot.

Layout: kvloop fuses q/k/v into one `Linear` and gate/up into another. A fused layer's slot
holds its parts side by side: A [P * R, in] (part p's A in rows p*R ..), B [out, P * R]
block-diagonal (part p's B in its output rows and columns p*R ..), R = `max_lora_rank`;
the padding is zeros, so it adds exact zeros. A part the adapter does not target stays zero.

Not supported (rejected when read, not silently ignored): DoRA, LoRA biases, rank or alpha
patterns, `modules_to_save`, adapters on the embedding or the LM head.
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from kvloop.config import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRAConfig
from kvloop.core.lora_slots import SlotLRU
from kvloop.model.loader import ModelConfig

MAX_CONFIG_BYTES = 1 << 20
MAX_LORA_SCALE = 1e4      # |lora_alpha / r| beyond this is refused (PEFT's are ~0.1-100)
_PREFIX = "base_model.model.model.layers."
# kvloop's fused layers and the PEFT module names each holds, in its output order
ATTN_PARTS = ("q_proj", "k_proj", "v_proj")
MLP_PARTS = ("gate_proj", "up_proj")
TARGET_MODULES = (*ATTN_PARTS, "o_proj", *MLP_PARTS, "down_proj")


class LoRAError(ValueError):
    """An adapter that can never be served (bad folder, format, shape or rank)."""


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter decoded: `weights[(layer, module)]` = (A [r, in], B [out, r] * scale)."""

    name: str
    path: str
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LoRAStep:
    """Which rows of a step's flattened batch use which slot: (slot, start, end) ranges,
    disjoint; rows in no range are the base model's (they add nothing)."""

    ranges: tuple[tuple[int, int, int], ...]


def module_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target module of one layer."""
    hidden, d = config.hidden_size, config.head_dim
    q, kv, ffn = config.num_attention_heads * d, config.num_key_value_heads * d, \
        config.intermediate_size
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden),
            "o_proj": (hidden, q), "gate_proj": (ffn, hidden), "up_proj": (ffn, hidden),
            "down_proj": (hidden, ffn)}


def read_peft_adapter(name: str, path: str, config: ModelConfig, max_rank: int) -> PeftAdapter:
    """Read and check the PEFT adapter in folder `path`; LoRAError says what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter {name!r}: {path} is not a directory")
    for file in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        _check_inside(folder, file, name)
    peft = _read_adapter_config(folder / ADAPTER_CONFIG, name)
    rank, scale = _rank_and_scale(peft, name, max_rank)
    weights_file = folder / ADAPTER_WEIGHTS
    _check_file_size(weights_file, config, rank, name)
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(weights_file), device="cpu")
    except Exception as e:   # a corrupt file: the library's message, as a LoRAError
        raise LoRAError(f"LoRA adapter {name!r}: cannot read {ADAPTER_WEIGHTS}: {e}") from e
    weights = _pair_weights(tensors, config, rank, scale, name)
    return PeftAdapter(name, str(folder), rank, weights)


def _check_inside(folder: Path, file: str, name: str) -> None:
    """`folder/file` must be a regular file in `folder` itself (no symlink out of it)."""
    real = Path(os.path.realpath(folder / file))
    if real.parent != Path(os.path.realpath(folder)) or not real.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no {file} in the folder")


def _read_adapter_config(file: Path, name: str) -> dict[str, object]:
    if not file.is_file() or file.stat().st_size > MAX_CONFIG_BYTES:
        raise LoRAError(f"LoRA adapter {name!r}: no {ADAPTER_CONFIG} (or over 1 MiB)")
    try:
        peft = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise LoRAError(f"LoRA adapter {name!r}: {ADAPTER_CONFIG} is not JSON: {e}") from e
    if not isinstance(peft, dict):
        raise LoRAError(f"LoRA adapter {name!r}: {ADAPTER_CONFIG} is not an object")
    unsupported = [k for k in ("use_dora", "modules_to_save", "rank_pattern", "alpha_pattern",
                               "fan_in_fan_out") if peft.get(k)]
    if peft.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise LoRAError(f"LoRA adapter {name!r}: unsupported settings {unsupported}")
    return peft


def _rank_and_scale(peft: dict[str, object], name: str, max_rank: int) -> tuple[int, float]:
    """PEFT's scaling: lora_alpha / r (rsLoRA: lora_alpha / sqrt(r))."""
    rank, alpha = peft.get("r"), peft.get("lora_alpha", peft.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= max_rank:
        raise LoRAError(f"LoRA adapter {name!r}: rank {rank!r} is not in [1, {max_rank}] "
                        "(--max-lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) \
            or not math.isfinite(alpha):
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha {alpha!r} is not a number")
    scale = alpha / (math.sqrt(rank) if peft.get("use_rslora") else rank)
    if not abs(scale) <= MAX_LORA_SCALE:
        raise LoRAError(f"LoRA adapter {name!r}: lora_alpha {alpha!r} gives a scale of "
                        f"{scale:.3g}, over {MAX_LORA_SCALE:g}")
    return rank, scale


def _check_file_size(file: Path, config: ModelConfig, rank: int, name: str) -> None:
    """Refuse a weights file larger than every target module at this rank in fp32 (+ its
    header), before reading it."""
    per_layer = sum(rank * (o + i) for o, i in module_shapes(config).values())
    limit = per_layer * config.num_hidden_layers * 4 + (1 << 20)
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {name!r}: no {ADAPTER_WEIGHTS}")
    if file.stat().st_size > limit:
        raise LoRAError(f"LoRA adapter {name!r}: {ADAPTER_WEIGHTS} is larger than an adapter "
                        f"of rank {rank} for this model can be")


def _pair_weights(tensors: dict[str, torch.Tensor], config: ModelConfig, rank: int,
                  scale: float, name: str
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    shapes = module_shapes(config)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, which = _parse_key(key, config.num_hidden_layers, name)
        found.setdefault((layer, module), {})[which] = tensor
    weights = {}
    for (layer, module), pair in found.items():
        out_f, in_f = shapes[module]
        a, b = pair.get("lora_A"), pair.get("lora_B")
        if a is None or b is None or tuple(a.shape) != (rank, in_f) \
                or tuple(b.shape) != (out_f, rank):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module}: A and B must be "
                            f"[{rank}, {in_f}] and [{out_f}, {rank}]")
        a, b = a.float().contiguous(), (b.float() * scale).contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module}: weights are "
                            f"not finite (inf or nan, or overflow once scaled)")
        weights[(layer, module)] = (a, b)
    if not weights:
        raise LoRAError(f"LoRA adapter {name!r}: no LoRA weights")
    return weights


def _parse_key(key: str, num_layers: int, name: str) -> tuple[int, str, str]:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' -> (3, q_proj, lora_A)."""
    parts = key[len(_PREFIX):].split(".") if key.startswith(_PREFIX) else []
    if (len(parts) == 5 and parts[0].isdigit() and int(parts[0]) < num_layers
            and parts[1] in ("self_attn", "mlp") and parts[2] in TARGET_MODULES
            and parts[3] in ("lora_A", "lora_B") and parts[4] == "weight"):
        return int(parts[0]), parts[2], parts[3]
    raise LoRAError(f"LoRA adapter {name!r}: unsupported tensor {key[:200]!r}")


class LinearLoRA:
    """The LoRA slots of one (possibly fused) linear layer.

    a: [max_loras, P * R, in], b: [max_loras, out, P * R] (P parts, R the max rank), zeros
    where no adapter writes. `add_(y, x, step)`: y[rows] += x[rows] @ a[slot].T @ b[slot].T
    for each range of the step, computed in the slots' dtype.
    """

    def __init__(self, parts: dict[str, tuple[int, int]], in_features: int, max_loras: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device):
        self.parts = parts          # module -> (first output row, rows) in the fused output
        out = sum(rows for _, rows in parts.values())
        width = len(parts) * max_rank
        self.max_rank = max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out, width, dtype=dtype, device=device)

    def write(self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Slot `slot` := the adapter's parts `pieces` (module -> (A, B)); others zero."""
        self.a[slot].zero_()
        self.b[slot].zero_()
        for p, (module, (first, rows)) in enumerate(self.parts.items()):
            if module not in pieces:
                continue
            a, b = pieces[module]
            col = p * self.max_rank
            self.a[slot, col:col + a.shape[0]] = a
            self.b[slot, first:first + rows, col:col + a.shape[0]] = b

    def add_(self, y: torch.Tensor, x: torch.Tensor, step: LoRAStep) -> None:
        for slot, start, end in step.ranges:
            rows = x[start:end].to(self.a.dtype)
            delta = (rows @ self.a[slot].T) @ self.b[slot].T       # [n, out]
            y[start:end] += delta.to(y.dtype)


class LoRASlots:
    """Registered adapters, the host cache and the layers' slots (see the module docstring).

    `layers[i][module]` names the `LinearLoRA` holding `module` of layer i.
    """

    def __init__(self, config: ModelConfig, lora: LoRAConfig,
                 layers: list[dict[str, LinearLoRA]]):
        self.config = config
        self.lora = lora
        self.layers = layers
        self.paths: dict[str, str] = {}
        self.host: OrderedDict[str, PeftAdapter] = OrderedDict()   # LRU, oldest first
        self.slots = SlotLRU(lora.max_loras)
        self.num_loads = 0          # copies into a slot (tests and metrics read it)

    @property
    def resident(self) -> list[str]:
        """The adapters in a slot, least recently used first."""
        return list(self.slots.resident)

    def register(self, name: str, path: str) -> None:
        """Read and check the adapter now (a bad one fails here, not in a step)."""
        if name in self.paths:
            raise LoRAError(f"LoRA adapter {name!r} is already loaded")
        if len(self.paths) >= self.lora.max_adapters:
            raise LoRAError(f"at most {self.lora.max_adapters} LoRA adapters may be loaded")
        adapter = read_peft_adapter(name, os.path.realpath(path), self.config,
                                    self.lora.max_lora_rank)
        self.paths[name] = adapter.path
        self._cache(adapter)

    def unregister(self, name: str) -> None:
        """Forget `name` (its slot is freed); unknown: LoRAError."""
        if self.paths.pop(name, None) is None:
            raise LoRAError(f"LoRA adapter {name!r} is not loaded")
        self.host.pop(name, None)
        self.slots.drop(name)

    def names(self) -> list[str]:
        return list(self.paths)

    def prepare(self, name: str) -> None:
        """Make sure a step can use registered adapter `name`: resident in a slot, or its
        host copy read now (LoRAError: its folder or files cannot be read any more)."""
        if name not in self.slots.resident:
            self._host_copy(name)

    def activate(self, names: set[str]) -> dict[str, int]:
        """Make every adapter of `names` (at most `max_loras`, all registered) resident,
        evicting the least recently used others -> name -> slot."""
        slot_of, loads = self.slots.activate(names)
        for name in loads:
            self._write(slot_of[name], self._host_copy(name))
        return slot_of

    def _host_copy(self, name: str) -> PeftAdapter:
        adapter = self.host.get(name)
        if adapter is None:
            adapter = read_peft_adapter(name, self.paths[name], self.config,
                                        self.lora.max_lora_rank)
            self._cache(adapter)
        self.host.move_to_end(name)
        return adapter

    def _cache(self, adapter: PeftAdapter) -> None:
        self.host[adapter.name] = adapter
        while len(self.host) > self.lora.cpu_loras:
            self.host.popitem(last=False)

    def _write(self, slot: int, adapter: PeftAdapter) -> None:
        for i, modules in enumerate(self.layers):
            by_linear: dict[int, tuple[LinearLoRA, dict]] = {}
            for module, linear in modules.items():
                entry = by_linear.setdefault(id(linear), (linear, {}))
                if (i, module) in adapter.weights:
                    entry[1][module] = adapter.weights[(i, module)]
            for linear, pieces in by_linear.values():
                linear.write(slot, pieces)
        self.num_loads += 1
