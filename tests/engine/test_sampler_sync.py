"""The sampler never waits for the device; the engine reads a step's results back in one copy.

On the CPU there is no device to wait for, so the CPU tests watch the calls that would wait on
CUDA: reads of tensor values into Python (``tolist``, ``item``, ``bool(t)``, ``.cpu()``, ...),
and host values turned into tensors anywhere but ``host_copy.to_device``. The CUDA tests check
the real thing with ``torch.cuda.set_sync_debug_mode``.
"""
import math
import warnings
from contextlib import contextmanager

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dayzero.engine import host_copy, sampler as sampler_mod
from dayzero.engine.host_copy import to_device
from dayzero.engine.sampler import Sampler, SamplerOutput, make_generator
from dayzero.engine.sampling_params import SamplingParams as SP

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# every kind of row: greedy, penalised greedy, filtered, seeded, min-p, unseeded with penalties
MIXED = [SP(temperature=0.0, logprobs=2), SP(temperature=0.0, repetition_penalty=1.5),
         SP(temperature=0.8, top_k=5, top_p=0.9, seed=3, logprobs=4), SP(min_p=0.1, seed=4),
         SP(temperature=1.2, presence_penalty=0.5, frequency_penalty=0.3, top_p=0.7), SP(logprobs=1)]
OUTPUT_IDS = [[1, 2], [3, 3, 40], [], [7], [0, 9, 9, 9], []]


def mixed_inputs(device="cpu", cpu_generator_row=None):
    logits = torch.randn(len(MIXED), 50, generator=torch.Generator().manual_seed(0)).to(device)
    gens = [make_generator(p.seed, device) if p.seed is not None else None for p in MIXED]
    if cpu_generator_row is not None:  # a CPU generator serving device logits
        gens[cpu_generator_row] = make_generator(MIXED[cpu_generator_row].seed)
    return logits, MIXED, gens, OUTPUT_IDS


def separate_tolists(out: SamplerOutput, num_top):
    """What the engine did before ``to_host``: one read per tensor."""
    top = None
    if out.top_ids is not None:
        top = [list(zip(i[:k], l[:k])) for k, i, l in
               zip(num_top, out.top_ids.tolist(), out.top_logprobs.tolist())]
    return out.token_ids.tolist(), out.logprobs.tolist(), top


def same(a, b) -> bool:
    """Equality of nested lists of numbers, with NaN equal to NaN."""
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b)) or (
        type(a) is type(b) and a == b)


# ---- to_device --------------------------------------------------------------------------------

def test_to_device_on_cpu_is_a_plain_tensor_and_never_pins(monkeypatch):
    pinned = []
    real_tensor = torch.tensor

    def tensor(*a, **kw):
        pinned.append(kw.get("pin_memory", False))
        return real_tensor(*a, **kw)

    def no_pin(self, *a, **kw):
        raise AssertionError("pin_memory() called for a CPU target")

    monkeypatch.setattr(torch, "tensor", tensor)
    monkeypatch.setattr(torch.Tensor, "pin_memory", no_pin)
    x = to_device([[1, 2, 3], [4, 5, 6]], torch.long, "cpu")
    assert x.dtype == torch.long and x.device.type == "cpu" and x.tolist() == [[1, 2, 3], [4, 5, 6]]
    y = to_device([0.5, -1.0], torch.float32, torch.device("cpu"))
    assert y.dtype == torch.float32 and y.tolist() == [0.5, -1.0]
    z = to_device(torch.arange(3), torch.float32, "cpu")
    assert z.dtype == torch.float32 and z.tolist() == [0.0, 1.0, 2.0]
    assert pinned == [False, False]


# ---- to_host ----------------------------------------------------------------------------------

BIG = [2 ** 24 + 1, 2 ** 31 - 1, -1, 2 ** 40 + 3]  # fp32 would round the first, third and fourth


def big_output() -> SamplerOutput:
    lps = torch.tensor([-0.1, float("nan"), float("-inf"), -3.3e-8])
    top_ids = torch.tensor([[2 ** 24 + 3, 5, 2 ** 33 + 1], [0, 1, 2], [7, 8, 9], [2 ** 25 + 1, 4, 6]])
    top_lps = torch.tensor([[-0.1, -2.0, -7.7], [float("nan")] * 3, [-1.0, -2.0, -3.0], [-0.3, -0.4, -0.5]])
    return SamplerOutput(torch.tensor(BIG), lps, top_ids, top_lps)


def test_to_host_round_trips_large_ids_and_nan_exactly():
    out = big_output()
    host = out.to_host()
    assert host.token_ids == BIG and all(type(i) is int for i in host.token_ids)
    assert same(host.logprobs, out.logprobs.tolist())  # the fp32 values, NaN and -inf kept
    assert same(host.top, separate_tolists(out, [3] * 4)[2])
    assert host.top[0][2] == (2 ** 33 + 1, out.top_logprobs[0, 2].item())


def test_to_host_trims_each_rows_alternatives():
    out = big_output()
    host = out.to_host([2, 0, 5, 1])
    assert [len(t) for t in host.top] == [2, 0, 3, 1]  # 5 > K keeps all K
    assert host.top[3] == [(2 ** 25 + 1, out.top_logprobs[3, 0].item())]
    no_top = SamplerOutput(out.token_ids, out.logprobs).to_host([2, 0, 5, 1])
    assert no_top.top is None and no_top.token_ids == BIG


def test_to_host_of_an_empty_batch():
    host = Sampler()(torch.empty(0, 10), [], []).to_host()
    assert host == ([], [], None)


def test_to_host_equals_separate_reads():
    out = Sampler()(*mixed_inputs())
    num_top = [p.logprobs or 0 for p in MIXED]
    host = out.to_host(num_top)
    assert same(list(host), list(separate_tolists(out, num_top)))
    assert [len(t) for t in host.top] == num_top


# ---- no host reads inside the sampler, one in to_host -------------------------------------------

READS = ("cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")


def _targets_cpu(args, kwargs) -> bool:
    for a in (*args, kwargs.get("device"), kwargs.get("other")):
        if isinstance(a, torch.Tensor):
            a = a.device
        if isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu":
            return True
    return False


@contextmanager
def host_reads(monkeypatch):
    """Records every call that would copy a CUDA tensor's values to the host."""
    calls = []
    with monkeypatch.context() as m:
        for name in READS:
            def read(self, *a, _real=getattr(torch.Tensor, name), _name=name, **kw):
                calls.append(_name)
                return _real(self, *a, **kw)
            m.setattr(torch.Tensor, name, read)

        def to(self, *a, _real=torch.Tensor.to, **kw):
            if _targets_cpu(a, kw):
                calls.append("to(cpu)")
            return _real(self, *a, **kw)
        m.setattr(torch.Tensor, "to", to)
        yield calls


def test_one_host_read_per_step(monkeypatch):
    inputs = mixed_inputs()
    with host_reads(monkeypatch) as in_sampler:
        out = Sampler()(*inputs)
    with host_reads(monkeypatch) as in_to_host:
        host = out.to_host([p.logprobs or 0 for p in MIXED])
    assert in_sampler == []
    assert len(in_to_host) == 1
    assert len(host.token_ids) == len(MIXED)


def test_the_counter_sees_reads():
    """The counter itself: each kind of read is recorded (so the test above can fail)."""
    t = torch.ones(2)
    with pytest.MonkeyPatch.context() as mp, host_reads(mp) as calls:
        t.tolist(), t[0].item(), bool(t[0]), t.to("cpu"), t.to(torch.device("cpu")), t.cpu()
        t.to(torch.float64)  # not a transfer
    assert calls == ["tolist", "item", "__bool__", "to(cpu)", "to(cpu)", "cpu"]


def test_host_values_reach_the_device_only_through_to_device(monkeypatch):
    """A tensor built from host values with ``device=`` is a blocking copy on CUDA, and so is a
    Python list used as an index; the sampler may only build tensors through ``to_device``."""
    inside, stray = [False], []

    def staged(*a, **kw):
        inside[0] = True
        try:
            return host_copy.to_device(*a, **kw)
        finally:
            inside[0] = False

    def watch(fn, name):
        def wrapped(*a, **kw):
            if not inside[0]:
                stray.append(name)
            return fn(*a, **kw)
        return wrapped

    class WatchIndex(TorchFunctionMode):
        """A Python list as an index, seen through the torch-function mode (patching ``torch.Tensor.__getitem__``
        on the class would leave the type a "sequence" for the rest of the process: ``torch.tensor([t])`` of a
        0-d tensor ``t`` then fails)."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) > 1:
                keys = args[1] if isinstance(args[1], tuple) else (args[1],)
                if any(isinstance(k, list) for k in keys):
                    stray.append(func.__name__)
            return func(*args, **(kwargs or {}))

    inputs = mixed_inputs()
    monkeypatch.setattr(sampler_mod, "to_device", staged)
    for name in ("tensor", "as_tensor", "from_numpy"):
        monkeypatch.setattr(torch, name, watch(getattr(torch, name), name))
    with WatchIndex():
        Sampler()(*inputs)
        assert stray == []
        torch.tensor([1]), torch.zeros(3)[[0, 1]]  # and the watch does see strays
    assert stray == ["tensor", "__getitem__"]


# ---- CUDA -------------------------------------------------------------------------------------

@contextmanager
def sync_debug(mode):
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


@needs_cuda
def test_cuda_to_device_does_not_synchronise():
    with sync_debug("error"):
        x = to_device([[1, 2], [3, 4]], torch.long, "cuda")
        y = to_device(torch.arange(4.0), torch.float32, "cuda")
    assert x.device.type == "cuda" and x.tolist() == [[1, 2], [3, 4]]
    assert y.device.type == "cuda" and y.tolist() == [0.0, 1.0, 2.0, 3.0]


@needs_cuda
def test_cuda_sampler_never_synchronises_and_to_host_once():
    logits, params, gens, out_ids = mixed_inputs("cuda", cpu_generator_row=3)
    Sampler()(logits, params, gens, out_ids)  # lazy CUDA set-up (handles, pinned pool) happens once
    torch.cuda.synchronize()
    with sync_debug("error"):
        out = Sampler()(logits, params, gens, out_ids)  # raises on any synchronising call
    num_top = [p.logprobs or 0 for p in params]
    with warnings.catch_warnings(record=True) as caught, sync_debug("warn"):
        warnings.simplefilter("always")
        host = out.to_host(num_top)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, [str(w.message) for w in syncs]
    assert same(list(host), list(separate_tolists(out, num_top)))
    # and the device result is the CPU result for the greedy rows
    cpu = Sampler()(*mixed_inputs())
    assert host.token_ids[:2] == cpu.token_ids[:2].tolist()
