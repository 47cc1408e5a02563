"""The API layer: ``RoundpipeOptimizer``, the base of the public classes (``optimizers.py``).

Each ``roundpipe.optim`` class subclasses its ``torch.optim`` namesake and reuses its
``__init__``: the signature, defaults, hyperparameter checks, ``param_groups`` layout,
``__setstate__`` and ``state_dict`` are torch's own, so they match by construction. What this
module adds:

* a keyword-only ``backend=`` argument (and ``ROUNDPIPE_OPTIM_BACKEND``), not stored in
  ``defaults`` or ``param_groups``, so state dicts stay interchangeable with torch.optim;
* the keyword-only ``state_dtype=`` and ``stochastic_rounding=`` (``storage.py``): the state
  stored in another dtype than the parameter's, a bfloat16 parameter rounded stochastically;
  ``state_dict()`` keeps the stream's seed (an entry torch.optim's ``load_state_dict`` ignores),
  and ``load_state_dict`` stores the state it loads in the state dtype;
* the contract's placeholders: ``foreach`` is ignored with a warning, and so is ``fused`` but
  where torch has a fused CPU kernel that the spec models (``spec.fused_kernel``: Adam, AdamW,
  SGD, Adagrad), whose ``fused=True`` steps as that kernel does; ``capturable=True``/``differentiable=True``
  raise ``ValueError``;
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

from . import amp, backends, storage, torch_support
from .masters import partner_of
from .plan import adopt_init_state, run_staged_step, run_step, store_state
from .spec.core import OptimizerSpec
from .spec.staged import StagedSpec


class RoundpipeOptimizer(torch.optim.Optimizer):
    """Base of the ``roundpipe.optim`` classes (``optimizers.py``); subclasses set ``spec``."""

    spec: ClassVar[OptimizerSpec | StagedSpec | None] = None
    _roundpipe_backend: str
    _roundpipe_storage: storage.Storage = storage.DEFAULT
    _roundpipe_sr_seed: int = 0  # stochastic rounding: the stream's seed, and the steps taken on it
    _roundpipe_sr_steps: int = 0
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

    @property
    def state_dtype(self) -> torch.dtype | None:
        """The dtype of the state tensors (None: each parameter's own, as torch)."""
        return self._roundpipe_storage.state_dtype

    @property
    def stochastic_rounding(self) -> bool:
        """Whether the bfloat16 parameters are rounded stochastically (``storage.py``)."""
        return self._roundpipe_storage.stochastic

    def __getstate__(self):
        state = super().__getstate__()
        state["_roundpipe_backend"] = self._roundpipe_backend
        for name in _STORAGE_ATTRIBUTES:
            if name in self.__dict__:
                state[name] = self.__dict__[name]
        return state

    def __setstate__(self, state):
        # torch's load_state_dict() calls this too, without the backend: keep ours then
        if "_roundpipe_backend" not in state and "_roundpipe_backend" not in self.__dict__:
            state = {**state, "_roundpipe_backend": backends.resolve(None)}
        super().__setstate__(state)

    def __repr__(self):
        keywords = f"backend={self.backend!r},"
        if self.state_dtype is not None:
            keywords += f" state_dtype={self.state_dtype},"
        if self.stochastic_rounding:
            keywords += " stochastic_rounding=True,"
        return super().__repr__().replace(f"{type(self).__name__} (", f"{type(self).__name__} ({keywords}", 1)

    @torch._disable_dynamo
    def state_dict(self):
        """torch's ``state_dict()``; with stochastic rounding also ``"stochastic_rounding"``:
        ``{"seed": int, "steps": int}``, the stream a resumed run continues (torch.optim's
        ``load_state_dict`` ignores the entry)."""
        sd = super().state_dict()
        if self.stochastic_rounding:
            sd[storage.SR_KEY] = {"seed": self._roundpipe_sr_seed, "steps": self._roundpipe_sr_steps}
        return sd

    @torch._disable_dynamo
    def load_state_dict(self, state_dict) -> None:
        """torch's ``load_state_dict``, the state then stored in the state dtype (a float32
        checkpoint into ``state_dtype=torch.bfloat16``: rounded to nearest even). A checkpoint
        with a stochastic rounding stream continues it (one without keeps this optimizer's)."""
        stream = state_dict.get(storage.SR_KEY)
        if stream is not None and self.stochastic_rounding:
            seed, steps = stream["seed"], stream["steps"]
            if type(seed) is not int or type(steps) is not int or steps < 0:
                raise ValueError(f"state_dict[{storage.SR_KEY!r}] needs an int seed and steps: {stream!r}")
        loaded = {k: v for k, v in state_dict.items() if k != storage.SR_KEY}
        super().load_state_dict(loaded)
        if self._roundpipe_storage != storage.DEFAULT and self.spec is not None:
            store_state(self, self.spec, loaded)
        if stream is not None and self.stochastic_rounding:
            self._roundpipe_sr_seed, self._roundpipe_sr_steps = seed, steps

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
            if opt._roundpipe_storage.stochastic:
                opt._roundpipe_sr_steps += 1  # the next step's random bits are the stream's next
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
_STORAGE_ATTRIBUTES = ("_roundpipe_storage", "_roundpipe_sr_seed", "_roundpipe_sr_steps")
_KEYWORD = inspect.Parameter.KEYWORD_ONLY
_OURS = (
    inspect.Parameter("backend", _KEYWORD, default=None, annotation="str | None"),
    inspect.Parameter("state_dtype", _KEYWORD, default=None, annotation="torch.dtype | None"),
    inspect.Parameter("stochastic_rounding", _KEYWORD, default=False, annotation="bool"),
)


def _make_init(cls, torch_cls):
    torch_sig = inspect.signature(torch_cls.__init__)
    public_sig = torch_sig.replace(parameters=[*torch_sig.parameters.values(), *_OURS])

    def __init__(self, *args, backend=None, state_dtype=None, stochastic_rounding=False, **kwargs):
        bound = torch_sig.bind(self, *args, **kwargs)
        arguments = bound.arguments
        for opt in _PLACEHOLDER_FALSE:
            if arguments.get(opt):
                raise ValueError(
                    f"roundpipe.optim.{cls.__name__} does not support {opt}=True "
                    "(it steps fp32 tensors on the CPU in place)"
                )
        modelled = getattr(cls.spec, "fused_kernel", False)  # fused=True: torch's fused kernel
        fused = modelled and arguments.get("fused")
        for opt in _PLACEHOLDER_WARN:
            if (opt == "fused" and modelled) or fused:
                continue  # kept as given (with fused=True, torch's __init__ refuses foreach=True)
            if arguments.get(opt) is not None:
                warnings.warn(
                    f"roundpipe.optim.{cls.__name__}: {opt}={arguments[opt]!r} is ignored; "
                    "roundpipe runs its own CPU implementation",
                    UserWarning,
                    stacklevel=2,
                )
                arguments[opt] = None
        kept = _storage(cls, state_dtype, stochastic_rounding)
        if fused and kept != storage.DEFAULT:
            raise TypeError(storage.fused_refusal(cls.__name__))
        self._roundpipe_backend = backends.resolve(backend)
        torch_cls.__init__(*bound.args, **bound.kwargs)
        if kept != storage.DEFAULT:
            _check_storage(cls, self.param_groups, kept)
            self._roundpipe_storage = kept
            if kept.stochastic:
                self._roundpipe_sr_seed = storage.draw_seed()
        if self.state:  # state torch's __init__ created (Adagrad)
            if kept != storage.DEFAULT:
                store_state(self, self.spec)
            adopt_init_state(self, self.spec, backends.get(self._roundpipe_backend).flat_state_below)
        torch_support.check_groups(cls, self.param_groups)

    __init__.__signature__ = public_sig
    __init__.__qualname__ = f"{cls.__name__}.__init__"
    __init__.__doc__ = torch_cls.__init__.__doc__
    return __init__


def _storage(cls, state_dtype, stochastic_rounding) -> storage.Storage:
    """The checked keywords (``storage.Storage``); the staged optimizers take neither."""
    kept = storage.check_keywords(cls.__name__, state_dtype, stochastic_rounding)
    if kept != storage.DEFAULT and isinstance(cls.spec, StagedSpec):
        raise TypeError(
            f"roundpipe.optim.{cls.__name__} does not take state_dtype or stochastic_rounding (its "
            "step is staged: passes with torch ops between them); the elementwise optimizers do"
        )
    return kept


def _check_storage(cls, param_groups, kept):
    """Refuse, at construction, parameters the keywords cannot step (a step checks again)."""
    for gi, group in enumerate(param_groups):
        for pi, p in enumerate(group["params"]):
            problem = kept.problem(p.dtype)
            if problem is not None:
                where = f"roundpipe.optim.{cls.__name__}: param_groups[{gi}]['params'][{pi}]"
                raise TypeError(f"{where}: {problem}")
