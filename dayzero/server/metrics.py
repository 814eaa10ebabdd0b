"""Prometheus metrics (``GET /metrics``), in a registry of the app's own.

Engine state (queue lengths, cache blocks, state slots, preemptions, aborts) is read at scrape time
from the engine thread's latest stats snapshot; per-request numbers (tokens, latencies) are recorded by
the server when a request ends.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Gauges and counters read from the engine's stats at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, int]], queued: Callable[[], int]):
        self._stats, self._queued = stats, queued

    def collect(self):
        s = self._stats()
        gauges = [
            ("dayzero_requests_running", "Sequences the scheduler is running (a request with n > 1 counts n)", s["running"]),
            ("dayzero_requests_waiting", "Sequences waiting in the engine (new, or preempted)", s["waiting"]),
            ("dayzero_requests_queued", "Requests waiting for a place in the engine (--max-concurrent-requests)",
             self._queued()),
            ("dayzero_cache_blocks_used", "Paged cache blocks in use", s["blocks_total"] - s["blocks_free"]),
            ("dayzero_cache_blocks_free", "Paged cache blocks free", s["blocks_free"]),
            ("dayzero_state_slots_used", "Linear-attention state slots in use", s["slots_total"] - s["slots_free"]),
            ("dayzero_state_slots_free", "Linear-attention state slots free", s["slots_free"]),
            ("dayzero_prefix_cache_blocks", "Blocks the prefix cache can hand to a request with a shared prefix",
             s.get("blocks_cached", 0)),
            ("dayzero_prefix_cache_snapshots", "State snapshots kept for prefix hits", s.get("snapshots", 0)),
            ("dayzero_host_cache_blocks", "Evicted prefix-cache blocks kept in host memory (--host-cache-gib)",
             s.get("host_blocks_cached", 0)),
            ("dayzero_host_cache_snapshots", "Evicted state snapshots kept in host memory",
             s.get("host_snapshots_cached", 0)),
        ]
        if "window_blocks_total" in s:  # sliding-window layers with a pool of their own
            gauges += [("dayzero_cache_window_blocks_used", "Blocks of the sliding-window layers' own pool in use",
                        s["window_blocks_total"] - s["window_blocks_free"]),
                       ("dayzero_cache_window_blocks_free", "Blocks of the sliding-window layers' own pool free",
                        s["window_blocks_free"])]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], value)
            yield g
        for name, doc, key in [
            ("dayzero_preemptions", "Sequences preempted under cache pressure (recomputed later)", "preemptions"),
            ("dayzero_aborts", "Requests aborted before they finished (client gone, shutdown, failure)", "aborts"),
            ("dayzero_prefix_cache_queried_tokens", "Tokens of sequences admitted with prefix caching on",
             "prefix_queried_tokens"),
            ("dayzero_prefix_cache_hit_tokens", "Of those, tokens taken from the prefix cache (not computed)",
             "prefix_hit_tokens"),
            ("dayzero_host_cache_hit_blocks", "Prefix-cache blocks copied back from host memory for a hit",
             "host_hit_blocks"),
            ("dayzero_host_cache_hit_snapshots", "State snapshots copied back from host memory for a hit",
             "host_hit_snapshots"),
            ("dayzero_encoder_runs", "Images the vision encoder encoded", "encoder_runs"),
            ("dayzero_encoder_cache_hits", "Images whose features came from the encoder cache (the same image "
             "again, encoded once)", "encoder_cache_hits"),
        ]:
            c = CounterMetricFamily(name, doc)
            c.add_metric([], s.get(key, 0))
            yield c
        steps = CounterMetricFamily("dayzero_model_steps", "Model forward passes, by kind (decode: one row per "
                                    "sequence; prefill: any other, mixed included) and mode (graph: a replayed "
                                    "CUDA graph; eager)", labels=["kind", "mode"])
        for (kind, mode), n in sorted((s.get("model_steps") or {}).items()):
            steps.add_metric([kind, mode], n)
        yield steps
        if "replica_requests" in s:  # attention data parallelism: rank 0's queues above are replica 0's
            g = GaugeMetricFamily("dayzero_replica_requests", "Unfinished requests on each attention data-parallel "
                                  "replica (a new request goes to the one with the fewest)", labels=["replica"])
            for d, n in enumerate(s["replica_requests"]):
                g.add_metric([str(d)], n)
            yield g
        yield from _expert_families(s.get("expert_load") or {}, s.get("ep_size", 1))


def _expert_families(loads: dict, ep: int):
    """Routed (token, expert) pairs by expert-parallel rank and by expert (summed over the MoE layers), and each
    layer's imbalance; ``loads``: decoder layer index -> pairs per expert."""
    if not loads:
        return
    ranks = CounterMetricFamily("dayzero_ep_rank_routed_tokens", "(token, expert) pairs routed to the experts each "
                                "expert-parallel rank holds, summed over the MoE layers", labels=["rank"])
    for r, v in enumerate(sum(l.view(ep, -1).sum(1) for l in loads.values()).tolist()):
        ranks.add_metric([str(r)], v)
    yield ranks
    if len({l.numel() for l in loads.values()}) == 1:
        experts = CounterMetricFamily("dayzero_expert_routed_tokens", "(token, expert) pairs routed to each expert, "
                                      "summed over the MoE layers", labels=["expert"])
        for e, v in enumerate(sum(loads.values()).tolist()):
            experts.add_metric([str(e)], v)
        yield experts
    imbalance = GaugeMetricFamily("dayzero_expert_load_imbalance", "Per MoE layer, the busiest expert's pairs over "
                                  "the mean (1: balanced)", labels=["layer"])
    for i, l in loads.items():
        mean = l.double().mean().item()
        imbalance.add_metric([str(i)], l.max().item() / mean if mean else 1.0)
    yield imbalance


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, int]], queued: Callable[[], int]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("dayzero_prompt_tokens", "Prompt tokens of finished or aborted requests", registry=r)
        self.generation_tokens = Counter("dayzero_generation_tokens", "Generated tokens", registry=r)
        self.requests = Counter("dayzero_requests", "Generation requests that ended, by outcome", ["outcome"], registry=r)
        self.errors = Counter("dayzero_request_errors", "Requests refused with an error, by HTTP status", ["status"], registry=r)
        self.images_received = Counter("dayzero_images_received", "Image parts in chat requests", registry=r)
        self.images_rejected = Counter("dayzero_images_rejected", "Images refused, by reason (a request is refused at "
                                       "its first bad image; without a vision encoder, every image counts)",
                                       ["reason"], registry=r)
        self.ttft = Histogram("dayzero_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("dayzero_time_per_output_token_seconds", "Mean time per generated token after the first",
                              buckets=_TOKEN_TIME_BUCKETS, registry=r)
        self.e2e = Histogram("dayzero_e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r)
        r.register(_EngineCollector(stats, queued))

    def record(self, outcome: str, prompt_tokens: int, output_tokens: int, longest: int, ttft: float | None,
               total: float) -> None:
        """One ended request: ``output_tokens`` over all its choices, ``longest`` of its longest choice."""
        self.requests.labels(outcome).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(output_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            if longest > 1:
                self.tpot.observe((total - ttft) / (longest - 1))
        self.e2e.observe(total)

    def render(self) -> bytes:
        return generate_latest(self.registry)
