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

from . import backends
from .spec.core import Options

SUPPORTED_DTYPES = (torch.float32, torch.complex64)


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
        state.setdefault("_roundpipe_backend", backends.resolve(None))
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
        work = self._prepare()
        backend = backends.get(self._roundpipe_backend)
        spec = self.spec
        for group, options, params, init_flags in work:
            batches: dict = {}
            for p, flags in zip(params, init_flags, strict=True):
                state = self.state[p]
                scalars = spec.scalars(group, p, state)
                step_flags = dict(flags)
                values = {}
                for k, v in scalars.items():
                    if isinstance(v, bool):
                        step_flags[k] = v
                    else:
                        values[k] = float(v)
                program = spec.program({**options, **step_flags})
                tensors = {name: _real(_lookup(p, state, name)) for name in program.tensors}
                batches.setdefault(id(program), (program, []))[1].append((tensors, values))
            for program, items in batches.values():
                backend.run(program, items)
        return loss

    # ------------------------------------------------------------------------------------------
    def _prepare(self):
        """Check everything the step needs, then create missing state; modify nothing else.

        Returns ``[(group, options, params, init_flags)]`` for the params that have a grad.
        """
        name = type(self).__name__
        spec = self.spec
        work = []
        for gi, group in enumerate(self.param_groups):
            params = []
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                _check_param(name, gi, pi, p)
                params.append(p)
            work.append((gi, group, params))
        prepared = []
        for gi, group, params in work:
            options = spec.options(group)
            inputs = [n for n in spec.inputs(Options(options)) if n not in ("param", "grad")]
            init_flags = []
            for p in params:
                init_flags.append(spec.init_state(group, p, self.state[p]) or {})
            for p in params:
                pi = _index(group["params"], p)
                _check_state(name, gi, pi, p, self.state[p], inputs)
            prepared.append((group, options, params, init_flags))
        return prepared


def _index(params, p):
    for i, q in enumerate(params):
        if q is p:
            return i
    return -1


def _where(cls_name, gi, pi, p):
    return (
        f"roundpipe.optim.{cls_name}: param_groups[{gi}]['params'][{pi}] "
        f"(shape {tuple(p.shape)}, dtype {p.dtype})"
    )


def _check_param(cls_name, gi, pi, p):
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


def _check_state(cls_name, gi, pi, p, state, names):
    where = _where(cls_name, gi, pi, p)
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


def _lookup(p, state, name):
    if name == "param":
        return p
    if name == "grad":
        return p.grad
    return state[name]


def _real(t):
    t = t.detach()
    return torch.view_as_real(t) if t.is_complex() else t


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
