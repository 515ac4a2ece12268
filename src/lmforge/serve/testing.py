"""Helpers for tests and benchmarks of the server: a tiny random model with a trained tokenizer,
and a uvicorn server on a free loopback port in a background thread.

    model_dir = make_model_with_tokenizer(tmp / "model", tmp / "tok")   # seconds on a CPU
    app = build_app(AsyncLLMEngine(EngineConfig(model=str(model_dir))), ServerConfig("tiny"))
    with ServerThread(app) as srv:
        openai.OpenAI(base_url=srv.url + "/v1", api_key="x").completions.create(...)

The corpus is generated from a seed, so the tokenizer (and the model on top of it) are the same
on every run. Knows nothing about the engine.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from lmforge.model.reference import save_hf_model
from lmforge.tokenizer import load_tokenizer, train_tokenizer

WORDS = ("the of and to in is was for on that with as by at from it his an were are which this be or has "
         "had not but first one their its new after who they have her she two been other when there all "
         "during into school time may years more most only over city some world would where later up such "
         "used many can state about national out known university united then made river python code data "
         "model token server request stream cache block engine value error return function class import").split()
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def corpus(num_docs: int = 400, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        sentences = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14))).capitalize() + "."
                     for _ in range(rng.randint(2, 6))]
        docs.append(" ".join(sentences) + f" {rng.randint(0, 9999)} ünïcödé 🙂")
    return docs


def train_test_tokenizer(out_dir: Path, vocab_size: int = 512) -> Path:
    out_dir = Path(out_dir)
    src = out_dir.parent / f"{out_dir.name}-corpus.jsonl"
    src.parent.mkdir(parents=True, exist_ok=True)
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in corpus()))
    train_tokenizer([str(src)], out_dir, vocab_size=vocab_size, show_progress=False, overwrite=True)
    return out_dir


def make_model_with_tokenizer(model_dir: Path, tokenizer_dir: Path, vocab_size: int = 512, hidden_size: int = 64,
                              layers: int = 2, **over) -> Path:
    """A random Llama whose vocabulary matches a freshly trained tokenizer; stops on
    <|end_of_text|> (1) and <|im_end|> (4), like a chat model of ours."""
    tok_dir = train_test_tokenizer(Path(tokenizer_dir), vocab_size)
    V = len(load_tokenizer(tok_dir))
    save_hf_model("llama", model_dir, vocab_size=V, hidden_size=hidden_size, layers=layers,
                  bos_token_id=0, eos_token_id=[1, 4], pad_token_id=2, **over)
    for f in TOKENIZER_FILES:
        shutil.copy(tok_dir / f, Path(model_dir) / f)
    gen = Path(model_dir) / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.exists() else {}
    gen.write_text(json.dumps({**cfg, "bos_token_id": 0, "eos_token_id": [1, 4], "pad_token_id": 2}, indent=2))
    return Path(model_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1:<free port> from a daemon thread (no signal handlers)."""

    def __init__(self, app, timeout_graceful_shutdown: float | None = 5.0):
        import uvicorn  # deferred: quickstart imports this module for free_port, and the CLI imports quickstart

        from .connection import uvicorn_config  # deferred: uvicorn, as above

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn_config(app, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=timeout_graceful_shutdown)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            if time.time() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def spawn_server(args: list[str], port: int, timeout: float = 240.0, env: dict | None = None,
                 log_path: Path | None = None):
    """`lmforge serve ARGS --port PORT` as a child process, returned once /health/ready answers 200
    (SystemExit with the server's last log lines if it exits first or never gets ready). For scripts
    that measure a real server: `lmforge bench soak`, scripts/bench_ops.py. `env` replaces the
    environment (e.g. a PYTHONPATH to serve another checkout's code). The server's stderr goes to a file,
    `log_path` (default: a temporary file), never to a pipe: nobody reads a pipe while a benchmark runs,
    and once its 64 KiB fill up the server's next log line blocks its event loop (a 30-minute soak hung
    so at minute 22, on 2026-12-06). `proc.log_path` names the file."""
    import tempfile  # deferred, as httpx

    import httpx  # deferred: quickstart imports this module for free_port, and the CLI imports quickstart

    # as the `lmforge` script starts it (lmforge.launch); another checkout's code (env) may predate that module
    entry = "lmforge.launch" if env is None else "lmforge.cli"
    if log_path is None:
        log_path = Path(tempfile.mkdtemp(prefix="lmforge-server-")) / "server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:  # the child holds its own descriptor
        proc = subprocess.Popen([sys.executable, "-m", entry, "serve", *args, "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=log, env=env)
    proc.log_path = log_path
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {_tail(log_path)}")
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server not ready in {timeout:g} s: {_tail(log_path)}")


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:]


def stop_server(proc) -> int:
    """SIGTERM, then the exit code (-9 after a kill when it does not stop within 60 s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return -9


def kill9_trial(model_dir: Path, n: int, concurrency: int = 8, args: tuple[str, ...] = (),
                env: dict | None = None) -> dict:
    """One trial of "is every answered exchange stored?": a fresh `lmforge serve MODEL --log-requests`,
    `n` completions answered by `concurrency` clients, SIGKILL to the server's pid the moment the last
    answer has been read, its children (the exchange-log writer, the engine) left to finish or die, then
    the feedback store read. Returns answered and stored counts, the ids lost, and each answer's latency.
    For tests/test_serve_exchange_log.py and scripts/exchange_log_crash.py."""
    import tempfile  # deferred, as the imports above
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import psutil

    from lmforge.registry import FeedbackStore

    db, port = Path(tempfile.mkdtemp()) / "fb.db", free_port()
    proc = spawn_server([str(model_dir), "--log-requests", "--feedback-db", str(db), "--log-level", "warning",
                         *args], port, env=env)
    children = psutil.Process(proc.pid).children(recursive=True)
    url = f"http://127.0.0.1:{port}"

    def one(i: int) -> tuple[str, float]:
        t0 = time.perf_counter()
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json={"prompt": f"request {i} from jane.doe@example.com", "max_tokens": 4})
        r.raise_for_status()
        return r.json()["id"], time.perf_counter() - t0

    try:
        with ThreadPoolExecutor(concurrency) as pool:
            answers = list(pool.map(one, range(n)))
    finally:
        proc.kill()  # at once: the last answer was read a moment ago
        proc.wait(30)
        _, alive = psutil.wait_procs(children, timeout=60)
        for p in alive:
            p.kill()
    stored = {r["id"] for r in FeedbackStore(db, create=False).exchanges()}
    answered = [a for a, _ in answers]
    return {"answered": len(answered), "stored": len(stored & set(answered)),
            "lost": sorted(set(answered) - stored), "latency_s": [t for _, t in answers]}
