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
from .threads import get_num_threads, set_num_threads

__all__ = [
    "Adadelta",
    "Adagrad",
    "Adam",
    "Adamax",
    "AdamW",
    "ASGD",
    "NAdam",
    "RAdam",
    "RMSprop",
    "Rprop",
    "SGD",
    "RoundpipeOptimizer",
    "get_num_threads",
    "set_num_threads",
]


class Adadelta(RoundpipeOptimizer, torch.optim.Adadelta):
    """``torch.optim.Adadelta`` on roundpipe's CPU backends; see :class:`torch.optim.Adadelta`."""

    spec = SPECS["Adadelta"]


class Adagrad(RoundpipeOptimizer, torch.optim.Adagrad):
    """``torch.optim.Adagrad`` on roundpipe's CPU backends; see :class:`torch.optim.Adagrad`."""

    spec = SPECS["Adagrad"]


class Adam(RoundpipeOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` on roundpipe's CPU backends; see :class:`torch.optim.Adam`."""

    spec = SPECS["Adam"]


class Adamax(RoundpipeOptimizer, torch.optim.Adamax):
    """``torch.optim.Adamax`` on roundpipe's CPU backends; see :class:`torch.optim.Adamax`."""

    spec = SPECS["Adamax"]


class AdamW(RoundpipeOptimizer, torch.optim.AdamW):
    """``torch.optim.AdamW`` on roundpipe's CPU backends; see :class:`torch.optim.AdamW`."""

    spec = SPECS["AdamW"]


class ASGD(RoundpipeOptimizer, torch.optim.ASGD):
    """``torch.optim.ASGD`` on roundpipe's CPU backends; see :class:`torch.optim.ASGD`."""

    spec = SPECS["ASGD"]


class NAdam(RoundpipeOptimizer, torch.optim.NAdam):
    """``torch.optim.NAdam`` on roundpipe's CPU backends; see :class:`torch.optim.NAdam`."""

    spec = SPECS["NAdam"]


class RAdam(RoundpipeOptimizer, torch.optim.RAdam):
    """``torch.optim.RAdam`` on roundpipe's CPU backends; see :class:`torch.optim.RAdam`."""

    spec = SPECS["RAdam"]


class RMSprop(RoundpipeOptimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` on roundpipe's CPU backends; see :class:`torch.optim.RMSprop`."""

    spec = SPECS["RMSprop"]


class Rprop(RoundpipeOptimizer, torch.optim.Rprop):
    """``torch.optim.Rprop`` on roundpipe's CPU backends; see :class:`torch.optim.Rprop`."""

    spec = SPECS["Rprop"]


class SGD(RoundpipeOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` on roundpipe's CPU backends; see :class:`torch.optim.SGD`."""

    spec = SPECS["SGD"]
