"""`lmforge serve --replicas N`: N engine replicas on Ray actors behind the one HTTP front.

`RayReplicaEngine` has the surface of `AsyncLLMEngine` (`generate`, `abort`, `stats`, `tokenizer`,
`max_model_len`, `is_running`, `shutdown`), so `build_app` and everything above the engine client
(the endpoints, `/metrics`, the registry's champion/challenger, the canary guard, hot reload) run
unchanged: a registry version simply loads a replica set instead of one engine. Each replica is a
Ray actor (`ReplicaActor`) holding an in-process `AsyncLLMEngine`; Ray places the actors (one CPU
or GPU share each, on any node of the cluster) and restarts one that dies (`max_restarts`). We
chose Ray actors over a Ray Serve deployment because Serve would put its own HTTP proxy and
replica lifecycle in front of ours: the loader/watchdog, the 503 while loading, admission control,
the request log and the canary would all have to be rebuilt on Serve's side. The one front here
routes; Ray schedules.

Routing (`PrefixRouter`) is prefix-aware, as Ray Serve LLM's `PrefixCacheAffinityRouter` and
vLLM production-stack's prefix-aware router are: the prompt's full KV blocks are hashed as a chain
(block k's key covers tokens 0..k*block_size, the engine's own prefix-cache rule), and a request
goes to the replica that last served its longest known chain, i.e. the one whose prefix cache
holds it; with no known prefix, or when that replica is much busier than the least loaded one
(in-flight requests: more than `abs_threshold` more and `rel_threshold` times as many), it goes to
the least loaded (ties in turn). Its blocks then belong to the chosen replica.

Failure: a replica that dies mid-stream fails only its own requests (`EngineDeadError`: the
stream ends with a 503 error chunk); it is left out of routing until it answers again (Ray
restarts it, `max_restarts` times); the others keep serving. `stats()` sums the replicas' snapshots
(polled every `poll_s` by a thread, so `/metrics` never waits on the cluster); counters of a
restarted replica carry on from where the dead one stopped, so Prometheus counters never go down.

    engine = RayReplicaEngine(EngineConfig(model="runs/model"), replicas=2)   # ray.init() if needed
    async for out in engine.generate(token_ids, SamplingParams(max_tokens=16), "r1"): ...

Knows nothing about HTTP. Ray is imported only when replicas are asked for.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from pathlib import Path

import torch

from lmforge.engine import AsyncLLMEngine, EngineConfig, EngineDeadError, RequestOutput, SamplingParams
from lmforge.tokenizer import load_tokenizer
from lmforge.tools.cluster import connect_ray

log = logging.getLogger("lmforge.serve")
RAY_MISSING = "--replicas needs Ray, which is not installed: pip install 'lmforge[ray]'"


def block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """One key per full block of the prompt, each covering the whole prefix up to that block's end."""
    out, h = [], hashlib.blake2b(digest_size=16)
    for end in range(block_size, len(token_ids) + 1, block_size):
        h.update(b"".join(t.to_bytes(4, "little", signed=True) for t in token_ids[end - block_size:end]))
        out.append(h.copy().digest())
    return out


class PrefixRouter:
    """Which replica serves a prompt: prefix affinity while loads are balanced, else the least loaded."""

    def __init__(self, replicas: int, block_size: int = 16, abs_threshold: int = 4, rel_threshold: float = 2.0,
                 max_entries: int = 200_000):
        self.block_size, self.abs_threshold, self.rel_threshold = block_size, abs_threshold, rel_threshold
        self.max_entries = max_entries
        self.load = [0] * replicas  # requests in flight per replica
        self.routed = {"prefix": 0, "least_loaded": 0}  # how each pick was made
        self._owner: OrderedDict[bytes, int] = OrderedDict()  # prefix key -> replica that last served it
        self._turn = 0

    def pick(self, token_ids: list[int], up: list[bool]) -> int:
        """The replica for this prompt among those `up`; records the prompt's blocks as its."""
        n = len(self.load)
        candidates = [i for i in range(n) if up[i]]
        if not candidates:
            raise EngineDeadError("no replica is serving (all are restarting or dead)")
        keys = block_hashes(token_ids, self.block_size)
        least = min(candidates, key=lambda i: (self.load[i], (i - self._turn) % n))
        owner = None
        for k in keys:  # the longest known prefix: stop at the first block nobody served
            o = self._owner.get(k)
            if o is None:
                break
            owner = o
        if owner is not None and up[owner] and not self._much_busier(owner, least):
            choice, how = owner, "prefix"
        else:
            choice, how, self._turn = least, "least_loaded", (least + 1) % n
        self.routed[how] += 1
        for k in keys:
            self._owner[k] = choice
            self._owner.move_to_end(k)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return choice

    def _much_busier(self, a: int, b: int) -> bool:
        la, lb = self.load[a], self.load[b]
        return la - lb > self.abs_threshold and la > self.rel_threshold * lb


class ReplicaActor:
    """The body of one replica's Ray actor: an in-process engine, its torch threads bounded."""

    def __init__(self, config: EngineConfig, threads: int):
        torch.set_num_threads(threads)
        self.engine = AsyncLLMEngine(config)

    def describe(self) -> dict:
        e = self.engine
        return {"max_model_len": e.max_model_len, "vocab_size": e.vocab_size, "model_path": e.model_path,
                "stats": e.stats()}

    def stats(self) -> dict:
        if not self.engine.is_running:  # its engine died inside a live actor: crash it, so Ray replaces it
            log.error("replica engine stopped: %s; exiting so Ray restarts this replica", self.engine.dead_reason)
            os._exit(1)
        return self.engine.stats()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str):
        async for out in self.engine.generate(prompt_token_ids, params, request_id):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)


def _ray():
    try:
        import ray  # deferred: optional dependency (pip install 'lmforge[ray]')
    except ImportError:
        raise ImportError(RAY_MISSING) from None
    return ray


def init_ray(address: str | None = None) -> None:
    """Join (or, without an address, start) a Ray cluster unless this process already has one. A server
    calls it on its main thread before uvicorn installs its signal handlers: Ray's own SIGTERM handling,
    installed later from a loader thread, turned a clean shutdown into an abort (exit -6)."""
    _ray()  # says how to install Ray when it is missing
    connect_ray(address)  # a HOST:PORT with nothing there: ClusterUnreachable naming it, within 30 s


class _Counters:
    """A replica's cumulative counters, carried over its restarts (a new actor starts from 0)."""

    def __init__(self):
        self.base: dict[str, float] = {}
        self.last: dict[str, float] = {}

    def update(self, stats: dict, counters: tuple[str, ...]) -> dict:
        if any(stats.get(k, 0) < self.last.get(k, 0) for k in counters):  # restarted: keep what it had counted
            self.base = {k: self.base.get(k, 0) + self.last.get(k, 0) for k in counters}
        self.last = {k: stats.get(k, 0) for k in counters}
        return {**stats, **{k: stats[k] + self.base.get(k, 0) for k in counters if k in stats}}


# engine statistics that only grow, and the gauges that add up over replicas; the rest (backends,
# bytes per token) are the same on every replica and come from the first
COUNTERS = ("steps", "preemptions", "prefix_cache_queries", "prefix_cache_hits", "kv_util_sum", "tokens_processed",
            "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
GAUGES = ("kv_blocks_total", "kv_blocks_in_use", "kv_blocks_cached_free", "running", "waiting",
          "num_requests_running", "num_requests_waiting", "kv_pool_tokens", "weight_bytes")


def sum_stats(snapshots: list[dict]) -> dict:
    """One engine's statistics for several: counters and additive gauges summed, averages recomputed."""
    out = dict(snapshots[0])
    for k in COUNTERS + GAUGES:
        if k in out:
            out[k] = sum(s.get(k, 0) for s in snapshots)
    out["kv_utilization_avg"] = out["kv_util_sum"] / out["steps"] if out.get("steps") else 0.0
    if "spec_decode_num_accepted_tokens_per_pos" in out:
        out["spec_decode_num_accepted_tokens_per_pos"] = [sum(col) for col in zip(
            *(s["spec_decode_num_accepted_tokens_per_pos"] for s in snapshots))]
    if out.get("spec_decode_num_draft_tokens"):
        accepted, drafted = out["spec_decode_num_accepted_tokens"], out["spec_decode_num_draft_tokens"]
        out["spec_decode_acceptance_rate"] = accepted / drafted
    return out


def _placement(ray, replicas: int, device: str) -> tuple[dict, int]:
    """The actor's resource request and its torch threads: a GPU each where the cluster has them
    (and the device allows), else an equal share of the CPUs, at most one node's."""
    total = ray.cluster_resources()
    if device != "cpu" and total.get("GPU", 0) >= replicas:
        return {"num_gpus": 1}, 1
    per_node = max((n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")), default=1)
    share = total.get("CPU", 1) / replicas
    threads = max(1, int(min(share, per_node)))
    return {"num_cpus": min(share, per_node)}, threads


class RayReplicaEngine:
    """`replicas` engines on Ray actors behind `AsyncLLMEngine`'s surface, routed by `PrefixRouter`."""

    def __init__(self, config: EngineConfig, replicas: int, address: str | None = None, max_restarts: int = 3,
                 poll_s: float = 0.5, router: PrefixRouter | None = None):
        if replicas < 1:
            raise ValueError(f"replicas={replicas}: must be at least 1")
        ray = _ray()
        init_ray(address)
        options, threads = _placement(ray, replicas, config.device)
        actor = ray.remote(max_restarts=max_restarts, max_task_retries=0, **options)(ReplicaActor)
        self.actors = [actor.remote(config, threads) for _ in range(replicas)]
        try:
            infos = ray.get([a.describe.remote() for a in self.actors])
        except ray.exceptions.RayTaskError as e:  # the model failed to load: the engine's own error
            self._kill()
            raise (e.cause if isinstance(e.cause, Exception) else e) from None
        except BaseException:
            self._kill()
            raise
        self.config, self.poll_s = config, poll_s
        self.tokenizer = load_tokenizer(Path(config.model), optional=True)
        self.max_model_len, self.vocab_size = infos[0]["max_model_len"], infos[0]["vocab_size"]
        self.model_path = infos[0]["model_path"]
        self.router = router or PrefixRouter(replicas, config.block_size)
        self.up = [True] * replicas  # answering (not restarting)
        self.lost: list[str | None] = [None] * replicas  # why a replica is gone for good (restarts used up)
        self._counters = [_Counters() for _ in range(replicas)]
        self._snapshots = [c.update(i["stats"], COUNTERS) for c, i in zip(self._counters, infos)]
        self._where: dict[str, int] = {}  # request id -> replica serving it
        self._stopped = False
        self._poller = threading.Thread(target=self._poll, name="lmforge-replica-stats", daemon=True)
        self._poller.start()
        log.info("%d engine replicas on Ray (%s each, %d torch threads)", replicas, options, threads)

    # ---- what the server reads ---------------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        """True until shut down or until every replica is gone for good (one restarting still counts)."""
        return not self._stopped and any(x is None for x in self.lost)

    @property
    def dead_reason(self) -> str | None:
        if self._stopped:
            return "the replica set was shut down"
        if all(x is not None for x in self.lost):
            return f"every replica died and Ray's restarts are used up: {self.lost[0]}"
        return None

    def stats(self) -> dict:
        """The replicas' statistics summed (as of the last poll; never waits), plus the routing counts."""
        out = sum_stats(self._snapshots)
        out.update(replicas=len(self.actors), replicas_up=sum(self.up), routed_by_prefix=self.router.routed["prefix"],
                   routed_least_loaded=self.router.routed["least_loaded"])
        return out

    def replica_stats(self) -> list[dict]:
        """Each replica's own snapshot (counters carried over its restarts)."""
        return list(self._snapshots)

    # ---- requests ------------------------------------------------------------------------------------------

    async def generate(self, prompt: str | list[int], sampling_params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """The chosen replica's outputs for this request. Its death fails this request with an
        `EngineDeadError` (others are untouched); leaving early aborts the request there."""
        if self._stopped:
            raise EngineDeadError("the replica set is shut down")
        if isinstance(prompt, str):  # the server sends token ids; a text prompt is routed on its encoding
            ids = self.tokenizer.encode(prompt, add_special_tokens=False) if self.tokenizer is not None else []
        else:
            ids = list(prompt)
        k = self.router.pick(ids, self.up)
        self.router.load[k] += 1
        self._where[request_id] = k
        finished = False
        try:
            stream = self.actors[k].generate.options(num_returns="streaming").remote(prompt, sampling_params,
                                                                                     request_id)
            async for ref in stream:
                out = await ref
                finished = out.finished
                yield out
        except _ray().exceptions.RayActorError as e:
            self._down(k, e)
            raise EngineDeadError(f"replica {k} died while serving this request: {_first_line(e)}") from None
        except _ray().exceptions.RayTaskError as e:  # the engine's own error (a ValueError is the client's 400)
            raise (e.cause if isinstance(e.cause, Exception) else e) from None
        finally:
            self.router.load[k] -= 1
            self._where.pop(request_id, None)
            if not finished and self.up[k] and not self._stopped:
                self.actors[k].abort.remote(request_id)  # free its blocks; no need to wait

    async def abort(self, request_id: str) -> None:
        k = self._where.get(request_id)
        if k is not None and self.up[k]:
            try:
                await self.actors[k].abort.remote(request_id)
            except _ray().exceptions.RayError as e:
                self._down(k, e)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self._poller is not threading.current_thread():  # no Ray call may outlive the set (ray.shutdown next)
            self._poller.join(timeout=max(2.0, 4 * self.poll_s) + 1.0)
        self._kill()

    # ---- replica health ------------------------------------------------------------------------------------

    def _kill(self) -> None:
        ray = _ray()
        for a in self.actors:
            ray.kill(a, no_restart=True)

    def _down(self, k: int, error: BaseException) -> None:
        """Leave replica k out of routing until it answers a poll; for good once Ray gave up on it."""
        if isinstance(error, _ray().exceptions.ActorDiedError):
            self.lost[k] = _first_line(error)
        if self.up[k]:
            log.warning("replica %d is down (%s); Ray restarts it, the others serve", k, _first_line(error))
        self.up[k] = False

    def _poll(self) -> None:
        """Every `poll_s`: each replica's statistics; one that answers is up, one that does not is down."""
        ray = _ray()
        while not self._stopped:
            refs = {a.stats.remote(): k for k, a in enumerate(self.actors) if self.lost[k] is None}
            wait_s = max(2.0, 4 * self.poll_s)
            ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s) if refs else ([], [])
            for ref, k in refs.items():
                try:
                    snapshot = ray.get(ref) if ref in ready else None
                except ray.exceptions.RayError as e:
                    self._down(k, e)
                    continue
                if snapshot is None:
                    self._down(k, TimeoutError("its statistics did not come back in time"))
                    continue
                self._snapshots[k] = self._counters[k].update(snapshot, COUNTERS)
                if not self.up[k] and not self._stopped:
                    log.info("replica %d serves again", k)
                self.up[k] = True
            time.sleep(self.poll_s)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
