"""The model registry and the feedback store: verbs through the CLI, hash verification, the eval gate,
rollback byte-identity, a stateful property test, 8 concurrent writer processes, PII never on disk.

    python -m pytest tests/test_registry.py -q
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from lmforge.data.config import PiiConfig
from lmforge.data.pii import mask_pii_many
from lmforge.eval.backends import MockBackend
from lmforge.eval.evaluate import evaluate
from lmforge.tasks.suite import load_suite
from lmforge.registry import FeedbackStore, ModelVersion, Registry, RegistryError
from lmforge.registry.feedback import (MAX_FEEDBACK_PER_EXCHANGE, MAX_USER_CHARS, FeedbackLimitError, is_low,
                                       mask_texts, normalize_score)
from lmforge.registry.store import hash_model

ROOT = Path(__file__).resolve().parents[1]


def make_model(folder: Path, seed: int) -> Path:
    """A folder in export's layout; the registry hashes bytes and never parses them."""
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8, "seed": seed}))
    (folder / "model.safetensors").write_bytes(rng.randbytes(4096))
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "seed": seed}))
    (folder / "README.md").write_text("not hashed")
    return folder


def make_eval(model: Path, out: Path, correct: bool) -> Path:
    suite = load_suite("choice-basics")
    evaluate(MockBackend([suite], correct=correct), [suite], out, model_dir=model, limit=20)
    return out


def cli(*args: str, expect: int = 0) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "lmforge.registry", *args], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.returncode == expect, (args, r.returncode, r.stdout, r.stderr)
    return r


# ---- the main path through the CLI -----------------------------------------------------------------

def test_cli_main_path(tmp_path: Path) -> None:
    db = str(tmp_path / "reg.db")
    good, bad = make_model(tmp_path / "v1", 1), make_model(tmp_path / "v2", 2)
    (good / "export.json").write_text(json.dumps({"run": str(tmp_path / "train-run"), "checkpoint": "step-00000010",
                                                  "step": 10, "git": {"commit": "abc", "dirty": False}}))
    (tmp_path / "train-run").mkdir()
    (tmp_path / "train-run" / "record.json").write_text(json.dumps(
        {"experiment_id": "tiny-1", "stage": "pretrain", "data_hash": "d" * 64, "tokenizer_hash": "t" * 64}))
    # `lmforge registry` as mounted in cli.py (in-process: the whole CLI's imports cost ~10 s per process
    # on a loaded 2-core box); the later verbs run as subprocesses of the same Typer app
    from typer.testing import CliRunner

    from lmforge.cli import app as lmforge_app

    r = CliRunner().invoke(lmforge_app, ["registry", "add", "tiny", str(good), "--notes", "first", "--registry", db])
    assert r.exit_code == 0, r.output
    assert "tiny v1" in r.output and "champion" in r.output
    reg = Registry(db)
    reg.add("tiny", bad)  # the API and the CLI share one database
    reg.attach_eval("tiny", 1, make_eval(good, tmp_path / "eval-1", correct=True))
    reg.attach_eval("tiny", 2, make_eval(bad, tmp_path / "eval-2", correct=False))
    refused = cli("promote", "tiny", "2", "--registry", db, expect=2)
    assert "refused" in refused.stderr and "choice-basics" in refused.stderr and "--force" in refused.stderr
    assert "REGRESSED" in refused.stdout  # the per-task table is printed before the refusal
    reg.promote("tiny", 2, force=True)
    assert "champion -> v1" in cli("rollback", "tiny", "--registry", db).stdout
    shown = json.loads(cli("list", "tiny", "--json", "--registry", db).stdout)
    assert [(v["version"], v["aliases"]) for v in shown] == [(1, ["champion"]), (2, [])]
    v1 = shown[0]
    assert v1["lineage"]["experiment_id"] == "tiny-1" and v1["lineage"]["data_hash"] == "d" * 64
    assert v1["lineage"]["git"] == {"commit": "abc", "dirty": False} and v1["notes"] == "first"
    assert v1["evals"]["choice-basics"]["value"] == 1.0
    kinds = [e["kind"] for e in Registry(db).events("tiny")]
    assert kinds == ["add", "add", "attach_eval", "attach_eval", "promote_refused", "promote", "rollback"]


# ---- hashes, the gate, rollback --------------------------------------------------------------------

def test_verify_refuses_a_changed_file(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.db")
    mv = reg.add("tiny", make_model(tmp_path / "m", 1))
    reg.verify(mv)
    (Path(mv.path) / "README.md").write_text("edited")  # not a hashed file: still fine
    reg.verify(reg.get("tiny", "champion"))
    weights = Path(mv.path) / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[100] ^= 1  # one bit
    weights.write_bytes(bytes(data))
    with pytest.raises(RegistryError, match=r"tiny v1: .*changed: model.safetensors"):
        reg.verify(reg.get("tiny", 1))
    (Path(mv.path) / "tokenizer.json").unlink()
    with pytest.raises(RegistryError, match=r"missing: tokenizer.json"):
        reg.verify(mv)
    from typer.testing import CliRunner

    from lmforge.registry.commands import app

    r = CliRunner().invoke(app, ["verify", "tiny", "1", "--registry", str(tmp_path / "reg.db")])
    assert r.exit_code == 2 and "changed: model.safetensors" in r.output


def test_gate_refused_then_forced_and_events(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.db")
    m1, m2, m3 = (make_model(tmp_path / f"m{i}", i) for i in (1, 2, 3))
    for m in (m1, m2, m3):
        reg.add("tiny", m)
    with pytest.raises(RegistryError, match="no eval suite scored by both"):
        reg.promote("tiny", 2)  # no evidence at all is not a pass
    reg.attach_eval("tiny", 1, make_eval(m1, tmp_path / "e1", correct=True))
    with pytest.raises(RegistryError, match="scored a model with hash"):
        reg.attach_eval("tiny", 2, tmp_path / "e1")  # v1's eval is not v2's
    reg.attach_eval("tiny", 2, make_eval(m2, tmp_path / "e2", correct=False))
    reg.attach_eval("tiny", 3, make_eval(m3, tmp_path / "e3", correct=True))
    with pytest.raises(RegistryError, match=r"regresses on choice-basics beyond --max-regression 0.5"):
        reg.promote("tiny", 2, max_regression=0.5)
    assert reg.get("tiny", "champion").version == 1
    forced = reg.promote("tiny", 2, force=True)
    assert forced["allowed"] and forced["forced"] and forced["reason"].startswith("forced: ")
    assert forced["gate"]["tasks"][0]["regression"] == pytest.approx(1.0)
    assert reg.aliases("tiny") == {"champion": 2, "previous": 1}
    passed = reg.promote("tiny", 3)  # v3 is better than v2 on the same suite bytes
    assert passed["allowed"] and not passed["forced"] and passed["gate"]["regressed"] == []
    assert reg.aliases("tiny") == {"champion": 3, "previous": 2}
    with pytest.raises(RegistryError, match="already the champion"):
        reg.promote("tiny", 3)
    events = [e for e in reg.events("tiny") if e["kind"].startswith("promote")]
    assert [(e["kind"], e["details"]["version"]) for e in events] == [
        ("promote_refused", 2), ("promote_refused", 2), ("promote", 2), ("promote", 3)]
    assert "regresses" in events[1]["details"]["reason"]


def test_rollback_restores_previous_byte_identical(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.db")
    m1, m2 = make_model(tmp_path / "m1", 1), make_model(tmp_path / "m2", 2)
    original = {p.name: p.read_bytes() for p in m1.iterdir()}
    v1, _ = reg.add("tiny", m1), reg.add("tiny", m2)
    reg.set_alias("tiny", "challenger", 2)
    decision = reg.promote("tiny", 2, force=True)
    assert decision["challenger_cleared"] and "challenger" not in reg.aliases("tiny")
    back = reg.rollback("tiny")
    assert back.version == 1 and back.aliases == ["champion"] and back.sha256 == v1.sha256
    assert hash_model(back.path)[0] == v1.sha256
    assert {p.name: p.read_bytes() for p in Path(back.path).iterdir()} == original
    with pytest.raises(RegistryError, match="no `previous` version"):
        reg.rollback("tiny")  # cleared: a second rollback does not flip back to v2
    ev = reg.events("tiny")[-1]
    assert ev["kind"] == "rollback" and ev["details"]["from"] == 2 and ev["details"]["to"] == 1


def test_champion_and_challenger_are_never_one_version(tmp_path: Path) -> None:
    """A rollback to the version that is the challenger clears the challenger (a server would load
    those weights twice, as champion and as challenger, and compare them with themselves)."""
    reg = Registry(tmp_path / "reg.db")
    reg.add("tiny", make_model(tmp_path / "m1", 1))
    reg.add("tiny", make_model(tmp_path / "m2", 2))
    with pytest.raises(RegistryError, match="v1 is the champion; a challenger is another version"):
        reg.set_alias("tiny", "challenger", 1)
    reg.promote("tiny", 2, force=True)
    reg.set_alias("tiny", "challenger", 1)  # the old champion, canaried against the new one
    assert reg.aliases("tiny") == {"champion": 2, "challenger": 1, "previous": 1}
    reg.rollback("tiny")
    assert reg.aliases("tiny") == {"champion": 1}
    ev = reg.events("tiny")[-1]
    assert ev["kind"] == "rollback" and ev["details"]["challenger_cleared"] is True


def test_read_verbs_never_create_a_registry(tmp_path: Path) -> None:
    """`registry list --registry typo/path.db` created the file (and its folder) and printed an empty table."""
    typo = tmp_path / "typo" / "path.db"
    for verb in (["list"], ["show", "tiny"], ["verify", "tiny"], ["rollback", "tiny"], ["gc"],
                 ["alias", "tiny", "staging", "1"], ["promote", "tiny", "2"]):
        r = cli(*verb, "--registry", str(typo), expect=2)
        assert f"{typo}: no registry database there" in " ".join(r.stderr.split()), (verb, r.stderr)
    assert not typo.parent.exists()
    with pytest.raises(RegistryError, match="no feedback store there"):
        FeedbackStore(tmp_path / "typo.db", create=False)
    assert not (tmp_path / "typo.db").exists()
    reg = Registry(typo)  # the API's default (and `registry add`) creates it
    assert typo.is_file() and Registry(typo, create=False).names() == [] == reg.names()


def test_refusals_name_what_to_fix(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.db")
    with pytest.raises(RegistryError, match="no such folder"):
        reg.add("tiny", tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(RegistryError, match=r"no config.json and no \*.safetensors.*lmforge export"):
        reg.add("tiny", tmp_path / "empty")
    with pytest.raises(RegistryError, match="model name"):
        reg.add("bad name!", make_model(tmp_path / "m", 1))
    reg.add("tiny", tmp_path / "m")
    with pytest.raises(RegistryError, match="no model named 'other'.*registered: tiny"):
        reg.get("other", "champion")
    with pytest.raises(RegistryError, match="no alias 'staging'.*champion=v1"):
        reg.get("tiny", "staging")
    with pytest.raises(RegistryError, match="no version 7"):
        reg.set_alias("tiny", "staging", 7)
    with pytest.raises(RegistryError, match="moved only by `registry promote`"):
        reg.set_alias("tiny", "champion", 1)
    with pytest.raises(RegistryError, match="start with a letter"):
        reg.set_alias("tiny", "3", 1)
    (tmp_path / "junk.db").write_bytes(b"this is not sqlite" * 100)
    with pytest.raises(RegistryError, match="junk.db"):
        Registry(tmp_path / "junk.db")
    with pytest.raises(RegistryError, match="junk.db"):
        FeedbackStore(tmp_path / "junk.db")
    with pytest.raises(RegistryError, match="tables aliases, events, names, versions, not a feedback store"):
        FeedbackStore(reg.path)  # a registry passed as --feedback gains no tables
    FeedbackStore(tmp_path / "fb.db")
    with pytest.raises(RegistryError, match="not a registry database"):
        Registry(tmp_path / "fb.db")


def test_gc_drops_rows_never_files_and_never_reuses_numbers(tmp_path: Path) -> None:
    reg = Registry(tmp_path / "reg.db")
    folders = [make_model(tmp_path / f"m{i}", i) for i in range(5)]
    for f in folders:
        reg.add("tiny", f)
    reg.set_alias("tiny", "staging", 2)
    dropped = reg.gc(keep=1)
    assert sorted(mv.version for mv in dropped) == [3, 4]  # v1 champion, v2 staging, v5 newest
    assert all(f.is_dir() and (f / "model.safetensors").is_file() for f in folders)
    assert reg.add("tiny", folders[3]).version == 6
    assert [mv.version for mv in reg.list("tiny")] == [1, 2, 5, 6]


# ---- a stateful property test against a plain-Python model ---------------------------------------

class RegistryMachine(RuleBasedStateMachine):
    """Random operations on a real registry and on a dict model of it; they must always agree."""

    @initialize(base=st.just(None))
    def setup(self, base: None) -> None:
        import tempfile

        self.tmp = Path(tempfile.mkdtemp(prefix="registry-sm-"))
        self.folders = [make_model(self.tmp / f"m{i}", i) for i in range(3)]
        self.reg = Registry(self.tmp / "reg.db")
        self.last: dict[str, int] = {}
        self.versions: dict[str, set[int]] = {}
        self.aliases: dict[str, dict[str, int]] = {}

    def teardown(self) -> None:
        if hasattr(self, "tmp"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    names = st.sampled_from(["a", "b"])

    @rule(name=names, folder=st.integers(0, 2))
    def add(self, name: str, folder: int) -> None:
        mv = self.reg.add(name, self.folders[folder])
        assert mv.version == self.last.get(name, 0) + 1
        self.last[name] = mv.version
        self.versions.setdefault(name, set()).add(mv.version)
        self.aliases.setdefault(name, {}).setdefault("champion", mv.version)

    @precondition(lambda self: self.versions)
    @rule(data=st.data(), alias=st.sampled_from(["challenger", "staging"]))
    def alias(self, data: st.DataObject, alias: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.versions)))
        v = data.draw(st.sampled_from(sorted(self.versions[name])))
        if alias == "challenger" and self.aliases[name].get("champion") == v:
            with pytest.raises(RegistryError, match="is the champion"):
                self.reg.set_alias(name, alias, v)
            return
        self.reg.set_alias(name, alias, v)
        self.aliases[name][alias] = v

    @precondition(lambda self: self.versions)
    @rule(data=st.data())
    def promote(self, data: st.DataObject) -> None:
        name = data.draw(st.sampled_from(sorted(self.versions)))
        v = data.draw(st.sampled_from(sorted(self.versions[name])))
        a = self.aliases[name]
        if a.get("champion") == v:
            with pytest.raises(RegistryError, match="already the champion"):
                self.reg.promote(name, v, force=True)
            return
        self.reg.promote(name, v, force=True)
        a["previous"], a["champion"] = a["champion"], v
        if a.get("challenger") == v:
            del a["challenger"]

    @precondition(lambda self: self.versions)
    @rule(name=names)
    def rollback(self, name: str) -> None:
        a = self.aliases.get(name)
        if a is None or "previous" not in a:
            with pytest.raises(RegistryError):
                self.reg.rollback(name)
            return
        assert self.reg.rollback(name).version == a["previous"]
        a["champion"] = a.pop("previous")
        if a.get("challenger") == a["champion"]:
            del a["challenger"]

    @rule(keep=st.integers(0, 2))
    def gc(self, keep: int) -> None:
        dropped = {(mv.name, mv.version) for mv in self.reg.gc(keep)}
        expect = set()
        for name, vs in self.versions.items():
            aliased = set(self.aliases[name].values())
            expect |= {(name, v) for v in sorted(vs, reverse=True)[keep:] if v not in aliased}
        assert dropped == expect
        for name, v in dropped:
            self.versions[name].discard(v)

    @invariant()
    def agrees(self) -> None:
        if not hasattr(self, "reg"):
            return
        for name in self.versions:
            assert {mv.version for mv in self.reg.list(name)} == self.versions[name]
            assert self.reg.aliases(name) == self.aliases[name]
            assert self.aliases[name].get("previous") != self.aliases[name]["champion"]
            assert self.aliases[name].get("challenger") != self.aliases[name]["champion"]


TestRegistryMachine = RegistryMachine.TestCase
TestRegistryMachine.settings = settings(max_examples=8, stateful_step_count=12, deadline=None,
                                        suppress_health_check=list(HealthCheck))


# ---- 8 processes writing at once -------------------------------------------------------------------

def _worker(args: tuple[str, list[str], int, int]) -> list[tuple]:
    """Random operations; returns what succeeded, in order, for the parent's bookkeeping."""
    db, folders, seed, n_ops = args
    rng = random.Random(seed)
    reg = Registry(db)
    done: list[tuple] = []
    for _ in range(n_ops):
        name = rng.choice(["a", "b"])
        op = rng.choices(["add", "alias", "promote", "rollback", "event", "gc"], [3, 2, 3, 1, 1, 0.5])[0]
        try:
            if op == "add":
                done.append(("add", name, reg.add(name, rng.choice(folders)).version))
            elif op in ("alias", "promote"):
                # a version that exists now; another process may drop it before we use it (then: refused)
                v = rng.choice([mv.version for mv in reg.list(name)])
                if op == "alias":
                    reg.set_alias(name, "challenger", v)
                else:
                    reg.promote(name, v, force=True)
                done.append((op, name, v))
            elif op == "rollback":
                done.append(("rollback", name, reg.rollback(name).version))
            elif op == "event":
                reg.record_event(name, "auto_rollback", {"seed": seed})
                done.append(("event", name, seed))
            else:
                done += [("gc", mv.name, mv.version) for mv in reg.gc(keep=rng.randint(2, 4))]
        except (RegistryError, IndexError):
            pass  # no version yet, one another process dropped, no previous, already champion: nothing written
    return done


def _replay(events: list[dict]) -> tuple[dict[str, int], set[int]]:
    """The aliases and the surviving versions that the event log alone implies."""
    aliases: dict[str, int] = {}
    versions: set[int] = set()
    for e in events:
        d = e["details"]
        if e["kind"] == "add":
            versions.add(d["version"])
            if d.get("champion"):
                aliases["champion"] = d["version"]
        elif e["kind"] == "alias":
            if d["version"] is None:
                aliases.pop(d["alias"], None)
            else:
                aliases[d["alias"]] = d["version"]
        elif e["kind"] == "promote":
            if d["champion_before"] is not None:
                aliases["previous"] = d["champion_before"]
            aliases["champion"] = d["version"]
            if d.get("challenger_cleared"):
                aliases.pop("challenger")
        elif e["kind"] == "rollback":
            aliases["champion"] = d["to"]
            aliases.pop("previous")
            if d.get("challenger_cleared"):
                aliases.pop("challenger")
        elif e["kind"] == "gc":
            versions -= set(d["dropped"])
    return aliases, versions


def test_eight_processes_leave_a_consistent_database(tmp_path: Path) -> None:
    db = str(tmp_path / "reg.db")
    folders = [str(make_model(tmp_path / f"m{i}", i)) for i in range(3)]
    Registry(db)  # created once; the workers open it concurrently
    with mp.get_context("fork").Pool(8) as pool:
        results = pool.map(_worker, [(db, folders, seed, 14) for seed in range(8)])
    done = [op for r in results for op in r]
    reg = Registry(db)
    con = sqlite3.connect(db)
    assert con.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    assert con.execute("PRAGMA foreign_key_check").fetchall() == []
    for name in reg.names():
        added = sorted(v for op, n, v in done if op == "add" and n == name)
        assert added == list(range(1, len(added) + 1))  # unique and gap-free across processes
        events = reg.events(name)
        kinds = [e["kind"] for e in events]
        for kind in ("add", "alias", "promote", "rollback"):
            assert kinds.count(kind) == sum(op == kind and n == name for op, n, _ in done), kind
        assert kinds.count("auto_rollback") == sum(op == "event" and n == name for op, n, _ in done)
        dropped = {v for op, n, v in done if op == "gc" and n == name}
        assert sum(len(e["details"]["dropped"]) for e in events if e["kind"] == "gc") == len(dropped)
        aliases, versions = _replay(events)
        assert reg.aliases(name) == aliases  # the log explains the final state exactly
        assert {mv.version for mv in reg.list(name)} == versions == set(added) - dropped
        assert set(aliases.values()) <= versions and "champion" in aliases
        assert aliases.get("previous") != aliases["champion"]
        assert [e["id"] for e in events] == sorted(e["id"] for e in events)


# ---- the feedback store ----------------------------------------------------------------------------

def _exchange(i: int, prompt: str, version: str = "1") -> dict:
    return {"id": f"cmpl-{i}", "created": "2026-12-01T00:00:00Z", "model": "tiny", "model_version": version,
            "user": "carol@example.org", "kind": "chat", "prompt": prompt, "response": "Sure."}


def test_feedback_pii_never_reaches_the_file(tmp_path: Path) -> None:
    path = tmp_path / "fb.db"
    store = FeedbackStore(path)
    secret = "alice.smith@example.com"
    store.log_exchanges([_exchange(0, f"Email {secret} my key sk-{'a' * 30}"), _exchange(1, "plain", "2")])
    assert store.add_feedback("cmpl-0", -1, comment=f"reach me at {secret}", correction="call +1 415 555 0100")
    assert not store.add_feedback("cmpl-404", 1)
    assert store.add_feedback("cmpl-1", 5) and store.add_feedback("cmpl-1", 2)  # the latest vote counts
    ex = {e["id"]: e for e in store.exchanges()}
    assert ex["cmpl-0"]["prompt"] == "Email <EMAIL> my key <API_KEY>" and ex["cmpl-0"]["user"] == "<EMAIL>"
    assert ex["cmpl-0"]["pii"] == {"api_key": 1, "email": 2}
    assert ex["cmpl-0"]["feedback"]["correction"] == "call <PHONE>"
    assert ex["cmpl-1"]["feedback"]["score"] == 2
    s = store.stats()
    assert s["exchanges"] == 2 and s["with_feedback"] == 2 and s["feedback_rows"] == 3
    assert s["histogram"] == {"stars_2": 1, "thumbs_down": 1} and s["low_score_ratio"] == 1.0
    assert store.stats("2")["exchanges"] == 1 and store.stats("9")["low_score_ratio"] is None
    on_disk = b"".join(p.read_bytes() for p in tmp_path.glob("fb.db*"))  # the file, its WAL and shm
    assert secret.encode() not in on_disk and b"carol@example.org" not in on_disk and b"415 555" not in on_disk
    assert b"<EMAIL>" in on_disk  # the check above looked at real data
    for bad, match in ((0, "score 0: neither a thumbs nor a star score"), (7, "score 7: neither"),
                       (0.5, "score 0.5: neither"), (2.5, "score 2.5: neither"), (-0.5, "score -0.5: neither"),
                       (float("nan"), "score nan: not a finite number"), (True, "score True: must be a number"),
                       ("1", "score '1': must be a number")):
        with pytest.raises(RegistryError, match=match):
            store.add_feedback("cmpl-0", bad)
    with pytest.raises(RegistryError, match="a star score is an integer 1..5"):
        store.add_feedback("cmpl-0", 2.5, scale="stars")
    with pytest.raises(RegistryError, match="row 0: missing field"):
        store.log_exchanges([{"id": "x"}])
    store.close()


def test_one_score_rule_and_bounded_rows(tmp_path: Path) -> None:
    """The scale rule the server's metric and canary guard use too: +1 is a thumbs-up, never low;
    an exchange takes MAX_FEEDBACK_PER_EXCHANGE rows; a 100 KB `user` is not stored whole."""
    assert [normalize_score(s) for s in (-1, 1, 2, 5)] == [(-1.0, "thumbs", 0.0), (1.0, "thumbs", 1.0),
                                                           (2.0, "stars", 0.25), (5.0, "stars", 1.0)]
    assert [is_low(normalize_score(s)[2]) for s in (-1, 1, 2, 3, 4, 5)] == [True, False, True, False, False, False]
    assert is_low(normalize_score(1, "stars")[2])  # one star, when the client says so
    store = FeedbackStore(tmp_path / "fb.db")
    store.log_exchanges([{**_exchange(0, "hi"), "user": "bob@example.com " + "x" * 100_000}])
    (ex,) = store.exchanges()
    assert ex["user"].startswith("<EMAIL> x") and len(ex["user"]) == MAX_USER_CHARS
    assert all(store.add_feedback("cmpl-0", -1) for _ in range(MAX_FEEDBACK_PER_EXCHANGE))
    with pytest.raises(FeedbackLimitError, match=f"already has {MAX_FEEDBACK_PER_EXCHANGE} feedback rows"):
        store.add_feedback("cmpl-0", 1)
    assert not store.add_feedback("cmpl-404", 1)  # unknown is still False, not the limit
    s = store.stats()
    assert s["feedback_rows"] == MAX_FEEDBACK_PER_EXCHANGE and s["with_feedback"] == 1 and s["low"] == 1


def test_feedback_fast_mask_matches_the_batch_scrubber() -> None:
    texts = ["", "ok", "mail a.b@c.io", "card 4111 1111 1111 1111 ok", "ip 10.0.0.1 and ::1 or fe80::1:2:3",
             "id 11010519491231002X", "+86 13812345678 or (555) 123-4567", "Bearer abcdefghijklmnopqrstuvwxyz0123",
             "v3.11.2 on 2024-01-15 at 12:30", "ghp_" + "x" * 36 + " AKIA" + "A" * 16]
    for t in texts:
        assert mask_texts([t]) == mask_pii_many([t], PiiConfig()), t
    assert mask_texts(texts[2:4]) == mask_pii_many(texts[2:4], PiiConfig())


def test_default_registry_lives_under_lmforge_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "home"))
    reg = Registry()
    assert reg.path == tmp_path / "home" / "registry.db" and reg.path.is_file()
    assert sqlite3.connect(reg.path).execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert list(ModelVersion.__dataclass_fields__)[:9] == ["name", "version", "path", "sha256", "created", "notes",
                                                           "lineage", "evals", "aliases"]
