import math

import numpy as np
import pytest

from dayzero.engine.sampling_params import SamplingParams

NAN, INF = float("nan"), float("inf")

# (case id, kwargs, field the message must start with); in a list, the bad entry comes last
INVALID = [
    ("n-0", dict(n=0), "n"),
    ("n-neg", dict(n=-1), "n"),
    ("n-float", dict(n=1.5), "n"),
    ("n-bool", dict(n=True), "n"),
    ("max_tokens-0", dict(max_tokens=0), "max_tokens"),
    ("max_tokens-neg", dict(max_tokens=-5), "max_tokens"),
    ("max_tokens-str", dict(max_tokens="16"), "max_tokens"),
    ("max_tokens-float", dict(max_tokens=16.0), "max_tokens"),
    ("min_tokens-neg", dict(min_tokens=-1), "min_tokens"),
    ("min_tokens-gt-max", dict(min_tokens=5, max_tokens=4), "min_tokens"),
    ("min_tokens-str", dict(min_tokens="1"), "min_tokens"),
    ("temperature-neg", dict(temperature=-0.1), "temperature"),
    ("temperature-nan", dict(temperature=NAN), "temperature"),
    ("temperature-inf", dict(temperature=INF), "temperature"),
    ("temperature-ninf", dict(temperature=-INF), "temperature"),
    ("temperature-str", dict(temperature="1.0"), "temperature"),
    ("temperature-none", dict(temperature=None), "temperature"),
    ("top_p-0", dict(top_p=0.0), "top_p"),
    ("top_p-neg", dict(top_p=-0.5), "top_p"),
    ("top_p-above-1", dict(top_p=1.01), "top_p"),
    ("top_p-nan", dict(top_p=NAN), "top_p"),
    ("top_k-0", dict(top_k=0), "top_k"),
    ("top_k-minus2", dict(top_k=-2), "top_k"),
    ("top_k-float", dict(top_k=5.0), "top_k"),
    ("min_p-neg", dict(min_p=-0.01), "min_p"),
    ("min_p-above-1", dict(min_p=1.5), "min_p"),
    ("min_p-nan", dict(min_p=NAN), "min_p"),
    ("presence_penalty-low", dict(presence_penalty=-2.01), "presence_penalty"),
    ("presence_penalty-high", dict(presence_penalty=2.5), "presence_penalty"),
    ("presence_penalty-nan", dict(presence_penalty=NAN), "presence_penalty"),
    ("frequency_penalty-low", dict(frequency_penalty=-3), "frequency_penalty"),
    ("frequency_penalty-high", dict(frequency_penalty=2.01), "frequency_penalty"),
    ("frequency_penalty-inf", dict(frequency_penalty=INF), "frequency_penalty"),
    ("repetition_penalty-0", dict(repetition_penalty=0.0), "repetition_penalty"),
    ("repetition_penalty-neg", dict(repetition_penalty=-1.0), "repetition_penalty"),
    ("repetition_penalty-inf", dict(repetition_penalty=INF), "repetition_penalty"),
    ("repetition_penalty-nan", dict(repetition_penalty=NAN), "repetition_penalty"),
    ("seed-float", dict(seed=1.5), "seed"),
    ("seed-str", dict(seed="42"), "seed"),
    ("stop-empty-str", dict(stop=""), "stop"),
    ("stop-empty-in-list", dict(stop=["a", ""]), "stop"),
    ("stop-non-str-entry", dict(stop=["a", 3]), "stop"),
    ("stop-int", dict(stop=3), "stop"),
    ("stop_token_ids-neg", dict(stop_token_ids=[1, -1]), "stop_token_ids"),
    ("stop_token_ids-str-entry", dict(stop_token_ids=["1"]), "stop_token_ids"),
    ("stop_token_ids-int", dict(stop_token_ids=5), "stop_token_ids"),
    ("ignore_eos-int", dict(ignore_eos=1), "ignore_eos"),
    ("ignore_eos-str", dict(ignore_eos="false"), "ignore_eos"),
    ("include_stop_str_in_output-none", dict(include_stop_str_in_output=None),
     "include_stop_str_in_output"),
    ("logprobs-neg", dict(logprobs=-1), "logprobs"),
    ("logprobs-float", dict(logprobs=2.0), "logprobs"),
    ("logprobs-bool", dict(logprobs=True), "logprobs"),
]


@pytest.mark.parametrize("kwargs,field", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_value_raises_naming_field(kwargs, field):
    with pytest.raises(ValueError) as exc:
        SamplingParams(**kwargs)
    msg = str(exc.value)
    assert msg.startswith(field + " "), msg
    # the message shows the value given; for a list field, the offending entry
    value = kwargs[field]
    if isinstance(value, list):
        value = value[-1]
    assert msg.endswith(f"got {value!r}"), msg


def test_message_states_range_and_value():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0 and finite, got nan$"):
        SamplingParams(temperature=NAN)
    with pytest.raises(ValueError, match=r"^top_p must be in \(0, 1\], got 1.5$"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"^min_tokens must be <= max_tokens \(4\), got 5$"):
        SamplingParams(min_tokens=5, max_tokens=4)


VALID = [
    ("defaults", dict()),
    ("n-1", dict(n=1)),
    ("max_tokens-1", dict(max_tokens=1)),
    ("max_tokens-none", dict(max_tokens=None)),
    ("min_tokens-eq-max", dict(min_tokens=8, max_tokens=8)),
    ("min_tokens-with-max-none", dict(min_tokens=100, max_tokens=None)),
    ("temperature-0", dict(temperature=0.0)),
    ("temperature-int", dict(temperature=2)),
    ("temperature-large", dict(temperature=1e6)),
    ("top_p-1", dict(top_p=1.0)),
    ("top_p-tiny", dict(top_p=1e-9)),
    ("top_k-minus1", dict(top_k=-1)),
    ("top_k-1", dict(top_k=1)),
    ("min_p-0", dict(min_p=0.0)),
    ("min_p-1", dict(min_p=1.0)),
    ("penalties-at-bounds", dict(presence_penalty=-2.0, frequency_penalty=2.0)),
    ("repetition_penalty-small", dict(repetition_penalty=1e-3)),
    ("seed-0", dict(seed=0)),
    ("seed-negative", dict(seed=-7)),
    ("seed-huge", dict(seed=2 ** 70)),
    ("stop-list", dict(stop=["a", "\n\n"])),
    ("stop_token_ids-0", dict(stop_token_ids=[0])),
    ("logprobs-0", dict(logprobs=0)),
    ("logprobs-20", dict(logprobs=20)),
    ("numpy-scalars", dict(max_tokens=np.int64(4), temperature=np.float32(0.5))),
    ("bools", dict(ignore_eos=True, include_stop_str_in_output=True)),
]


@pytest.mark.parametrize("kwargs", [c[1] for c in VALID], ids=[c[0] for c in VALID])
def test_valid_edge_values_accepted(kwargs):
    sp = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        if name not in ("stop", "stop_token_ids"):
            assert getattr(sp, name) == value


def test_defaults():
    sp = SamplingParams()
    assert (sp.n, sp.max_tokens, sp.min_tokens) == (1, 16, 0)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1.0, 1.0, -1, 0.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert sp.seed is None and sp.logprobs is None
    assert sp.stop == [] and sp.stop_token_ids == []
    assert sp.ignore_eos is False and sp.include_stop_str_in_output is False
    assert not sp.greedy


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(3, np.int64(4))).stop_token_ids == [3, 4]
    sp = SamplingParams(temperature=np.float32(0.5), max_tokens=np.int64(4))
    assert type(sp.temperature) is float and type(sp.max_tokens) is int
    assert math.isclose(sp.temperature, 0.5)


@pytest.mark.parametrize("kwargs,greedy", [
    (dict(temperature=0.0), True),
    (dict(temperature=0.7, top_k=1), True),
    (dict(temperature=0.7), False),
    (dict(temperature=1e-6), False),
    (dict(top_k=2), False),
], ids=["t0", "top_k-1", "t0.7", "t-tiny", "top_k-2"])
def test_greedy_property(kwargs, greedy):
    assert SamplingParams(**kwargs).greedy is greedy
