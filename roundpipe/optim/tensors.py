"""Tensor facts every layer above the spec reads: the floor that the step plan, the masters
and the backends import, so that none of them imports another for them.

* DTensor detection (``is_dtensor``, ``dtensor_types``) and the tensors a backend steps
  (``local``: a DTensor's local shard; ``real``: detached, complex as ``view_as_real``);
* the validated column (``Checked``) and ``contiguous_run`` (tensors that tile one buffer).
"""

from __future__ import annotations

import sys

import torch

# the 16-bit dtypes a step takes as they are (stepped in their own precision or widened), and the
# partners' of fp32 masters: written here once
LOW_PRECISION = (torch.bfloat16, torch.float16)

# the tensor types a step reads without unwrapping (a subclass may be a wrapper: refused)
PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)

# DTensor is looked up only once torch.distributed.tensor has been imported (by the user, or
# FSDP2): importing it here would slow ``import roundpipe.optim`` down (docs/step-plan.md), and
# no DTensor can exist before it is imported.
_DTENSOR_MODULE = "torch.distributed.tensor"


def dtensor_types():
    """``(DTensor, Replicate, Shard)``, or None while ``torch.distributed.tensor`` is not loaded."""
    mod = sys.modules.get(_DTENSOR_MODULE)
    if mod is None:
        return None
    return mod.DTensor, mod.Replicate, mod.Shard


def is_dtensor(t) -> bool:
    types = dtensor_types()
    return types is not None and isinstance(t, types[0])


def local(t):
    """The tensor a backend steps: a DTensor's local shard, else the tensor itself."""
    return t._local_tensor if is_dtensor(t) else t


def real(t):
    """The real float32 alias a backend steps: detached (torch's foreach copies are much slower
    on tensors that require grad), complex64 tensors as ``view_as_real``."""
    t = local(t).detach()
    return torch.view_as_real(t) if t.is_complex() else t


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
