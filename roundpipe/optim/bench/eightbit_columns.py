"""The columns of the 8-bit rows (``eightbit``): what each one steps, made here for the rows and
for the memory subprocess (``eightbit_memory``), which imports this module, not the rows'.
bitsandbytes and torchao are imported here only, inside functions: a column whose package is
not installed says so."""

from __future__ import annotations

import warnings

import torch

from roundpipe import optim as rp_optim

__all__ = ["BNB", "FUSED", "OPTIMIZERS", "THIRD_PARTY", "TORCHAO", "TORCH_PARTNER", "make", "third_party"]

# optimizer -> the torch.optim class with fp32 state it stands in for; bitsandbytes and torchao
# name their 8-bit classes as roundpipe does
TORCH_PARTNER = {"AdamW8bit": "AdamW", "Adam8bit": "Adam"}
OPTIMIZERS = tuple(TORCH_PARTNER)
FUSED, BNB, TORCHAO = "torch fused", "bitsandbytes", "torchao"
THIRD_PARTY = {BNB: "bitsandbytes", TORCHAO: "torchao"}  # column -> the package it needs


def import_column(column: str):
    """The module ``column`` steps with: ``bitsandbytes.optim`` or ``torchao.optim``."""
    if column == BNB:
        import bitsandbytes

        return bitsandbytes.optim
    import torchao.optim

    return torchao.optim


def third_party(column: str):
    """``(module, None)`` where ``column``'s package imports, else ``(None, why)``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return import_column(column), None
    except ModuleNotFoundError:
        return None, "not installed"
    except Exception as e:  # noqa: BLE001 - a broken install: say so, time the rest
        return None, f"cannot be imported: {type(e).__name__}: {e}"


def make(config: str, name: str, params):
    """The optimizer of column ``config`` (``rp <backend>``, ``torch fused``, ``bitsandbytes``,
    ``torchao``) for 8-bit optimizer ``name`` over ``params``, with its library's defaults."""
    if config == FUSED:
        return getattr(torch.optim, TORCH_PARTNER[name])(params, fused=True)
    if config in THIRD_PARTY:
        module, why = third_party(config)
        if module is None:
            raise RuntimeError(f"{THIRD_PARTY[config]} {why}")
        return getattr(module, name)(params)
    return getattr(rp_optim, name)(params, backend=config.removeprefix("rp "))
