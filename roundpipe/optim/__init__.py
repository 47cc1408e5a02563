"""roundpipe.optim: CPU optimizers that are drop-in replacements for ``torch.optim``.

Each class subclasses its ``torch.optim`` namesake (same signature, defaults, errors, state
and ``state_dict``) and adds a keyword-only ``backend=`` argument: ``"fast"`` (numexpr, the
default) or ``"reference"`` (plain torch ops); ``ROUNDPIPE_OPTIM_BACKEND`` sets the default.

Where things live:

* the math of every optimizer: ``roundpipe/optim/spec/<name>.py`` (one spec each);
* the statement language: ``roundpipe/optim/spec/ir.py``;
* the backends: ``roundpipe/optim/backends/{reference,fast}.py``;
* the API and validation: ``roundpipe/optim/optimizer.py``.
"""

import torch

from .optimizer import RoundpipeOptimizer
from .spec import SPECS

__all__ = ["Adagrad", "Adam", "AdamW", "SGD", "RoundpipeOptimizer"]


class Adam(RoundpipeOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` on roundpipe's CPU backends; see :class:`torch.optim.Adam`."""

    spec = SPECS["Adam"]


class AdamW(RoundpipeOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` on roundpipe's CPU backends; see :class:`torch.optim.AdamW`."""

    spec = SPECS["AdamW"]


class Adagrad(RoundpipeOptimizer, torch.optim.Adagrad):
    """``torch.optim.Adagrad`` on roundpipe's CPU backends; see :class:`torch.optim.Adagrad`."""

    spec = SPECS["Adagrad"]


class SGD(RoundpipeOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` on roundpipe's CPU backends; see :class:`torch.optim.SGD`."""

    spec = SPECS["SGD"]
