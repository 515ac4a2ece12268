"""`lmforge.launch`, the `lmforge` command's entry point: `serve` starts its engine child before the CLI imports
torch, and sends it its start as soon as the flags are read (`engine.spawn`); the MPClient built later adopts
the child only for the config it was started with."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from lmforge.engine import spawn
from lmforge.launch import wants_engine_child


@pytest.mark.parametrize("args, want", [
    (["serve", "m.gguf"], True),
    (["serve", "m", "--port", "8000", "--api-key", "k"], True),
    (["serve", "--help"], False),
    (["serve", "m", "--no-engine-process"], False),
    (["serve", "m", "--replicas", "2"], False),
    (["serve", "m", "--replicas=2"], False),
    (["serve", "m", "--ray-address=auto"], False),
    (["train", "c.yaml"], False),
    ([], False),
])
def test_only_serve_with_an_engine_child_prespawns(args, want):
    assert wants_engine_child(args) is want


def test_the_entry_and_the_spawner_import_no_torch():
    """What runs before the child is started must not pay for torch (~1.5 s): the point of the early start."""
    code = "import sys, lmforge.launch, lmforge.engine.spawn; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


class _Pipe:
    def __init__(self):
        self.sent = []

    def send(self, obj):
        self.sent.append(obj)


@pytest.fixture
def fake_children(monkeypatch):
    made, killed = [], []

    def fake_spawn():
        child = (SimpleNamespace(pid=len(made)), _Pipe(), None)
        made.append(child)
        return child

    monkeypatch.setattr(spawn, "spawn", fake_spawn)
    monkeypatch.setattr(spawn, "kill", lambda proc: killed.append(proc.pid))
    monkeypatch.setattr(spawn, "_waiting", None)
    monkeypatch.setattr(spawn, "_sent", None)
    return made, killed


def test_a_child_started_for_this_config_is_adopted_with_its_start_sent(fake_children):
    made, killed = fake_children
    spawn.prespawn()  # lmforge.launch: no config yet
    start = SimpleNamespace(config={"model": "a"})
    spawn.prespawn(start)  # serve, once its flags are read: the same child gets its start
    assert len(made) == 1 and made[0][1].sent == [start]
    child, started = spawn.take({"model": "a"})
    assert child is made[0] and started and not killed


def test_a_child_started_for_another_config_is_stopped_and_replaced(fake_children):
    made, killed = fake_children
    spawn.prespawn(SimpleNamespace(config={"model": "a"}))
    child, started = spawn.take({"model": "b"})
    assert killed == [0] and child is made[1] and not started  # the MPClient sends b's start itself


def test_without_a_waiting_child_take_spawns_one(fake_children):
    made, _ = fake_children
    child, started = spawn.take({"model": "a"})
    assert child is made[0] and not started


def test_a_quiet_start_turns_the_collector_back_on_once():
    """`lmforge serve`'s processes start with the cyclic collector off (`QUIET_START` in the engine child,
    `launch.main` in the server) and `startup_done` turns it back on with the start's objects frozen; a
    second call, or one where it was on, changes nothing."""
    from lmforge.tools.procs import QUIET_START

    code = (QUIET_START + "from lmforge.tools.procs import startup_done; import gc; off = not gc.isenabled(); "
            "startup_done(); frozen = gc.get_freeze_count(); startup_done(); "
            "print(off, gc.isenabled(), frozen > 1000, gc.get_freeze_count() == frozen)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True", "True"]


def test_the_engine_child_starts_quiet(monkeypatch):
    """The child's command line begins with `QUIET_START` (its `child_main` calls `startup_done` once READY is
    sent)."""
    from lmforge.tools.procs import QUIET_START

    seen = []
    monkeypatch.setattr(spawn, "start_python", lambda code, fds: seen.append(code) or SimpleNamespace(pid=0))
    spawn.spawn()
    assert seen and seen[0].startswith(QUIET_START)


def test_the_server_turns_the_collector_back_on_when_its_first_load_ends():
    """A failed first load too: the server keeps answering 503 with the reason, with its collector on."""
    code = ("import asyncio, gc; gc.disable()\n"
            "from lmforge.serve.engine_client import VersionRouterClient\n"
            "c = VersionRouterClient(0)\n"
            "def broken(): raise RuntimeError('no model here')\n"
            "asyncio.run(c.load('v1', broken, None, 0.0))\n"
            "print(type(c.load_error).__name__, gc.isenabled(), gc.get_freeze_count() > 1000)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["RuntimeError", "True", "True"]
