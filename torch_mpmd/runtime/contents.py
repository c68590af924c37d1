"""What the ranks of one pipeline compare of a call's microbatches: a digest
of their count, sizes and value labels (:func:`microbatch_digest`) and an
exact digest of every input's and target's contents
(:func:`microbatch_contents`; NOTE [Microbatch contents])."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["microbatch_digest", "microbatch_contents", "as_int64"]


def microbatch_digest(count: int, sizes: Sequence[tuple[int, ...]],
                       labels: Sequence[str] = ()) -> int:
    """A digest of a call's microbatch count, sizes and value labels
    (microbatch_contents; nonzero), which the ranks of one pipeline compare in
    the call's begin exchange: ranks given different microbatches stop there,
    before any transfer."""
    h = hashlib.sha256(repr((count, [tuple(k) for k in sizes], list(labels))).encode()).digest()
    return as_int64(int.from_bytes(h[:8], "little")) or 1


# NOTE [Microbatch contents]: the ranks of one pipeline must be given the same
# microbatches, contents included (rank 0 reads the inputs, the last rank the
# targets: different batches would train on rank 0's inputs with the last
# rank's targets, silently). Each call's begin exchange therefore carries a
# digest of every input and target value of every microbatch, exact (every
# byte counts; a strided sample could miss a difference): a CPU tensor's
# bytes go through BLAKE2b (read in place, no copy); a tensor on another
# device is reduced there (_device_digest) and two int64 come to the host.
# Non-tensor values count by their repr where it is a value's (numbers,
# strings, None, containers of them), else by their type name (an object's
# default repr holds its address, which differs by process). Measured in
# BENCHMARKS.md ("The microbatch digest").
_PLAIN = (int, float, complex, str, bytes, bool, type(None))
_READ_IN_PLACE = ("cpu",)  # device types whose tensors' bytes BLAKE2b reads itself


def _device_sums(flat: torch.Tensor) -> torch.Tensor:
    """An exact digest of a 1-D uint8 tensor's bytes, computed on its device:
    the bytes as 32-bit words (sign-extended to int64, so no bit of a word
    reaches a product's top bit alone) times two position-derived odd
    pseudo-random int64 sequences, each summed with int64 wraparound. A
    change of any word changes each sum unless the changes cancel in both
    (one word: never, an odd multiplier is invertible mod 2**64). Returns
    the two sums (int64, on the device)."""
    if flat.numel() % 4:
        words = flat.to(torch.int64)
    else:
        words = flat.view(torch.int32).to(torch.int64)
    i = torch.arange(words.numel(), dtype=torch.int64, device=flat.device)
    sums = []
    for mult, add in ((-7046029254386353131, 1442695040888963407),     # (splitmix-style
                      (-4658895280553007687, -7723592293110705685)):  #  constants)
        r = i * mult + add
        r = r ^ ((r >> 31) & 0x1FFFFFFFF)  # logical shift: the top bits mix down
        sums.append(((r | 1) * words).sum())
    return torch.stack(sums)


def _device_digest(flat: torch.Tensor) -> bytes:
    """:func:`_device_sums` as bytes (one transfer to the host)."""
    return struct.pack("<2q", *_device_sums(flat).tolist())


def _value_parts(value: Any, parts: list[Any]) -> None:
    """What the digest of ``value`` (a tensor, a plain value, or a list,
    tuple or dict tree of them) reads, in order, into ``parts``: bytes, and
    for a tensor off the CPU its two device sums, read back later, all of a
    call's at once (NOTE [Microbatch contents])."""
    if isinstance(value, torch.Tensor):
        t = value.to_local() if hasattr(value, "to_local") else value  # a DTensor's shard
        parts.append(repr((str(t.dtype), tuple(t.shape), str(t.layout))).encode())
        if t.layout != torch.strided or t.device.type == "meta":
            return  # (no bytes to read: sparse layouts, meta tensors count by their shape)
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        parts.append(memoryview(flat.numpy()) if flat.device.type in _READ_IN_PLACE
                     else _device_sums(flat))
    elif isinstance(value, (list, tuple)):
        parts.append(f"{type(value).__name__}[{len(value)}]".encode())
        for v in value:
            _value_parts(v, parts)
    elif isinstance(value, dict):
        parts.append(f"dict[{len(value)}]".encode())
        for k, v in value.items():
            parts.append(repr(k).encode() if isinstance(k, _PLAIN) else b"?")
            _value_parts(v, parts)
    elif isinstance(value, _PLAIN):
        parts.append(repr(value).encode())
    else:
        parts.append(type(value).__qualname__.encode())


def microbatch_contents(inputs: Sequence[Mapping[str, Any]], targets: Sequence[Any]
                        ) -> tuple[int, list[str], list[int]]:
    """(digest of everything, each value's label, each value's digest) for a
    call's microbatches: per microbatch its named inputs, then its target
    (NOTE [Microbatch contents]). The labels name the value in an error."""
    labels, values = [], []
    for mb, named in enumerate(inputs):
        target = targets[mb] if mb < len(targets) else None
        for label, value in [*((f"input {name!r}", v) for name, v in named.items()),
                             ("target", target)]:
            parts: list[Any] = []
            _value_parts(value, parts)
            labels.append(f"microbatch {mb}, {label}")
            values.append(parts)
    # The device sums: one transfer per device for the whole call.
    on_device: dict[torch.device, list[torch.Tensor]] = {}
    for parts in values:
        for p in parts:
            if isinstance(p, torch.Tensor):
                on_device.setdefault(p.device, []).append(p)
    host = {id(t): struct.pack("<2q", *pair)
            for ts in on_device.values() for t, pair in zip(ts, torch.stack(ts).tolist())}
    digests = []
    whole = hashlib.blake2b(digest_size=8)
    for parts in values:
        h = hashlib.blake2b(digest_size=8)
        for p in parts:
            h.update(host[id(p)] if isinstance(p, torch.Tensor) else p)
        d = h.digest()
        whole.update(d)
        digests.append(as_int64(int.from_bytes(d, "little")))
    return as_int64(int.from_bytes(whole.digest(), "little")) or 1, labels, digests


def as_int64(x: int) -> int:
    """``x`` (mod 2**64) as the signed int64 a lockstep record carries."""
    x &= 0xFFFFFFFFFFFFFFFF
    return x - (1 << 64) if x >= 1 << 63 else x
