"""The algorithm spec: every optimizer's math, once. One module per optimizer.

See ``ir.py`` for the statement language and ``core.py`` for what a spec holds.
"""

from .adadelta import ADADELTA
from .adagrad import ADAGRAD
from .adam import ADAM, ADAMW
from .adamax import ADAMAX
from .asgd import ASGD
from .core import OptimizerSpec
from .nadam import NADAM
from .radam import RADAM
from .rmsprop import RMSPROP
from .rprop import RPROP
from .sgd import SGD

SPECS = {s.name: s for s in (ADADELTA, ADAGRAD, ADAM, ADAMAX, ADAMW, ASGD, NADAM, RADAM, RMSPROP, RPROP, SGD)}

__all__ = ["OptimizerSpec", "SPECS"]
