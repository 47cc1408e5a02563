"""roundpipe.optim: CPU optimizers that are drop-in replacements for ``torch.optim``.

Each class (``Adam``, ``AdamW``, ``SGD``, ``Adafactor`` ..., declared in ``optimizers.py``, one per
entry of the spec registries) subclasses its ``torch.optim`` namesake (same signature, defaults, errors, state
and ``state_dict``) and adds a keyword-only ``backend=``: ``"fast"`` (the default: the numba
engine, one compiled parallel pass per step, bit for bit torch.optim's for-loop),
``"fast:torch"`` (chunked torch ops, no compiler), ``"fast:numexpr"`` (fused numexpr
expressions) or ``"reference"`` (plain torch ops); ``ROUNDPIPE_OPTIM_BACKEND`` sets the default.

fp32 masters for a bf16/fp16 model (``masters.py``): ``fp32_masters(model)`` pairs each
low-precision parameter with an fp32 master; a step then reads the partner's gradient and writes
the partner back, in the same pass.

Where things live:

* the math of every optimizer: ``roundpipe/optim/spec/<name>.py`` (one spec each; Adafactor's and
  Muon's are staged, several passes a step: ``spec/staged.py``, run by ``plan/staged.py``);
* the statement language: ``roundpipe/optim/spec/ir.py``;
* the backend interface: ``roundpipe/optim/backend_api.py``; the backends and their registry:
  ``roundpipe/optim/backends/``;
* the step plan (what a step needs, checked cheaply every step) and the step on it
  (``plan/launches.py``): ``roundpipe/optim/plan/`` (its design: ``docs/step-plan.md``);
* the API: ``roundpipe/optim/optimizer.py``; the public classes: ``roundpipe/optim/optimizers.py``,
  and bitsandbytes' 8-bit family (``Adam8bit`` ..., math in ``spec/eightbit.py``): ``eightbit.py``,
  bitsandbytes' per-parameter config (``GlobalOptimManager``): ``overrides.py``;
  loss scaling and clipping: ``roundpipe/optim/amp.py``; masters and partners:
  ``roundpipe/optim/masters.py``; the end of a distributed rank (``shutdown_process_group``):
  ``roundpipe/optim/shutdown.py``.
"""

from .amp import GradScaler, clip_grad_norm_
from .eightbit import (
    Adagrad8bit,
    Adam8bit,
    AdamW8bit,
    AdEMAMix8bit,
    LAMB8bit,
    LARS8bit,
    Lion8bit,
    PagedAdam8bit,
    PagedAdamW8bit,
    PagedAdEMAMix8bit,
    PagedLion8bit,
    RMSprop8bit,
    SGD8bit,
)
from .masters import fp32_masters, pair, partner_of, unpair
from .optimizer import RoundpipeOptimizer
from .optimizers import (
    ASGD,
    SGD,
    Adadelta,
    Adafactor,
    Adagrad,
    Adam,
    Adamax,
    AdamW,
    NAdam,
    RAdam,
    RMSprop,
    Rprop,
)
from .overrides import GlobalOptimManager
from .shutdown import shutdown_process_group
from .threads import get_num_threads, set_num_threads

__all__ = [
    "ASGD",
    "SGD",
    "AdEMAMix8bit",
    "Adadelta",
    "Adafactor",
    "Adagrad",
    "Adagrad8bit",
    "Adam",
    "Adam8bit",
    "AdamW",
    "AdamW8bit",
    "Adamax",
    "GlobalOptimManager",
    "GradScaler",
    "LAMB8bit",
    "LARS8bit",
    "Lion8bit",
    "NAdam",
    "PagedAdEMAMix8bit",
    "PagedAdam8bit",
    "PagedAdamW8bit",
    "PagedLion8bit",
    "RAdam",
    "RMSprop",
    "RMSprop8bit",
    "RoundpipeOptimizer",
    "Rprop",
    "SGD8bit",
    "clip_grad_norm_",
    "fp32_masters",
    "get_num_threads",
    "pair",
    "partner_of",
    "set_num_threads",
    "shutdown_process_group",
    "unpair",
]


try:
    from .optimizers import Muon as Muon  # (the "as": an explicit re-export)
except ImportError:  # torch < 2.9: no torch.optim.Muon (``__getattr__`` below says so)
    pass
else:  # listed only where it exists, so that a star-import works on a torch without it
    __all__.append("Muon")


def __getattr__(name: str):
    if name == "Muon":
        import torch

        raise ImportError(
            f"roundpipe.optim.Muon needs torch.optim.Muon, which torch ships from 2.9; "
            f"the installed torch is {torch.__version__}"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
