"""`lmforge serve --replicas N` (lmforge.serve.replicas): N engines on Ray actors behind the one app.

Through the real `openai` client: a stream through 2 replicas gives the single engine's greedy
text; a shared-prefix workload hits the prefix cache (vllm:prefix_cache_hits / queries, read from
/metrics) at least as often as one engine does; a replica killed mid-stream fails at most its own
requests, the others finish, Ray restarts it and it serves again. The router's policy is tested
without Ray. One module-scoped local cluster (`ray.init(num_cpus=2)`), a tiny random Llama.

    python -m pytest -q tests/test_serve_replicas.py
"""

from __future__ import annotations

import re
import sys
import threading
import time

import httpx
import openai
import pytest
import ray

from lmforge.engine import AsyncLLMEngine, EngineConfig, EngineDeadError
from lmforge.eval.backends import TransformerBackend
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig
from lmforge.serve.replicas import PrefixRouter, RayReplicaEngine, block_hashes, sum_stats
from lmforge.serve.testing import ServerThread, make_model_with_tokenizer

ENGINE = {"device": "cpu", "dtype": "float32", "block_size": 4, "num_kv_blocks": 1024}
PREFIXES = ("the city school river national university python code data model token server request stream",
            "engine value error return function class import cache block world would where later up such")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("replicas")
    return make_model_with_tokenizer(tmp / "model", tmp / "tok", max_position_embeddings=2048)


@pytest.fixture(scope="module")
def cluster():
    if ray.is_initialized():  # another module's cluster: this module wants exactly 2 CPUs
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield
    ray.shutdown()


def _wait_ready(url: str, timeout: float = 180.0) -> None:
    deadline = time.time() + timeout
    while httpx.get(url + "/health/ready").status_code != 200:
        assert time.time() < deadline, httpx.get(url + "/health/ready").text
        time.sleep(0.2)


@pytest.fixture(scope="module")
def replicated(model_dir, cluster):
    config = EngineConfig(model=str(model_dir), **ENGINE)
    app = build_app(lambda: RayReplicaEngine(config, 2, poll_s=0.2), ServerConfig("tiny"))
    with ServerThread(app) as srv:
        _wait_ready(srv.url)
        yield srv, app.state.server.router.champion.engine


@pytest.fixture(scope="module")
def single(model_dir):
    app = build_app(lambda: AsyncLLMEngine(EngineConfig(model=str(model_dir), **ENGINE)), ServerConfig("tiny"))
    with ServerThread(app) as srv:
        _wait_ready(srv.url)
        yield srv


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)


def _prefix_counters(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics").text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.M))

    return total("vllm:prefix_cache_hits"), total("vllm:prefix_cache_queries")


# ---- the router's policy, without Ray ---------------------------------------------------------------------


def test_block_hashes_key_whole_prefixes():
    a, b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4), block_hashes([1, 2, 3, 4, 5, 6, 7, 0], 4)
    assert len(a) == 2 and a[0] == b[0] and a[1] != b[1]  # a partial block has no key
    assert block_hashes([9, 2, 3, 4, 5, 6, 7, 8], 4)[1] != a[1]  # block 2's key covers block 1 too


def test_router_keeps_a_prefix_on_its_replica_until_it_is_much_busier():
    r = PrefixRouter(2, block_size=4, abs_threshold=2, rel_threshold=2.0)
    up = [True, True]
    p, q = list(range(12)), list(range(100, 112))
    assert r.pick(p, up) == 0 and r.pick(q, up) == 1  # no known prefix: least loaded, ties in turn
    assert [r.pick(p + [50 + i], up) for i in range(3)] == [0, 0, 0] and r.routed["prefix"] == 3
    r.load = [3, 0]  # 3 more in flight and over twice as many: the prefix's replica is much busier
    assert r.pick(p, up) == 1 and r.routed["least_loaded"] == 3
    r.load = [0, 0]
    assert r.pick(p, up) == 1  # its blocks moved with it
    assert r.pick(p, [True, False]) == 0  # a replica that is down is never picked
    with pytest.raises(EngineDeadError, match="no replica"):
        r.pick(p, [False, False])


def test_stats_sum_counters_and_gauges_and_recompute_averages():
    a = dict(steps=2, kv_util_sum=1.0, prefix_cache_hits=4, prefix_cache_queries=8, kv_blocks_total=10,
             kv_blocks_in_use=1, num_requests_running=1, kv_utilization_avg=0.5, kv_bytes_per_token=64)
    b = dict(a, steps=6, kv_util_sum=0.6, prefix_cache_hits=0, kv_blocks_in_use=3, kv_utilization_avg=0.1)
    s = sum_stats([a, b])
    assert (s["steps"], s["prefix_cache_hits"], s["prefix_cache_queries"], s["kv_blocks_total"]) == (8, 4, 16, 20)
    assert s["kv_blocks_in_use"] == 4 and s["kv_bytes_per_token"] == 64
    assert s["kv_utilization_avg"] == pytest.approx(0.2)


def test_without_ray_replicas_say_how_to_install(model_dir, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lmforge\[ray\]'"):
        RayReplicaEngine(EngineConfig(model=str(model_dir), **ENGINE), 2)


def test_eval_generates_on_ray_replicas_as_in_one_process(model_dir, cluster):
    """`lmforge eval --executor ray --replicas 2`: the backend hands generation to `lmforge generate`'s Ray path."""
    prompts = ["the city school", "python code data model", "river national", "engine value error"]
    kw = dict(max_tokens=6, stop=["."], temperature=0.0)
    local = TransformerBackend(model_dir, dtype="float32", device="cpu").generate(prompts, **kw)
    on_ray = TransformerBackend(model_dir, dtype="float32", device="cpu", executor="ray", replicas=2)
    assert on_ray.generate(prompts, **kw) == local and "Ray (2 replicas)" in on_ray.info()["generation"]
    with pytest.raises(ValueError, match="--executor ray"):
        TransformerBackend(model_dir, device="cpu", replicas=2)


# ---- through the server ------------------------------------------------------------------------------------


def test_openai_client_streams_through_two_replicas(replicated, single):
    srv, engine = replicated
    prompt = "the river school python"
    chunks = list(_client(srv).completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                                  stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    want = _client(single).completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert text == want.choices[0].text and chunks[-1].choices[0].finish_reason == want.choices[0].finish_reason
    chat = _client(srv).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5, temperature=0, stream=True)
    assert [c for c in chat if c.choices and c.choices[0].finish_reason]  # the stream ended properly
    assert engine.stats()["replicas"] == 2 and sum(engine.up) == 2


def test_shared_prefix_hits_the_cache_as_often_as_one_replica(replicated, single):
    srv, engine = replicated
    prompts = [f"{PREFIXES[i % 2]} {w}" for i, w in enumerate("alpha beta gamma delta epsilon zeta eta theta".split())]
    got = {}
    for name, s in (("replicas", srv), ("single", single)):
        time.sleep(0.5)  # the replicas' statistics are polled every 0.2 s
        h0, q0 = _prefix_counters(s.url)
        for p in prompts:
            _client(s).completions.create(model="tiny", prompt=p, max_tokens=1, temperature=0)
        time.sleep(0.8)
        h1, q1 = _prefix_counters(s.url)
        got[name] = (h1 - h0, q1 - q0)
    assert got["replicas"][1] == got["single"][1] > 0  # the same prompt tokens looked up
    assert got["replicas"][0] >= got["single"][0] > 0, got
    per_replica = [s["prefix_cache_queries"] for s in engine.replica_stats()]
    assert all(q > 0 for q in per_replica), per_replica  # both replicas served: affinity, not one replica


def test_a_killed_replica_fails_only_its_own_requests_and_is_replaced(replicated):
    srv, engine = replicated
    started, results = threading.Barrier(5), {}

    def stream(i: int) -> None:
        first = True
        try:
            s = _client(srv).completions.create(model="tiny", prompt=f"{i} unique prompt number {i}", stream=True,
                                                max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
            for c in s:
                if first:
                    first = False
                    started.wait(60)
                if c.choices and c.choices[0].finish_reason:
                    results[i] = c.choices[0].finish_reason
        except openai.APIError as e:
            results[i] = e
        finally:
            if first:
                started.abort()

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    started.wait(60)
    own = engine.router.load[0]
    ray.kill(engine.actors[0], no_restart=False)  # Ray restarts it (max_restarts)
    for t in threads:
        t.join(60)
    failed = [i for i, r in results.items() if isinstance(r, Exception)]
    assert len(results) == 4 and 1 <= len(failed) <= own, results
    assert all(results[i] == "length" for i in results if i not in failed)  # the other replica's streams finished
    deadline = time.time() + 90
    while not all(engine.up):
        assert time.time() < deadline, "the killed replica did not come back"
        time.sleep(0.2)
    before = engine.replica_stats()[0]["prefix_cache_queries"]
    for i in range(4):
        out = _client(srv).completions.create(model="tiny", prompt=f"after {i} again", max_tokens=3, temperature=0)
        assert out.choices[0].finish_reason in ("length", "stop")
    time.sleep(0.6)
    assert engine.replica_stats()[0]["prefix_cache_queries"] > before  # the replacement serves
    assert httpx.get(srv.url + "/health/ready").status_code == 200
