"""Packed documents: token sequences packed into microbatches up to a token budget.

Pre-training and fine-tuning data are documents of many lengths; padding each
to the longest wastes the compute of the padding. :func:`pack` puts whole
documents one after another into rows of at most ``tokens_per_microbatch``
tokens (first fit, in order), and gives per row what a model needs so that
no document sees another:

- ``input_ids``: the tokens, ``pad_id`` after the last document;
- ``labels``: each token's next token within its document, -100 at each
  document's last token and on padding (cross entropy's ``ignore_index``);
- ``position_ids``: restarting at 0 for every document;
- ``document_ids``: the document's index within its row, -1 on padding;
- ``cu_seqlens``: the documents' cumulative lengths (``[0, l0, l0 + l1, ...]``).

Everything but ``cu_seqlens`` has one entry per token, so a batch of rows
(:meth:`Packed.batch`) splits into microbatches along dim 0 like any batch
tensor and each stage that reads them gets its rows' own: the document
boundaries travel as ``document_ids``, never as a flattened ``cu_seqlens``
that a split along dim 0 would cut apart. :func:`document_mask` turns them
into the block-diagonal causal mask scaled dot-product attention takes.
With a token-weighted loss (``loss_fn`` returning ``(sum, count)``: NOTE
[Token-weighted losses] in training.py) the step's loss and gradients are
those of the documents run one by one.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import torch

__all__ = ["Packed", "pack", "document_mask"]


@dataclasses.dataclass(frozen=True)
class Packed:
    """Packed rows, one list entry per row (see the module docstring)."""

    input_ids: list[torch.Tensor]
    labels: list[torch.Tensor]
    position_ids: list[torch.Tensor]
    document_ids: list[torch.Tensor]
    cu_seqlens: list[torch.Tensor]
    pad_id: int

    def __post_init__(self) -> None:
        """Every row's fields agree: one entry per token each, and the document
        boundaries (``cu_seqlens``) add up to the row's documents (ValueError
        naming the row and the values)."""
        fields = ("input_ids", "labels", "position_ids", "document_ids", "cu_seqlens")
        counts = {name: len(getattr(self, name)) for name in fields}
        if len(set(counts.values())) != 1:
            raise ValueError(f"packed fields have different row counts: {counts}")
        for k in range(len(self.input_ids)):
            length = len(self.input_ids[k])
            for name in fields[1:4]:
                if len(getattr(self, name)[k]) != length:
                    raise ValueError(f"row {k}: {name} has {len(getattr(self, name)[k])} "
                                     f"entries, input_ids {length}")
            bounds = [int(b) for b in self.cu_seqlens[k]]
            if (not bounds or bounds[0] != 0 or any(b <= a for a, b in zip(bounds, bounds[1:]))
                    or bounds[-1] > length):
                raise ValueError(f"row {k}: cu_seqlens {bounds} must rise from 0 by each "
                                 f"document's length to at most the row's {length} tokens")
            want = torch.full((length,), -1, dtype=torch.long)
            for doc, (a, b) in enumerate(zip(bounds, bounds[1:])):
                want[a:b] = doc
            if not torch.equal(self.document_ids[k].long(), want):
                raise ValueError(f"row {k}: document_ids do not follow cu_seqlens {bounds} "
                                 "(document i on tokens cu_seqlens[i] to cu_seqlens[i+1], -1 "
                                 "on padding)")

    def __len__(self) -> int:
        return len(self.input_ids)

    def microbatches(self, rows_per_microbatch: int = 1,
                     keys: Sequence[str] = ("position_ids", "document_ids")
                     ) -> tuple[list[tuple[tuple, dict]], list[torch.Tensor]]:
        """The rows as explicit microbatches (``Pipeline.step(microbatches=,
        targets=)``): ``rows_per_microbatch`` rows each, padded to their own
        longest, ``input_ids`` the positional argument, the fields named in
        ``keys`` keyword arguments, and ``labels`` the targets. Each
        microbatch keeps its own length: no row is padded to the batch's
        longest (pass ``dynamic=True`` to the pipeline)."""
        if isinstance(rows_per_microbatch, bool) or not isinstance(rows_per_microbatch, int) \
                or rows_per_microbatch < 1:
            raise ValueError(f"rows_per_microbatch={rows_per_microbatch!r} must be a positive int")
        unknown = [k for k in keys if k not in ("labels", "position_ids", "document_ids")]
        if unknown:
            raise ValueError(f"keys {unknown} are not per-token fields of a packed row "
                             "(position_ids, document_ids, labels)")
        mbs, targets = [], []
        for start in range(0, len(self), rows_per_microbatch):
            part = Packed(*(getattr(self, f.name)[start:start + rows_per_microbatch]
                            for f in dataclasses.fields(self) if f.name != "pad_id"),
                          pad_id=self.pad_id)
            rows = part.batch()
            mbs.append(((rows["input_ids"],), {k: rows[k] for k in keys}))
            targets.append(rows["labels"])
        return mbs, targets

    def batch(self, length: int | None = None) -> dict[str, torch.Tensor]:
        """The rows stacked into ``(rows, length)`` tensors (default length: the
        longest row), padded as :func:`pack` pads: ``input_ids``, ``labels``,
        ``position_ids``, ``document_ids``."""
        longest = max((len(r) for r in self.input_ids), default=0)
        length = longest if length is None else length
        if length < longest:
            raise ValueError(f"length={length} is shorter than the longest packed row "
                             f"({longest} tokens)")
        fills = {"input_ids": self.pad_id, "labels": -100, "position_ids": 0,
                 "document_ids": -1}
        return {name: torch.stack([_padded(row, length, fill)
                                   for row in getattr(self, name)])
                for name, fill in fills.items()}


def _padded(row: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    return torch.cat([row, row.new_full((length - len(row),), fill)])


def _what(value: Any) -> str:
    """``value`` as an error names it: its type, and its value when short."""
    if value is None:
        return "None"
    if isinstance(value, torch.Tensor):
        return f"a tensor of dtype {value.dtype} and shape {tuple(value.shape)}"
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype == torch.bool or dtype.is_floating_point or dtype.is_complex)


def _token_ids(i: int, doc: Any) -> torch.Tensor:
    """Document ``i``'s token ids as a 1-D long tensor. Only integers are
    ids: a float (1.5 would become 1), a bool, a string or None is a
    ValueError naming the document and the value, never converted."""
    if hasattr(doc, "dtype") and hasattr(doc, "shape") and not isinstance(doc, torch.Tensor):
        doc = torch.as_tensor(doc)  # a numpy array: checked by its dtype below
    if isinstance(doc, torch.Tensor):
        if not _integer(doc.dtype):
            raise ValueError(f"document {i} is {_what(doc)}; token ids must be integers: pass "
                             "an integer tensor (e.g. .long(), if its values are whole ids)")
        return doc.to(torch.long).reshape(-1)
    if doc is None or isinstance(doc, (str, bytes)) or not isinstance(doc, Sequence):
        raise ValueError(f"document {i} is {_what(doc)}; each document is a 1-D integer "
                         "tensor or a list of int token ids")
    if set(map(type, doc)) <= {int}:  # the common case, at C speed (1M ids: +20 ms)
        return torch.tensor(doc, dtype=torch.long)
    for j, v in enumerate(doc):
        # ints and numpy ints (anything with __index__), never bool: True is no token id
        if isinstance(v, bool) or not hasattr(type(v), "__index__") or \
                isinstance(v, torch.Tensor) and (v.dim() or not _integer(v.dtype)):
            raise ValueError(f"document {i}, token {j} is {_what(v)}; token ids must be ints")
    return torch.tensor([operator.index(v) for v in doc], dtype=torch.long)


def pack(sequences: Sequence[Any], *, tokens_per_microbatch: int,
         pad_to_multiple: int | None = None, pad_id: int = 0) -> Packed:
    """Pack ``sequences`` (1-D integer tensors or lists of token ids) into rows
    of at most ``tokens_per_microbatch`` tokens, whole documents only, first
    fit in the given order; each row is padded to a multiple of
    ``pad_to_multiple`` when given (fewer distinct shapes for static-shape
    programs; the budget must be a multiple of it). A ValueError names a
    document that is empty, longer than the budget, or not of integer token
    ids (a float, bool or string, named with its index and value: a float id
    is never truncated), and a budget that is no multiple of
    ``pad_to_multiple``."""
    if isinstance(tokens_per_microbatch, bool) or not isinstance(tokens_per_microbatch, int) \
            or tokens_per_microbatch < 1:
        raise ValueError(f"tokens_per_microbatch={tokens_per_microbatch!r} must be a positive int")
    multiple = pad_to_multiple
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or
                                 not 1 <= multiple <= tokens_per_microbatch):
        raise ValueError(f"pad_to_multiple={multiple!r} must be None or an int from 1 to "
                         f"tokens_per_microbatch={tokens_per_microbatch}")
    if multiple is not None and tokens_per_microbatch % multiple:
        raise ValueError(f"tokens_per_microbatch={tokens_per_microbatch} is not a multiple of "
                         f"pad_to_multiple={multiple}: a full row could not be padded to a "
                         "multiple within the budget; use a budget of "
                         f"{tokens_per_microbatch // multiple * multiple} or "
                         f"{-(-tokens_per_microbatch // multiple) * multiple}")
    # A 1-D tensor would iterate as one-token documents, a string as characters.
    if not isinstance(sequences, Iterable) or \
            isinstance(sequences, (str, bytes)) or \
            isinstance(sequences, torch.Tensor) and sequences.dim() != 2:
        raise ValueError(f"sequences must be a list of documents (1-D integer tensors or lists "
                         f"of int token ids), got {_what(sequences)}")
    docs = [_token_ids(i, s) for i, s in enumerate(sequences)]
    for i, d in enumerate(docs):
        if len(d) == 0:
            raise ValueError(f"document {i} is empty")
        if len(d) > tokens_per_microbatch:
            raise ValueError(f"document {i} has {len(d)} tokens, more than "
                             f"tokens_per_microbatch={tokens_per_microbatch}; split it first")
    rows: list[list[torch.Tensor]] = []
    used: list[int] = []
    for d in docs:  # first fit: the first row with room
        for r, n in enumerate(used):
            if n + len(d) <= tokens_per_microbatch:
                rows[r].append(d)
                used[r] += len(d)
                break
        else:
            rows.append([d])
            used.append(len(d))
    out: dict[str, list[torch.Tensor]] = {k: [] for k in
                                          ("input_ids", "labels", "position_ids",
                                           "document_ids", "cu_seqlens")}
    for row in rows:
        lengths = [len(d) for d in row]
        n = sum(lengths)
        # Within the budget: n <= tokens_per_microbatch, a multiple of pad_to_multiple.
        size = n if multiple is None else -(-n // multiple) * multiple
        ids = torch.cat(row)
        labels = torch.cat([torch.cat([d[1:], d.new_full((1,), -100)]) for d in row])
        positions = torch.cat([torch.arange(len(d)) for d in row])
        documents = torch.cat([torch.full((len(d),), i, dtype=torch.long)
                               for i, d in enumerate(row)])
        out["input_ids"].append(_padded(ids, size, pad_id))
        out["labels"].append(_padded(labels, size, -100))
        out["position_ids"].append(_padded(positions, size, 0))
        out["document_ids"].append(_padded(documents, size, -1))
        out["cu_seqlens"].append(torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                              dtype=torch.int32))
    return Packed(**out, pad_id=pad_id)


def document_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """The attention mask of packed rows: ``(batch, 1, T, T)``, True where
    query ``i`` may attend key ``j``: the same document and ``j <= i``
    (padding, document -1, attends padding before it, so no row is empty).
    For ``F.scaled_dot_product_attention(q, k, v, attn_mask=...)``."""
    same = document_ids[:, :, None] == document_ids[:, None, :]
    t = document_ids.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=document_ids.device).tril()
    return (same & causal)[:, None]
