"""The API layer: ``RoundpipeOptimizer``, the base of the public classes (``optimizers.py``).

Each ``roundpipe.optim`` class subclasses its ``torch.optim`` namesake and reuses its
``__init__``: the signature, defaults, hyperparameter checks, ``param_groups`` layout,
``__setstate__`` and ``state_dict`` are torch's own, so they match by construction. What this
module adds:

* a keyword-only ``backend=`` argument (and ``ROUNDPIPE_OPTIM_BACKEND``), not stored in
  ``defaults`` or ``param_groups``, so state dicts stay interchangeable with torch.optim;
* the contract's placeholders: ``foreach``/``fused`` are ignored with a warning,
  ``capturable=True``/``differentiable=True`` raise ``ValueError``;
* ``step()``: torch's hooks around the step, which it hands to the step plan
  (``plan.run_step``: validation, the scalars, one backend launch per program, the replay of
  an unchanged step) with the gradient factors loss scaling and clipping left for it
  (``amp.py``); everything that can fail happens before the first write.
"""

from __future__ import annotations

import inspect
import itertools
import sys
import warnings
from typing import ClassVar

import torch
from torch.optim import optimizer as _torch_optimizer

from . import amp, backends, torch_support
from .masters import partner_of
from .plan import adopt_init_state, run_staged_step, run_step
from .spec.core import OptimizerSpec
from .spec.staged import StagedSpec


class RoundpipeOptimizer(torch.optim.Optimizer):
    """Base of the ``roundpipe.optim`` classes (``optimizers.py``); subclasses set ``spec``."""

    spec: ClassVar[OptimizerSpec | StagedSpec | None] = None
    _roundpipe_backend: str
    # torch's GradScaler hands the unscale and its inf check to the step (amp.py)
    _step_supports_amp_scaling = True
    _roundpipe_folds_grad_factors = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.spec is None or "__init__" in cls.__dict__:
            return  # (a class with an __init__ of its own; the 8-bit family has its own hook: eightbit.py)
        torch_cls = cls.spec.torch_class
        if not issubclass(cls, torch_cls):
            raise TypeError(f"{cls.__name__} must subclass {torch_cls.__name__}")
        cls.__init__ = _make_init(cls, torch_cls)  # type: ignore[method-assign]
        if torch_cls.__doc__:  # help() shows torch's description of the algorithm and arguments
            cls.__doc__ = f"{cls.__doc__ or ''}\n\n{inspect.cleandoc(torch_cls.__doc__)}"

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

    def step(*args, **kwargs):  # noqa: N805 (``self`` is args[0], as in torch's wrapper)
        """Perform a single optimization step, as ``torch.optim``'s ``step`` does.

        All or nothing: everything that can fail (validation, the scalars, the engine's
        compilation and workspaces) happens before the first write, so an exception (or a
        KeyboardInterrupt) before it leaves every parameter and state entry as it was."""
        if "torch._dynamo" in sys.modules and torch.compiler.is_compiling():
            return _disabled(_hooked_step)(*args, **kwargs)
        return _hooked_step(*args, **kwargs)

    # torch's __init__ wraps an unmarked step in its hook runner (profile_hook_step); ours runs
    # the same hooks (_hooked_step) for less, which a step of one parameter pays
    step.hooked = True

    def clip_grad_norm_(
        self,
        max_norm: float | torch.Tensor,
        norm_type: float | str = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over every gradient the next step reads, the
        masters' partners' included (widened, unscaled): returns the total norm; the next step
        applies the clip coefficient in its own pass (``roundpipe.optim.amp``)."""
        return amp.clip_grad_norm_(self, max_norm, norm_type, error_if_nonfinite, foreach)

    @torch._disable_dynamo
    def zero_grad(self, set_to_none: bool = True):
        """torch's ``zero_grad``, and the same for the gradients of the masters' partners
        (``roundpipe.optim.pair``): the step reads those. A clip or unscale recorded for the
        next step is dropped with the gradients it was computed from."""
        amp.clear(self)
        super().zero_grad(set_to_none)
        for group in self.param_groups:
            for p in group["params"]:
                q = partner_of(p)
                if q is not None and q.grad is not None:
                    if set_to_none:
                        q.grad = None
                    else:
                        if q.grad.grad_fn is not None:
                            q.grad.detach_()
                        else:
                            q.grad.requires_grad_(False)
                        q.grad.zero_()


def _run_step(opt):
    try:
        factors = amp.begin_step(opt)  # raises before anything moves where scaling cannot be seen
        if factors is not None:  # None: an inf or NaN under loss scaling, the step modifies nothing
            run = run_staged_step if isinstance(opt.spec, StagedSpec) else run_step
            run(opt, backends.get(opt._roundpipe_backend), factors)
    except BaseException:
        amp.drop_scaler_attributes(opt)  # a step that raised changed nothing, the scale included
        raise
    amp.clear(opt)  # (a step that raised keeps what was recorded for it: it changed nothing)


def _hooked_step(*args, **kwargs):
    """torch's ``Optimizer.profile_hook_step`` wrapper, the same hooks in the same order with
    the same arguments, under a ``record_function`` of the same name (torch's cheap C++ one
    where it has it: the Python one costs far more, even with no profiler running)."""
    self = args[0]
    cls = type(self)
    if cls.step is not RoundpipeOptimizer.step:
        # a subclass's own step: torch wrapped that one in its hook runner, which runs the hooks
        return _step_body(*args, **kwargs)
    name = _step_names.get(cls)
    if name is None:
        name = _step_names[cls] = f"Optimizer.step#{cls.__name__}.step"
    with _record_function(name):
        if _torch_optimizer._global_optimizer_pre_hooks or self._optimizer_step_pre_hooks:
            for pre_hook in itertools.chain(
                _torch_optimizer._global_optimizer_pre_hooks.values(),
                self._optimizer_step_pre_hooks.values(),
            ):
                result = pre_hook(self, args, kwargs)
                if result is not None:
                    if isinstance(result, tuple) and len(result) == 2:
                        args, kwargs = result
                    else:
                        raise RuntimeError(
                            f"{_step_body} must return None or a tuple of (new_args, new_kwargs), "
                            f"but got {result}."
                        )
        out = _step_body(*args, **kwargs)
        self._optimizer_step_code()
        if self._optimizer_step_post_hooks or _torch_optimizer._global_optimizer_post_hooks:
            for post_hook in itertools.chain(
                self._optimizer_step_post_hooks.values(),
                _torch_optimizer._global_optimizer_post_hooks.values(),
            ):
                post_hook(self, args, kwargs)
        return out


def _step_body(self, closure=None):
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    grad_enabled = torch.is_grad_enabled()
    torch._C._set_grad_enabled(False)
    try:
        _run_step(self)
    finally:
        torch._C._set_grad_enabled(grad_enabled)
    return loss


_step_names: dict = {}  # class -> its step's profiler name (as torch's wrapper names it)
_record_function = getattr(torch._C._profiler, "_RecordFunctionFast", torch.autograd.profiler.record_function)
_disabled_fns: dict = {}


def _disabled(fn):
    """``fn`` run as itself inside ``torch.compile``: dynamo would otherwise trace into numba's
    dispatcher (and fail) or recompile the torch engine's ops with inductor (other rounding).
    Only called once dynamo is imported (``torch.compiler.disable`` imports it, which is slow)."""
    hit = _disabled_fns.get(fn)
    if hit is None:
        hit = _disabled_fns[fn] = torch.compiler.disable(fn, recursive=True)
    return hit


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
        if self.state:  # state torch's __init__ created (Adagrad)
            adopt_init_state(self, self.spec, backends.get(self._roundpipe_backend).flat_state_below)
        torch_support.check_groups(cls, self.param_groups)

    __init__.__signature__ = public_sig
    __init__.__qualname__ = f"{cls.__name__}.__init__"
    __init__.__doc__ = torch_cls.__init__.__doc__
    return __init__
