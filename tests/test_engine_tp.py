"""Engine tensor parallelism (`LLM(tensor_parallel_size=2)`, `serve --tensor-parallel-size 2`): greedy
tokens identical to one process in float32 (the fused CPU kernels and the paged-decode C kernel on) and
in float64 exactness mode (through the server), with a chunked prefill and prefix-cache hits; the
all-reduced bytes per layer per token; refusals before any process starts; no worker outlives its
engine (shutdown, garbage collection, a killed worker, the server's engine core dying with it).

Every TP engine starts worker interpreters (seconds of imports each on a shared 2-core box), so the
file starts two engines: one offline float32 engine shared by most tests, and the server's.

    python -m pytest -q tests/test_engine_tp.py
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from hf_models import save_hf_model
from lmforge.engine import LLM, SamplingParams
from lmforge.engine.executor import WorkerDiedError

# head_dim 32: the paged-decode C kernel takes it; MLP width 256 and 4 heads / 2 kv heads split over 2
TINY = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
# 1 token, a 9-token prefix of the next, a 70-token prefill chunked by the 32-token budget, and a repeat
# of the 70 tokens' first 48 (3 full blocks of 16 served from the prefix cache)
PROMPTS = [[7], list(range(3, 12)), list(range(3, 73)), list(range(3, 51)) + [99, 98]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
OPTS = dict(device="cpu", block_size=16, max_num_batched_tokens=32)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc (Linux), or None once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below `pid`, children first."""
    parents = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := _stat(int(d.name))) is not None and st[0] != "Z":
            parents[int(d.name)] = st[1]
    out, todo = [], [pid]
    while todo:
        parent = todo.pop(0)
        kids = sorted(p for p, pp in parents.items() if pp == parent)
        out += kids
        todo += kids
    return out


def wait_gone(pids: list[int], timeout: float = 15.0) -> None:
    deadline = time.time() + timeout
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), f"orphaned worker processes: {[p for p in pids if alive(p)]}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_hf_model("llama", tmp_path_factory.mktemp("tp-llama"), **TINY))


@pytest.fixture(scope="module")
def pair(model_dir, one_thread):
    """[TP=1, TP=2] float32 engines on one model, compiled CPU kernels on (the default); a list so the
    last test can drop the TP=2 engine."""
    engines = [LLM(model_dir, **OPTS), LLM(model_dir, tensor_parallel_size=2, **OPTS)]
    yield engines
    if len(engines) == 2:
        engines[1].llm_engine.shutdown()


class Background:
    """`make()` running in a thread, so several engines' worker processes import at once; `get()` waits."""

    def __init__(self, make, stop=lambda value: value.shutdown()):
        self.box: dict = {}
        self.stop = stop
        self.thread = threading.Thread(target=lambda: self.box.setdefault("value", make()))
        self.thread.start()

    def get(self):
        self.thread.join()
        return self.box["value"]

    def close(self) -> None:
        self.thread.join()
        if "value" in self.box:
            self.stop(self.box["value"])


@pytest.fixture(scope="module")
def doomed(model_dir, one_thread):
    """A second TP=2 engine, for the test that kills its worker."""
    bg = Background(lambda: LLM(model_dir, tensor_parallel_size=2, **OPTS), lambda llm: llm.llm_engine.shutdown())
    yield bg
    bg.close()


@pytest.fixture(scope="module")
def served(chat_model_dir, one_thread):
    """The config `lmforge serve ... --tensor-parallel-size 2` builds (the CLI's own parsing, `run_server`
    caught), in float64 exactness mode, and the server's engine core process starting on it."""
    from typer.testing import CliRunner

    from lmforge.cli import app
    from lmforge.engine import ProcessAsyncLLMEngine
    from lmforge.serve import commands

    seen: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(commands, "run_server", lambda config, *a, **kw: seen.setdefault("config", config) and 0)
        res = CliRunner().invoke(app, ["serve", str(chat_model_dir), "--dtype", "float64", "--max-model-len",
                                       "256", "--max-num-batched-tokens", "32", "--tensor-parallel-size", "2"])
    assert res.exit_code == 0, res.output
    assert seen["config"].tensor_parallel_size == 2
    config = dataclasses.replace(seen["config"], attention="reference")
    bg = Background(lambda: ProcessAsyncLLMEngine(config))
    yield config, bg
    bg.close()


def generate_both(pair, prompts):
    return [[o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)] for llm in pair]


def test_tp2_greedy_tokens_equal_tp1_float32_with_cpu_kernels(served, doomed, pair):
    tp1, tp2 = pair
    r1, r2 = tp1.llm_engine.model_runner, tp2.llm_engine.model_runner
    assert r1.attention_backend == r2.attention_backend == "paged-decode kernel (C)"
    assert r2.fused_modules == r1.fused_modules > 0
    assert r2.attn.kv.k_pools_PBKH[0].shape[2] == 1  # rank 0 caches its 1 of the 2 kv heads
    ones, twos = generate_both(pair, PROMPTS)
    assert [o.token_ids for o in twos] == [o.token_ids for o in ones]
    for a, b in zip(ones, twos):  # the partial sums add in another order: float32 rounding apart
        assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)
    for llm in pair:  # the prompts shared prefixes and the long one was chunked (32-token budget)
        s = llm.stats()
        assert s["prefix_cache_hits"] >= 48 and s["kv_blocks_in_use"] == 0


def test_bytes_all_reduced_per_layer_per_token_are_2_D_dtype(pair):
    """Two all-reduces (after o_proj, after down_proj) of T x D float32 per layer per step: 2 x 128 x 4
    bytes per token, the same whatever N (the docs measure N = 2 and 4)."""
    tp2 = pair[1]
    counter, before = tp2.llm_engine.executor.counter, tp2.stats()
    counter.reset()
    tp2.generate(PROMPTS[2:3], GREEDY, use_tqdm=False)
    tokens, steps = (tp2.stats()[k] - before[k] for k in ("tokens_processed", "steps"))
    assert counter.per_layer() == {0: 2 * 128 * 4 * tokens, 1: 2 * 128 * 4 * tokens}
    assert counter.calls[(0, "attn")] == counter.calls[(1, "mlp")] == steps  # one all-reduce each per step


def test_refusals_name_the_value_and_leave_no_process(model_dir, tmp_path, pair, doomed, served):
    tp2 = pair[1]
    doomed.get(), served[1].get()  # their processes are all started: the count below is only ours
    before = set(descendants(os.getpid()))
    with pytest.raises(ValueError, match="tensor_parallel_size=3 must divide the model's num_attention_heads=4"):
        LLM(model_dir, tensor_parallel_size=3, **OPTS)
    odd = str(save_hf_model("llama", tmp_path / "odd", **{**TINY, "intermediate_size": 255}))
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide the model's intermediate_size=255"):
        LLM(odd, tensor_parallel_size=2, **OPTS)
    with pytest.raises(ValueError, match="tensor_parallel_size=0: must be an integer >= 1"):
        LLM(model_dir, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 with device='cuda:1'"):
        LLM(model_dir, tensor_parallel_size=2, device="cuda:1")
    with pytest.raises(ValueError, match="load_weights is not supported with tensor_parallel_size=2"):
        tp2.load_weights(pair[0].llm_engine.model.state_dict())
    assert set(descendants(os.getpid())) == before
    with pytest.raises(ValueError, match="unknown dtype 'float8'"):  # rank 0 fails after its worker started
        LLM(model_dir, tensor_parallel_size=2, dtype="float8", **OPTS)
    assert set(descendants(os.getpid())) == before


def test_a_killed_worker_is_named_and_rank_0_stops_cleanly(doomed):
    llm = doomed.get()
    (pid,) = llm.llm_engine.executor.pids
    os.kill(pid, signal.SIGKILL)
    for _ in range(2):  # the step that finds it, and every later one
        with pytest.raises(WorkerDiedError, match=rf"worker 1 \(pid {pid}\) exited \(killed by SIGKILL\)"):
            llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
        for rid in list(llm.llm_engine.requests):
            llm.llm_engine.abort_request(rid)
    llm.llm_engine.shutdown()
    wait_gone([pid])


def test_garbage_collection_stops_the_worker(pair):
    """Runs last of the offline tests: it drops the TP=2 engine."""
    pids = pair[1].llm_engine.executor.pids
    assert all(alive(p) for p in pids)
    del pair[1]
    gc.collect()
    wait_gone(pids)


def test_serve_tp2_float64_equals_one_process_and_no_orphan_when_rank_0_dies(served):
    """That config through the server's engine core process (whose child is the worker) and the `openai`
    client answers a chat completion and gives the greedy tokens (text and logprobs) of a one-process
    engine, the last prompt served partly from the prefix cache. Then the core (rank 0) is killed: its
    worker exits on its own. (In-process uvicorn rather than a server subprocess: one interpreter less.)"""
    import openai

    from lmforge.serve.app import build_app
    from lmforge.serve.config import ServerConfig
    from lmforge.serve.testing import ServerThread

    config, bg = served
    one = LLM(**{**dataclasses.asdict(config), "tensor_parallel_size": 1})
    want = [o.outputs[0] for o in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    engine = bg.get()
    tree = [engine.pid] + descendants(engine.pid)
    assert len(tree) == 2  # the engine core and its tensor-parallel worker
    with ServerThread(build_app(engine, ServerConfig("tiny"))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello"}],
                                              max_tokens=8, temperature=0)
        assert chat.choices[0].message.content and chat.usage.completion_tokens >= 1
        for prompt, w in zip(PROMPTS, want):  # one at a time: the last one reuses the third's blocks
            c = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True}).choices[0]
            assert c.text == w.text
            assert sum(c.logprobs.token_logprobs) == pytest.approx(w.cumulative_logprob, abs=1e-9)
        assert engine.stats()["prefix_cache_hits"] >= 48
    os.kill(tree[0], signal.SIGKILL)  # rank 0 dies: its worker must notice and exit, not linger
    wait_gone(tree)
    assert "killed by SIGKILL" in engine.dead_reason
