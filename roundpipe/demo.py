"""Demo: train a small GPT-style language model with roundpipe's AdamW and torch's, side by side.

    python -m roundpipe.demo [--steps 30] [--threads N] [--backend fast] [--compare fast:torch,...]
                             [--optimizer AdamW|Adafactor|AdamW8bit] [--small]
                             [--mixed float16|bfloat16 [--compute auto|16-bit|float32]]
                             [--state-dtype bfloat16 | --dtype bfloat16 [--stochastic-rounding]]
                             [--fused [--dtype bfloat16]]

Identical copies of one model (``build_model``: token and position embeddings, pre-LayerNorm
transformer blocks with separate q/k/v/o projections, an untied output head: about 29M
parameters in 69 tensors, from 8M-element matrices down to 512-element biases and LayerNorm
weights) train on the same synthetic token stream (a random successor table: each token is
followed by one of 4 tokens, so there is something to learn; nothing is downloaded), each with
its own AdamW, in this order:

* ``roundpipe fast``: ``roundpipe.optim.AdamW`` on its default backend, ``fast`` (the numba
  engine: one compiled pass per step; the header says which engine it runs), or ``--backend``;
* ``torch fused``: ``torch.optim.AdamW(fused=True)``, torch's fused CPU kernel;
* ``torch for-loop``: ``torch.optim.AdamW(foreach=False)``, torch's default for CPU tensors;
* ``roundpipe <backend>`` for each ``--compare`` backend (e.g. ``fast:torch,fast:numexpr``;
  default none).

Every step, each copy runs its forward and backward pass on the same batch and then its
optimizer step; the order of the copies rotates from step to step, so machine noise hits them
alike. The demo times the forward+backward pass and the ``optimizer.step()`` of each copy and
prints the medians side by side, the speedups of each roundpipe copy over torch fused and over
torch's for-loop. Then the match: one step of each optimizer from the for-loop copy's final
parameters, gradients and state, against the for-loop's step, parameters and state compared
bit for bit (a backend that claims torch's for-loop bit for bit, ``backends.get(name).exact``,
must be; any other must pass ``torch.testing.assert_close``; else the exit status is 1), and
how far the trained copies ended up from the for-loop copy. Copies whose steps differ in the
last bits drift apart during training (their gradients differ, and Adam turns tiny gradient
differences into steps of about lr); torch fused shows the scale. Every number printed is
measured in this run.

``--optimizer Adafactor`` trains with Adafactor instead (``HYPERS``; no first moment, and a
matrix's second moment factored into a row and a column statistic). torch has no fused
Adafactor: its second copy is then ``torch foreach`` (``foreach=True``), and the speedups are
over torch's foreach and for-loop.

``--optimizer AdamW8bit`` trains with roundpipe's 8-bit AdamW against torch's fused fp32 AdamW
and, where installed, bitsandbytes' AdamW8bit, and checks after every step that roundpipe's copy
is bitsandbytes' bit for bit (``demo_eightbit.py``; 10 steps by default).

``--state-dtype bfloat16`` trains the float32 model with AdamW's moments stored in bfloat16, and
``--dtype bfloat16 [--stochastic-rounding]`` a pure bfloat16 model, each beside float32 AdamW
(``demo_stored.py``). ``--fused [--dtype bfloat16]``: ``AdamW(fused=True)`` against torch's, on
the float32 or a pure bfloat16 model, bit for bit every step (``demo_fused.py``).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import numexpr
import torch
import torch.nn.functional as F
from torch import nn

from roundpipe import demo_eightbit, demo_fused, demo_mixed, demo_stored
from roundpipe import optim as rp_optim
from roundpipe.demo_common import max_abs_diff, table, train_rotating
from roundpipe.optim import backends as rp_backends
from roundpipe.optim.bench.engine import FallbackWatch, fast_engine
from roundpipe.optim.bench.workloads import bits_mismatch

# (vocab, width, layers, heads, context, batch): the default model, and --small's (for tests)
SIZES = {"default": (16384, 512, 4, 8, 64, 2), "small": (512, 64, 2, 4, 16, 2)}
SUCCESSORS = 4  # each token of the synthetic language is followed by one of this many tokens
HYPER = {"lr": 1e-3, "betas": (0.9, 0.95), "weight_decay": 0.1}
# --optimizer: each one's hyperparameters (Adafactor: torch's lr, with weight decay)
HYPERS = {"AdamW": HYPER, "Adafactor": {"lr": 1e-2, "weight_decay": 0.1}, "AdamW8bit": HYPER}
OPTIMIZERS = tuple(HYPERS)
LOOP, FUSED, FOREACH = "torch for-loop", "torch fused", "torch foreach"
# torch's fastest CPU path of each, the demo's second copy: fused where torch has a CPU kernel
SECOND = {"AdamW": FUSED, "Adafactor": FOREACH}


def torch_for_loop(params, optimizer: str = "AdamW"):
    """torch's default for CPU tensors: the for-loop (``foreach=False``)."""
    return getattr(torch.optim, optimizer)(params, foreach=False, **HYPERS[optimizer])


def torch_second(optimizer: str):
    """The demo's second copy's optimizer: torch fused (AdamW) or foreach (Adafactor)."""
    kind = {"fused": True} if SECOND[optimizer] == FUSED else {"foreach": True}
    return lambda ps: getattr(torch.optim, optimizer)(ps, **kind, **HYPERS[optimizer])


class Block(nn.Module):
    """A pre-LayerNorm transformer block: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (
            m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, context: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def synthetic_tokens(vocab: int, context: int, sequences: int, gen: torch.Generator) -> torch.Tensor:
    """``sequences`` rows of ``context + 1`` tokens from a random successor table."""
    successors = torch.randint(0, vocab, (vocab, SUCCESSORS), generator=gen)
    tokens = torch.empty(sequences, context + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (sequences,), generator=gen)
    for t in range(context):
        pick = torch.randint(0, SUCCESSORS, (sequences,), generator=gen)
        tokens[:, t + 1] = successors[tokens[:, t], pick]
    return tokens


def build_model(size: str = "default") -> GPT:
    """The demo's model, ``"default"`` or ``"small"`` (``SIZES``; small: for tests), initialised
    from torch's global generator."""
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; valid: {', '.join(SIZES)}")
    vocab, d, layers, heads, context, _ = SIZES[size]
    return GPT(vocab, d, layers, heads, context)


def roundpipe_optimizer(backend: str, optimizer: str = "AdamW"):
    """roundpipe's ``optimizer`` (AdamW by default) on ``backend``, with the demo's settings."""
    return lambda ps: getattr(rp_optim, optimizer)(ps, backend=backend, **HYPERS[optimizer])


def optimizer_kinds(backend: str | None, compare=(), optimizer: str = "AdamW") -> dict:
    """name -> a function that makes that ``optimizer`` (AdamW, Adafactor or AdamW8bit) for
    some parameters, in the demo's order: roundpipe's default (or ``backend``), torch fused (for
    Adafactor, which torch has no fused kernel for: torch foreach), torch's for-loop (for
    AdamW8bit instead: bitsandbytes', where installed; ``demo_eightbit``), then each
    ``compare`` backend. A roundpipe name carries the backend actually used (``roundpipe
    fast``). ValueError for an unknown backend or optimizer, ImportError for a backend that
    cannot load here."""
    if optimizer not in HYPERS:
        raise ValueError(f"unknown optimizer {optimizer!r}; valid: {', '.join(OPTIMIZERS)}")
    probe = [nn.Parameter(torch.zeros(1))]
    chosen = rp_optim.AdamW(probe, backend=backend).backend  # None: the environment, else "fast"
    if optimizer in demo_eightbit.OPTIMIZERS:  # against torch fused fp32 and bitsandbytes
        kinds = demo_eightbit.optimizer_kinds(chosen, HYPERS[optimizer], optimizer)
    else:
        kinds = {
            f"roundpipe {chosen}": roundpipe_optimizer(chosen, optimizer),
            SECOND[optimizer]: torch_second(optimizer),
            LOOP: lambda ps: torch_for_loop(ps, optimizer),
        }
    for b in compare:
        name = rp_optim.AdamW(probe, backend=b).backend  # an alias (native) resolved
        kinds.setdefault(f"roundpipe {name}", roundpipe_optimizer(name, optimizer))
    return kinds


def engine_label(backend: str, fallbacks=()) -> str:
    """``fast: numba engine`` (plain ``fast`` names the engine it ran), else the backend name."""
    if backend != "fast":
        return backend
    info = fast_engine(fallbacks)
    return f"fast: {info['engine']} engine" + (" with fallbacks" if info["fell_back"] else "")


def one_step_check(make, model: nn.Module, opt, loop=torch_for_loop) -> tuple[float, bool, str | None]:
    """From ``model``'s parameters and gradients and ``opt``'s state (the for-loop copy's), one
    step with torch's for-loop (``loop``: AdamW's by default) and one with ``make``'s optimizer:
    (max abs difference of the parameters, whether parameters and every state tensor are equal
    bit for bit, None or the mismatch that ``torch.testing.assert_close`` reports)."""
    stepped = []
    for factory in (loop, make):
        m = copy.deepcopy(model)
        for p, q in zip(m.parameters(), model.parameters(), strict=True):
            p.grad = q.grad.clone()
        o = factory(m.parameters())
        o.load_state_dict(copy.deepcopy(opt.state_dict()))
        o.step()
        stepped.append((m, o))
    (ref_model, ref_opt), (got_model, got_opt) = stepped
    pairs = []
    for p, q in zip(got_model.parameters(), ref_model.parameters(), strict=True):
        pairs.append((f"param {tuple(q.shape)}", p.detach(), q.detach()))
        for key, v in ref_opt.state[q].items():
            if isinstance(v, torch.Tensor):
                pairs.append((f"state {key!r} {tuple(q.shape)}", got_opt.state[p][key], v))
    bitwise = all(bits_mismatch(a, b) is None for _, a, b in pairs)
    mismatch = None
    if not bitwise:
        try:
            for what, a, b in pairs:
                torch.testing.assert_close(a, b, msg=lambda m, what=what: f"{what}: {m}")
        except AssertionError as e:
            mismatch = str(e)
    return max_abs_diff(got_model, ref_model), bitwise, mismatch


def parse_args(argv=None):
    """``(args, kinds)``: the command line, and the optimizers it asks for (``optimizer_kinds``)."""
    parser = argparse.ArgumentParser(prog="python -m roundpipe.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="training steps (default 30)")
    parser.add_argument(
        "--backend", default=None, help="roundpipe's backend (default: fast, or the environment's)"
    )
    parser.add_argument(
        "--compare",
        default="",
        metavar="BACKEND[,BACKEND]",
        help=f"more roundpipe copies on these backends, from {','.join(rp_backends.NAMES)} "
        "(e.g. fast:torch,fast:numexpr; default none)",
    )
    parser.add_argument(
        "--threads", type=int, help="set torch's (and so roundpipe's) and numexpr's thread counts"
    )
    parser.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="AdamW",
        help="the optimizer every copy trains with (default AdamW; Adafactor: against torch's "
        "foreach and for-loop, torch having no fused Adafactor; AdamW8bit: against torch's fused "
        "fp32 AdamW and bitsandbytes' AdamW8bit where installed, bit for bit the latter)",
    )
    parser.add_argument("--small", action="store_true", help="a tiny model (for tests: seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--mixed",
        choices=("float16", "bfloat16"),
        help="instead: the model in this dtype with fp32 masters, loss scaling (float16) and clipping, "
        "against the same loop with torch.optim and explicit casts (roundpipe/demo_mixed.py)",
    )
    parser.add_argument(
        "--compute",
        choices=demo_mixed.COMPUTE,
        help="with --mixed: the forward and backward in its dtype (16-bit) or in float32 from the "
        "16-bit parameters (default auto: float32 where a 16-bit matmul is slow on this CPU)",
    )
    parser.add_argument(
        "--state-dtype",
        choices=("bfloat16",),
        help="instead: AdamW with its moments stored in this dtype (state_dtype=) on the float32 "
        "model, beside float32 moments and torch's fused step (roundpipe/demo_stored.py)",
    )
    parser.add_argument(
        "--dtype",
        choices=("bfloat16",),
        help="instead: a pure model of this dtype stepped as it is (torch's for-loop bit for bit), "
        "beside float32 AdamW on a float32 copy (roundpipe/demo_stored.py)",
    )
    parser.add_argument(
        "--fused",
        action="store_true",
        help="instead: AdamW(fused=True) against torch's AdamW(fused=True), on the float32 model or with "
        "--dtype bfloat16 a pure bfloat16 one (torchtune's layout), bit for bit every step (demo_fused.py)",
    )
    parser.add_argument(
        "--stochastic-rounding",
        action="store_true",
        help="with --dtype: also a copy whose parameters are rounded stochastically "
        "(stochastic_rounding=True), and whether it stayed closer to float32 than nearest rounding",
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 30
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.compute is not None and not (args.mixed or args.dtype):
        parser.error("--compute applies to --mixed and --dtype only")
    if args.mixed and args.optimizer != "AdamW":
        parser.error("--mixed trains with AdamW: drop --optimizer")
    stored = args.state_dtype or args.dtype
    if sum(map(bool, (args.mixed, args.state_dtype, args.dtype))) > 1:
        parser.error("--mixed, --state-dtype and --dtype are different demos: pick one")
    if args.stochastic_rounding and not args.dtype:
        parser.error("--stochastic-rounding applies to --dtype bfloat16 only")
    if args.fused and (
        args.mixed or args.state_dtype or args.stochastic_rounding or args.optimizer != "AdamW"
    ):
        parser.error("--fused trains AdamW(fused=True), alone or with --dtype bfloat16")
    if stored and args.optimizer != "AdamW":
        parser.error("--state-dtype and --dtype train with AdamW: drop --optimizer")
    args.compute = args.compute or "auto"
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
        numexpr.set_num_threads(args.threads)
    compare = [b.strip() for b in args.compare.split(",") if b.strip()]
    try:
        kinds = optimizer_kinds(args.backend, compare, args.optimizer)
    except (ValueError, ImportError) as e:  # an unknown backend, or fast:numba without numba
        parser.error(str(e))
    return args, kinds


def main(argv=None) -> int:
    args, kinds = parse_args(argv)
    size = "small" if args.small else "default"
    vocab, d, layers, heads, context, batch = SIZES[size]
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    data = synthetic_tokens(vocab, context, 64 * batch, gen)
    model = build_model(size)
    if args.mixed:
        return demo_mixed.run(args, model, data, gen, HYPER, batch, args.backend)
    if args.fused:
        return demo_fused.run(args, model, data, gen, HYPER, batch, args.backend)
    if args.state_dtype or args.dtype:
        return demo_stored.run(args, model, data, gen, HYPER, batch, args.backend)
    sizes = sorted(p.numel() for p in model.parameters())
    runs = {}
    for name, make in kinds.items():
        m = copy.deepcopy(model)
        runs[name] = (m, make(m.parameters()))
    del model
    names = list(runs)
    _print_header(args, names[0], sizes, size)
    if args.optimizer in demo_eightbit.OPTIMIZERS:
        return demo_eightbit.run(args, runs, data, gen, batch)
    med_step, med_fwd, drift, checks, fallbacks = train(args, runs, kinds, data, gen, batch)
    return print_report(args, names, med_step, med_fwd, drift, checks, fallbacks)


def _print_header(args, default, sizes, size):
    vocab, d, layers, heads, context, batch = SIZES[size]
    load = f"; load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""
    chosen = default.removeprefix("roundpipe ")
    copy_note = "" if chosen == rp_backends.DEFAULT else f"; this run's first copy: backend {chosen!r}"
    opt = getattr(args, "optimizer", "AdamW")
    hyper = ", ".join(f"{k}={v}" for k, v in HYPERS[opt].items())
    print(
        f"GPT-style language model: vocab {vocab}, d {d}, {layers} layers, {heads} heads, context "
        f"{context}; {sum(sizes):,} parameters in {len(sizes)} tensors ({sizes[0]:,} to {sizes[-1]:,} "
        f"elements)\nsynthetic tokens (each token followed by one of {SUCCESSORS}), batch {batch} x "
        f"{context}; {args.steps} steps of {opt}({hyper}) per copy\n"
        f"threads: torch {torch.get_num_threads()}, "
        f"roundpipe {rp_optim.get_num_threads()}, numexpr {numexpr.get_num_threads()}{load}\n"
        f"roundpipe's default backend: {fast_engine()['text']}{copy_note}"
    )


def train(args, runs, kinds, data, gen, batch):
    """Every copy's training steps (``demo_common.train_rotating``): the medians of the step and
    of the forward+backward, the drift of each copy from the for-loop's, the one-step checks
    (``one_step_check``) and the fallback warnings seen."""
    names = list(runs)
    with FallbackWatch() as watch:
        med_step, med_fwd = train_rotating(runs, data, gen, batch, args.steps)
        loop_model, loop_opt = runs[LOOP]
        drift = {n: max_abs_diff(runs[n][0], loop_model) for n in names}
        loop = kinds[LOOP]
        checks = {n: one_step_check(kinds[n], loop_model, loop_opt, loop) for n in names if n != LOOP}
    return med_step, med_fwd, drift, checks, watch.messages


def print_report(args, names, med_step, med_fwd, drift, checks, fallbacks) -> int:
    """The table, the speedups and the match verdicts; the exit status (1 on a mismatch)."""

    def equal_or(x: float) -> str:
        return "bitwise equal" if x == 0 else f"{x:.2e}"

    opt = getattr(args, "optimizer", "AdamW")
    second = SECOND[opt]  # torch fused, or torch foreach (Adafactor)
    short = second.removeprefix("torch ")

    rows = [
        [
            f"{n} {opt}",
            f"{med_step[n] * 1e3:.1f}",
            f"{med_fwd[n] * 1e3:.1f}",
            f"{100 * med_step[n] / (med_step[n] + med_fwd[n]):.0f}%",
            f"{med_step[second] / med_step[n]:.2f}x",
            f"{med_step[LOOP] / med_step[n]:.2f}x",
            "-" if n == LOOP else equal_or(checks[n][0]),
            "-" if n == LOOP else equal_or(drift[n]),
        ]
        for n in names
    ]
    header = [
        f"median of {args.steps} steps",
        "step ms",
        "fwd+bwd ms",
        "step share",
        f"vs {short}",
        "vs for-loop",
        "1-step diff",
        f"diff after {args.steps} steps",
    ]
    print()
    print(table(header, rows))
    print(
        f"vs {short}, vs for-loop: that step's median / this step's median; diffs: max |param - torch "
        "for-loop's|, after one step from the for-loop copy's final state, and between the trained copies"
    )
    print()
    roundpipe = [n for n in names if n.startswith("roundpipe ")]
    for n in roundpipe:
        label = engine_label(n.removeprefix("roundpipe "), fallbacks)
        print(
            f"speedup of roundpipe ({label}) over {second} {opt}: {med_step[second] / med_step[n]:.2f}x "
            f"(over torch's default for-loop: {med_step[LOOP] / med_step[n]:.2f}x)"
        )
    if fallbacks:
        print(f"note: {fast_engine(fallbacks)['text']}")
    status = 0
    for n in roundpipe:
        diff, bitwise, mismatch = checks[n]
        exact = rp_backends.get(n.removeprefix("roundpipe ")).exact
        if bitwise:
            print(f"{n}: a step is bitwise equal to torch's for-loop step (parameters and state)")
        elif mismatch or exact:
            claim = " (this backend claims bit for bit)" if exact else ""
            print(f"MISMATCH: one {n} step differs from torch's for-loop step{claim}:", file=sys.stderr)
            print(mismatch or f"max abs difference of the parameters {diff:.2e}", file=sys.stderr)
            print(f"{n}: a step is NOT equal to torch's for-loop step{claim}")
            status = 1
        else:
            print(
                f"{n}: a step is not bitwise equal to torch's for-loop step but close (assert_close; "
                f"max abs difference of the parameters {diff:.2e})"
            )
    if any(drift[n] for n in names):
        print(
            "(copies whose steps differ in the last bits drift apart in training: their gradients differ, "
            + (
                "and Adam scales every gradient to a step of about lr"
                if opt == "AdamW"
                else "and Adafactor scales every update to about lr times the parameter's RMS"
            )
            + f"; {second} shows the scale)"
        )
    return status


if __name__ == "__main__":
    sys.exit(main())
