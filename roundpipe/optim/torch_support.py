"""Which torch releases roundpipe.optim follows, and the guard for the ones nobody checked.

The specs follow the installed torch's for-loops; where torch's changed inside the supported
range, a feature probe picks the variant (``spec/core.py``'s ``to_scalar``, ``spec/adam.py``'s
AdamW). The conformance suite checks every engine on the releases of ``CHECKED``; the
package's dependency range is ``SUPPORTED``.

On a torch outside ``SUPPORTED`` (a newer release, or a build whose version says nothing),
the first construction of each optimizer class with a given set of hyperparameters runs a
self-check: a few steps of ``torch.optim``'s for-loop and of the spec (the ``reference``
backend) side by side on a few elements with those hyperparameters; where they differ, a
warning names the optimizer, the options and the torch version, once. Inside the range the
check is skipped: the conformance suite has run there (for the staged optimizers, Adafactor and
Muon, on the releases of ``STAGED_CHECKED``; elsewhere they check themselves). ``ROUNDPIPE_OPTIM_SELF_CHECK``:
``auto`` (the default, as above), ``always``, ``never``, or ``error`` (like ``always``, and a
difference raises ``RuntimeError`` instead of warning).
"""

from __future__ import annotations

import copy
import inspect
import os
import re
import threading
import warnings

import torch

# (major, minor) bounds, inclusive: pyproject.toml's torch range
SUPPORTED = ((2, 6), (2, 15))
# the releases whose conformance suite ran in full (README, docs/torch-versions.md)
CHECKED = ("2.6.0", "2.13.0", "2.14.1")
# the staged optimizers (spec/staged.py) were checked on fewer: elsewhere in the range they
# check themselves as on a torch outside it
STAGED_CHECKED = ((2, 13), (2, 14))
ENV_VAR = "ROUNDPIPE_OPTIM_SELF_CHECK"
MODES = ("auto", "always", "never", "error")

_SIZE = 8  # elements of the checked parameter
_STEPS = 8  # steps: RAdam rectifies from step 6 with its default betas

_done: set = set()
_lock = threading.Lock()


def torch_release(version: str | None = None) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string, None when it has none."""
    m = re.match(r"(\d+)\.(\d+)", torch.__version__ if version is None else version)
    return (int(m[1]), int(m[2])) if m else None


def supported(version: str | None = None) -> bool:
    release = torch_release(version)
    return release is not None and SUPPORTED[0] <= release <= SUPPORTED[1]


def _mode() -> str:
    mode = os.environ.get(ENV_VAR, "auto") or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: expected one of {', '.join(MODES)}")
    return mode


def check_groups(cls, param_groups) -> None:
    """The self-check for each param group of a new ``cls`` instance (see the module)."""
    mode = _mode()
    if mode == "never" or (mode == "auto" and supported() and _followed(cls)):
        return
    torch_cls = cls.spec.torch_class
    accepted = set(inspect.signature(torch_cls.__init__).parameters) - {"self", "params"}
    for group in param_groups:
        kwargs = {k: v for k, v in group.items() if k in accepted}
        key = (cls.__name__, repr(sorted(kwargs.items())))
        with _lock:
            if key in _done:
                continue
            _done.add(key)
        try:
            difference = _difference(cls, torch_cls, kwargs)
        except Exception as e:  # noqa: BLE001 (the user's own step will raise it, or not)
            difference = f"the check could not run ({type(e).__name__}: {e})"
        if difference is None:
            continue
        message = (
            f"roundpipe.optim.{cls.__name__} differs from torch.optim.{torch_cls.__name__}'s for-loop "
            f"on torch {torch.__version__}, a release roundpipe has not been checked against "
            f"(supported: {_range()}), with {kwargs}: {difference}. Use torch.optim, or a torch in "
            f"the supported range, and report it."
        )
        if mode == "error":
            raise RuntimeError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _followed(cls) -> bool:
    """Whether the conformance suite checked ``cls`` on the installed torch's release."""
    from .spec.staged import StagedSpec

    return not isinstance(cls.spec, StagedSpec) or torch_release() in STAGED_CHECKED


def _range() -> str:
    (a, b), (c, d) = SUPPORTED
    return f"{a}.{b} to {c}.{d}"


def _difference(cls, torch_cls, kwargs) -> str | None:
    """What differs after ``_STEPS`` steps on ``_SIZE`` elements, or None: the parameter and
    every state entry, bit for bit."""
    from .spec.staged import StagedSpec

    # a matrix for the staged optimizers (Adafactor factors it; Muon steps nothing else)
    shape = (4, _SIZE) if isinstance(cls.spec, StagedSpec) else (_SIZE,)
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(_STEPS)]
    theirs, ours = start.clone(), start.clone()
    opts = (
        torch_cls([theirs], **copy.deepcopy(kwargs)),
        cls([ours], **copy.deepcopy(kwargs), backend="reference"),
    )
    for step, grad in enumerate(grads, 1):
        for p, opt in zip((theirs, ours), opts, strict=True):
            p.grad = grad.clone()
            opt.step()
        if not _same(theirs, ours):
            return f"the parameter differs after step {step}"
    for name, value in opts[0].state[theirs].items():
        other = opts[1].state[ours].get(name)
        if not (torch.is_tensor(value) and torch.is_tensor(other) and _same(value, other)):
            return f"state {name!r} differs after {_STEPS} steps"
    return None


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}
_BITS[torch.float64] = torch.int64


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaNs included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS.get(a.dtype)
    if bits is None:
        return torch.equal(a, b)
    return torch.equal(a.reshape(-1).view(bits), b.reshape(-1).view(bits))
