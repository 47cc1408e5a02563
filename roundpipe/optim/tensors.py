"""Tensor facts every layer above the spec reads: the floor that the step plan, the masters
and the backends import, so that none of them imports another for them."""

from __future__ import annotations


class Checked(list):
    """A column the step plan has validated (contiguous float32 CPU tensors of the parameters'
    sizes): a backend need not check it again."""

    __slots__ = ()


def contiguous_run(tensors):
    """The 1-D tensor that ``tensors`` (contiguous, in this order, in one storage) tile
    exactly, or None. Works on detached aliases too (they have no ``_base``)."""
    if not tensors:
        return None
    first = tensors[0]
    storage = first.untyped_storage().data_ptr()
    dtype = first.dtype
    pos = start = first.storage_offset()
    for t in tensors:
        if (
            t.storage_offset() != pos
            or t.dtype != dtype
            or not t.is_contiguous()
            or t.untyped_storage().data_ptr() != storage
        ):
            return None
        pos += t.numel()
    if pos * first.element_size() > first.untyped_storage().nbytes():
        return None
    return first.as_strided((pos - start,), (1,), start)
