"""Conformance suite: every ``roundpipe.optim`` optimizer, on every backend (``reference``,
``fast`` with each of its engines: ``fast:numba``, ``fast:torch``, ``fast:numexpr``), against torch.optim.

* ``cases.py``            the table of cases: one (optimizer, kwargs) per entry, and the backends;
* ``harness.py``          the parameter set, the gradients, the step-by-step comparison and the
  error statistics;
* ``deviations.py``       the declared deviations from torch: (backends, optimizer, options,
  comparisons, tolerance or expected failure, reason, what was measured);
* ``test_conformance.py`` one test per (case, backend);
* ``staged_cases.py``     the staged optimizers' (Adafactor, Muon) parameter sets and cases;
* ``test_staged.py``      those bit for bit on every backend, state_dict both ways, and their
  errors (torch's exception, nothing moved);
* ``conftest.py``         the end-of-session summary table (and JSON report).

Run with ``pytest conformance/``. Set ``ROUNDPIPE_CONFORMANCE_REPORT=path.json`` to also get
the summary as JSON.
"""
