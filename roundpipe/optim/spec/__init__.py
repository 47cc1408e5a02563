"""The algorithm spec: every optimizer's math, once. One module per optimizer.

See ``ir.py`` for the statement language and ``core.py`` for what a spec holds.
"""

from .adagrad import ADAGRAD
from .adam import ADAM, ADAMW
from .core import OptimizerSpec
from .sgd import SGD

SPECS = {s.name: s for s in (ADAGRAD, ADAM, ADAMW, SGD)}

__all__ = ["OptimizerSpec", "SPECS"]
