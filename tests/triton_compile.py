"""Every Triton kernel the tests ran through the interpreter, compiled for an H100/H200 (sm90) on the CPU.

Triton's interpreter runs a kernel's Python body, so a kernel it runs right may still fail to compile: a name two
branches of a runtime ``if`` assign with tiles of different shapes, a constexpr the compiler cannot fold, a
layout the sm90 passes refuse. Without a GPU, tests/conftest.py records each interpreted launch (the kernel, its
arguments' types, its constexpr values and launch options); at the session's end the distinct specialisations
are compiled in a subprocess without ``TRITON_INTERPRET`` (Triton's front end, its sm90 passes and the bundled
ptxas), and any that fails fails the session with the kernel, its specialisation and the compiler's message.
``DAYZERO_TRITON_COMPILE=0`` turns the check off.

    python -m tests.triton_compile SPECS.pkl        # what the session end runs
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import importlib
import inspect
import os
import pickle
import subprocess
import sys
import tempfile
import time

import torch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
PER_KIND = 2  # specialisations compiled per (kernel, argument types, non-integer constexprs): sizes rarely matter
DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
          torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8",
          torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_specs: dict[tuple, dict] = {}
unmodelled: dict[str, str] = {}  # kernel -> why a launch of it was not recorded
_paused = False


@functools.cache
def _parameters(fn) -> tuple[set[str], dict]:
    """(the constexpr parameters' names, every parameter's default) of a kernel's Python function."""
    names, defaults = set(), {}
    for p in inspect.signature(fn).parameters.values():
        a = p.annotation
        if (isinstance(a, str) and a.endswith("constexpr")) or getattr(a, "__name__", "") == "constexpr":
            names.add(p.name)
        defaults[p.name] = p.default
    return names, defaults


def _arg_type(v) -> str | None:
    """Triton's signature type of a runtime argument (None: a constexpr, as Triton takes None)."""
    if v is None:
        return None
    if hasattr(v, "data_ptr") and hasattr(v, "dtype"):
        return "*" + DTYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2**31 <= v < 2**31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"argument of type {type(v).__name__}")


def record(fn, arg_names: list[str], args: tuple, kwargs: dict, into: dict | None = None) -> None:
    """Note one interpreted launch of the kernel ``fn`` (its Python function), in ``into`` (spec by key) or the
    session's record."""
    module, name = fn.__module__, fn.__qualname__
    if "<locals>" in name:
        unmodelled[f"{module}.{name}"] = "defined inside a function: not importable"
        return
    bound = dict(zip(arg_names, args))
    bound.update({k: v for k, v in kwargs.items() if k in arg_names})
    options = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    constexprs, defaults = _parameters(fn)
    signature, constants, aligned = {}, {}, []
    try:
        for i, n in enumerate(arg_names):
            v = bound.get(n, defaults[n])
            t = None if n in constexprs else _arg_type(v)
            if t is None:
                constants[n] = v
                signature[n] = "constexpr"
                continue
            signature[n] = t
            aligned_ptr = t.startswith("*") and v.data_ptr() % 16 == 0
            if aligned_ptr or (t in ("i32", "i64") and v % 16 == 0 and v != 0):
                aligned.append(i)
        pickle.dumps(constants)
    except (TypeError, KeyError, pickle.PicklingError, AttributeError) as e:
        # an argument this check does not model: the kernel stays the GPU tests' to compile (and is named)
        unmodelled[f"{module}.{name}"] = f"{type(e).__name__}: {e}"
        return
    flags = tuple(sorted((k, repr(v)) for k, v in constants.items() if not isinstance(v, int) or isinstance(v, bool)))
    kind = (module, name, tuple(signature.values()), flags)
    key = (kind, tuple(sorted((k, repr(v)) for k, v in constants.items())), tuple(sorted(options.items())))
    specs = _specs if into is None else into
    if key in specs or sum(k[0] == kind for k in specs) >= PER_KIND:
        return
    specs[key] = dict(module=module, name=name, signature=signature, constants=constants, aligned=aligned,
                       options=options)


def install() -> None:
    """Record every launch the interpreter runs from now on."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    if getattr(run, "_records", False):
        return

    def recording_run(self, *args, grid, warmup, **kwargs):
        if not _paused:
            record(self.fn, self.arg_names, args, kwargs)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    recording_run._records = True
    InterpretedFunction.run = recording_run


@contextlib.contextmanager
def unrecorded():
    """Launches inside are not recorded (a test's kernel that is meant not to compile)."""
    global _paused
    before, _paused = _paused, True
    try:
        yield
    finally:
        _paused = before


def recorded() -> list[dict]:
    return list(_specs.values())


def check(specs: list[dict] | None = None, timeout_s: float = 1800) -> tuple[int, str]:
    """Compile ``specs`` (default: those recorded) in a subprocess without the interpreter: (return code, its
    report)."""
    with tempfile.TemporaryDirectory(prefix="dayzero-sm90-") as d:
        path = os.path.join(d, "specs.pkl")
        with open(path, "wb") as f:
            pickle.dump(recorded() if specs is None else specs, f)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        p = subprocess.run([sys.executable, "-m", "tests.triton_compile", path], env=env, capture_output=True,
                           text=True, timeout=timeout_s,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return p.returncode, p.stdout + p.stderr


def compile_sm90(kernel, signature: dict, constants: dict, aligned, options: dict):
    """``kernel`` (a ``triton.jit`` function) compiled for an H100/H200 (sm90) without a GPU: Triton's front end,
    its sm90 passes and the bundled ptxas. ``signature``: type per argument name ("constexpr" for ``constants``');
    ``aligned``: the indices of arguments known 16-divisible (pointers 16-byte aligned), as a real launch
    specialises them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    return triton.compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def _compile(spec: dict) -> str | None:
    """None, or why ``spec`` did not compile."""
    try:
        kernel = functools.reduce(getattr, spec["name"].split("."), importlib.import_module(spec["module"]))
        while not hasattr(kernel, "arg_names") or not hasattr(kernel, "src"):  # autotuner / heuristics wrappers
            kernel = kernel.fn
        names = list(kernel.arg_names)
        constants = {(names.index(n),): v for n, v in spec["constants"].items()}
        compile_sm90(kernel, spec["signature"], constants, spec["aligned"], spec["options"])
    except Exception as e:  # the compiler's message is the report
        return f"{type(e).__name__}: {e}"
    return None


def _describe(spec: dict) -> str:
    consts = ", ".join(f"{k}={v!r}" for k, v in spec["constants"].items())
    return f"{spec['module']}.{spec['name']}({consts}) {spec['options']}"


def main(argv: list[str]) -> int:
    with open(argv[0], "rb") as f:
        specs = pickle.load(f)
    t0 = time.perf_counter()
    workers = max(1, min(4, os.cpu_count() or 1))
    with concurrent.futures.ProcessPoolExecutor(workers) as pool:
        errors = [(s, e) for s, e in zip(specs, pool.map(_compile, specs)) if e is not None]
    kernels = len({(s["module"], s["name"]) for s in specs})
    print(f"sm90 compile of the interpreted kernels: {len(specs)} specialisations of {kernels} kernels, "
          f"{len(errors)} failed, {time.perf_counter() - t0:.0f} s")
    for spec, err in errors:
        print(f"FAILED {_describe(spec)}\n    {err.strip()[-2000:]}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
