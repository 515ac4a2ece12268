"""`--log-requests`' writer process (`lmforge.serve.exchange_log`): rows are masked and written by a
child interpreter, the queue is bounded (drops counted), feedback on an id waits for that id's
write, a dead writer neither hangs nor takes serving down, and a server killed with SIGKILL loses
no answered exchange it had handed over. The writer is paused with SIGSTOP to make "the writer has
not caught up yet" happen on purpose.

    python -m pytest -q tests/test_serve_exchange_log.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
import pytest

from lmforge.engine import AsyncLLMEngine, EngineConfig
from lmforge.registry import FeedbackStore
from lmforge.serve.app import build_app
from lmforge.serve.config import ServerConfig, VersionsConfig
from lmforge.serve.exchange_log import INTERVAL_S, ExchangeLog
from lmforge.serve.testing import ServerThread, free_port, kill9_trial

SECRET_MAIL, SECRET_KEY = "jane.doe@example.com", "sk-" + "a1B2c3D4e5F6g7H8i9J0k1L2m3N4"


def row(i: int, prompt: str = "hello", version: str = "1") -> dict:
    return {"id": f"cmpl-{i}", "created": 0, "model": "tiny", "model_version": version, "user": None,
            "kind": "completion", "prompt": prompt, "response": "world"}


@pytest.fixture
def store(tmp_path: Path) -> FeedbackStore:
    return FeedbackStore(tmp_path / "fb.db")


def test_rows_are_masked_in_the_writer_process_and_never_reach_the_file(store, tmp_path):
    xlog = ExchangeLog(store)
    try:
        assert xlog._proc.pid != os.getpid() and xlog._proc.poll() is None  # a child interpreter does the work
        for i in range(300):
            assert xlog.add(row(i, f"mail {SECRET_MAIL} key {SECRET_KEY} #{i}"))
        assert xlog.flush(timeout=60) and xlog.pending == 0 and xlog.dropped == 0
        assert xlog.version_of("cmpl-7") == "1" and xlog.version_of("cmpl-nope") is None
    finally:
        xlog.close()
    assert xlog._proc.returncode == 0  # close() ends the writer
    rows = list(store.exchanges())
    assert len(rows) == 300 and all(SECRET_MAIL not in r["prompt"] and "<EMAIL>" in r["prompt"] for r in rows)
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("fb.db*"))
    assert SECRET_MAIL.encode() not in raw and SECRET_KEY.encode() not in raw


def test_rows_are_written_within_the_interval_without_anyone_waiting(store):
    xlog = ExchangeLog(store)
    try:
        for batch in range(3):  # a quiet server: a few rows, nobody calls flush or wait_written
            assert xlog.add(row(batch))
            deadline = time.time() + 10
            while len(list(store.exchanges())) < batch + 1:
                assert time.time() < deadline, f"row {batch} was never written"
                time.sleep(0.02)
        deadline = time.time() + 10  # the writer commits, then acks: the row can be visible before the ack
        while xlog.pending:
            assert time.time() < deadline, "the written rows were never acknowledged"
            time.sleep(0.02)
    finally:
        xlog.close()


def test_a_full_queue_drops_and_counts_and_wait_written_waits_for_the_id(store):
    xlog = ExchangeLog(store, max_pending=3)
    try:
        os.kill(xlog._proc.pid, signal.SIGSTOP)  # the writer falls behind
        try:
            accepted = [xlog.add(row(i)) for i in range(5)]
            assert accepted == [True, True, True, False, False] and xlog.dropped == 2 and xlog.pending == 3
            assert not xlog.wait_written("cmpl-0", timeout=0.3)  # not written while the writer is stopped
            assert xlog.wait_written("cmpl-999", timeout=0.01)  # an id we never queued does not wait
        finally:
            os.kill(xlog._proc.pid, signal.SIGCONT)
        assert xlog.wait_written("cmpl-2", timeout=60)
        assert store.add_feedback("cmpl-2", -1)  # the row is there as soon as wait_written returns
        assert not store.add_feedback("cmpl-4", 1)  # the dropped one is not: feedback on it is a 404
        assert xlog.add(row(10)) and xlog.flush(timeout=60)  # room again once the writer caught up
    finally:
        xlog.close()
    assert {r["id"] for r in store.exchanges()} == {"cmpl-0", "cmpl-1", "cmpl-2", "cmpl-10"}


def test_a_writer_killed_is_replaced_and_later_rows_are_stored(store):
    xlog = ExchangeLog(store, interval_s=0)
    try:
        assert xlog.add(row(0)) and xlog.wait_written("cmpl-0", timeout=30)
        os.kill(xlog._proc.pid, signal.SIGKILL)
        deadline = time.time() + 30
        while xlog.restarts == 0 and time.time() < deadline:
            time.sleep(0.01)
        for i in range(1, 6):  # queued while the new writer starts, or sent to it
            assert xlog.add(row(i))
        assert xlog.flush(timeout=60) and xlog.restarts == 1 and xlog._dead is None
    finally:
        xlog.close()
    stored = {r["id"] for r in store.exchanges()}
    assert stored == {f"cmpl-{i}" for i in range(6)} and xlog.dropped == 0


def test_a_dead_writer_past_its_restarts_drops_and_counts_and_never_hangs_a_waiter(store):
    xlog = ExchangeLog(store, max_restarts=0)
    try:
        os.kill(xlog._proc.pid, signal.SIGSTOP)
        assert xlog.add(row(0))
        os.kill(xlog._proc.pid, signal.SIGKILL)
        assert xlog.wait_written("cmpl-0", timeout=30)  # released (lost, counted), not a 30 s hang
        assert xlog.dropped == 1 and xlog._dead is not None
        assert not xlog.add(row(1)) and xlog.dropped == 2
    finally:
        xlog.close()
    assert list(store.exchanges()) == []


def _ready(url: str, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    while httpx.get(url + "/health/ready").status_code != 200:
        assert time.time() < deadline, "server never became ready"
        time.sleep(0.05)


def test_feedback_sent_before_the_writer_caught_up_still_finds_its_exchange(chat_model_dir, tmp_path):
    store = FeedbackStore(tmp_path / "fb.db")
    app = build_app(lambda: AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32",
                                                        max_model_len=256)),
                    ServerConfig("tiny", feedback=store, log_requests=True, versions=VersionsConfig(version="3")))
    with ServerThread(app) as srv:
        _ready(srv.url)
        xlog = app.state.server.exchange_log
        os.kill(xlog._proc.pid, signal.SIGSTOP)
        try:
            r = httpx.post(srv.url + "/v1/completions", json={"prompt": f"write to {SECRET_MAIL}", "max_tokens": 4},
                           timeout=60)  # it waits DURABLE_TIMEOUT_S for a commit that cannot come, then answers
            assert r.status_code == 200
            cid = r.json()["id"]
            assert xlog.pending == 1 and not store.add_feedback(cid, 1)  # not in the store yet
            box: dict = {}
            t = threading.Thread(target=lambda: box.update(
                r=httpx.post(srv.url + "/v1/feedback", json={"id": cid, "score": -1}, timeout=60)))
            t.start()
            time.sleep(0.5)
            assert t.is_alive()  # the feedback waits for its exchange's write instead of answering 404
        finally:
            os.kill(xlog._proc.pid, signal.SIGCONT)
        t.join(timeout=60)
        assert box["r"].status_code == 200, box["r"].text
        metrics = httpx.get(srv.url + "/metrics").text
        assert "lmforge:exchange_log_dropped_total 0.0" in metrics
        assert "lmforge:exchange_log_pending 0.0" in metrics
        assert 'lmforge:feedback_score_count{model_name="tiny",model_version="3"} 1.0' in metrics
    (ex,) = store.exchanges()
    assert ex["id"] == cid and SECRET_MAIL not in ex["prompt"] and ex["feedback"]["score"] == -1


def test_an_answer_is_committed_before_its_last_byte_goes_out(chat_model_dir, tmp_path):
    """Issue 43: the moment a client has read an answer (a JSON body, a stream's [DONE], a Responses stream's
    last event), its exchange is in the store; before, it waited up to INTERVAL_S in the server's memory."""
    store = FeedbackStore(tmp_path / "fb.db")
    app = build_app(lambda: AsyncLLMEngine(EngineConfig(model=str(chat_model_dir), dtype="float32",
                                                        max_model_len=256)),
                    ServerConfig("tiny", feedback=store, log_requests=True))
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    with ServerThread(app) as srv:
        _ready(srv.url)
        reader = FeedbackStore(tmp_path / "fb.db", create=False)
        for i in range(12):
            path, body = [("/v1/completions", {"prompt": f"q {i}", "max_tokens": 3}), ("/v1/chat/completions", chat),
                          ("/v1/responses", {"input": "hi", "max_output_tokens": 3})][i % 3]
            stream = i % 2 == 1
            with httpx.stream("POST", srv.url + path, json={**body, "stream": stream}, timeout=60) as r:
                text = r.read().decode()
            assert r.status_code == 200 and (not stream or text.rstrip().endswith(("[DONE]", "}"))), text[-300:]
            key = re.search(r"(?:cmpl|resp)[-_]([0-9a-f]{32})", text).group(1)  # the job id (resp_ shares it)
            assert any(row["id"].endswith(key) for row in reader.exchanges()), (i, path, stream)


def test_a_batch_the_store_refuses_is_counted_and_the_writer_goes_on(store):
    xlog = ExchangeLog(store)
    try:
        assert xlog.add({**row(0), "kind": "not-a-kind"})  # log_exchanges raises on this batch
        assert xlog.flush(timeout=60) and xlog.dropped == 1
        assert xlog.add(row(1)) and xlog.flush(timeout=60) and xlog.dropped == 1
    finally:
        xlog.close()
    assert [r["id"] for r in store.exchanges()] == ["cmpl-1"]


def test_batches_go_to_a_stalled_writer_without_waiting_for_acks_and_a_bad_one_loses_only_itself(store):
    xlog = ExchangeLog(store)
    try:
        os.kill(xlog._proc.pid, signal.SIGSTOP)
        try:
            assert xlog.add({**row(0), "kind": "not-a-kind"})
            deadline = time.time() + 10
            while len(xlog._in_flight) < 1:  # sent without waiting for any ack
                assert time.time() < deadline
                time.sleep(0.01)
            for i in range(1, 4):
                assert xlog.add(row(i))
            while len(xlog._in_flight) < 2:  # the next batch goes too, while the first is not acked
                assert time.time() < deadline, "the sender waited for the stalled writer's ack"
                time.sleep(0.01)
        finally:
            os.kill(xlog._proc.pid, signal.SIGCONT)
        assert xlog.flush(timeout=60) and xlog.dropped == 1  # the merged write failed; each batch alone
    finally:
        xlog.close()
    assert sorted(r["id"] for r in store.exchanges()) == ["cmpl-1", "cmpl-2", "cmpl-3"]


def _writer_of(server: psutil.Process, timeout: float = 60) -> psutil.Process:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for child in server.children():
            if "lmforge.serve.exchange_log" in " ".join(child.cmdline()):
                return child
        time.sleep(0.05)
    raise AssertionError("the server started no exchange-log writer")


@pytest.mark.slow
@pytest.mark.parametrize("trial", range(2))
def test_no_answered_exchange_is_lost_to_a_kill_9_right_after_the_answer(chat_model_dir, trial):
    """Issue 43: each answer waits for its exchange's commit, so a SIGKILL of the server the moment the
    last answer is read loses none (before: up to 2 of 60; the 50 ms hand-over window). The full figure,
    20 trials of 60: `python scripts/exchange_log_crash.py MODEL --trials 20 -n 60 --concurrency 8`."""
    result = kill9_trial(chat_model_dir, 20, concurrency=4,
                         args=("--no-engine-process", "--dtype", "float32", "--max-model-len", "256"))
    assert result["answered"] == 20 and result["lost"] == [], result


@pytest.mark.slow
def test_answered_exchanges_survive_a_kill_9_of_the_server(chat_model_dir, tmp_path):
    """20 completions answered 200 while the writer is behind (stopped: each answer waits for its commit
    in vain, then goes out), then SIGKILL to the server: every row handed to the writer is committed by
    it after the server is gone (before: the rows waited in the server's memory for the writer's ack of
    the batch before, and died with it)."""
    db, port, n = tmp_path / "fb.db", free_port(), 20
    log = tempfile.TemporaryFile("w+")  # never a pipe nobody reads
    proc = subprocess.Popen([sys.executable, "-m", "lmforge.cli", "serve", str(chat_model_dir), "--port", str(port),
                             "--log-requests", "--feedback-db", str(db), "--no-engine-process", "--dtype", "float32",
                             "--max-model-len", "256", "--log-level", "warning"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None and time.time() < deadline, (log.seek(0), log.read())
            try:
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        writer = _writer_of(psutil.Process(proc.pid))
        writer.suspend()  # the writer falls behind: nothing is committed while the requests are answered

        def one(i: int) -> str:  # each answer waits for its commit at most DURABLE_TIMEOUT_S, then goes out
            with httpx.Client(base_url=url, timeout=60) as c:
                r = c.post("/v1/completions", json={"prompt": f"request {i} from jane.doe@example.com",
                                                    "max_tokens": 4})
            assert r.status_code == 200, r.text
            return r.json()["id"]

        with ThreadPoolExecutor(n) as pool:
            ids = list(pool.map(one, range(n)))
        time.sleep(10 * INTERVAL_S)  # the documented window: a row is in the pipe within INTERVAL_S
        proc.kill()
        assert proc.wait(30) == -signal.SIGKILL
        writer.resume()
        writer.wait(60)  # it reads the pipe to its end, commits, and exits on EOF
    finally:
        proc.kill()
        proc.wait(30)
    rows = {r["id"]: r for r in FeedbackStore(db, create=False).exchanges()}
    assert sorted(rows) == sorted(ids), f"{n - len(rows)} of {n} answered exchanges lost"
    assert all("jane.doe@example.com" not in r["prompt"] for r in rows.values())
