"""The optimizer classes' shared machinery: API, validation and the step loop.

Each ``roundpipe.optim`` class subclasses its ``torch.optim`` namesake and reuses its
``__init__``: the signature, defaults, hyperparameter checks, ``param_groups`` layout,
``__setstate__`` and ``state_dict`` are torch's own, so they match by construction. What this
module adds:

* a keyword-only ``backend=`` argument (and ``ROUNDPIPE_OPTIM_BACKEND``), not stored in
  ``defaults`` or ``param_groups``, so state dicts stay interchangeable with torch.optim;
* the contract's placeholders: ``foreach``/``fused`` are ignored with a warning,
  ``capturable=True``/``differentiable=True`` raise ``ValueError``;
* ``step()``: validates every parameter, gradient and state tensor the step needs *before*
  anything is modified, then runs the spec through the chosen backend.
"""

from __future__ import annotations

import inspect
import warnings

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import backends
from .spec.core import Options

SUPPORTED_DTYPES = (torch.float32, torch.complex64)
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_STRIDED = torch.strided


class RoundpipeOptimizer(torch.optim.Optimizer):
    """Base of the ``roundpipe.optim`` classes; subclasses set ``spec``."""

    spec = None  # an OptimizerSpec

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.spec is None:
            return
        torch_cls = cls.spec.torch_class
        if not issubclass(cls, torch_cls):
            raise TypeError(f"{cls.__name__} must subclass {torch_cls.__name__}")
        cls.__init__ = _make_init(cls, torch_cls)

    @property
    def backend(self) -> str:
        """The name of the backend this optimizer runs on."""
        return self._roundpipe_backend

    def __getstate__(self):
        state = super().__getstate__()
        state["_roundpipe_backend"] = self._roundpipe_backend
        return state

    def __setstate__(self, state):
        # torch's load_state_dict() calls this too, without the backend: keep ours then
        if "_roundpipe_backend" not in state and "_roundpipe_backend" not in self.__dict__:
            state = {**state, "_roundpipe_backend": backends.resolve(None)}
        super().__setstate__(state)

    def __repr__(self):
        return (
            super()
            .__repr__()
            .replace(f"{type(self).__name__} (", f"{type(self).__name__} (backend={self.backend!r},", 1)
        )

    @torch.no_grad()
    def step(self, closure=None):
        """Perform a single optimization step, as ``torch.optim``'s ``step`` does."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work, created = self._prepare()
        # Every group's scalars are computed on scratch copies of the 0-d state before any
        # tensor is written: a bad hyperparameter in a later group changes nothing.
        try:
            plans = []
            for gi, (group, options, params, states, init_flags) in enumerate(work):
                for plan in self._plan_group(gi, group, options, params, states, init_flags):
                    plans.append((gi, plan))
        except BaseException:
            _rollback(self.state, created)
            raise
        backend = backends.get(self._roundpipe_backend)
        cache = self.__dict__.setdefault("_roundpipe_cache", {})
        for gi, (program, scalars, columns, writeback) in plans:
            for targets, value in writeback:
                torch._foreach_copy_(targets, [value] * len(targets))
            backend.run(program, scalars, columns, cache.setdefault(gi, {}))
        return loss

    def _plan_group(self, gi, group, options, params, states, init_flags):
        """Bucket a group's parameters by program and scalars; compute each bucket's scalars.

        Parameters whose 0-d state (``step``, ...) and init flags are equal get equal scalars,
        so the spec's scalar function runs once per bucket on a scratch copy of that state.
        Returns ``[(program, scalars, columns, writeback)]``; ``writeback`` lists the 0-d
        state tensors to set to the scratch's new values when the step is applied.
        """
        spec = self.spec
        names = spec.scalar_state
        buckets: dict = {}
        if params and _all_equal(states, names) and all(f == init_flags[0] for f in init_flags):
            # the common case: every parameter of the group is at the same step
            buckets[(tuple(sorted(init_flags[0].items())), ())] = (params, states)
        else:
            for p, st, flags in zip(params, states, init_flags, strict=True):
                key = (
                    tuple(sorted(flags.items())) if flags else (),
                    tuple((st[n].item(), st[n].dtype) for n in names),
                )
                members, member_states = buckets.setdefault(key, ([], []))
                members.append(p)
                member_states.append(st)
        plans = []
        for (flag_items, _), (members, states) in buckets.items():
            scratch = {n: states[0][n].clone() for n in names}
            values, step_flags = {}, dict(flag_items)
            try:
                for k, v in spec.scalars(group, scratch).items():
                    if isinstance(v, bool):
                        step_flags[k] = v
                    else:
                        values[k] = float(v)
            except (ValueError, TypeError, RuntimeError) as e:
                raise type(e)(
                    f"roundpipe.optim.{type(self).__name__}: param_groups[{gi}]: "
                    f"cannot compute this step's scalars from the group's hyperparameters: {e}"
                ) from e
            writeback = [([st[n] for st in states], scratch[n]) for n in names]
            program = spec.program({**options, **step_flags})
            columns = {}
            for name in program.tensors:
                if name == "param":
                    col = members
                elif name == "grad":
                    col = [p.grad for p in members]
                else:
                    col = [st[name] for st in states]
                columns[name] = col
            if any(map(torch.is_complex, members)):
                # complex parameters step as their real views, as torch's for-loop does
                for name, col in columns.items():
                    columns[name] = [torch.view_as_real(t) if t.is_complex() else t for t in col]
            plans.append((program, values, columns, writeback))
        return plans

    # ------------------------------------------------------------------------------------------
    def _prepare(self):
        """Check everything the step needs and create missing state; modify nothing else.

        If any check fails, the state entries this call created are removed again before the
        error propagates, so a failed step leaves the optimizer exactly as it found it.
        Returns ``([(group, options, params, states, init_flags)], created)`` for the params
        that have a grad; ``created`` is what ``_rollback`` removes if the step fails later.
        """
        name = type(self).__name__
        spec = self.spec
        backend = backends.get(self._roundpipe_backend)
        backend.check_settings()
        work = []
        seen = set()
        for gi, group in enumerate(self.param_groups):
            indices = [pi for pi, p in enumerate(group["params"]) if p.grad is not None]
            all_params = group["params"]
            params = [all_params[pi] for pi in indices]
            for pi, p in zip(indices, params, strict=True):
                if not _param_ok(p, p.grad):
                    _raise_param_error(name, gi, pi, p)
            if not backend.tensor_subclasses:
                for pi, p in zip(indices, params, strict=True):
                    if type(p) not in _PLAIN and is_traceable_wrapper_subclass(p):
                        raise TypeError(
                            f"{_where(name, gi, pi, p)} is a {type(p).__name__} (a tensor subclass, "
                            "e.g. an FSDP2 shard); the fast backend steps plain tensors: use "
                            "backend='reference'"
                        )
            ids = list(map(id, params))
            if len(set(ids)) != len(ids) or not seen.isdisjoint(ids):
                _raise_duplicate(name, gi, indices, params, seen)
            seen.update(ids)
            work.append((gi, group, params, indices))
        _check_overlap(name, work)
        state = self.state
        created = []  # (state dict, number of entries it had before init_state)
        try:
            prepared = []
            for gi, group, params, indices in work:
                options = spec.options(group)
                inputs = [n for n in spec.inputs(Options(options)) if n not in ("param", "grad")]
                scalar_names = spec.scalar_state
                init_flags = []
                states = [state[p] for p in params]
                for p, st in zip(params, states, strict=True):
                    before = len(st)
                    init_flags.append(spec.init_state(group, p, st) or {})
                    if len(st) != before:
                        created.append((p, st, before))
                for p, pi, st in zip(params, indices, states, strict=True):
                    if not _state_ok(p, st, inputs, scalar_names):
                        _raise_state_error(name, gi, pi, p, st, inputs, scalar_names)
                prepared.append((group, options, params, states, init_flags))
        except BaseException:
            _rollback(state, created)
            raise
        return prepared, created


def _where(cls_name, gi, pi, p):
    return (
        f"roundpipe.optim.{cls_name}: param_groups[{gi}]['params'][{pi}] "
        f"(shape {tuple(p.shape)}, dtype {p.dtype})"
    )


def _check_overlap(cls_name, work):
    """Refuse parameters that overlap in memory: torch's for-loop and foreach paths give
    different results for them (each updates in place what the other reads)."""
    spans = []
    for gi, _, params, indices in work:
        for pi, p in zip(indices, params, strict=True):
            n = p.numel()
            if n:
                start = p.data_ptr()
                spans.append((start, start + n * p.element_size(), gi, pi, p))
    if len(spans) < 2:
        return
    spans.sort(key=lambda s: s[0])
    end, prev = spans[0][1], spans[0]
    for span in spans[1:]:
        if span[0] < end:
            raise ValueError(
                f"{_where(cls_name, span[2], span[3], span[4])} overlaps in memory with "
                f"param_groups[{prev[2]}]['params'][{prev[3]}]; parameters must not share elements"
            )
        if span[1] > end:
            end, prev = span[1], span
    return


def _rollback(state, created):
    """Remove the state entries a failed step created (``created`` from ``_prepare``)."""
    for p, st, before in created:
        for key in list(st)[before:]:
            del st[key]
        if not st:
            del state[p]


def _all_equal(states, names):
    """True when every state holds the same values and dtypes in its 0-d entries ``names``."""
    for n in names:
        col = [st[n] for st in states]
        dtype = col[0].dtype
        if any(t.dtype != dtype for t in col):
            return False
        stacked = torch.stack(col)
        if not bool((stacked == stacked[0]).all()):
            return False
    return True


def _raise_duplicate(cls_name, gi, indices, params, seen):
    local = set()
    for pi, p in zip(indices, params, strict=True):
        if id(p) in seen or id(p) in local:
            raise ValueError(
                f"{_where(cls_name, gi, pi, p)} appears more than once in param_groups; "
                "torch.optim would step it twice (deprecated there), roundpipe refuses"
            )
        local.add(id(p))


def _param_ok(p, g):
    """The fast check of the contract; the slow one below says what is wrong."""
    return (
        p.dtype in SUPPORTED_DTYPES
        and p.is_cpu
        and p.layout == _STRIDED
        and p.is_contiguous()
        and g.dtype == p.dtype
        and g.is_cpu
        and g.layout == _STRIDED
        and g.shape == p.shape
        and g.is_contiguous()
    )


def _state_ok(p, st, names, scalar_names):
    for n in scalar_names:
        t = st.get(n)
        if not (isinstance(t, torch.Tensor) and t.dim() == 0 and t.is_floating_point()):
            return False
    for n in names:
        t = st.get(n)
        if not (
            isinstance(t, torch.Tensor)
            and t.dtype == p.dtype
            and t.is_cpu
            and t.layout == _STRIDED
            and t.shape == p.shape
            and t.is_contiguous()
        ):
            return False
    return True


def _raise_param_error(cls_name, gi, pi, p):
    where = _where(cls_name, gi, pi, p)
    g = p.grad
    if p.device.type != "cpu":
        raise ValueError(f"{where} is on device {p.device}; only CPU tensors are supported")
    if p.layout != torch.strided:
        raise RuntimeError(f"{where} has layout {p.layout}; only dense tensors are supported")
    if p.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"{where}: dtype {p.dtype} is not supported; use torch.float32 (or torch.complex64) "
            "master weights"
        )
    if not p.is_contiguous():
        raise ValueError(f"{where} is not contiguous (strides {p.stride()}); call .contiguous()")
    if g.is_sparse or g.layout != torch.strided:
        raise RuntimeError(f"{where}: sparse gradients are not supported (grad layout {g.layout})")
    if g.device.type != "cpu":
        raise ValueError(f"{where}: its grad is on device {g.device}; only CPU is supported")
    if g.dtype != p.dtype:
        raise TypeError(f"{where}: its grad has dtype {g.dtype}, expected {p.dtype}")
    if g.shape != p.shape:
        raise RuntimeError(f"{where}: its grad has shape {tuple(g.shape)}, expected {tuple(p.shape)}")
    if not g.is_contiguous():
        raise ValueError(f"{where}: its grad is not contiguous (strides {g.stride()})")
    raise AssertionError(f"{where}: failed the contract check")  # unreachable


def _raise_state_error(cls_name, gi, pi, p, state, names, scalar_names):
    where = _where(cls_name, gi, pi, p)
    for n in scalar_names:
        t = state.get(n)
        if not isinstance(t, torch.Tensor) or t.dim() != 0 or not t.is_floating_point():
            raise KeyError(f"{where}: optimizer state {n!r} must be a 0-d floating tensor, got {t!r}")
    for n in names:
        t = state.get(n)
        if not isinstance(t, torch.Tensor):
            raise KeyError(f"{where}: optimizer state {n!r} is missing or not a tensor ({type(t).__name__})")
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(f"{where}: state {n!r} must be a dense CPU tensor, got {t.device}/{t.layout}")
        if t.dtype != p.dtype or t.shape != p.shape:
            raise ValueError(
                f"{where}: state {n!r} has shape {tuple(t.shape)} and dtype {t.dtype}, "
                f"expected those of the parameter"
            )
        if not t.is_contiguous():
            raise ValueError(f"{where}: state {n!r} is not contiguous (strides {t.stride()})")


# ----------------------------------------------------------------------------------------------
# __init__: torch's signature plus ``backend``


_PLACEHOLDER_WARN = ("foreach", "fused")
_PLACEHOLDER_FALSE = ("capturable", "differentiable")


def _make_init(cls, torch_cls):
    torch_sig = inspect.signature(torch_cls.__init__)
    backend_param = inspect.Parameter(
        "backend", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None"
    )
    public_sig = torch_sig.replace(parameters=[*torch_sig.parameters.values(), backend_param])

    def __init__(self, *args, backend=None, **kwargs):
        bound = torch_sig.bind(self, *args, **kwargs)
        arguments = bound.arguments
        for opt in _PLACEHOLDER_FALSE:
            if arguments.get(opt):
                raise ValueError(
                    f"roundpipe.optim.{cls.__name__} does not support {opt}=True "
                    "(it steps fp32 tensors on the CPU in place)"
                )
        for opt in _PLACEHOLDER_WARN:
            if arguments.get(opt) is not None:
                warnings.warn(
                    f"roundpipe.optim.{cls.__name__}: {opt}={arguments[opt]!r} is ignored; "
                    "roundpipe runs its own CPU implementation",
                    UserWarning,
                    stacklevel=2,
                )
                arguments[opt] = None
        self._roundpipe_backend = backends.resolve(backend)
        torch_cls.__init__(*bound.args, **bound.kwargs)

    __init__.__signature__ = public_sig
    __init__.__qualname__ = f"{cls.__name__}.__init__"
    __init__.__doc__ = torch_cls.__init__.__doc__
    return __init__
