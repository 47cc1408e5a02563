"""The algorithm spec: every optimizer's math, once. One module per optimizer.

See ``ir.py`` for the statement language, ``core.py`` for what a spec holds and ``staged.py``
for the specs whose step is several passes (Adafactor, Muon, bitsandbytes' 8-bit family:
``eightbit.py``, its classes ``eightbit_classes.py``).
"""

from .adadelta import ADADELTA
from .adafactor import ADAFACTOR
from .adagrad import ADAGRAD
from .adam import ADAM, ADAMW
from .adamax import ADAMAX
from .asgd import ASGD
from .core import OptimizerSpec
from .eightbit_classes import EIGHTBIT_SPECS
from .muon import MUON
from .nadam import NADAM
from .radam import RADAM
from .rmsprop import RMSPROP
from .rprop import RPROP
from .sgd import SGD

SPECS = {s.name: s for s in (ADADELTA, ADAGRAD, ADAM, ADAMAX, ADAMW, ASGD, NADAM, RADAM, RMSPROP, RPROP, SGD)}

# The staged specs (``staged.py``): steps that are not one elementwise pass. Muon only where
# the installed torch has it (2.9 and later).
STAGED_SPECS = {s.name: s for s in (ADAFACTOR, MUON) if s is not None}

# EIGHTBIT_SPECS: bitsandbytes' 8-bit classes, the Paged ones included (``eightbit_classes.py``):
# each a staged spec of one pass with bitsandbytes' constructor as data
__all__ = ["EIGHTBIT_SPECS", "OptimizerSpec", "SPECS", "STAGED_SPECS"]
