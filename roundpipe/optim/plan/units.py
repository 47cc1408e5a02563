"""Units: the parameters of one group whose 0-d state (``step``, ...), init flags and pairing
are equal, so that the spec's ``scalars`` runs once per unit, not once per parameter; and the
bucketing of a group's parameters into units."""

from __future__ import annotations

import torch

from ..spec.core import Scratch
from ..spec.modes import StepMode
from ..tensors import contiguous_run, real

# a unit's pairing (masters.py): (its gradients' dtype, its partners' dtype or None)
NO_PAIRING = (torch.float32, None)

# torch's count of the references to a storage (tensors and storage objects); without it (an
# older torch) the 0-d state is always read and written tensor by tensor
_storage_use_count = getattr(torch._C, "_storage_Use_Count", None)


def _uses(t) -> int:
    return _storage_use_count(t.untyped_storage()._cdata)


class Unit:
    """Parameters of one group whose 0-d state, init flags, pairing, dtype and state dtypes are
    equal: one ``scalars`` call, and one launch's worth of tensors of one dtype each (a bfloat16
    or float16 parameter's ops round to its dtype: its launch is not a float32 one's). ``storage``:
    its program's (``modes.StepMode``): TORCH or, stepped widened (``storage.py``), WIDENED or
    STOCHASTIC."""

    # No reference back to the GroupPlan: a plan holds no reference cycle, so a replaced plan
    # is freed at once (its views of the flat buffers would otherwise skew ``scalar_uses``).
    __slots__ = (
        "positions",
        "single_member",
        "covers_group",
        "flags",
        "pairing",
        "dtype",
        "scalar_columns",
        "scalar_heads",
        "scalar_flat",
        "scalar_uses",
        "columns",
        "state_dtypes",
        "storage",
    )

    def __init__(self, group_plan, positions, flags, pairing=NO_PAIRING, dtype=torch.float32, *more):
        self.positions = positions  # indices into group_plan.params
        # (plain bools in the unit's own slots: a step reads these instead of the lists)
        self.single_member = len(positions) < 2  # uniform by definition
        self.covers_group = len(positions) == len(group_plan.params)  # every stepped one of its group
        self.flags = flags
        # (the gradients' dtype, the partners' dtype or None): one kind of pairing per unit
        self.pairing = pairing
        self.dtype = dtype  # the parameters' dtype (complex64: float32, as a backend steps it)
        # the dtype of each input state tensor (in inputs' order), and ``storage``
        self.state_dtypes, self.storage = more if more else ((), "")
        states = [group_plan.states[i] for i in positions]
        self.scalar_columns = {n: [st[n] for st in states] for n in group_plan.scalar_names}
        # each name's first member, whose value the step's scalars start from (all are equal)
        self.scalar_heads = tuple((n, c[0]) for n, c in self.scalar_columns.items())
        # 0-d state created in one buffer (adopt_flat_state) is checked and written in one op
        # each (one member's is written as itself: nothing to gain, and no storage to watch)
        self.scalar_flat = {
            n: contiguous_run(c) if _storage_use_count is not None and len(c) > 1 else None
            for n, c in self.scalar_columns.items()
        }
        # how many tensors share each flat buffer's storage, as the last write left it (None:
        # not written yet): a member moved to other storage (``.data =``, ``.set_()``) lowers
        # it, and the step rebuilds the plan instead of writing the buffer that no longer
        # holds that member (an O(1) check per buffer)
        self.scalar_uses = {n: None for n, f in self.scalar_flat.items() if f is not None}
        self.columns = {"param": [group_plan.reals[i] for i in positions]}
        for name in group_plan.inputs:
            self.columns[name] = [real(st[name]) for st in states]
        if pairing[1] is not None:
            self.columns["partner"] = [group_plan.partners[i] for i in positions]
        if (
            self.storage == StepMode.STOCHASTIC
        ):  # (not a tensor column: each parameter's id, for its random bits)
            self.columns["sr_ids"] = tuple(group_plan.pids[i] for i in positions)

    def uniform(self) -> bool:
        """Whether the members' 0-d state (``step``, ...) still holds one value per name, in
        the storage the plan writes."""
        if self.single_member:  # (its 0-d state is written as itself: see scalar_flat)
            return True
        for n, uses in self.scalar_uses.items():
            if uses is not None and _uses(self.scalar_flat[n]) != uses:
                return False
        if len(self.positions) < 2:
            return True
        for n, col in self.scalar_columns.items():
            flat = self.scalar_flat[n]
            if flat is not None:
                if not bool((flat == flat[0]).all()):
                    return False
            elif not uniform_column(col):
                return False
        return True

    def write(self, scratch: dict):
        """Set every member's 0-d state to the step's new values (``scratch``)."""
        if self.single_member:  # (fewer objects to read: see scalar_heads)
            for n, t in self.scalar_heads:
                new = scratch[n]
                if type(new) is Scratch:
                    t.fill_(new.value)
                else:
                    t.copy_(new)
            return
        for n, col in self.scalar_columns.items():
            flat = self.scalar_flat[n]
            new = scratch[n]
            if type(new) is Scratch:
                if flat is None:
                    for t in col:
                        t.fill_(new.value)
                    continue
                new = new.value
            if flat is not None:
                flat.fill_(new)
                self.scalar_uses[n] = _uses(flat)
            else:
                torch._foreach_copy_(col, [scratch[n]] * len(col))


def bucket_units(gp, init_flags):
    """The units of the GroupPlan ``gp``: one when every parameter agrees (the common case,
    checked without a per-parameter key), else one per distinct (flags, 0-d state, pairing)."""
    names = gp.scalar_names
    states = gp.states
    n = len(gp.params)
    pairings = _pairings(gp)
    dtypes = [_step_dtype(d) for d in gp.dtypes]
    state_dtypes = [tuple(st[m].dtype for m in gp.inputs) for st in states]
    kinds = [_storage(gp.storage, d) for d in gp.dtypes]
    if (
        n
        and all(f == init_flags[0] for f in init_flags)
        and all(k == pairings[0] for k in pairings)
        and all(d is dtypes[0] for d in dtypes)
        and all(d == state_dtypes[0] for d in state_dtypes)
        and all(k == kinds[0] for k in kinds)
        and _uniform(states, names)
    ):
        return [Unit(gp, list(range(n)), init_flags[0], pairings[0], dtypes[0], state_dtypes[0], kinds[0])]
    buckets: dict = {}
    for i, (st, flags) in enumerate(zip(states, init_flags, strict=True)):
        scalars = tuple((st[m].item(), st[m].dtype) for m in names)
        key = (tuple(sorted(flags.items())), scalars, pairings[i], dtypes[i], state_dtypes[i], kinds[i])
        buckets.setdefault(key, []).append(i)
    return [Unit(gp, pos, dict(key[0]), *key[2:]) for key, pos in buckets.items()]


def _storage(storage, dtype) -> StepMode:
    """The ``Program.storage`` a parameter of ``dtype`` is stepped with (``storage.py``)."""
    if storage is None or not storage.widened(dtype):
        return StepMode.TORCH
    return StepMode.STOCHASTIC if storage.stochastic else StepMode.WIDENED


def _step_dtype(dtype):
    """The dtype a backend steps a parameter of ``dtype`` in (a complex64's real view: float32)."""
    return torch.float32 if dtype is torch.complex64 else dtype


def _pairings(gp):
    if gp.partners is None:
        return [NO_PAIRING] * len(gp.params)
    return [
        (q.dtype if from_partner else torch.float32, None if q is None else q.dtype)
        for q, from_partner in zip(gp.partners, gp.grad_from_partner, strict=True)
    ]


def _uniform(states, names) -> bool:
    """True when every state holds the same values and dtypes in its 0-d entries ``names``."""
    for n in names:
        col = [st[n] for st in states]
        if not uniform_column(col):
            return False
    return True


def uniform_column(col) -> bool:
    if len(col) < 2:
        return True
    dtype = col[0].dtype
    if any(t.dtype != dtype for t in col):
        return False
    stacked = torch.stack(col)
    return bool((stacked == stacked[0]).all())
