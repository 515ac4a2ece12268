"""AsyncLLMEngine: concurrent streams, an abort mid-stream frees blocks, errors reach requests.

    python -m pytest -q tests/test_engine_async.py
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from hf_models import save_hf_model
from lmforge.engine import LLM, AsyncLLMEngine, EngineConfig, EngineDeadError, EngineStepError, ProcessAsyncLLMEngine, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny model on a shared 2-core machine
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("engine_cls", [AsyncLLMEngine, ProcessAsyncLLMEngine])
def test_two_streams_and_an_abort(model_dir, engine_cls):
    engine = engine_cls(EngineConfig(model=str(model_dir), device="cpu", enable_prefix_caching=False))
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def collect(rid, prompt, abort_after=None):
        outs = []
        async for out in engine.generate(prompt, greedy, rid):
            outs.append(out)
            if abort_after is not None and len(out.outputs[0].token_ids) >= abort_after:
                await engine.abort(rid)
        return outs

    async def main():
        return await asyncio.gather(collect("a", [5, 6, 7]), collect("b", list(range(3, 40)), abort_after=5))

    try:
        a, b = asyncio.run(main())
        assert a[-1].finished and len(a[-1].outputs[0].token_ids) == 40 and len(a) > 1  # streamed
        assert b[-1].finished and b[-1].outputs[0].finish_reason == "abort"
        assert len(b[-1].outputs[0].token_ids) < 40
        assert engine.stats()["kv_blocks_in_use"] == 0
        expected = LLM(str(model_dir), device="cpu").generate([[5, 6, 7]], greedy, use_tqdm=False)
        assert a[-1].outputs[0].token_ids == expected[0].outputs[0].token_ids
    finally:
        engine.shutdown()


def test_step_error_reaches_the_request_and_loop_survives(model_dir):
    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
    run = engine.engine.model_runner.run
    calls = {"n": 0}

    def flaky(scheduled):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return run(scheduled)
    engine.engine.model_runner.run = flaky

    async def consume(rid):
        return [o async for o in engine.generate([5, 6], SamplingParams(max_tokens=4, ignore_eos=True), rid)]

    try:
        # the request learns that the step failed, not the internals (those go to the log)
        with pytest.raises(EngineStepError, match="internal error") as e:
            asyncio.run(consume("x"))
        assert "boom" not in str(e.value)
        assert engine.stats()["kv_blocks_in_use"] == 0
        outs = asyncio.run(consume("y"))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("engine_cls", [AsyncLLMEngine, ProcessAsyncLLMEngine])
def test_invalid_request_raises_before_streaming(model_dir, engine_cls):
    engine = engine_cls(EngineConfig(model=str(model_dir), device="cpu", max_model_len=32))

    async def consume():
        return [o async for o in engine.generate([5] * 30, SamplingParams(max_tokens=8), "z")]
    try:
        with pytest.raises(ValueError, match="max_model_len"):
            asyncio.run(consume())
    finally:
        engine.shutdown()


def test_the_event_loop_never_waits_for_a_step(model_dir):
    """Submissions, aborts and stats go through a queue / a snapshot: with 0.3 s steps, the loop's
    timer ticks stay punctual while requests are added, streamed and aborted."""
    import time

    engine = AsyncLLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
    run = engine.engine.model_runner.run

    def slow(scheduled):
        time.sleep(0.3)
        return run(scheduled)
    engine.engine.model_runner.run = slow
    assert engine.is_running and engine.max_model_len == 512 and engine.vocab_size == 256
    assert engine.model_path == str(model_dir)

    async def main():
        lags, stop = [], False

        async def ticker():
            while not stop:
                t = time.perf_counter()
                await asyncio.sleep(0.01)
                lags.append(time.perf_counter() - t - 0.01)

        tick = asyncio.ensure_future(ticker())
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        gens = [engine.generate([5, 6, 7], params, f"r{i}") for i in range(4)]
        first = await asyncio.gather(*(g.__anext__() for g in gens))
        t = time.perf_counter()
        s = engine.stats()
        assert time.perf_counter() - t < 0.01 and s["num_requests_running"] + s["num_requests_waiting"] == 4
        assert len(first[0].outputs[0].token_times) == len(first[0].outputs[0].token_ids)
        await engine.abort("r3")
        for g in gens[:3]:
            async for _ in g:
                pass
        await gens[3].aclose()
        stop = True
        await tick
        return lags

    try:
        lags = asyncio.run(main())
        assert max(lags) < 0.15, f"the event loop stalled {max(lags):.3f} s"
        assert engine.stats()["kv_blocks_in_use"] == 0 and engine.stats()["num_requests_running"] == 0
    finally:
        engine.shutdown()
    assert not engine.is_running


def test_engine_process_death_fails_requests_in_flight(model_dir):
    """The engine in its own process: if that process dies mid-stream, the stream raises (it never
    hangs), the engine reports itself down, and new requests are refused at once."""
    import os
    import signal

    engine = ProcessAsyncLLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
    assert engine.is_running and engine.max_model_len == 512 and engine.vocab_size == 256
    assert engine.model_path == str(model_dir) and engine.pid != os.getpid()

    async def main():
        n = 0
        async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), "k"):
            n += 1
            if n == 2:
                os.kill(engine.pid, signal.SIGKILL)
    try:
        with pytest.raises(EngineDeadError, match=r"engine process exited \(killed by SIGKILL\)"):
            asyncio.run(asyncio.wait_for(main(), timeout=60))
        assert not engine.is_running
        with pytest.raises(EngineDeadError, match="killed by SIGKILL"):  # new requests: the same cause
            asyncio.run(main())
    finally:
        engine.shutdown()


def test_shutdown_closes_the_command_pipe_only_after_the_sender_let_go(model_dir):
    """A restarted engine's new pipe may reuse the old pipe's fd number: the old sender thread must be
    done with it before shutdown closes it, or the old SHUTDOWN lands in the new engine's pipe ahead of
    its CoreStart (seen once in make test: the restarted child failed on 'EngineCoreRequest.threads')."""
    import os
    import signal
    import time

    engine = ProcessAsyncLLMEngine(EngineConfig(model=str(model_dir), device="cpu"))
    client, events = engine.client, []
    real = client._cmd_send

    class SlowPipe:  # the sender thread descheduled between taking the fd and writing to it
        def send(self, obj):
            events.append("send")
            time.sleep(0.3)
            try:
                real.send(obj)
            finally:
                events.append("sent")

        def close(self):
            events.append("close")
            real.close()

    client._cmd_send = SlowPipe()
    os.kill(engine.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while engine.is_running and time.monotonic() < deadline:
        time.sleep(0.05)
    engine.shutdown()
    assert events == ["send", "sent", "close"]
    assert not client._sender.is_alive()


def test_engine_process_load_error_is_raised(model_dir, tmp_path):
    (tmp_path / "config.json").write_bytes((model_dir / "config.json").read_bytes())  # no weights
    with pytest.raises(FileNotFoundError) as raised:
        ProcessAsyncLLMEngine(EngineConfig(model=str(tmp_path), device="cpu"))
    assert str(tmp_path) in str(raised.value)  # the child's own error, with its message


def test_output_kinds_reconcile(model_dir):
    """delta outputs concatenate to the cumulative ones; final_only yields exactly one output."""
    engine = LLM(str(model_dir), device="cpu").llm_engine
    kinds = ("cumulative", "delta", "final_only")
    for kind in kinds:
        engine.add_request(kind, [5, 6, 7], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True,
                                                           output_kind=kind))
    seen: dict[str, list] = {k: [] for k in kinds}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen[out.request_id].append(out)
    full = seen["cumulative"][-1].outputs[0].token_ids
    assert len(full) == 7 and len(seen["final_only"]) == 1 and seen["final_only"][0].outputs[0].token_ids == full
    assert [t for o in seen["delta"] for t in o.outputs[0].token_ids] == full
    assert sum(len(o.outputs[0].token_times) for o in seen["delta"]) == 7


def test_engine_core_answers_typed_messages(model_dir):
    """Both transports run one `EngineCore`: typed commands in, typed replies and outputs out."""
    from lmforge.engine.core import EngineCore
    from lmforge.engine.llm_engine import LLMEngine
    from lmforge.engine.messages import EngineCoreRequest, RequestType

    core = EngineCore(LLMEngine(EngineConfig(model=str(model_dir), device="cpu", max_model_len=32)))
    refused = core.apply(EngineCoreRequest(RequestType.ADD, 1, "a", [5] * 30, SamplingParams(max_tokens=8)))
    assert refused.type is RequestType.ADD and refused.cid == 1 and isinstance(refused.error, ValueError)
    added = core.apply(EngineCoreRequest(RequestType.ADD, 2, "b", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True)))
    assert added.error is None and added.request_id == "b"
    stepped = core.step()
    assert stepped.failure is None and [o.request_id for o in stepped.outputs] == ["b"]
    assert stepped.stats["num_requests_running"] == 1
    aborted = core.apply(EngineCoreRequest(RequestType.ABORT, 3, "b"))
    assert aborted.output.finished and aborted.output.outputs[0].finish_reason == "abort"
    assert core.apply(EngineCoreRequest(RequestType.ABORT, 4, "b")).output is None  # unknown by now
    assert core.engine.stats()["kv_blocks_in_use"] == 0
