"""Operations in `lmforge serve`: versions behind one API (canary split, sticky users, automatic
rollback, hot reload without failed requests), user feedback with the request log (PII masked
before anything is written), and the web console driven in headless Chromium. Through a real
server on a loopback port, as users and operators meet it.

    python -m pytest -q tests/test_serve_ops.py
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import pytest

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.registry import FeedbackStore
from lmforge.serve.app import VERSION_HEADER, build_app
from lmforge.serve.config import ServerConfig, VersionsConfig
from lmforge.serve.testing import ServerThread
from lmforge.serve.engine_client import ReloadResult, VersionRouterClient
from lmforge.serve.versions import CanaryGuard, Router, Served

MODEL = "tiny"
C, CHAT = "/v1/completions", "/v1/chat/completions"
KEY = {"Authorization": "Bearer k"}


@pytest.fixture(scope="module")
def model_dir(chat_model_dir) -> Path:
    return chat_model_dir


def loader(model_dir: Path):
    return lambda: AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256))


class _FakeEngine:
    tokenizer, max_model_len, vocab_size, model_path, is_running = None, 64, 10, "x", True

    def stats(self):
        return {}


def test_canary_split_is_on_target_and_users_are_sticky():
    champ, chal = Served("champion", "1", _FakeEngine()), Served("challenger", "2", _FakeEngine())
    r = Router(champ, chal, canary_percent=30, seed=1)
    share = sum(r.route(None) is chal for _ in range(1000)) / 10
    assert abs(share - 30) <= 3
    users = [f"user-{i}" for i in range(1000)]
    first = {u: r.route(u).label for u in users}
    assert abs(sum(v == "2" for v in first.values()) / 10 - 30) <= 3  # sticky split is on target too
    assert all(r.route(u).label == first[u] for u in users for _ in range(3))  # never switches mid-session


def test_challenger_is_rolled_back_when_it_errs_more():
    champ, chal = Served("champion", "1", _FakeEngine()), Served("challenger", "2", _FakeEngine())
    r = Router(champ, chal, canary_percent=50)
    events = []
    g = CanaryGuard(r, margin=0.1, min_samples=20, on_rollback=lambda kind, d: events.append((kind, d)))
    for i in range(40):
        g.outcome("1", failed=False)
        g.outcome("2", failed=i % 4 == 0)  # 25% errors vs 0%: past the 10-point margin once both have 20
    assert r.canary_percent == 0 and events and events[0][0] == "auto_rollback"
    assert events[0][1]["metric"] == "error_rate" and events[0][1]["challenger"] == "2"
    assert all(r.route(f"u{i}") is champ for i in range(50))


def test_the_engine_client_reloads_new_version_first_and_drains_the_old_one():
    class Engine(_FakeEngine):
        def __init__(self):
            self.stopped = False

        def shutdown(self):
            self.stopped = True

    old, new = Engine(), Engine()
    client = VersionRouterClient(max_engine_restarts=3)
    client.attach(Served("champion", "1", old, lambda: old))
    running = client.route("u1")
    running.inflight.add("cmpl-x-0")  # a request still streaming on version 1

    async def main():
        done = await client.reload({"champion": ("2", lambda: new, "/models/2")})
        assert done == ReloadResult({"champion": "2"}, {"champion": "2"}, 0.0)
        assert client.route("u1").engine is new and client.info().models == {"champion": "2"}
        await asyncio.sleep(0.2)
        assert not old.stopped  # drained, not cut: its request is still in flight
        running.inflight.clear()
        for _ in range(50):
            await asyncio.sleep(0.05)
            if old.stopped:
                break
        assert old.stopped and not new.stopped
        assert (await client.reload({"champion": ("2", lambda: new, "/models/2")})).changed == {}

    asyncio.run(main())


def test_feedback_is_stored_beside_a_pii_masked_exchange(model_dir, tmp_path):
    store = FeedbackStore(tmp_path / "fb.db")
    app = build_app(loader(model_dir), ServerConfig(MODEL, feedback=store, log_requests=True,
                                                  versions=VersionsConfig(version="7")))
    with ServerThread(app) as srv:
        _ready(srv)
        r = httpx.post(srv.url + C, json={"prompt": "mail me at jane.doe@example.com", "max_tokens": 4})
        assert r.status_code == 200 and r.headers[VERSION_HEADER] == "7"
        body = r.json()
        assert body["system_fingerprint"] == "lmforge-7"
        ok = httpx.post(srv.url + "/v1/feedback", json={"id": body["id"], "score": -1, "comment": "wrong"})
        assert ok.status_code == 200, ok.text
        assert httpx.post(srv.url + "/v1/feedback", json={"id": "cmpl-nope", "score": 1}).status_code == 404
        assert httpx.post(srv.url + "/v1/feedback", json={"id": body["id"], "score": 9}).status_code == 400
        long = httpx.post(srv.url + C, json={"prompt": "The city of", "max_tokens": 64, "ignore_eos": True})
        words = long.json()["choices"][0]["text"].split()
        metrics = httpx.get(srv.url + "/metrics").text
        assert 'lmforge:feedback_score_count{model_name="tiny",model_version="7"} 1.0' in metrics
        if len(words) >= 3:  # the repetition histogram observes every output with a 3-gram
            assert 'lmforge:output_repeated_ngram_rate_count{model_name="tiny",model_version="7"}' in metrics
        assert 'lmforge:feedback_low_score_ratio{model_name="tiny",model_version="7"} 1.0' in metrics
        assert 'vllm:request_success_total{finished_reason="length",model_name="tiny",model_version="7"}' in metrics
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("fb.db*"))
    assert b"jane.doe@example.com" not in raw and b"example.com" not in raw
    rows = list(store.exchanges())
    assert len(rows) == 2 and {r["model_version"] for r in rows} == {"7"}


def _ready(srv, timeout: float = 60) -> None:
    import time

    deadline = time.time() + timeout
    while httpx.get(srv.url + "/health/ready").status_code != 200:
        assert time.time() < deadline, "server never became ready"
        time.sleep(0.05)


def test_reload_swaps_versions_with_no_failed_request(model_dir, tmp_path):
    other = tmp_path / "v2"
    shutil.copytree(model_dir, other)
    target = {"champion": ("1", loader(model_dir), str(model_dir))}
    app = build_app(loader(model_dir), ServerConfig(MODEL, api_key="k", admin_api_key="admin", versions=VersionsConfig(
        version="1", reloader=lambda: dict(target))))
    with ServerThread(app) as srv:
        _ready(srv)
        assert httpx.post(srv.url + "/admin/reload").status_code == 401  # the admin key is required ...
        assert httpx.post(srv.url + "/admin/reload", headers=KEY).status_code == 401  # ... not the inference key
        old_engine = app.state.server.router.champion.engine

        async def stream(c: httpx.AsyncClient, i: int) -> tuple[str, str]:
            body = {"prompt": f"The city of {i}", "max_tokens": 48, "ignore_eos": True, "stream": True}
            async with c.stream("POST", C, json=body, headers=KEY) as r:
                lines = [line async for line in r.aiter_lines() if line]
            assert r.status_code == 200 and lines[-1] == "data: [DONE]"
            assert not any('"error"' in line for line in lines)
            return r.headers[VERSION_HEADER], json.loads(lines[-2][6:])["choices"][0]["finish_reason"]

        async def main():
            async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c:
                before = [asyncio.create_task(stream(c, i)) for i in range(8)]
                await asyncio.sleep(0.2)
                target["champion"] = ("2", loader(other), str(other))
                reload = await c.post("/admin/reload", headers={"Authorization": "Bearer admin"})
                after = await asyncio.gather(*(stream(c, i) for i in range(4)))
                return await asyncio.gather(*before), reload, after

        before, reload, after = asyncio.run(main())
        assert reload.status_code == 200 and reload.json()["changed"] == {"champion": "2"}
        assert all(reason == "length" for _, reason in before)  # in flight during the swap: all completed
        assert {v for v, _ in after} == {"2"}
        import time

        deadline = time.time() + 30
        while old_engine.is_running and time.time() < deadline:  # the old version is drained, then stopped
            time.sleep(0.05)
        assert not old_engine.is_running
        assert 'model_version="2"' in httpx.get(srv.url + "/metrics").text


def test_console_streams_a_reply_and_counts_a_thumbs_down(model_dir, tmp_path):
    from playwright.sync_api import sync_playwright

    store = FeedbackStore(tmp_path / "fb.db")
    app = build_app(loader(model_dir), ServerConfig(MODEL, feedback=store, log_requests=True,
                                                  versions=VersionsConfig(version="1")))
    with ServerThread(app) as srv, sync_playwright() as pw:
        _ready(srv)
        browser = pw.chromium.launch(executable_path=shutil.which("chromium") or "/usr/bin/chromium", args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_page()
            page.goto(srv.url + "/ui?poll=250")
            page.wait_for_function("document.getElementById('model').textContent.startsWith('tiny')")
            page.fill("#prompt", "The city of")
            page.click("#send")
            page.wait_for_selector(".msg.assistant.done", timeout=30_000)
            reply = page.inner_text(".msg.assistant.done")
            assert reply.strip() and "error" not in reply
            page.wait_for_function("document.getElementById('rps').textContent !== '–'")
            # the rate is over the last minute: the chat still counts after the polls that followed it
            page.wait_for_function("Number(document.getElementById('rps').textContent) > 0", timeout=10_000)
            assert page.inner_text("#fb-count") == "0"
            _thumbs_render_without_an_emoji_font(page)
            page.click(".thumb-down")
            page.wait_for_function("document.getElementById('fb-count').textContent === '1'", timeout=10_000)
            assert "version 1" in page.inner_text("#traffic")
            assert "100%" in page.inner_text("#fb-low")
            page.wait_for_timeout(600)  # two more polls
            assert page.inner_text("#errors") == "0"  # the browser's own requests (its icon) are no errors
            page.screenshot(path=str(tmp_path / "console.png"), full_page=True)
        finally:
            browser.close()
        for path, kind in (("/favicon.ico", "image/svg+xml"), ("/ui/favicon.svg", "image/svg+xml"),
                           ("/robots.txt", "text/plain")):
            r = httpx.get(srv.url + path)
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), path
        assert httpx.get(srv.url + "/apple-touch-icon.png").status_code == 204
        assert "lmforge:http_errors_total{" not in httpx.get(srv.url + "/metrics").text
    assert (tmp_path / "console.png").stat().st_size > 10_000
    stats = store.stats("1")
    assert stats["exchanges"] == 1 and stats["with_feedback"] == 1 and stats["low"] == 1


def _thumbs_render_without_an_emoji_font(page) -> None:
    """Each thumb is an inline SVG icon with a word, drawn at a real size; the page's own source holds no
    emoji (the model's reply may: it is random)."""
    for cls, word in (("thumb-up", "Good"), ("thumb-down", "Bad")):
        assert page.inner_text(f".{cls}").strip() == word
        box = page.locator(f".{cls} svg").bounding_box()
        assert box is not None and box["width"] >= 10 and box["height"] >= 10
    source = httpx.get(page.url).text
    assert "thumbButton" in source and not any(0x1F300 <= ord(ch) <= 0x1FAFF for ch in source)


@pytest.mark.slow
def test_the_loop_serve_feedback_flywheel_lora_registry_canary_promote_rollback(model_dir, tmp_path):
    """Champion served -> requests -> feedback -> flywheel -> LoRA training -> export -> registry add ->
    canary at 50% -> promote (the gate passes) -> rollback restores the previous champion, byte-identical."""
    import hashlib

    from lmforge.eval.commands import run as eval_run
    from lmforge.registry import Registry
    from lmforge.registry.flywheel import build as flywheel
    from lmforge.train.export import export_run
    from lmforge.train.commands import main as train_main

    v1 = tmp_path / "v1"
    shutil.copytree(model_dir, v1)
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(v1.iterdir()) if p.is_file()}
    reg = Registry(tmp_path / "registry.db")
    assert reg.add("tiny", v1).version == 1 and reg.get("tiny", "champion").version == 1
    store = FeedbackStore(tmp_path / "feedback.db")

    app = build_app(loader(v1), ServerConfig("tiny", feedback=store, log_requests=True,
                                            versions=VersionsConfig(version="1")))
    with ServerThread(app) as srv:
        _ready(srv)
        questions = ["How do I reverse a list?", "What does a dict map?", "Name a sorting algorithm.",
                     "What is a tuple?"]
        for i, q in enumerate(questions):
            r = httpx.post(srv.url + CHAT, json={"messages": [{"role": "user", "content": q}], "max_tokens": 8})
            assert r.status_code == 200 and r.headers[VERSION_HEADER] == "1"
            fix = {"correction": f"A short, correct answer number {i}."} if i < 3 else {}
            assert httpx.post(srv.url + "/v1/feedback", json={"id": r.json()["id"], "score": -1, **fix}).status_code == 200

    stats = flywheel(tmp_path / "feedback.db", reg, "tiny", tmp_path / "fw", min_count=1)
    assert stats["in"] == 4 and stats["sft"] == 3  # the three corrected answers (the fourth has none)
    train_main(str(tmp_path / "fw" / "sft-lora.yaml"), ["train.max_steps=2", "train.eval_every=0",
                                                      "train.ckpt_every=2", "train.batch_size=2"], str(tmp_path / "run"))
    v2 = export_run(tmp_path / "run", tmp_path / "v2")
    assert reg.add("tiny", v2).version == 2
    reg.set_alias("tiny", "challenger", 2)

    app = build_app(loader(v1), ServerConfig("tiny", versions=VersionsConfig(
        version="1", challenger=("2", loader(v2)), canary_percent=50)))
    with ServerThread(app) as srv:
        _ready(srv)
        seen = {httpx.post(srv.url + C, json={"prompt": "The city of", "max_tokens": 2, "user": f"u{i}"}
                           ).headers[VERSION_HEADER] for i in range(30)}
        assert seen == {"1", "2"}  # both versions take traffic at 50%

    for version, folder in ((1, v1), (2, v2)):
        eval_run(folder, suite=["tiny-text"], out=tmp_path / f"eval-{version}", limit=8, dtype="float32",
                 device="cpu", batch_size=8, engine="simple", overwrite=False, executor="local", replicas=1,
                 ray_address=None, quant_activations="none")
        reg.attach_eval("tiny", version, tmp_path / f"eval-{version}")
    decision = reg.promote("tiny", 2, max_regression=0.5)  # bits/byte: LoRA for 2 steps barely moves it
    assert decision["allowed"] and not decision["forced"] and decision["gate"]["tasks"]  # the gate itself passed
    assert reg.get("tiny", "champion").version == 2
    assert reg.rollback("tiny").version == 1 and reg.get("tiny", "champion").version == 1
    reg.verify(reg.get("tiny", "champion"))
    assert digest == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(v1.iterdir()) if p.is_file()}
    kinds = [e["kind"] for e in reg.events("tiny")]
    assert "promote" in kinds and "rollback" in kinds


def test_repetition_histogram_counts_a_looping_output_in_its_top_bucket():
    from lmforge.serve.metrics import ServerMetrics

    m = ServerMetrics("tiny", 256, lambda: {})
    m.observe_repetition("1", ["the cat sat " * 10, "one two", "a fresh sentence with no repeats at all"])
    text = m.exposition().decode()
    assert 'lmforge:output_repeated_ngram_rate_count{model_name="tiny",model_version="1"} 2.0' in text  # "one two": no 3-gram
    assert 'lmforge:output_repeated_ngram_rate_bucket{le="0.7",model_name="tiny",model_version="1"} 1.0' in text


def test_load_log_rates_are_over_the_interval_not_since_the_counters_began(monkeypatch):
    """The logger is made on the first tick after start, when the counters already hold warm-up and early
    traffic: that tick is the baseline (it once printed 'prompt 13874541.1 tok/s' over a microsecond)."""
    from lmforge.serve import metrics as mm

    clock = iter([100.0, 105.0, 110.0])
    monkeypatch.setattr(mm.time, "monotonic", lambda: next(clock))
    m = mm.ServerMetrics("tiny", 256, lambda: {})
    m.totals.update(prompt_tokens=5000, generation_tokens=900)
    stats = dict(prefix_cache_queries=10, prefix_cache_hits=5, num_requests_running=1, num_requests_waiting=0,
                 kv_blocks_in_use=3, kv_blocks_total=12)
    log = mm.LoadLogger(m, 5.0)
    assert log.tick(stats) is None
    m.totals.update(prompt_tokens=5500, generation_tokens=1000)
    line = log.tick(dict(stats, prefix_cache_queries=14, prefix_cache_hits=8))
    assert line.startswith("throughput: prompt 100.0 tok/s, generation 20.0 tok/s | running 1, waiting 0")
    assert "KV usage 25.0%" in line and "prefix hit rate 75.0%" in line
    assert log.tick(dict(stats, num_requests_running=0, prefix_cache_queries=14, prefix_cache_hits=8)) is None  # idle
