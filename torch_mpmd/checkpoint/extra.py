"""The user's state of a checkpoint (``extra``, ``extra_per_rank``) as JSON: tagged values, Statefuls, tensor references; and RNGState.

A value with ``state_dict()``/``load_state_dict()`` (DCP's Stateful) is
stored as its encoded ``state_dict()``; any other value as itself. Nothing is
pickled: the encoding is JSON, tensors are stored by DCP under the key their
reference names.
"""

from __future__ import annotations

import base64
import numbers
import random
from collections.abc import Mapping
from typing import Any

import torch

from torch_mpmd.checkpoint.plain import MAX_PLAIN_DEPTH

__all__ = ["RNGState", "EXTRA", "EXTRA_PER_RANK", "is_stateful", "encode_extra", "decode",
           "walk_tensors"]

EXTRA = "extra"                             # DCP keys of extra tensors: extra.<name>.<i>
EXTRA_PER_RANK = "extra_per_rank"           # extra_per_rank.<rank>.<name>.<i>


class RNGState:
    """The random number generators of this process as a Stateful, for
    ``extra_per_rank``: torch's CPU generator, every CUDA device's (when CUDA is
    initialized at save), and Python's ``random``."""

    def state_dict(self) -> dict[str, Any]:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        return {"cpu": torch.get_rng_state(), "cuda": list(cuda), "python": random.getstate()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        torch.set_rng_state(state["cpu"])
        if state["cuda"] and torch.cuda.is_available():
            for device, s in enumerate(state["cuda"][:torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, device)
        random.setstate(state["python"])


def is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and \
        callable(getattr(value, "load_state_dict", None))


# JSON values stand for themselves; the rest is tagged: {"__tuple__": [...]},
# {"__dict__": [[key, value], ...]} (keys that are not all strings, or that
# collide with a tag), {"__bytes__": base64}, and {"__tensor__": dcp_key,
# "dtype": "float32", "shape": [...]} whose data DCP stores under dcp_key.

_TAGS = ("__tuple__", "__dict__", "__bytes__", "__tensor__")


def _encode(value: Any, where: str, prefix: str, tensors: dict[str, torch.Tensor]) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if isinstance(value, torch.Tensor):
        key = f"{prefix}.{len(tensors)}"
        tensors[key] = value.detach()
        return {"__tensor__": key, "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape)}
    if isinstance(value, (bytes, bytearray)):
        return {"__bytes__": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", prefix, tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]", prefix, tensors)
                              for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not any(t in value for t in _TAGS):
            return {k: _encode(v, f"{where}[{k!r}]", prefix, tensors) for k, v in value.items()}
        return {"__dict__": [[_encode(k, f"{where} key {k!r}", prefix, tensors),
                              _encode(v, f"{where}[{k!r}]", prefix, tensors)]
                             for k, v in value.items()]}
    raise TypeError(f"{where}: a value of type {type(value).__name__} cannot be saved "
                    f"(JSON values, tuples, bytes, tensors and dicts/lists of them, or "
                    f"an object with state_dict()/load_state_dict())")


def walk_tensors(value: Any, where: str, found: dict[str, torch.Tensor], depth: int = 0) -> None:
    """Empty tensors for the tensor references in an encoded value (DCP loads
    into them); raises ValueError on a malformed reference or a value nested
    deeper than a checkpoint's plain values may be."""
    if depth > MAX_PLAIN_DEPTH:
        raise ValueError(f"{where} is nested more than {MAX_PLAIN_DEPTH} levels deep: refused")
    if isinstance(value, list):
        for i, v in enumerate(value):
            walk_tensors(v, f"{where}[{i}]" if depth < 8 else where, found, depth + 1)
    elif isinstance(value, dict):
        if "__tensor__" in value:
            dtype = getattr(torch, str(value.get("dtype")), None)
            shape = value.get("shape")
            if (not isinstance(value["__tensor__"], str) or not isinstance(dtype, torch.dtype)
                    or not isinstance(shape, list)
                    or not all(isinstance(s, int) and s >= 0 for s in shape)):
                raise ValueError(f"{where}: malformed tensor entry {value!r}")
            found[value["__tensor__"]] = torch.empty(shape, dtype=dtype)
        else:
            for k, v in value.items():
                walk_tensors(v, f"{where}[{k!r}]" if depth < 8 else where, found, depth + 1)


def decode(value: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    if isinstance(value, list):
        return [decode(v, tensors) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        return tensors[value["__tensor__"]]
    if "__tuple__" in value:
        return tuple(decode(v, tensors) for v in value["__tuple__"])
    if "__bytes__" in value:
        return base64.b64decode(value["__bytes__"])
    if "__dict__" in value:
        return {decode(k, tensors): decode(v, tensors) for k, v in value["__dict__"]}
    return {k: decode(v, tensors) for k, v in value.items()}


def encode_extra(values: Mapping[str, Any] | None, where: str, prefix: str,
                  tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """{name: {"state_dict": ...}} for a Stateful, {name: {"value": ...}} otherwise."""
    out: dict[str, Any] = {}
    for name, value in (values or {}).items():
        if not isinstance(name, str):
            raise TypeError(f"{where} names must be strings, not {name!r}")
        at = f"{where}[{name!r}]"
        if is_stateful(value):
            out[name] = {"state_dict": _encode(value.state_dict(), f"{at}.state_dict()",
                                               f"{prefix}.{name}", tensors)}
        else:
            out[name] = {"value": _encode(value, at, f"{prefix}.{name}", tensors)}
    return out
