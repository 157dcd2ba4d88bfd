"""Compressed synchronisation: what a machine sends is its round's change, encoded.

With ``PeriodicAverager(..., compression=...)`` every averaged tensor (parameters, the optimizer's
declared state such as SLowcal-SGD's w, floating buffers) travels as its change since the round's
start, the *anchor* every machine holds after the last synchronisation: machine i sends
``encode(delta_i)`` with ``delta_i = value_i - anchor`` (plus its error feedback, below), and every
machine ends the round at ``anchor + reduce(delta)``. The absolute values never travel. A tensor
without an anchor yet (the first synchronisation, or optimizer state that appeared since) is averaged
exactly and gets one; so is every tensor when ``compression=None`` (today's average, bit for bit).

The reduce is the two-stage scheme (torchft's for DiLoCo), the same on every path and for any number
of processes P:

1. every machine encodes its change, block by block;
2. an all-to-all gives process j every machine's codes for its chunk j of the blocks (every tensor's
   blocks split into P nearly equal runs, chunk j the round's tensors' j-th runs: a block's process
   depends on its tensor and P alone, not on the other tensors of the round);
3. process j decodes them and sums the changes in the accumulation dtype (float32; float64 for
   float64 tensors), in machine order, then divides by M (under partial participation: sums the S
   participants' and divides by S);
4. with ``Compressor.second_stage``, process j encodes that mean again (its own error feedback
   added); an all-to-all of each chunk to every process (an all-gather) then gives every machine
   every chunk, decoded; without it, the mean travels in the accumulation dtype.

Blocks are ``block_size`` consecutive values of one tensor (a tensor's last block may be shorter;
no block spans two tensors), so a tensor's result depends neither on the other tensors averaged with
it nor on P: a simulated run, a run on several processes and a trial stacked with others agree bit
for bit. One machine sends ``(P - 1) / P`` of its codes in step 2 and ``(P - 1) / P`` of the mean's
in step 4, per byte as the ring all-reduce's ``2 (P - 1) / P`` when both stages have the same size;
``PeriodicAverager.link_counts`` counts these bytes (codes and scales, no padding) and the ring's
``2 (P - 1)`` latencies.

*Error feedback* (``error_feedback=True``, the default for a lossy compressor): each machine keeps,
per tensor, what its encoded message lost (``delta_i + e_i - decode(encode(delta_i + e_i))``) and adds
it to its next change; the owner of a chunk does the same for its second-stage encoding. What the
rounds applied then stays within the last round's quanta of the sum of the true changes instead of
drifting. The buffers, and the anchors, travel in ``PeriodicAverager.state_dict()``; a machine that
does not take part in a round keeps its buffer.

The compressors
---------------
``"bf16"`` (``BFloat16``): the changes travel as bfloat16 and are summed in float32; the mean
travels back in float32 (no second encoding): the result is exactly
``anchor + mean_i(bf16(delta_i + e_i))``.

``"int8"`` (``Int8``): per block one float32 scale ``max |v| / 127`` (a block whose max is 0 is sent
as zeros with scale 0), the values ``round(v / scale)`` (half to even) clamped to [-127, 127]; the
mean is encoded the same way for the second stage. A float32 tensor then travels at a quarter of
its bytes plus 4 bytes a block.

``"int4"``, ``"int2"`` (``Int4``, ``Int2``): int8's code with ``L = 2^(bits-1) - 1`` levels a side (7; 1: the
codes -1, 0, 1, symmetric, zero exact), scale ``max |v| / L``, packed two and four to a byte (``_packing.pack``):
the packed bytes travel in both stages, ``ceil(values x bits / 8)`` a block and its scale.

Another block compressor is a subclass of ``Compressor`` (``encode``, ``decode``, ``second_stage``,
``block_size``, ``code_width``), passed as the ``compression`` argument itself.

Any other code: ``Code``
------------------------
A ``Code`` sees one machine's whole change of one tensor (flat, in the accumulation dtype) and
chooses what travels: ``encode(change) -> message`` (any picklable value: tensors of indices and
values, a low-rank pair, ...), ``decode(message, numel, dtype) -> Tensor`` and
``message_bytes(numel, dtype)``, the bytes its message has (what ``bytes_communicated`` counts). Every
participant's messages reach every process (an all-gather of the pickled messages); ``reduce(messages,
numel, dtype)`` turns the participants' messages, in machine order, into their mean change: by
default the sum of the decoded changes in machine order divided by S; a code may gather instead
(``TopK``-like codes: add each message's values at its indices). Every machine ends the round at
``anchor + reduce(...)``; error feedback is the same as above, for any lossy code: each machine keeps
``delta_i + e_i - decode(encode(delta_i + e_i))``. docs/communication.md ("A code of your own")
gives a sparse code written against this interface alone; ``TopK`` (``"topk:<fraction>[:<bits>]"``) is one
with packed indices and quantised values.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import torch
from torch import Tensor

from lit_slowcal import _packing
from lit_slowcal._validation import check_int, check_number, is_int

__all__ = ["BFloat16", "Code", "Compressor", "Int2", "Int4", "Int8", "TopK", "compressor"]


class Compressor:
    """How one machine's change travels: ``encode`` maps blocks of values to codes (and optionally one
    value per block), ``decode`` maps them back. Subclass it to plug another code.

    ``encode`` gets ``blocks`` of shape ``[..., n_blocks, block_size]`` in the accumulation dtype
    (float32, or float64), zero-padded past a tensor's last value (the padding is never sent, and its
    decoded values are ignored); it returns ``(codes, per_block)``: ``codes`` of shape ``[..., n_blocks,
    code_width(block_size)]`` in the dtype that travels, ``per_block`` of shape ``[..., n_blocks]`` or
    ``None``. ``decode(codes, per_block, dtype)`` returns the values in ``dtype``, of shape ``[...,
    n_blocks, block_size]``. Both act on each block alone (elementwise, or per block), so that the result
    does not depend on how blocks are grouped. ``code_width(values)``: the codes that carry a block's
    first ``values`` values (``values`` itself by default; packed codes fewer): what of a tensor's last,
    shorter block travels.
    """

    #: Values a block.
    block_size: int = 256
    #: Whether the mean of the decoded changes travels encoded too (else in the accumulation dtype).
    second_stage: bool = True
    #: Whether decoding loses information (error feedback is on by default when it does).
    lossy: bool = True
    #: The name the app and ``repr`` use.
    name: str = "compressor"

    def encode(self, blocks: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        raise NotImplementedError

    def decode(self, codes: Tensor, per_block: Optional[Tensor], dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def code_width(self, values: int) -> int:
        return values

    def __repr__(self) -> str:
        return f"{type(self).__name__}(block_size={self.block_size})"

    def __eq__(self, other: object) -> bool:  # the same code: the same class and settings
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), repr(self)))


class BFloat16(Compressor):
    """The changes as bfloat16 (round to nearest even), summed in float32; the mean travels in float32."""

    second_stage = False
    name = "bf16"

    def encode(self, blocks: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        return _packing.saturate(blocks, torch.bfloat16).to(torch.bfloat16), None

    def decode(self, codes: Tensor, per_block: Optional[Tensor], dtype: torch.dtype) -> Tensor:
        return codes.to(dtype)


class Int8(Compressor):
    """Per block, a float32 scale ``max |v| / 127`` and the values ``round(v / scale)`` as int8 in [-127, 127]."""

    name = "int8"

    def __init__(self, block_size: int = 256) -> None:
        self.block_size = check_int("block_size", block_size)

    def encode(self, blocks: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        return _packing.quantise(blocks, 127)

    def decode(self, codes: Tensor, per_block: Optional[Tensor], dtype: torch.dtype) -> Tensor:
        assert per_block is not None
        return codes.to(dtype).mul_(per_block.to(dtype).unsqueeze(-1))


class _Packed(Int8):
    """Per block, a float32 scale ``max |v| / L`` and the codes ``round(v / scale)`` in [-L, L], ``L = 2^(bits-1) - 1``,
    packed ``8 // bits`` to a byte."""

    bits = 8

    def encode(self, blocks: Tensor) -> tuple[Tensor, Optional[Tensor]]:
        codes, scale = _packing.quantise(blocks, (1 << (self.bits - 1)) - 1)
        return _packing.pack(codes, self.bits), scale

    def decode(self, codes: Tensor, per_block: Optional[Tensor], dtype: torch.dtype) -> Tensor:
        return super().decode(_packing.unpack(codes, self.bits, self.block_size), per_block, dtype)

    def code_width(self, values: int) -> int:
        return -(-values * self.bits // 8)


class Int4(_Packed):
    """Int8's code with 4 bits: the values ``round(v / scale)`` in [-7, 7], ``scale = max |v| / 7``, two to a byte."""

    name, bits = "int4", 4


class Int2(_Packed):
    """Int8's code with 2 bits: the values ``round(v / scale)`` in {-1, 0, 1}, ``scale = max |v|``, four to a byte."""

    name, bits = "int2", 2


class Code:
    """A code of one machine's whole change of one tensor (see the module docstring, "Any other code").

    ``encode(change)`` gets a 1-D tensor (the change plus its error feedback, in the accumulation dtype:
    float32, or float64 for float64 tensors) and returns the message; ``decode(message, numel, dtype)``
    returns the change the message stands for; ``message_bytes(numel, dtype)`` the bytes of a message of
    ``numel`` values, which every message of that size must have. ``reduce`` may be overridden.
    """

    #: Whether decoding loses information (error feedback is on by default when it does).
    lossy: bool = True
    #: The name ``repr`` and error messages use.
    name: str = "code"

    def encode(self, change: Tensor) -> Any:
        raise NotImplementedError

    def decode(self, message: Any, numel: int, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        raise NotImplementedError

    def reduce(self, messages: list[Any], numel: int, dtype: torch.dtype) -> Tensor:
        """The participants' mean change: their decoded changes summed in machine order, divided by their number."""
        total = self.decode(messages[0], numel, dtype).clone()
        for message in messages[1:]:
            total.add_(self.decode(message, numel, dtype))
        return total.div_(len(messages))

    def __repr__(self) -> str:  # its settings too: what the ranks compare (``AveragingOptions.agreement``)
        settings = ", ".join(f"{k}={v!r}" for k, v in sorted(vars(self).items()) if not k.startswith("_"))
        return f"{type(self).__name__}({settings})"

    def __eq__(self, other: object) -> bool:  # the same code: the same class and settings
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), repr(self)))


class TopK(Code):
    """Each machine's ``k = max(1, ceil(fraction * numel))`` largest changes of a tensor by magnitude: their indices
    (ascending, ``_packing.index_width(numel)`` bytes each) and values (``bits``: 32 float32, 16 bfloat16; 8, 4 or 2
    Int8's, Int4's or Int2's code with one float32 scale for the k values, packed). The reduce adds every message's
    values at its indices in machine order and divides by their number; error feedback keeps what was not sent."""

    name = "topk"

    def __init__(self, fraction: float, bits: int = 32) -> None:
        self.fraction = float(check_number("TopK fraction", fraction, maximum=1.0))
        if not is_int(bits) or bits not in _TOPK_BITS:
            raise ValueError(f"Invalid TopK bits: {bits!r} (one of {', '.join(map(str, _TOPK_BITS))})")
        self.bits = int(bits)

    def k(self, numel: int) -> int:
        """The values a message of a tensor of ``numel`` values carries."""
        return min(numel, max(1, math.ceil(self.fraction * numel)))

    def encode(self, change: Tensor) -> tuple[Tensor, ...]:
        top = torch.argsort(change.abs(), descending=True, stable=True)[: self.k(change.numel())]
        index = top.sort().values
        values = change[index]
        packed = _packing.pack_indices(index, _packing.index_width(change.numel()))
        if self.bits >= 16:  # float32 or bfloat16, a float64 value beyond their range saturated at it
            dtype = torch.float32 if self.bits == 32 else torch.bfloat16
            return packed, _packing.saturate(values, dtype).to(dtype)
        codes, scale = _packing.quantise(values, (1 << (self.bits - 1)) - 1)
        return packed, _packing.pack(codes, self.bits), scale.reshape(1)

    def _sparse(self, message: tuple[Tensor, ...], numel: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        index = _packing.unpack_indices(message[0], _packing.index_width(numel))
        if self.bits >= 16:
            return index, message[1].to(dtype)
        codes = _packing.unpack(message[1], self.bits, index.numel())
        return index, codes.to(dtype).mul_(message[2].to(dtype))

    def decode(self, message: tuple[Tensor, ...], numel: int, dtype: torch.dtype) -> Tensor:
        index, values = self._sparse(message, numel, dtype)
        return torch.zeros(numel, dtype=dtype, device=values.device).index_put_((index,), values)

    def message_bytes(self, numel: int, dtype: torch.dtype) -> int:
        k = self.k(numel)
        values = k * self.bits // 8 if self.bits >= 16 else -(-k * self.bits // 8) + 4
        return k * _packing.index_width(numel) + values

    def reduce(self, messages: list[Any], numel: int, dtype: torch.dtype) -> Tensor:
        """Every message's values added at its indices, in machine order, divided by their number."""
        total: Optional[Tensor] = None
        for message in messages:
            index, values = self._sparse(message, numel, dtype)
            if total is None:
                total = torch.zeros(numel, dtype=dtype, device=values.device)
            total.index_add_(0, index, values)
        assert total is not None
        return total.div_(len(messages))


_TOPK_BITS = (2, 4, 8, 16, 32)

#: The compressors the ``compression`` argument names.
NAMES = {"bf16": BFloat16, "int8": Int8, "int4": Int4, "int2": Int2}
#: The spelling of a ``TopK`` (``"topk:0.01:2"``: fraction 0.01, 2 bits; ``"topk:0.01"``: 32 bits).
TOPK_SPELLING = "topk:<fraction>[:<bits>]"


def _topk(spec: str) -> TopK:
    """The ``TopK`` ``"topk:<fraction>[:<bits>]"`` spells; one line if it spells none."""
    parts = spec.split(":")
    try:
        if len(parts) > 3:
            raise ValueError
        fraction, bits = float(parts[1]), int(parts[2]) if len(parts) == 3 else 32
    except (IndexError, ValueError):
        raise ValueError(f"Invalid compression: {spec!r} ({TOPK_SPELLING}, e.g. 'topk:0.01:2')") from None
    return TopK(fraction, bits)


def compressor(spec: Union[None, str, Compressor, Code]) -> Union[None, Compressor, Code]:
    """The code ``spec`` names: ``None`` (no compression), ``"bf16"``, ``"int8"``, ``"int4"``, ``"int2"``,
    ``"topk:<fraction>[:<bits>]"`` (``TopK``), a ``Compressor`` or a ``Code``."""
    if isinstance(spec, (Code, Compressor)):
        base, needed = (
            (Code, ("encode", "decode", "message_bytes"))
            if isinstance(spec, Code)
            else (Compressor, ("encode", "decode"))
        )
        missing = [name for name in needed if getattr(type(spec), name) is getattr(base, name)]
        if missing:
            raise ValueError(f"Invalid compression: {spec!r} (a {base.__name__} defines {', '.join(needed[:-1])} and {needed[-1]}; "
                             f"{', '.join(missing)} missing)")  # fmt: skip
        if isinstance(spec, Compressor):
            check_int("block_size", spec.block_size)
    if spec is None or isinstance(spec, (Compressor, Code)):
        return spec
    if isinstance(spec, str) and spec in NAMES:
        return NAMES[spec]()
    if isinstance(spec, str) and spec.startswith("topk:"):
        return _topk(spec)
    raise ValueError(
        f"Invalid compression: {spec!r} (None, one of {', '.join(map(repr, NAMES))}, {TOPK_SPELLING!r}, "
        "a lit_slowcal.compression.Compressor or a lit_slowcal.compression.Code)"
    )
