"""`POST /v1/feedback` and the one score rule (`lmforge.registry.feedback`): through a real server on
a loopback port, a thumbs-up is never a low score in `/metrics` or in the canary guard; scoring one
completion over and over is bounded (409) and moves the guard by one exchange, not by one row; a
score outside the scale is a 400 naming `score` and the keep-alive connection goes on serving.

    python -m pytest -q tests/test_serve_feedback_rules.py
"""

from __future__ import annotations

import http.client
import json
import math
import re
from pathlib import Path

import httpx
import pytest

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.registry import FeedbackStore
from lmforge.registry.feedback import MAX_FEEDBACK_PER_EXCHANGE
from lmforge.serve.app import VERSION_HEADER, build_app
from lmforge.serve.config import ServerConfig, VersionsConfig
from lmforge.serve.testing import ServerThread
from lmforge.serve.versions import CanaryGuard, Router, Served

C, FB = "/v1/completions", "/v1/feedback"


def loader(model_dir: Path):
    return lambda: AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256))


def _ready(srv) -> None:
    import time

    deadline = time.time() + 60
    while httpx.get(srv.url + "/health/ready").status_code != 200:
        assert time.time() < deadline, "server never became ready"
        time.sleep(0.05)


def _low_ratio(metrics: str, version: str) -> float:
    m = re.search(r'lmforge:feedback_low_score_ratio\{model_name="tiny",model_version="%s"\} (\S+)' % version, metrics)
    assert m, f"no low-score ratio for version {version}"
    return float(m.group(1))


def _complete(c: httpx.Client, user: str | None = None) -> tuple[str, str]:
    """(id, version that answered)."""
    r = c.post(C, json={"prompt": "The city of", "max_tokens": 2, **({"user": user} if user else {})})
    assert r.status_code == 200, r.text
    return r.json()["id"], r.headers[VERSION_HEADER]


@pytest.fixture
def one_version(chat_model_dir, tmp_path):
    app = build_app(loader(chat_model_dir), ServerConfig("tiny", feedback=FeedbackStore(tmp_path / "fb.db"),
                                                         log_requests=True, versions=VersionsConfig(version="7")))
    with ServerThread(app) as srv:
        _ready(srv)
        yield srv


def test_a_thumbs_up_is_never_a_low_score(one_version):
    """Finding 2: 25 x score 1 read 1.0 on `feedback_low_score_ratio` (the endpoint took +1 for one star)."""
    srv = one_version
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for _ in range(25):
            cid, _ = _complete(c)
            assert c.post(FB, json={"id": cid, "score": 1}).status_code == 200
        assert _low_ratio(c.get("/metrics").text, "7") == 0.0
        cid, _ = _complete(c)
        assert c.post(FB, json={"id": cid, "score": -1}).status_code == 200  # a thumbs-down is low
        assert _low_ratio(c.get("/metrics").text, "7") == pytest.approx(1 / 26)
        for stars, low in ((2, True), (3, False), (5, False)):
            cid, _ = _complete(c)
            assert c.post(FB, json={"id": cid, "score": stars}).status_code == 200
        assert _low_ratio(c.get("/metrics").text, "7") == pytest.approx(2 / 29)
        for _ in range(3):  # re-scored: the metric, like the store and the guard, counts an exchange once ...
            assert c.post(FB, json={"id": cid, "score": -1}).status_code == 200
        assert _low_ratio(c.get("/metrics").text, "7") == pytest.approx(3 / 29)
        assert c.post(FB, json={"id": cid, "score": 1}).status_code == 200  # ... with its latest score
        assert _low_ratio(c.get("/metrics").text, "7") == pytest.approx(2 / 29)


def test_a_score_off_the_scale_is_a_400_naming_score_and_the_connection_goes_on(one_version):
    """Finding 4: 0, 0.5, 2.5, -0.5 were a 500 (an uncaught RegistryError) that dropped the connection."""
    srv = one_version
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        cid, _ = _complete(c)
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=60)
    try:
        conn.request("GET", "/health/live")
        conn.getresponse().read()
        sock = conn.sock
        for bad in (0, 0.5, 2.5, -0.5, math.nan):
            conn.request("POST", FB, body=json.dumps({"id": cid, "score": bad}),
                         headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == 400, (bad, body)
            err = body["error"]
            assert err["param"] == "score" and err["type"] == "invalid_request_error", (bad, err)
            if not math.isnan(bad):
                assert "score" in err["message"] and "1..5" in err["message"], err
            assert conn.sock is sock, f"the connection was closed after score {bad}"  # kept alive
        conn.request("POST", FB, body=json.dumps({"id": cid, "score": 4}), headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200 and json.loads(r.read())["status"] == "recorded"
        assert conn.sock is sock
    finally:
        conn.close()


@pytest.fixture
def canary(chat_model_dir, tmp_path):
    app = build_app(loader(chat_model_dir), ServerConfig(
        "tiny", feedback=FeedbackStore(tmp_path / "fb.db"), log_requests=True,
        versions=VersionsConfig(version="1", challenger=("2", loader(chat_model_dir)), canary_percent=50)))
    with ServerThread(app) as srv:
        _ready(srv)
        yield srv, app.state.server


def _answered_by(c: httpx.Client, version: str, n: int) -> list[str]:
    """Ids of `n` completions answered by `version` (users are sticky: each user is one version's)."""
    ids, i = [], 0
    while len(ids) < n:
        i += 1
        assert i < 50 * n, f"no user routed to version {version}"
        cid, v = _complete(c, user=f"user-{version}-{i}")
        if v == version:
            ids.append(cid)
    return ids


def test_one_client_scoring_one_completion_cannot_roll_the_canary_back(canary):
    """Finding 3: 25 x -1 on one completion made the guard count 25 low samples and roll back. An
    exchange takes 10 feedback rows; the 11th is a 409 naming `id`, and the canary stays."""
    srv, st = canary
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for cid in _answered_by(c, "1", 20):  # the champion: 20 exchanges, 5 stars each
            assert c.post(FB, json={"id": cid, "score": 5}).status_code == 200
        (target,) = _answered_by(c, "2", 1)
        codes = [c.post(FB, json={"id": target, "score": -1}) for _ in range(25)]
        assert [r.status_code for r in codes] == [200] * MAX_FEEDBACK_PER_EXCHANGE + [409] * (
            25 - MAX_FEEDBACK_PER_EXCHANGE)
        err = codes[-1].json()["error"]
        assert err["param"] == "id" and err["code"] == "feedback_limit" and "latest score counts" in err["message"]
        assert c.post(FB, json={"id": target, "score": 5}).status_code == 409  # bounded: the 10th score stands
        assert st.router.canary_percent == 50 and c.get("/version").json()["rolled_back"] is None
        stats = st.feedback.stats("2")
        assert stats["with_feedback"] == 1 and stats["feedback_rows"] == MAX_FEEDBACK_PER_EXCHANGE


def test_the_canary_guard_counts_each_exchange_once_through_the_server(canary):
    """Three challenger completions scored 10 x -1 each are 3 samples for the guard, not 30 (the
    store's rule: each exchange's latest score); the 20th distinct low exchange rolls it back."""
    srv, st = canary
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        for cid in _answered_by(c, "1", 20):
            assert c.post(FB, json={"id": cid, "score": 5}).status_code == 200
        chal = _answered_by(c, "2", 20)  # all answered before any score: the routing stays put
        for cid in chal[:3]:
            assert all(c.post(FB, json={"id": cid, "score": -1}).status_code == 200
                       for _ in range(MAX_FEEDBACK_PER_EXCHANGE))
        assert st.router.canary_percent == 50  # 3 exchanges, 30 rows
        for cid in chal[3:19]:
            assert c.post(FB, json={"id": cid, "score": -1}).status_code == 200
        assert st.router.canary_percent == 50  # 19 exchanges: below min_samples (20)
        assert c.post(FB, json={"id": chal[19], "score": -1}).status_code == 200
        assert st.router.canary_percent == 0
        assert c.get("/version").json()["rolled_back"].startswith("low_score_ratio 1.000")


def test_the_guard_counts_each_exchanges_latest_score_once():
    class Engine:
        tokenizer, max_model_len, vocab_size, model_path, is_running = None, 64, 10, "x", True

    r = Router(Served("champion", "1", Engine()), Served("challenger", "2", Engine()), canary_percent=50)
    g = CanaryGuard(r, margin=0.5, min_samples=3, window=5)
    for i in range(3):
        g.score("1", False, f"a{i}")
    for _ in range(25):
        g.score("2", True, "b0")
    g.score("2", True, "b1")
    assert list(g._of("2").scores.values()) == [True, True] and r.canary_percent == 50
    g.score("2", False, "b0")  # a change of mind replaces that exchange's sample
    g.score("2", False, "b2")
    assert r.canary_percent == 50  # 1 low of 3
    g.score("2", True, "b0")
    assert r.canary_percent == 0 and r.rolled_back.startswith("low_score_ratio 0.667")  # 2 low of 3
    for i in range(10):
        g.score("1", False, f"c{i}")
    assert list(g._of("1").scores) == [f"c{i}" for i in range(5, 10)]  # the newest `window` exchanges
