"""Prometheus metrics in vLLM's names and units, and the periodic load log line.

Two sources, both read outside the engine's step loop:

* the engine's cumulative statistics (`AsyncLLMEngine.stats()`), read at scrape time by
  `EngineCollector`: running/waiting gauges, KV-cache usage (fraction of blocks in use, 0..1 as
  vLLM's `kv_cache_usage_perc`), preemptions and prefix-cache queries/hits (in tokens), and with
  speculative decoding vLLM's `spec_decode_num_drafts` / `_num_draft_tokens` / `_num_accepted_tokens`
  / `_num_accepted_tokens_per_pos` (label `position`) counters; and `lmforge:kernel_info` (value 1:
  labels `linear`, `attention`, `dtype`, `dtype_choice` say which kernels run and why that dtype);
* each request's `RequestOutput`, observed by the HTTP layer when the request ends: token
  counters, finish reasons and the latency histograms, from the timestamps the engine recorded
  (arrival, first scheduled, first token, each token, finished).

Every family carries a `model_name` label, and lives in a private `CollectorRegistry`, so several
apps in one process (tests) never collide. This module knows nothing about HTTP or scheduling.

    curl -s localhost:8000/metrics | grep '^vllm:'
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from lmforge.engine import RequestOutput
from lmforge.eval.metrics import repeated_ngram_rate

log = logging.getLogger("lmforge.serve")

# vLLM's buckets (seconds), so dashboards built for vLLM read ours unchanged
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                   240.0, 480.0, 960.0, 1920.0, 7680.0)


def token_buckets(max_model_len: int) -> list[float]:
    """1-2-5 buckets up to max_model_len, as vLLM's `build_1_2_5_buckets`."""
    out, exp = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exp
            if v > max_model_len:
                return out
            out.append(float(v))
        exp += 1


class EngineCollector:
    """Reads each served version's engine statistics at scrape time (a custom collector, so counters the
    engine already accumulates are exposed as-is rather than mirrored)."""

    def __init__(self, stats_fn: Callable[[], dict[str, dict]], model_name: str):
        self.stats_fn, self.model_name = stats_fn, model_name

    def collect(self):
        per_version = self.stats_fn() or {}
        specs = [
            (GaugeMetricFamily, "vllm:num_requests_running", "Number of requests in the running batch.",
             lambda s: s["num_requests_running"]),
            (GaugeMetricFamily, "vllm:num_requests_waiting", "Number of requests waiting to be scheduled.",
             lambda s: s["num_requests_waiting"]),
            (GaugeMetricFamily, "vllm:kv_cache_usage_perc", "KV-cache usage: fraction of blocks in use (1 means 100 percent).",
             lambda s: s["kv_blocks_in_use"] / (s["kv_blocks_total"] or 1)),
            (CounterMetricFamily, "vllm:num_preemptions", "Cumulative number of preemptions.", lambda s: s["preemptions"]),
            (CounterMetricFamily, "vllm:prefix_cache_queries", "Prefix-cache queries, in tokens.",
             lambda s: s["prefix_cache_queries"]),
            (CounterMetricFamily, "vllm:prefix_cache_hits", "Prefix-cache hits, in tokens.", lambda s: s["prefix_cache_hits"]),
        ]
        if not per_version:  # engine still loading
            return
        for cls, name, doc, value in specs:
            f = cls(name, doc, labels=["model_name", "model_version"])
            for version, s in per_version.items():
                f.add_metric([self.model_name, version], value(s))
            yield f
        yield from self._spec_decode(per_version)
        yield from self._kernel_info(per_version)

    def _kernel_info(self, per_version: dict[str, dict]):
        """`lmforge:kernel_info` = 1, labelled with what runs: the linear and attention backends, the compute
        dtype and why `--dtype auto` chose it (the Prometheus info-metric idiom)."""
        labels = ["model_name", "model_version", "linear", "attention", "dtype", "dtype_choice"]
        f = GaugeMetricFamily("lmforge:kernel_info", "Kernels and compute dtype the engine runs (value 1).",
                              labels=labels)
        for version, s in per_version.items():
            if "linear_backend" in s:
                f.add_metric([self.model_name, version, s["linear_backend"], s.get("attention_backend", ""),
                              s.get("dtype", ""), s.get("dtype_choice", "")], 1)
        yield f

    def _spec_decode(self, per_version: dict[str, dict]):
        """vLLM's speculative-decoding counters, for the versions whose engine speculates (as vLLM: only then)."""
        spec = {v: s for v, s in per_version.items() if "spec_decode_num_drafts" in s}
        if not spec:
            return
        for key, doc in (("num_drafts", "Number of spec decoding drafts."),
                         ("num_draft_tokens", "Number of draft tokens."),
                         ("num_accepted_tokens", "Number of accepted tokens.")):
            f = CounterMetricFamily(f"vllm:spec_decode_{key}", doc, labels=["model_name", "model_version"])
            for version, s in spec.items():
                f.add_metric([self.model_name, version], s[f"spec_decode_{key}"])
            yield f
        f = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                                labels=["model_name", "model_version", "position"])
        for version, s in spec.items():
            for pos, n in enumerate(s["spec_decode_num_accepted_tokens_per_pos"]):
                f.add_metric([self.model_name, version, str(pos)], n)
        yield f


class ExchangeLogCollector:
    """`--log-requests`' queue at scrape time: rows dropped (queue full or writer gone) and rows waiting."""

    def __init__(self, log_fn: Callable[[], object | None]):
        self.log_fn = log_fn

    def collect(self):
        x = self.log_fn()
        if x is None:
            return
        yield CounterMetricFamily("lmforge:exchange_log_dropped", "Exchanges not stored by --log-requests "
                                  "(its queue was full, or its writer failed).", value=x.dropped)
        yield GaugeMetricFamily("lmforge:exchange_log_pending", "Exchanges queued for the writer process, "
                                "not yet committed.", value=x.pending)


FEEDBACK_BUCKETS = (-1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0)


FEEDBACK_EXCHANGES = 100_000  # exchanges per version whose latest score the low-score ratio remembers


class ServerMetrics:
    """Request-level families carry `model_name` and `model_version` (the served version that answered)."""

    def __init__(self, model_name: str, max_model_len: int, stats_fn: Callable[[], dict[str, dict]],
                 exchange_log_fn: Callable[[], object | None] = lambda: None):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lab = ["model_name", "model_version"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lab, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", lab,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Count of finished requests by finish reason.",
                                       lab + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token, seconds.", lab,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency, seconds.", lab,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency, seconds.", lab,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue = Histogram("vllm:request_queue_time_seconds", "Time from arrival to first scheduling, seconds.",
                               lab, buckets=REQUEST_BUCKETS, registry=r)
        tb = token_buckets(max_model_len)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.", lab, buckets=tb,
                                    registry=r)
        self.req_gen = Histogram("vllm:request_generation_tokens", "Generation tokens per request.", lab, buckets=tb,
                                 registry=r)
        self.http_errors = Counter("lmforge:http_errors", "HTTP error responses by status.", ["model_name", "status"],
                                   registry=r)
        self.engine_restarts = Counter("lmforge:engine_restarts", "Times the engine died and was restarted.",
                                       registry=r)
        self.feedback_score = Histogram("lmforge:feedback_score", "Users' feedback scores (thumbs -1/+1, or 1-5).",
                                        lab, buckets=FEEDBACK_BUCKETS, registry=r)
        self.low_score_ratio = Gauge("lmforge:feedback_low_score_ratio",
                                     "Fraction of feedback that is low (thumbs down, or 1-2 of 5).", lab, registry=r)
        self.auto_rollbacks = Counter("lmforge:canary_rollbacks", "Automatic rollbacks of the challenger.", registry=r)
        self.repetition = Histogram("lmforge:output_repeated_ngram_rate",
                                    "Per output: share of its word 3-grams already seen earlier in it (1 = a loop).",
                                    lab, buckets=(0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9, 1.0), registry=r)
        r.register(EngineCollector(stats_fn, model_name))
        r.register(ExchangeLogCollector(exchange_log_fn))
        self._children: dict[str, dict] = {}
        # version -> {exchange id: its latest score is low}, the store's and the canary guard's rule:
        # each exchange counts once, however often it is re-scored (bounded: the oldest are forgotten)
        self._feedback: dict[str, OrderedDict[str, bool]] = {}
        self.totals = dict(prompt_tokens=0, generation_tokens=0, requests=0)  # plain ints for the load log

    def _c(self, version: str) -> dict:
        """Label children resolved once per version: `.labels()` takes a lock and a dict lookup per call."""
        c = self._children.get(version)
        if c is None:
            m = (self.model_name, version)
            c = self._children[version] = dict(
                prompt=self.prompt_tokens.labels(*m), gen=self.generation_tokens.labels(*m),
                ttft=self.ttft.labels(*m), itl=self.itl.labels(*m), e2e=self.e2e.labels(*m),
                queue=self.queue.labels(*m), req_prompt=self.req_prompt.labels(*m), req_gen=self.req_gen.labels(*m))
        return c

    def observe_itl(self, version: str, seconds: float) -> None:
        self._c(version)["itl"].observe(seconds)

    def observe_finished(self, version: str, out: RequestOutput, finish_reason: str | None = None) -> None:
        """Called once per engine request when it ends (finished, aborted or failed)."""
        c, m = self._c(version), out.metrics
        n_prompt = len(out.prompt_token_ids)
        n_gen = sum(len(o.token_ids) for o in out.outputs)
        reason = finish_reason or (out.outputs[0].finish_reason if out.outputs else None) or "abort"
        c["prompt"].inc(n_prompt)
        c["gen"].inc(n_gen)
        self.request_success.labels(self.model_name, version, reason).inc()
        c["req_prompt"].observe(n_prompt)
        c["req_gen"].observe(n_gen)
        if m.first_token_time is not None:
            c["ttft"].observe(max(m.first_token_time - m.arrival_time, 0.0))
        if m.first_scheduled_time is not None:
            c["queue"].observe(max(m.first_scheduled_time - m.arrival_time, 0.0))
        end = m.finished_time or time.time()  # an aborted request we no longer hear from: now
        c["e2e"].observe(max(end - m.arrival_time, 0.0))
        t = self.totals
        t["prompt_tokens"] += n_prompt
        t["generation_tokens"] += n_gen
        t["requests"] += 1

    def observe_feedback(self, version: str, score: float, low: bool, exchange_id: str) -> None:
        self.feedback_score.labels(self.model_name, version).observe(score)
        latest = self._feedback.setdefault(version, OrderedDict())
        latest.pop(exchange_id, None)
        latest[exchange_id] = low
        if len(latest) > FEEDBACK_EXCHANGES:
            latest.popitem(last=False)
        self.low_score_ratio.labels(self.model_name, version).set(sum(latest.values()) / len(latest))

    def observe_repetition(self, version: str, texts: list[str]) -> None:
        """Repeated output (the seed's "repeated output" symptom) as a distribution per version."""
        child = self.repetition.labels(self.model_name, version)
        for t in texts:
            rate = repeated_ngram_rate(t, 3)
            if rate is not None:  # too short to repeat a 3-gram: not an observation
                child.observe(rate)

    def count_error(self, status: int) -> None:
        self.http_errors.labels(self.model_name, str(status)).inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class LoadLogger:
    """One line every `interval` seconds while there is work; silent when idle. The first tick only
    takes the baseline: rates are over the time between two ticks, never since the counters began."""

    def __init__(self, metrics: ServerMetrics, interval: float = 5.0):
        self.metrics, self.interval = metrics, interval
        self._last: tuple | None = None

    def tick(self, stats: dict | None) -> str | None:
        now = time.monotonic()
        t = self.metrics.totals
        if stats is None:
            return None
        q, h = stats["prefix_cache_queries"], stats["prefix_cache_hits"]
        last, self._last = self._last, (now, t["generation_tokens"], t["prompt_tokens"], q, h)
        if last is None:
            return None
        t0, gen0, prompt0, q0, h0 = last
        dt = max(now - t0, 1e-9)
        running, waiting = stats["num_requests_running"], stats["num_requests_waiting"]
        busy = running or waiting or t["generation_tokens"] > gen0
        if not busy:
            return None
        line = (f"throughput: prompt {(t['prompt_tokens'] - prompt0) / dt:.1f} tok/s, "
                f"generation {(t['generation_tokens'] - gen0) / dt:.1f} tok/s | running {running}, "
                f"waiting {waiting} | KV usage {100 * stats['kv_blocks_in_use'] / max(stats['kv_blocks_total'], 1):.1f}% "
                f"| prefix hit rate {100 * (h - h0) / (q - q0) if q > q0 else 0.0:.1f}%")
        log.info(line)
        return line
