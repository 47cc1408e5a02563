"""The public API as type checkers and editors see it: mypy on a user's script that uses every
public name (``user_script.py``), the optimizers' declared ``__init__`` (``optimizers.py``, and
``eightbit.py`` for bitsandbytes' 8-bit family) against the signature they run with, and
``py.typed``."""

import ast
import inspect
import os
import pathlib
import subprocess
import sys

import pytest

import roundpipe
import roundpipe.optim as ro
from roundpipe.optim import eightbit, optimizers
from roundpipe.optim.spec import EIGHTBIT_SPECS, SPECS, STAGED_SPECS

# every optimizer class (Muon where this torch has it), by the registry it is made from
ALL_SPECS = {**SPECS, **STAGED_SPECS, **EIGHTBIT_SPECS}

HERE = pathlib.Path(__file__).parent
ROOT = HERE.parents[1]

# what mypy must reveal at each reveal_type of user_script.py, in order
REVEALED = [
    "roundpipe.optim.optimizers.AdamW",
    "builtins.str",
    "builtins.list[torch._tensor.Tensor]",
    "torch._tensor.Tensor",
    "torch._tensor.Tensor | None",
    "builtins.int",
    "builtins.bool",
]


def _mypy(tmp_path, script):
    # as a user's checker sees an installed package: types followed, its own errors not reported
    cmd = [sys.executable, "-m", "mypy", "--follow-imports=silent", "--show-error-codes"]
    cmd += ["--no-error-summary", "--cache-dir", str(tmp_path / "cache"), "--no-pretty", str(script)]
    env = {k: v for k, v in os.environ.items() if k != "MYPYPATH"}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_mypy_sees_every_public_name_with_its_type(tmp_path):
    """``user_script.py``, and each registered optimizer constructed with its spec's rich options
    (generated here, so a new optimizer is checked without an edit to this file)."""
    script = tmp_path / "user_script.py"
    generated = [
        f"reveal_type(ro.{name}(params, {', '.join(f'{k}={v!r}' for k, v in spec.rich_kwargs.items())}))"
        for name, spec in ALL_SPECS.items()
    ]
    script.write_text((HERE / "user_script.py").read_text() + "\n".join(generated) + "\n")
    out = _mypy(tmp_path, script)
    lines = out.stdout.splitlines()
    errors = [line for line in lines if ": error:" in line]
    assert not errors and out.returncode == 0, out.stdout + out.stderr
    revealed = [line.split('Revealed type is "')[1].rstrip('"') for line in lines if "Revealed type" in line]
    expected = REVEALED + [f"{getattr(ro, name).__module__}.{name}" for name in ALL_SPECS]
    assert [r.replace("builtins.", "") for r in revealed] == [r.replace("builtins.", "") for r in expected]


def test_mypy_flags_a_misspelled_argument(tmp_path):
    """The declared signatures are what mypy checks calls against: a typo is an error."""
    script = tmp_path / "typo.py"
    script.write_text("import torch, roundpipe.optim as ro\nro.AdamW([torch.zeros(1)], weight_decy=0.1)\n")
    out = _mypy(tmp_path, script)
    assert out.returncode == 1 and 'Unexpected keyword argument "weight_decy"' in out.stdout, out.stdout


def test_the_user_script_names_every_public_name():
    """Every public name but the optimizer classes (the mypy test adds one call per spec)."""
    tree = ast.parse((HERE / "user_script.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    missing = set(ro.__all__) - imported - set(ALL_SPECS) - {"Muon"}
    assert not missing, sorted(missing)
    assert set(ALL_SPECS) <= set(ro.__all__), "every registered spec has a public class"


def _declared_init(name):
    """The ``__init__`` declared for the type checker for class ``name`` (in ``optimizers.py`` or
    ``eightbit.py``), or where it declares none (a ``Paged`` 8-bit class), its base's."""
    module = eightbit if name in EIGHTBIT_SPECS else optimizers
    tree = ast.parse(inspect.getsource(module))
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name)
    found = [n for n in ast.walk(cls) if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    return found[0] if found else _declared_init(cls.bases[0].id)


def _declared_parameters(fn):
    """``[(name, kind, default)]`` of a declared ``def``, ``self`` left out."""
    a = fn.args
    positional = a.posonlyargs + a.args
    defaults = [inspect.Parameter.empty] * (len(positional) - len(a.defaults)) + [
        ast.literal_eval(d) for d in a.defaults
    ]
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    out = [(p.arg, kind, d) for p, d in zip(positional, defaults, strict=True)]
    out += [
        (p.arg, inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.empty if d is None else ast.literal_eval(d))
        for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)
    ]
    return out[1:]


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_declared_init_is_the_signature_it_runs_with(name):
    """The declaration (torch 2.13's signature, or bitsandbytes 0.50's, and ``backend``; the torch
    family's also ``state_dtype`` and ``stochastic_rounding``) names the same parameters, kinds
    and defaults as the ``__init__`` the class runs with on the installed torch, except
    parameters an older torch of the supported range lacks (declared, not accepted there) and
    the ``is_paged`` a ``Paged`` 8-bit class lacks (it declares its base's)."""
    runtime = [
        (p.name, p.kind, p.default)
        for p in list(inspect.signature(getattr(ro, name).__init__).parameters.values())[1:]
    ]
    declared = _declared_parameters(_declared_init(name))
    names = {n for n, _, _ in runtime}
    assert [d for d in declared if d[0] in names] == runtime
    ours = ("backend",) if name in EIGHTBIT_SPECS else ("backend", "state_dtype", "stochastic_rounding")
    kw = inspect.Parameter.KEYWORD_ONLY
    assert [p[:2] for p in runtime[-len(ours) :]] == [(n, kw) for n in ours]


def test_py_typed_ships_with_the_package():
    marker = pathlib.Path(roundpipe.__file__).parent / "py.typed"
    assert marker.is_file()
    assert '"py.typed"' in (ROOT / "pyproject.toml").read_text(), "listed as package data"
