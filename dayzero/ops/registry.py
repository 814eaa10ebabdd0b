"""The ops registry: op name -> {platform: implementation}.

Every op has a pure-PyTorch ``reference`` implementation that runs on any device with fp32
accumulation. A platform (``cpu``, ``cuda``, ...) may register faster implementations with a
verifier that can refuse a call's shapes and say why; the refusal falls back to the reference.
The choice for each (op, platform) is logged once. ``DAYZERO_OPS="kda_pooled=reference,paged_mla=cuda"``
(or :func:`override`) forces a choice; the variable is checked whole (see :func:`env_overrides`).

:func:`use_platform` makes every call inside it pick another platform's implementations whatever the tensors'
device: ``dayzero.train`` runs the model under ``"train"``, whose implementations are autograd-safe and start
every sequence from zero state (ops it does not implement fall back to their references).
"""
from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import torch

log = logging.getLogger("dayzero.ops")

REFERENCE = "reference"


@dataclass
class Impl:
    fn: Callable
    # verifier(*args, **kwargs) -> None when the impl can run this call, else a reason string
    verifier: Callable[..., str | None] | None = None
    note: str = ""


@dataclass
class OpEntry:
    name: str
    impls: dict[str, Impl] = field(default_factory=dict)


_OPS: dict[str, OpEntry] = {}
_OVERRIDES: dict[str, str] = {}
_LOGGED: set[tuple[str, str]] = set()
# Wraps every op call while set (profilers, op tracing): hook(op, chosen, reason, fn, args, kwargs) runs
# ``fn(*args, **kwargs)`` itself and returns its result. None (the default) costs one comparison per call.
_HOOK: Callable | None = None
# The platform every call picks while :func:`use_platform` is active (None: the tensors' device decides).
_PLATFORM: str | None = None


def register(op: str, platform: str = REFERENCE, verifier=None, note: str = ""):
    """Decorator: ``@register("kda_chunk")`` for the reference, ``@register("kda_chunk", "cuda")`` else."""

    def deco(fn):
        _OPS.setdefault(op, OpEntry(op)).impls[platform] = Impl(fn, verifier, note)
        return fn

    return deco


class OpsOverrideError(ValueError, KeyError):
    """A bad ``DAYZERO_OPS``: a ValueError (a setting is wrong), and a KeyError like the one :func:`choose`
    raises for a forced platform that the op lacks."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


_ENV: tuple[str, dict[str, str]] = ("", {})  # the last DAYZERO_OPS value read, and what it means


def parse_overrides(spec: str) -> dict[str, str]:
    """``"op=platform,op=platform"`` -> {op: platform}. Every item is checked against the registered ops and
    their implementations: a malformed item, an unknown op or a platform the op lacks raises
    :class:`OpsOverrideError` naming the item."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        op, eq, plat = (p.strip() for p in item.partition("="))
        if not (eq and op and plat):
            raise OpsOverrideError(f"DAYZERO_OPS item {item!r} is not op=platform "
                                   f"(e.g. DAYZERO_OPS=kda_pooled=reference)")
        entry = _OPS.get(op)
        if entry is None:
            raise OpsOverrideError(f"DAYZERO_OPS item {item!r}: unknown op {op!r}; "
                                   f"registered ops: {', '.join(sorted(_OPS))}")
        if plat not in entry.impls:
            known = sorted({p for e in _OPS.values() for p in e.impls})
            unknown = "" if plat in known else f"; {plat!r} is no registered platform (platforms: {', '.join(known)})"
            raise OpsOverrideError(f"DAYZERO_OPS item {item!r}: op {op} has no {plat!r} implementation "
                                   f"(it has {', '.join(sorted(entry.impls))}){unknown}")
        out[op] = plat
    return out


def env_overrides() -> dict[str, str]:
    """``DAYZERO_OPS`` parsed and checked, once per value of the variable."""
    global _ENV
    spec = os.environ.get("DAYZERO_OPS", "")
    if spec != _ENV[0]:
        _ENV = (spec, parse_overrides(spec))
    return _ENV[1]


def override(op: str, platform: str | None) -> None:
    """Force ``op`` to ``platform`` (None removes the override)."""
    if platform is None:
        _OVERRIDES.pop(op, None)
    else:
        _OVERRIDES[op] = platform


def platform_of(device: torch.device | str) -> str:
    return torch.device(device).type


@contextlib.contextmanager
def use_platform(platform: str):
    """Inside the block every :func:`call` chooses ``platform``'s implementations (falling back to the reference
    where it has none), whatever device its tensors are on; forced choices (:func:`override`, ``DAYZERO_OPS``)
    still win."""
    global _PLATFORM
    prev, _PLATFORM = _PLATFORM, platform
    try:
        yield
    finally:
        _PLATFORM = prev


def active_platform() -> str | None:
    """The platform :func:`use_platform` has set, or None."""
    return _PLATFORM


def choose(op: str, platform: str, *args, **kwargs) -> tuple[str, Impl, str | None]:
    """Pick the implementation of ``op`` for ``platform``; returns (platform chosen, impl, why not faster)."""
    entry = _OPS.get(op)
    if entry is None:
        raise KeyError(f"unknown op {op!r}; registered ops: {sorted(_OPS)}")
    forced = _OVERRIDES.get(op) or env_overrides().get(op)
    if forced is not None:
        if forced not in entry.impls:
            raise KeyError(f"op {op!r} has no {forced!r} implementation; it has {sorted(entry.impls)}")
        return forced, entry.impls[forced], "forced"
    impl = entry.impls.get(platform)
    reason = None if impl is not None else f"no {platform} implementation"
    if impl is not None and impl.verifier is not None:
        reason = impl.verifier(*args, **kwargs)
    if impl is not None and reason is None:
        return platform, impl, None
    return REFERENCE, entry.impls[REFERENCE], reason


def call(op: str, *args, device: torch.device | str | None = None, **kwargs):
    """Run ``op`` with the implementation for ``device`` (taken from the first tensor argument if None), or for
    the platform :func:`use_platform` has set."""
    if _PLATFORM is not None:
        plat = _PLATFORM
    else:
        if device is None:
            device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        plat = platform_of(device)
    chosen, impl, reason = choose(op, plat, *args, **kwargs)
    key = (op, plat)
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info("op %s on %s: %s%s", op, plat, chosen, f" ({reason})" if reason else "")
    if _HOOK is not None:
        return _HOOK(op, chosen, reason, impl.fn, args, kwargs)
    return impl.fn(*args, **kwargs)


def set_hook(hook: Callable | None) -> Callable | None:
    """Install ``hook`` around every :func:`call` (None removes it); returns the hook it replaces."""
    global _HOOK
    prev, _HOOK = _HOOK, hook
    return prev


def table(platform: str) -> list[dict]:
    """Rows for ``dayzero ops``: op, implementation chosen on ``platform`` (without shape checks), reason."""
    rows = []
    for name in sorted(_OPS):
        entry = _OPS[name]
        impl = entry.impls.get(platform)
        rows.append({
            "op": name,
            "platform": platform,
            "implementation": platform if impl is not None else REFERENCE,
            "available": sorted(entry.impls),
            "note": "" if impl is not None else f"no {platform} implementation, uses the reference",
        })
    return rows


def registered() -> dict[str, OpEntry]:
    return dict(_OPS)
