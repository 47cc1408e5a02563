"""roundpipe.optim: CPU optimizers that are drop-in replacements for ``torch.optim``.

Each class (``Adam``, ``AdamW``, ``SGD`` ... one per entry of the spec registry) subclasses its
``torch.optim`` namesake (same signature, defaults, errors, state and ``state_dict``) and adds
a keyword-only ``backend=``: ``"fast"`` (the default: no compiler, small tensors batched, the
torch engine), ``"fast:numexpr"`` (the design card's numexpr engine), ``"native"`` (numba, one
parallel loop per step) or ``"reference"`` (plain torch ops); ``ROUNDPIPE_OPTIM_BACKEND`` sets
the default.

Where things live:

* the math of every optimizer: ``roundpipe/optim/spec/<name>.py`` (one spec each);
* the statement language: ``roundpipe/optim/spec/ir.py``;
* the backends and their interface: ``roundpipe/optim/backends/__init__.py``;
* the step plan (what a step needs, checked cheaply every step): ``roundpipe/optim/plan.py``;
* the API: ``roundpipe/optim/optimizer.py``.
"""

from .optimizer import RoundpipeOptimizer
from .spec import SPECS
from .threads import get_num_threads, set_num_threads


def _optimizer_class(spec):
    torch_cls = spec.torch_class
    return type(
        spec.name,
        (RoundpipeOptimizer, torch_cls),
        {
            "spec": spec,
            "__module__": __name__,
            "__qualname__": spec.name,
            "__doc__": f"``torch.optim.{torch_cls.__name__}`` on roundpipe's CPU backends; "
            f"see :class:`torch.optim.{torch_cls.__name__}`.",
        },
    )


globals().update({name: _optimizer_class(spec) for name, spec in SPECS.items()})

__all__ = [*SPECS, "RoundpipeOptimizer", "get_num_threads", "set_num_threads"]
