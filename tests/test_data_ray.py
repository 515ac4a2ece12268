"""`data prepare` and `data pack` with `--executor ray` on a local 2-CPU Ray cluster: the same bytes
as `--executor local` (splits, rejected, quarantine, manifest, stats' counts), also when a worker
process is killed mid-run (Ray retries its task), and a driver killed mid-run leaves nothing that
`data pack` accepts. One module-scoped cluster (`ray.init(num_cpus=2)`, ~5 s to start); the
corpus is split over three files plus a duplicate-id file, with every kind of drop planted.

    python -m pytest -q tests/test_data_ray.py
"""

from __future__ import annotations

import copy
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import ray

from lmforge.data import executor as ray_executor
from lmforge.data.config import PrepareConfig
from lmforge.data.pack import pack_dataset
from lmforge.data.prepare import _Pipeline, prepare_dataset
from lmforge.data.readers import resolve_inputs
from test_data_pack import make_docs, tok_dir, write_prepared  # noqa: F401  (tok_dir: a fixture)
from test_data_prepare import EVAL_ITEMS, edit, random_doc, vocab

OVERRIDES = ["split.val=0.1", "split.test=0.1", "boilerplate.min_docs=5", "quality.max_chars=20000"]
OUTPUTS = ("splits/train.jsonl", "splits/val.jsonl", "splits/test.jsonl", "rejected.jsonl", "quarantine.jsonl",
           "manifest.json")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    fault = tmp_path_factory.mktemp("fault") / "fault"
    os.environ[ray_executor.FAULT_ENV] = str(fault)  # inherited by the workers ray.init starts
    if ray.is_initialized():  # another module's cluster: ours needs the variable above
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
    yield {"fault": fault, "address": ray.get_runtime_context().gcs_address}
    ray.shutdown()
    os.environ.pop(ray_executor.FAULT_ENV, None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    """Three JSONL shards: near and exact duplicates across shards, a boilerplate footer, PII,
    planted eval items, long and empty documents, bad lines, and ids that repeat across files."""
    rng = random.Random(1)
    words = vocab(rng, 3000)
    root = tmp_path_factory.mktemp("raycorpus")
    footer = "Copyright the example project authors, all rights reserved."
    base = [random_doc(rng, words, 120) for _ in range(90)]
    rows = [{"id": f"doc{i}", "text": t + ("\n" + footer if i % 3 == 0 else "")} for i, t in enumerate(base)]
    rows += [{"text": edit(rng, base[i], 0.02, words)} for i in range(0, 60, 3)]  # id: path:line
    rows += [{"id": f"exact{i}", "text": base[i]} for i in range(60, 75)]
    rows += [{"id": f"contam{k}", "text": random_doc(rng, words, 60) + " " + item["prompt"]}
             for k, item in enumerate(EVAL_ITEMS)]
    rows += [{"id": "empty", "text": "  \n "}, {"id": "long", "text": random_doc(rng, words, 9000)},
             {"id": "pii", "text": random_doc(rng, words, 80) + " mail jane.roe@example.org or 10.0.0.12"}]
    rng.shuffle(rows)
    paths = []
    for k in range(3):
        lines = [json.dumps(r) for r in rows[k::3]]
        lines.insert(2, '{"id": "broken", "text": "unterminated')
        lines.insert(len(lines) - 3, "[1, 2, 3]")  # in the last byte range of the file
        paths.append(root / f"part{k}.jsonl")
        paths[-1].write_text("\n".join(lines) + "\n", encoding="utf-8")
    paths.append(root / "part3.jsonl")  # ids seen in part0: renamed, with the global document index
    paths[-1].write_text("\n".join(json.dumps({"id": r["id"], "text": random_doc(rng, words, 70)})
                                   for r in [r for r in rows[0::3] if "id" in r][:3]) + "\n", encoding="utf-8")
    evals = root / "eval.jsonl"
    evals.write_text("\n".join(json.dumps(i) for i in EVAL_ITEMS) + "\n")
    return {"inputs": [str(p) for p in paths], "eval": str(evals)}


def _prepare(corpus: dict, out: Path, executor=None, **kw) -> dict:
    return prepare_dataset(corpus["inputs"], out, eval_sets=[corpus["eval"]], overrides=OVERRIDES, workers=1,
                           executor=executor, **kw)


@pytest.fixture(scope="module")
def local_run(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("local") / "out"
    return out, _prepare(corpus, out)


def _counts(stats: dict) -> dict:
    return {k: v for k, v in stats.items() if k not in ("seconds", "mb_per_s", "workers", "workers_requested")}


def _same_outputs(a: Path, b: Path) -> None:
    for name in OUTPUTS:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert _counts(json.loads((a / "stats.json").read_text())) == _counts(json.loads((b / "stats.json").read_text()))


def test_prepare_on_ray_is_byte_identical(cluster, corpus, local_run, tmp_path):
    out, stats = local_run
    steps = stats["steps"]  # the corpus exercises every global step, or identity would prove little
    assert steps["read"]["renamed_duplicate_ids"] == 3 and steps["read"]["dropped"]["quarantined"] == 6
    assert steps["boilerplate"]["lines_removed"] >= 30 and steps["normalize"]["dropped"]["empty"] == 1
    assert steps["exact_dedup"]["dropped"]["exact_duplicate"] >= 10
    assert steps["near_dedup"]["dropped"]["near_duplicate"] >= 10
    assert steps["contamination"]["hits"] >= 1 and steps["quality"]["parts_added_by_split"] >= 1
    assert all(steps["split"]["sizes"].values())
    for buckets, shard_bytes in ((2, 1 << 25), (3, 16_000)):  # whole files, then ~4 byte ranges per file
        ex = ray_executor.RayExecutor(buckets=buckets, shard_bytes=shard_bytes)
        n_shards = len(ex._shards(resolve_inputs(corpus["inputs"]))[1])
        assert n_shards == 4 if buckets == 2 else n_shards > 8
        ray_stats = _prepare(corpus, tmp_path / f"ray{buckets}", ex)
        assert ray_stats["workers"] == 2
        _same_outputs(out, tmp_path / f"ray{buckets}")


def test_uri_inputs_read_through_pyarrow_fs(cluster, corpus, local_run, tmp_path):
    """file:// URIs take the pyarrow.fs path (as s3:// would): local and Ray agree, and the same
    documents survive as from the plain paths (ids and meta.path name the URI instead)."""
    uris = [Path(p).as_uri() for p in corpus["inputs"]]
    for name, ex in (("local", None), ("ray", ray_executor.RayExecutor(shard_bytes=16_000))):
        prepare_dataset(uris, tmp_path / name, eval_sets=[corpus["eval"]], overrides=OVERRIDES, workers=1,
                        executor=ex)
    _same_outputs(tmp_path / "local", tmp_path / "ray")
    manifest = json.loads((tmp_path / "ray" / "manifest.json").read_text())
    assert [i["path"] for i in manifest["inputs"]] == uris
    assert manifest["counts"] == json.loads((local_run[0] / "manifest.json").read_text())["counts"]
    train = (tmp_path / "ray" / "splits" / "train.jsonl").read_text()
    assert uris[0] + ":" in train  # a default id: the URI and the line number


def test_killed_worker_is_retried_and_output_identical(cluster, corpus, local_run, tmp_path):
    for stage in ("clean", "split"):
        cluster["fault"].write_text(stage)
        _prepare(corpus, tmp_path / stage, ray_executor.RayExecutor())
        assert Path(f"{cluster['fault']}.fired").is_file(), f"no worker of stage {stage} was killed"
        os.unlink(f"{cluster['fault']}.fired")
        _same_outputs(local_run[0], tmp_path / stage)


def test_killed_driver_leaves_nothing_pack_accepts(cluster, corpus, tok_dir, tmp_path):  # noqa: F811
    out = tmp_path / "killed"
    fault = tmp_path / "driver-fault"
    fault.write_text("write")  # the driver kills itself after writing its first output piece
    env = {**os.environ, ray_executor.FAULT_ENV: str(fault)}
    cmd = [str(Path(sys.executable).with_name("lmforge")), "data", "prepare", *corpus["inputs"], "--out", str(out),
           "--executor", "ray", "--ray-address", cluster["address"], "--no-progress", *OVERRIDES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert Path(f"{fault}.fired").is_file()
    assert not (out / "splits").exists() and not (out / "manifest.json").exists()
    with pytest.raises((ValueError, FileNotFoundError), match="splits|not 'finished'"):
        pack_dataset(out, tok_dir, 16, tmp_path / "packed")


def test_pack_on_ray_is_byte_identical(cluster, tok_dir, tmp_path):  # noqa: F811
    prepared = write_prepared(tmp_path / "prepared", {"train": make_docs(600, 5), "val": make_docs(30, 6)})
    local = pack_dataset(prepared, tok_dir, 16, tmp_path / "local", workers=1, shard_tokens=1000)
    cluster["fault"].write_text("pool")
    on_ray = pack_dataset(prepared, tok_dir, 16, tmp_path / "ray", shard_tokens=1000,
                          executor=ray_executor.RayExecutor())
    assert Path(f"{cluster['fault']}.fired").is_file()
    os.unlink(f"{cluster['fault']}.fired")
    assert on_ray == local and len(local["splits"]["train"]["files"]) > 3
    for name in [f for s in local["splits"].values() for f in s["files"]] + ["manifest.json"]:
        assert (tmp_path / "local" / name).read_bytes() == (tmp_path / "ray" / name).read_bytes(), name


def test_without_ray_the_executor_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'lmforge\[ray\]'"):
        ray_executor.RayExecutor()


def test_a_ray_address_with_nothing_listening_fails_within_seconds_naming_it(tmp_path):
    """Issue 43: `--ray-address 127.0.0.1:6399` with nothing there printed Ray's warnings for minutes."""
    import socket
    import time

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "hello world " * 20}) + "\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "lmforge.cli", "data", "prepare", str(src), "--out",
                           str(tmp_path / "out"), "--executor", "ray", "--ray-address", f"127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=90, env=env)
    took = time.monotonic() - t0
    assert proc.returncode == 2 and f"127.0.0.1:{port}" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and took < 30, took


def _dedup_items(n: int, seed: int) -> list[dict]:
    """Cleaned items (one part each) whose signatures form exact copies, near copies and chains of
    copies of copies, with similarities around the confirm level (multiples of 1/128: ties happen)."""
    rng = np.random.default_rng(seed)
    items: list[dict] = []
    for i in range(n):
        r, src = rng.random(), items[int(rng.integers(len(items)))]["parts"][0] if items else None
        if src is not None and r < 0.15:
            key, sig = src["exact"], src["sig"]
        else:
            key = rng.bytes(32)
            sig = rng.integers(0, 2**32, 128, dtype=np.uint32)
            if src is not None and r < 0.7:
                sig = src["sig"].copy()
                sig[rng.choice(128, int(rng.integers(2, 45)), replace=False)] = rng.integers(0, 2**32, 1)[0]
        items.append(_item(rng, i, key, sig))
    for i in range(n, n + 60, 3):  # ties: z agrees with x and with y on 108 of 128 (x and y on 88)
        x = rng.integers(0, 2**32, 128, dtype=np.uint32)
        y, z = x.copy(), x.copy()
        d = rng.choice(128, 40, replace=False)
        y[d] = rng.integers(0, 2**32, 40, dtype=np.uint32)
        z[d[:20]] = y[d[:20]]
        items += [_item(rng, i + k, rng.bytes(32), sig) for k, sig in enumerate((x, y, z))]
    return items


def _item(rng: np.random.Generator, i: int, key: bytes, sig: np.ndarray) -> dict:
    doc = {"id": f"id{rng.integers(10**6):06d}-{i}", "text": "", "meta": {}}  # random ids: ties go to the smaller
    return {"id": doc["id"], "boilerplate_lines": 0,
            "parts": [{"doc": doc, "reason": None, "pii": {}, "exact": key, "sig": sig}]}


@pytest.mark.parametrize("shards,nb", [(1, 1), (3, 2), (5, 4)])
def test_bucket_decisions_match_sequential_dedup(shards, nb):
    """exact_task + bands_task + near_task (called directly) decide what the local executor's
    in-order NearDedup decides: the same rejected lines, survivors and cluster count."""
    cfg = PrepareConfig().validate()
    items = _dedup_items(300, seed=shards)
    local = _Pipeline(cfg, None)
    local_writers = local.split_writers()
    local.take_cleaned(copy.deepcopy(items), local_writers)
    assert local.stats.steps["near_dedup"]["dropped"]["near_duplicate"] >= 40
    assert local.stats.steps["exact_dedup"]["dropped"]["exact_duplicate"] >= 20
    cuts = np.linspace(0, len(items), shards + 1).astype(int)
    parts = [[it["parts"][0] for it in items[a:b]] for a, b in zip(cuts[:-1], cuts[1:])]
    keys = [ray_executor.dedup_keys(p, cfg, nb) for p in parts]
    exact = [ray_executor.exact_task(shards, *[k[0][b] for k in keys]) for b in range(nb)]
    targets = [e[-1] for e in exact]
    edges = [ray_executor.bands_task(local.dedup.lsh.confirm, nb, *targets, *[k[1][b] for k in keys])
             for b in range(nb)]
    near = ray_executor.near_task(shards, nb, *targets, *edges)
    rejected, kept = "", []
    for s, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
        pipe = _Pipeline(cfg, None)
        pipe.dedup = ray_executor._Decided({q: f for e in exact for q, f in e[s].items()}, near[s])
        writers = pipe.split_writers()
        pipe.take_cleaned(copy.deepcopy(items[a:b]), writers)
        rejected += pipe.rejected.text()
        kept += [d["id"] for w in writers.values() for d in w.docs]
    assert rejected == local.rejected.text()
    assert sorted(kept) == sorted(d["id"] for w in local_writers.values() for d in w.docs)
    assert near[-1] == sum(1 for c in local.cluster_sizes.values() if c > 1)
