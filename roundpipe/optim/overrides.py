"""bitsandbytes' per-parameter config for the 8-bit family: its ``GlobalOptimManager``, read as
bitsandbytes 0.50's optimizers read it (``bitsandbytes/optim/optimizer.py``).

bitsandbytes keeps one manager per process. ``register_module_override(module, "weight",
{"optim_bits": 32})`` is how it keeps an embedding's state in 32 bits (HF Trainer registers that
for every ``nn.Embedding`` when ``optim="adamw_bnb_8bit"``); ``override_config(p, key, value)``
overrides a hyperparameter of one parameter. An 8-bit optimizer of roundpipe reads the manager
of bitsandbytes where bitsandbytes is imported in the process (never importing it), and
roundpipe's own, :class:`GlobalOptimManager` (the same API, for a process without
bitsandbytes), at the moments bitsandbytes' optimizers read theirs:

* at its first step, module overrides become parameter overrides of the parameters this
  optimizer holds (``check_overrides``: written into the manager, as bitsandbytes does);
* where a parameter's state is created: ``optim_bits`` (8 or 32, else the NotImplementedError
  bitsandbytes raises) and ``min_8bit_size``;
* every step: the hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``, and
  AdEMAMix's ``alpha``, ``t_alpha``, ``t_beta3``), over the param group's.

A parameter's config is bitsandbytes' ``get_config``: the overrides of its position (group,
index) and then those of the parameter itself, bitsandbytes' manager's before roundpipe's.
``skip_zeros`` is read and, as by bitsandbytes' CPU step, not applied; ``max_unorm`` (its
update-norm clipping, which its CPU step applies to 32-bit state) raises; keys bitsandbytes
reads nowhere are ignored, as there.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import replace

import torch

from .spec.eightbit import HYPERPARAMETERS

__all__ = ["GlobalOptimManager", "bind", "managers"]


class GlobalOptimManager:
    """bitsandbytes' ``GlobalOptimManager`` (0.50), its API and behaviour, for a process without
    bitsandbytes: ``GlobalOptimManager.get_instance()``, then ``register_module_override``,
    ``override_config`` or ``register_parameters`` as there. roundpipe's 8-bit optimizers read
    this one and, where bitsandbytes is imported, bitsandbytes' too."""

    _instance: GlobalOptimManager | None = None

    def __init__(self):
        raise RuntimeError("Call get_instance() instead")

    def initialize(self) -> None:
        self.pid2config: dict = {}
        self.index2config: dict = {}
        self.optimizer = None
        self.uses_config_override = False
        self.module_weight_config_triple: list = []

    @classmethod
    def get_instance(cls) -> GlobalOptimManager:
        if cls._instance is None:
            cls._instance = cls.__new__(cls)
            cls._instance.initialize()
        return cls._instance

    def register_parameters(self, params) -> None:
        """The overrides of ``params`` already registered, also by their position (group, index)
        in ``params``: what bitsandbytes' optimizers read when a parameter is replaced by
        another at the same position."""
        param_groups = list(params)
        if not isinstance(param_groups[0], dict):
            param_groups = [{"params": param_groups}]
        for group_index, group in enumerate(param_groups):
            for p_index, p in enumerate(group["params"]):
                if id(p) in self.pid2config:
                    self.index2config[(group_index, p_index)] = self.pid2config[id(p)]

    def override_config(self, parameters, key=None, value=None, key_value_dict=None) -> None:
        """Override hyperparameters (``key``/``value``, or ``key_value_dict``) of ``parameters``
        (a tensor or a list of them), as bitsandbytes' ``override_config`` does."""
        self.uses_config_override = True
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        if key is not None and value is not None:
            assert key_value_dict is None
            key_value_dict = {key: value}
        if key_value_dict is not None:
            for p in parameters:
                if id(p) in self.pid2config:
                    self.pid2config[id(p)].update(key_value_dict)
                else:
                    self.pid2config[id(p)] = key_value_dict

    def register_module_override(self, module, param_name, config) -> None:
        """``config`` for ``getattr(module, param_name)``, taken up by an optimizer at its first
        step (``{"optim_bits": 32}``: 32-bit state, as for an embedding)."""
        self.module_weight_config_triple.append((module, param_name, config))


_THEIRS: list = []  # bitsandbytes' manager once seen (one per process: never looked up again)


def _theirs():
    if _THEIRS:
        return _THEIRS[0]
    module = sys.modules.get("bitsandbytes.optim.optimizer")
    found = getattr(getattr(module, "GlobalOptimManager", None), "_instance", None)
    if found is not None:
        _THEIRS.append(found)
    return found


def managers() -> tuple:
    """The managers in use: bitsandbytes' where bitsandbytes is imported and it was made, then
    roundpipe's where it was made. (A step asks once per parameter: kept cheap.)"""
    theirs, ours = _theirs(), GlobalOptimManager._instance
    if theirs is None:
        return () if ours is None else (ours,)
    return (theirs,) if ours is None else (theirs, ours)


def _held(param_groups):
    """``(group index, index, parameter)`` of every parameter: bitsandbytes' position keys."""
    return ((gi, pi, p) for gi, g in enumerate(param_groups) for pi, p in enumerate(g["params"]))


def check_overrides(manager, param_groups) -> None:
    """bitsandbytes' ``Optimizer8bit.check_overrides``: each module override of ``manager`` whose
    parameter is in ``param_groups`` becomes that parameter's config, by identity and position."""
    for module, attr, config in manager.module_weight_config_triple:
        pmodule = getattr(module, attr)
        assert pmodule is not None
        assert isinstance(pmodule, torch.Tensor)
        where = next(((gi, pi) for gi, pi, p in _held(param_groups) if p is pmodule), None)
        if where is not None:
            manager.pid2config[id(pmodule)] = config
            manager.index2config[where] = manager.pid2config[id(pmodule)]


class _ParameterConfig:
    """One optimizer's view of the managers: a parameter's config over its group's (bitsandbytes'
    ``get_config`` less the group), ``{}`` where nothing overrides it."""

    __slots__ = ("_opt", "checked", "_positions", "_layout")

    def __init__(self, opt):
        self._opt = weakref.ref(opt)
        self.checked = False
        self._positions: dict = {}
        self._layout: tuple = ()

    def __call__(self, p) -> dict | None:
        found_managers = managers()
        if not self.checked:
            # bitsandbytes' check_overrides runs once, at its optimizer's first step (the first
            # time a step asks for a parameter's config here)
            self.checked = True
            for m in found_managers:
                check_overrides(m, self._opt().param_groups)
        config = None
        for m in found_managers:
            if m.index2config:
                where = self._position(p)
                if where in m.index2config:
                    config = {**(config or {}), **m.index2config[where]}
            if m.pid2config:
                mine = m.pid2config.get(id(p))
                if mine:
                    config = {**(config or {}), **mine}
        if config is None:
            return None
        if config.get("max_unorm", 0.0) > 0.0:
            raise NotImplementedError(
                f"roundpipe.optim.{type(self._opt()).__name__}: GlobalOptimManager config "
                f"max_unorm={config['max_unorm']!r} for a parameter of shape {tuple(p.shape)}: "
                "bitsandbytes' update-norm clipping (max_unorm) is not reproduced by roundpipe's 8-bit "
                "step; leave max_unorm at 0.0"
            )
        return config

    def _position(self, p):
        """``(group index, index)`` of ``p`` in the optimizer (bitsandbytes' position key)."""
        groups = self._opt().param_groups
        layout = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if layout != self._layout:
            self._positions = {id(q): (gi, pi) for gi, pi, q in _held(groups)}
            self._layout = layout
        return self._positions.get(id(p))


def _hashable(value):
    # a step's options are hashed: a list of betas keys its stages as the tuple would
    return tuple(value) if isinstance(value, list) else value


def bind(opt) -> None:
    """Give ``opt`` (an 8-bit optimizer) a spec of its own that reads the per-parameter config:
    its class's spec with ``init_state`` given the group as the config changes it and
    ``options`` carrying the hyperparameters it overrides (``hyper``; ``spec/eightbit.py``)."""
    spec = type(opt).spec
    config = _ParameterConfig(opt)
    base_init_state, base_options = spec.init_state, spec.options

    def init_state(group, p, state):
        found = config(p)
        return base_init_state({**group, **found} if found else group, p, state)

    def options(group, p):
        # (asked for every parameter every step: where no manager holds a config, a few reads)
        theirs, ours = _THEIRS[0] if _THEIRS else _theirs(), GlobalOptimManager._instance
        if config.checked and not (theirs and (theirs.pid2config or theirs.index2config)):
            if not (ours and (ours.pid2config or ours.index2config)):
                return base_options(group, p)
        found = config(p)
        if not found:
            return base_options(group, p)
        o = base_options({**group, **found}, p)
        hyper = tuple((k, _hashable(found[k])) for k in HYPERPARAMETERS if k in found and k in group)
        return {**o, "hyper": hyper} if hyper else o

    # an instance attribute: the step plan reads ``opt.spec``; the class keeps the registry's
    vars(opt)["spec"] = replace(spec, init_state=init_state, options=options)
