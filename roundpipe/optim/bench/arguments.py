"""The command line of ``python -m roundpipe.optim.bench``: its parser and the checks of what
argparse cannot check alone (``parse_args``)."""

from __future__ import annotations

import argparse
import importlib.util

from roundpipe import optim as rp_optim
from roundpipe.optim import backends as rp_backends

from . import partners, stored
from .eightbit_columns import OPTIMIZERS as EIGHTBIT_OPTIMIZERS
from .timing import log
from .workloads import (
    ALL_OPTIMIZERS,
    DEFAULT_OPTIMIZERS,
    SUMMARY_WORKLOADS,
    WORKLOAD_NAMES,
    WORKLOADS,
    is_staged,
)

# the constructor's arguments that are no hyperparameter (--dtype, --state-dtype: stored.py)
_NOT_OPTIONS = ("params", "backend", "state_dtype", "stochastic_rounding")
# every roundpipe engine worth timing (``--backends all``): the default first
ALL_BACKENDS = (rp_backends.DEFAULT, "fast:torch", "fast:numexpr", "reference")


def parse_names(text: str, valid, what: str) -> list[str]:
    by_lower = {v.lower(): v for v in valid}
    out = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        if item.lower() not in by_lower:
            raise argparse.ArgumentTypeError(f"unknown {what} {item!r}; valid: {', '.join(valid)}")
        if by_lower[item.lower()] not in out:
            out.append(by_lower[item.lower()])
    if not out:
        raise argparse.ArgumentTypeError(f"no {what} given")
    return out


def parse_backends(text: str) -> list[str]:
    """``--backends``: names from ``backends.NAMES`` or ``all`` (``ALL_BACKENDS``), in order,
    without repeats, the default (``fast``) moved first; a deprecated alias (``native``) is
    accepted as the name it stands for, with a note."""
    aliases = rp_backends.ALIASES
    items = []
    for item in text.split(","):
        item = item.strip()
        if item.lower() in aliases:
            log(f"note: --backends {item} is the old name of {aliases[item.lower()]}")
            item = aliases[item.lower()]
        items.append(item)
    names = parse_names(",".join(items), (*rp_backends.NAMES, "all"), "backend")
    out = []
    for b in names:
        for one in ALL_BACKENDS if b == "all" else (b,):
            if one not in out:
                out.append(one)
    return sorted(out, key=lambda b: b != rp_backends.DEFAULT)  # stable: the default first


def _option(text: str) -> tuple[str, str, object]:
    """``NAME.KEY=VALUE`` (``--option``) as ``(NAME, KEY, VALUE)``, VALUE a Python literal."""
    import ast

    target, sep, value = text.partition("=")
    name, dot, key = target.partition(".")
    if not (sep and dot and key):
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME.KEY=VALUE")
    if name not in ALL_OPTIMIZERS:
        raise argparse.ArgumentTypeError(f"{name!r} is not one of {', '.join(ALL_OPTIMIZERS)}")
    import inspect

    known = [k for k in inspect.signature(getattr(rp_optim, name)).parameters if k not in _NOT_OPTIONS]
    if key not in known:
        raise argparse.ArgumentTypeError(f"{name} has no hyperparameter {key!r}; it has {', '.join(known)}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        raise argparse.ArgumentTypeError(f"{value!r} in {text!r} is not a Python literal") from None
    return name, key, parsed


def parse_args(argv=None):
    p = _parser()
    args = p.parse_args(argv)
    apart = args.partners or args.dtype or args.state_dtype or args.fused  # a mode of its own table
    if args.workloads is None:
        args.workloads = list(partners.WORKLOADS if apart else WORKLOADS)
    if args.optimizers is None and args.fused:
        args.optimizers = list(stored.FUSED_OPTIMIZERS)
    if args.optimizers is None:  # --partners, --dtype, --state-dtype: the elementwise optimizers
        args.optimizers = [n for n in DEFAULT_OPTIMIZERS if not (apart and is_staged(n))]
    _check_args(p, args)
    return args


def _parser():
    p = argparse.ArgumentParser(
        prog="python -m roundpipe.optim.bench",
        description="Time roundpipe.optim against torch.optim (for-loop, foreach, fused) on CPU; "
        "or, with --first-use, what its first import and step cost.",
    )
    p.add_argument("--quick", action="store_true", help="a few minutes: fewer repetitions, smaller workloads")
    p.add_argument(
        "--optimizers",
        type=lambda s: parse_names(s, (*ALL_OPTIMIZERS, *EIGHTBIT_OPTIMIZERS), "optimizer"),
        default=None,
        help=f"comma-separated from {','.join(ALL_OPTIMIZERS + EIGHTBIT_OPTIMIZERS)}, e.g. Adam,SGD "
        "(default: all but Muon, whose step is mostly torch's bfloat16 Newton-Schulz matmuls, and "
        "the 8-bit ones; with --partners: the elementwise ones, all but Adafactor and Muon); "
        "AdamW8bit: roundpipe's against torch's fused fp32 AdamW, bitsandbytes' and torchao's "
        "AdamW8bit (where installed), with state and peak memory per parameter",
    )
    p.add_argument(
        "--workloads",
        type=lambda s: parse_names(s, WORKLOAD_NAMES, "workload"),
        default=None,
        help=f"comma-separated subset of {','.join(WORKLOAD_NAMES)} (default: {','.join(WORKLOADS)}; "
        f"per_param = per_param_small,per_param_large; with --partners: {','.join(partners.WORKLOADS)})",
    )
    p.add_argument(
        "--backends",
        type=parse_backends,
        default=[rp_backends.DEFAULT],
        help=f"roundpipe backends to time, comma-separated from {','.join(rp_backends.NAMES)}, or all "
        f"(= {','.join(ALL_BACKENDS)}); default: {rp_backends.DEFAULT}",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        metavar="N",
        help="keep N other processes busy (a pure-Python loop each) during the whole run (default 0)",
    )
    p.add_argument(
        "--after-backward",
        action="store_true",
        help="run a forward and backward pass (torch, untimed) right before every timed step, as "
        "in a training loop (default: steps back to back)",
    )
    p.add_argument("--repeats", type=int, help="round-robin repetitions (default 7, --quick 3)")
    p.add_argument("--warmup", type=int, help="warm-up steps per configuration (default 2, --quick 1)")
    p.add_argument(
        "--threads",
        type=int,
        help="set torch's and numexpr's thread counts (the whole run at that count: no one-thread pass)",
    )
    p.add_argument(
        "--no-one-thread",
        action="store_true",
        help="skip the one-thread pass: by default, after the run, roundpipe's default backend and "
        "torch's fastest path are timed again with every thread pool at one thread (as each rank "
        f"of a torchrun launch, which sets OMP_NUM_THREADS=1), on {' and '.join(SUMMARY_WORKLOADS)}, "
        "for the summary's one-thread column; skipped anyway with --threads or on one thread",
    )
    p.add_argument("--json", metavar="PATH", help="write all results (every sample) as JSON")
    p.add_argument("--plot", metavar="PATH.png", help="draw a chart (needs matplotlib: the 'plot' extra)")
    _add_modes(p)
    p.add_argument(
        "--option",
        action="append",
        default=[],
        type=_option,
        metavar="NAME.KEY=VALUE",
        help="an optimizer's hyperparameter for this run, over the bench's (e.g. SGD.momentum=0: plain "
        "SGD; the bench's SGD has momentum 0.9); repeatable",
    )
    p.add_argument(
        "--model",
        choices=("default", "small"),
        default="default",
        help="--first-use: the demo's model to step (default: default; small: tiny, for tests)",
    )
    return p


def _add_modes(p) -> None:
    """The modes that time something else than the default rows ("instead: ...")."""
    p.add_argument(
        "--first-use",
        action="store_true",
        help="instead: time import roundpipe.optim, and the first step of the demo's model with an "
        "empty (cold) and a filled (warm) kernel cache, each in fresh subprocesses",
    )
    p.add_argument(
        "--partners",
        nargs="?",
        const="bfloat16",
        choices=tuple(partners.DTYPES),
        help="instead: fp32 masters paired with bfloat16 (the default) or float16 partners; time the "
        "default backend's fused step against the composition (widen the grads, step, round back), "
        "and torch's composition, after checking fused equals the composition bit for bit",
    )
    p.add_argument(
        "--dtype",
        choices=tuple(stored.DTYPES),
        help="instead: bfloat16 (or float16) parameters, gradients and state, stepped as they are: "
        "roundpipe against torch's for-loop on them (the ground truth, checked bit for bit first) "
        "and torch's fused step on them (float32 math rounded once: another result)",
    )
    p.add_argument(
        "--fused",
        nargs="?",
        const="float32",
        choices=tuple(stored.FUSED_DTYPES),
        help="instead: fused=True on both sides, float32 (the default), bfloat16 or float16 parameters: "
        "roundpipe against torch's fused CPU kernel (Adam, AdamW, SGD, Adagrad), checked bit for bit first "
        "(a torch kernel known wrong is timed, not checked)",
    )
    p.add_argument(
        "--state-dtype",
        choices=tuple(stored.DTYPES),
        help="instead: fp32 parameters with bfloat16 (or float16) state (state_dtype=): roundpipe "
        "against itself with fp32 state and torch's fused fp32 step, with each one's state bytes per "
        "parameter (checked first: the composition with torch's for-loop, bit for bit)",
    )
    p.add_argument(
        "--amp",
        action="store_true",
        help="with --partners: the whole optimizer phase of mixed-precision training, loss scaling "
        "(float16) and clipping, folded into the fused step against the composition",
    )


def _check_args(p, args):
    """What argparse cannot check alone: combinations and ranges (``p.error`` exits)."""
    eight = [n for n in args.optimizers if n in EIGHTBIT_OPTIMIZERS]
    modes = [m for m, on in (("--partners", args.partners), ("--dtype", args.dtype)) if on]
    modes += ["--state-dtype"] if args.state_dtype else []
    modes += ["--fused"] if args.fused else []
    if eight and (modes or args.first_use or args.plot):
        without = ", ".join(modes) or "--first-use or --plot"
        p.error(f"{', '.join(eight)}: timed in the normal mode, without {without}")
    runs = modes + (["--first-use"] if args.first_use else [])
    if len(runs) > 1:
        p.error(f"{' and '.join(runs)} are different runs: give one")
    if args.dtype or args.state_dtype or args.fused:
        stored.check_args(p, args)
    if args.partners:
        others = [w for w in args.workloads if w not in partners.WORKLOADS]
        if others:
            p.error(f"--partners times {', '.join(partners.WORKLOADS)}, not {', '.join(others)}")
        if args.backends != [rp_backends.DEFAULT]:
            p.error(f"--partners times the default backend ({rp_backends.DEFAULT}): drop --backends")
        if args.plot:
            p.error("--plot draws the normal mode's times; --partners has its own table")
        staged = [n for n in args.optimizers if is_staged(n)]
        if staged:
            p.error(f"--partners times the elementwise optimizers, not {', '.join(staged)}")
    elif args.amp:
        p.error("--amp times the optimizer phase around paired masters: give --partners too")
    for b in args.backends:
        try:
            rp_backends.resolve(b)
        except ImportError as e:  # fast:numba where numba cannot be imported
            p.error(f"--backends {b}: {e}")
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        p.error("--warmup must be at least 0")
    if args.busy < 0:
        p.error("--busy must be at least 0")
    if args.threads is not None and args.threads < 1:
        p.error("--threads must be at least 1")
    if args.plot and args.first_use:
        p.error("--plot draws the workloads' times; --first-use has none")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        p.error(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            "(or pip install -e '.[plot]'), or drop --plot"
        )
