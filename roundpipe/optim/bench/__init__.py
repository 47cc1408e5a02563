"""Benchmark roundpipe.optim against torch.optim's CPU paths, side by side in one process.

    python -m roundpipe.optim.bench [--quick] [--optimizers Adam,SGD] [--workloads small,per_param]
                                    [--backends fast,fast:torch | all] [--busy N] [--repeats N]
                                    [--warmup N] [--threads N | --no-one-thread] [--json PATH]
                                    [--plot PATH.png]
    python -m roundpipe.optim.bench --first-use [--model default|small] [--json PATH]
    python -m roundpipe.optim.bench --partners [bfloat16|float16] [--quick] [--optimizers ...]
                                    [--workloads large,small,transformer] [--busy N] [--repeats N]
                                    [--warmup N] [--threads N] [--json PATH]
    python -m roundpipe.optim.bench --dtype bfloat16|float16 | --state-dtype bfloat16|float16
                                    [the same options as --partners]

For every optimizer and workload, the same parameters and gradients (seeded) are stepped by each
engine, one column each, roundpipe's first (its default, ``fast``, leftmost):

* ``<backend>`` ``roundpipe.optim.<Name>(..., backend=<backend>)`` for each ``--backends`` entry:
  ``fast`` (the default: the numba engine, or the torch engine where numba cannot run, which the
  header says), ``fast:numba``, ``fast:torch``, ``fast:numexpr``, ``reference``. Default:
  ``fast``; ``--backends all`` = ``fast,fast:torch,fast:numexpr,reference``; ``native`` is
  accepted as the old name of ``fast:numba``;
* ``for-loop``  ``torch.optim.<Name>(..., foreach=False)`` (torch's default for CPU tensors);
* ``foreach``   ``torch.optim.<Name>(..., foreach=True)``;
* ``fused``     ``torch.optim.<Name>(..., fused=True)``, where torch has a CPU kernel
  (detected by trying; in torch 2.13: Adam, AdamW, SGD, Adagrad).

Optimizers (``--optimizers``): the eleven elementwise ones and Adafactor by default; Muon (torch
>= 2.9) when named: its step is mostly torch's bfloat16 Newton-Schulz, timed apart from the rest
(``timing.CALLOUTS``), on the workload's 2-D tensors only. torch has no fused Adafactor or Muon
and no Muon foreach (``n/a``); empty tensors are left out for Adafactor (torch's step divides by
the element count). A staged step's bytes per element sum its passes' (``traffic.staged_bytes``);
``state B/el`` is the optimizer state's bytes per parameter element after the timed steps.

``--optimizers AdamW8bit`` (or ``Adam8bit``; run only when named) times roundpipe's 8-bit
optimizer apart from the rest (``eightbit``), on ``large`` (4 x 4M for these rows), ``small`` and
``transformer``: roundpipe's backends against torch's fused fp32 step and bitsandbytes' and
torchao's 8-bit CPU steps (each where installed; bitsandbytes and torchao are imported by the
bench only, inside functions), with each column's bandwidth bound (16 bytes an element for 8-bit
state), state bytes and peak extra memory per parameter (``eightbit_memory``: a subprocess per
column), each roundpipe backend checked against bitsandbytes bit for bit.

``--dtype bfloat16`` (or ``float16``) times 16-bit parameters, gradients and state stepped as
they are: roundpipe against torch's for-loop on them (the ground truth, checked bit for bit
first) and torch's fused step on them, which computes in float32 and rounds once (another
result: its column says so, and the check counts where it differs). ``--state-dtype bfloat16``
times fp32 parameters with bfloat16 state (``state_dtype=``) against roundpipe's fp32 state and
torch's fused fp32 step, checked against its composition with torch's for-loop. Both show each
configuration's state bytes per parameter and the bytes a step moves per element
(``stored``).

Workloads (``--workloads``, default all): ``large`` (4 x 16M fp32), ``small`` (about 2,000
tensors of 0 to 1,024 elements), ``transformer`` (32000x512 embedding + 8 layers at d=512) and
``per_param``: one optimizer per parameter, each stepped once per step, as offload wrappers
(torchao's ``CPUOffloadOptimizer``) and ``register_post_accumulate_grad_hook`` training loops
do, so a step's fixed cost is paid once per tensor. It runs in two parts (each can be named on
its own): ``per_param_small``, 256 optimizers of one 4Ki-element tensor, and
``per_param_large``, 4 optimizers of one 4Mi-element tensor; columns: roundpipe's backends,
the for-loop and fused (no foreach), and a table of microseconds per ``step()`` call.

Methodology (the machine may be shared and noisy):

* each configuration takes ``--warmup`` steps first (state creation, compilation caches);
* then the configurations step round-robin (the starting one rotates each round) for
  ``--repeats`` rounds; the reported time is the **median** step time of each, and every ratio
  is between two medians of the same run;
* the memory bandwidth is measured in the same run (in-place ``mul_`` and ``copy_`` on 256 MiB
  arrays, before and after the optimizers; the higher of the two medians is the ceiling);
* the bandwidth-bound time of a step is its minimal traffic divided by that bandwidth; "% bw" is
  that bound over the measured median (100% = at the memory limit). The minimal traffic is
  derived from the spec program a step runs (``traffic``): each tensor the program uses before
  it assigns it, read once, plus each tensor it assigns, written once, 4 bytes per fp32 element;
* after timing, each roundpipe backend is checked against torch's for-loop: two steps from
  identical fresh inputs (one optimizer per parameter in ``per_param``), parameters and every
  state tensor compared bit for bit (integer views, NaN by position) for a backend that claims
  it (``backends.get(name).exact``: ``fast:torch``, ``reference``, and ``fast`` and
  ``fast:numba`` where the numba engine's probes say it reproduces this torch's rounding), else
  with ``torch.testing.assert_close`` (``fast:numexpr``); the header says which. A mismatch is
  reported in the table instead of a speedup and makes the exit status 1;
* configurations are built for one optimizer at a time and freed before the next;
* ``--busy N`` starts N processes that each keep a core busy (a pure-Python loop) before the
  first measurement and stops them after the last, to measure a machine that is doing other
  work too (data loading, the Python main thread, feeding a GPU): compare with a quiet run.

The report ends with a summary: on ``large`` and ``transformer`` (the kernels' time, not a
per-call overhead), for every optimizer but Muon, torch's fastest path (fused where it has a CPU
kernel, else the faster of the for-loop and foreach) over roundpipe's default backend, a ratio of
medians, at the run's thread count and at one thread. ``torchrun`` sets ``OMP_NUM_THREADS=1`` on
every rank, so a step there runs on one thread: after the run, a one-thread pass times those
configurations again, the same way, with torch's, numexpr's and roundpipe's thread counts at 1
(``timing.one_thread``; restored afterwards), so a regression at one thread shows next to the
many-thread ratio. It is skipped with ``--no-one-thread``, with ``--threads N`` (the whole run is
at that count) and where the run is at one thread already; the JSON document holds its rows
under ``one_thread`` and the summary under ``summary``. A roundpipe error in the pass shows in
its cell (and makes the exit status 1).

``--quick`` (a few minutes on 2 idle vCPUs with the default backend; ``all`` takes longer):
1 warm-up step and 3 repetitions instead of 2 and 7; ``large`` is 4 x 2M elements instead of
4 x 16M (still 128 MiB of Adam state, far above L3); ``transformer`` keeps d=512 but has a
8000-token embedding and 2 layers instead of 32000 and 8; ``per_param_large`` is 4 x 2Mi instead
of 4 x 4Mi; ``small`` and ``per_param_small`` are unchanged; the bandwidth probe uses 128 MiB
arrays.

``--first-use`` measures what a user waits for once, each in fresh subprocesses (``first_use``):
``import roundpipe.optim`` beyond ``import torch`` (median of 3), the first AdamW ``step()``
(default backend) of the demo's model with an empty kernel cache (``ROUNDPIPE_CACHE_DIR`` a new
temporary directory: cold), the first step again in a new process with that cache (warm), and
that process's third step (normal); against the goals import <= 0.5 s, cold first step <= 2 s,
warm first step <= 0.3 s beyond a normal step.

``--partners [bfloat16|float16]`` (bfloat16 when given without a value; ``partners``) times fp32
masters with low-precision partners (``roundpipe.optim.masters``) on the default backend, for
``large``, ``small`` and ``transformer`` (the default ``--workloads``): ``composition`` (unpaired
masters; a step widens the partners' grads into fp32 ones with ``torch._foreach_copy_``, steps,
and rounds the partners back the same way), ``fused`` (the masters paired; a step is
``opt.step()`` alone) and ``torch composition`` (the composition with torch's fused optimizer
where it has a CPU kernel, else its for-loop), with the same warm-up, round-robin and medians.
Its table gives each median, the speedup composition / fused, the bytes per element of each
(``traffic.partner_bytes``: fused moves the fp32 step's traffic with the grad read at 2 bytes
instead of 4, plus a 2-byte partner write; the composition adds the widen pass, read 2 + write
4, and the round-back pass, read 4 + write 2) and their ratio. Before timing, fused and
composition step twice from the same inputs and must leave masters, partners and every state
tensor equal bit for bit; a difference is reported and makes the exit status 1.

Modules: ``workloads`` (options, shapes, the configurations and the check against torch),
``traffic`` (bytes per element from the spec), ``timing`` (the round-robin loop, the bandwidth
probe, ``--busy`` workers, threads), ``report`` (tables, the summary, JSON, plot), ``engine``
(which engine ``fast`` runs), ``first_use`` (``--first-use``), ``partners`` (``--partners``),
``eightbit`` and ``eightbit_memory`` (the 8-bit rows), ``cli`` (arguments, the run and its
one-thread pass, ``main``).
"""

from .arguments import ALL_BACKENDS, parse_args, parse_backends, parse_names
from .cli import machine_meta, main, run
from .engine import FallbackWatch, fast_engine
from .report import configs_of, derived, failures_of, format_tables, report, to_json
from .timing import Row, bench_one, busy, measure_bandwidth, set_threads, thread_pools, timed_step
from .traffic import bytes_per_element, steady_program, traffic
from .workloads import (
    ALL_OPTIMIZERS,
    FOREACH,
    FUSED,
    LOOP,
    OPTIONS,
    PER_PARAM_PARTS,
    TORCH_CONFIGS,
    WORKLOAD_NAMES,
    WORKLOADS,
    PerParam,
    Workload,
    bits_mismatch,
    check,
    check_kind,
    clone_params,
    exact,
    has_fused,
    label,
    make_optimizer,
    make_workload,
    workload_parts,
)

__all__ = [
    "ALL_BACKENDS",
    "ALL_OPTIMIZERS",
    "FOREACH",
    "FUSED",
    "LOOP",
    "OPTIONS",
    "PER_PARAM_PARTS",
    "TORCH_CONFIGS",
    "WORKLOADS",
    "WORKLOAD_NAMES",
    "FallbackWatch",
    "PerParam",
    "Row",
    "Workload",
    "parse_backends",
    "parse_names",
    "bench_one",
    "busy",
    "bytes_per_element",
    "bits_mismatch",
    "check",
    "check_kind",
    "clone_params",
    "configs_of",
    "derived",
    "exact",
    "failures_of",
    "fast_engine",
    "format_tables",
    "has_fused",
    "label",
    "machine_meta",
    "main",
    "make_optimizer",
    "make_workload",
    "measure_bandwidth",
    "parse_args",
    "report",
    "run",
    "set_threads",
    "steady_program",
    "thread_pools",
    "timed_step",
    "to_json",
    "traffic",
    "workload_parts",
]
