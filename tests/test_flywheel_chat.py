"""Chats stay chats through the flywheel: the request log keeps a chat's message list (PII masked per
message, roles as roles), and `lmforge flywheel build` writes TRL's conversational rows with every
turn: `{"messages": [...]}` for SFT, `{"prompt": [...], "chosen": [...], "rejected": [...]}` for DPO.
Old logs, whose chats were flattened to `role: content` lines, still build, split back into turns.

    python -m pytest -q tests/test_flywheel_chat.py
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from lmforge.registry import FeedbackStore, Registry
from lmforge.registry.flywheel import prompt_messages

THREE_TURNS = [
    {"role": "user", "content": "I am planning a trip to Lyon. Mail me at ana@example.com."},
    {"role": "assistant", "content": "Lyon is lovely in spring."},
    {"role": "user", "content": "What should I eat there?"},
    {"role": "assistant", "content": "Try a bouchon."},
    {"role": "user", "content": "And which museum first?"},
]
CORRECTION = "Start with the Musée des Confluences."
# a turn whose text holds a line that reads like another turn: only a logged message list keeps it whole
TRICKY = [*THREE_TURNS[:1], {"role": "assistant", "content": "Lyon is lovely.\nuser: this line is no turn"},
          *THREE_TURNS[2:]]


def _row(id: str, prompt, response: str = "No idea.") -> dict:
    return {"id": id, "created": "2026-12-05T00:00:00Z", "model": "tiny", "model_version": "1", "user": "u",
            "kind": "chat", "prompt": prompt, "response": response}


def test_the_store_keeps_a_chat_as_masked_messages(tmp_path):
    store = FeedbackStore(tmp_path / "fb.db")
    call = {"id": "call_1", "type": "function", "function": {"name": "mail", "arguments": '{"to": "ana@example.com"}'}}
    store.log_exchanges([_row("c1", [*THREE_TURNS[:3], {"role": "assistant", "content": None, "tool_calls": [call]},
                                     {"role": "tool", "tool_call_id": "call_1", "content": "sent"}])])
    (ex,) = list(store.exchanges())
    assert [m["role"] for m in ex["messages"]] == ["user", "assistant", "user", "assistant", "tool"]
    assert ex["messages"][0]["content"] == "I am planning a trip to Lyon. Mail me at <EMAIL>."
    assert ex["messages"][3]["tool_calls"][0]["function"]["arguments"] == '{"to": "<EMAIL>"}'
    assert ex["messages"][4]["tool_call_id"] == "call_1" and ex["pii"] == {"email": 2}
    assert ex["prompt"].startswith("user: I am planning a trip to Lyon. Mail me at <EMAIL>.\nassistant: Lyon")
    raw = b"".join(p.read_bytes() for p in tmp_path.glob("fb.db*"))
    assert b"ana@example.com" not in raw


def test_old_flattened_chat_logs_split_back_into_turns():
    flat = "\n".join(f"{m['role']}: {m['content']}" for m in THREE_TURNS[2:])
    assert prompt_messages("chat", flat) == THREE_TURNS[2:]
    assert prompt_messages("chat", "no role here") == [{"role": "user", "content": "no role here"}]
    assert prompt_messages("completion", "user: text") == [{"role": "user", "content": "user: text"}]


def _build(tmp_path: Path, store: Path, champion: Path) -> tuple[list[dict], list[dict]]:
    from lmforge.cli import app

    reg = tmp_path / "reg.db"
    Registry(reg).add("tiny", champion)
    r = CliRunner().invoke(app, ["flywheel", "build", "--feedback", str(store), "--registry", str(reg), "--model",
                                 "tiny", "--out", str(tmp_path / "fw"), "--min-count", "1"])
    assert r.exit_code == 0, r.output
    read = lambda name: [json.loads(line) for line in (tmp_path / "fw" / name).read_text().splitlines()]  # noqa: E731
    return read("sft.jsonl"), read("preferences.jsonl")


def _masked(messages: list[dict]) -> list[dict]:
    return [{**m, "content": m["content"].replace("ana@example.com", "<EMAIL>")} for m in messages]


def test_logged_messages_build_conversational_sft_and_dpo_rows(tmp_path, chat_model_dir):
    store = FeedbackStore(tmp_path / "fb.db")
    store.log_exchanges([_row("c1", THREE_TURNS)])
    assert store.add_feedback("c1", -1, correction=CORRECTION)
    store.close()
    sft, prefs = _build(tmp_path, tmp_path / "fb.db", chat_model_dir)
    assert sft[0]["messages"] == _masked(THREE_TURNS) + [{"role": "assistant", "content": CORRECTION}]
    assert prefs[0]["prompt"] == _masked(THREE_TURNS)
    assert prefs[0]["chosen"] == [{"role": "assistant", "content": CORRECTION}]
    assert prefs[0]["rejected"] == [{"role": "assistant", "content": "No idea."}]


def _serve_chat(tmp_path: Path, model_dir: Path, messages: list[dict]) -> tuple[Path, str]:
    """A real server with --log-requests: the chat, then a thumbs-down with a correction."""
    from openai import OpenAI

    from lmforge.engine import AsyncLLMEngine, EngineConfig
    from lmforge.serve.app import build_app
    from lmforge.serve.config import ServerConfig
    from lmforge.serve.testing import ServerThread

    store = FeedbackStore(tmp_path / "fb.db")
    app = build_app(lambda: AsyncLLMEngine(EngineConfig(model=str(model_dir), dtype="float32", max_model_len=256)),
                    ServerConfig("tiny", feedback=store, log_requests=True))
    with ServerThread(app) as srv:
        client = OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=20)
        reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
        r = httpx.post(srv.url + "/v1/feedback", json={"id": reply.id, "score": -1, "correction": CORRECTION},
                       timeout=30)
        assert r.status_code == 200, r.text
    return tmp_path / "fb.db", reply.choices[0].message.content


def test_a_served_three_turn_chat_builds_rows_that_keep_every_turn(tmp_path, chat_model_dir):
    """Must show (issue 42): served -> logged -> built, all three user turns and both assistant turns kept,
    roles as roles (no `user: ` text inside a content)."""
    store, served = _serve_chat(tmp_path, chat_model_dir, THREE_TURNS)
    sft, prefs = _build(tmp_path, store, chat_model_dir)
    assert [m["role"] for m in sft[0]["messages"]] == ["user", "assistant", "user", "assistant", "user", "assistant"]
    assert sft[0]["messages"][4]["content"] == "And which museum first?"
    assert sft[0]["messages"][-1]["content"] == CORRECTION
    assert prefs[0]["prompt"] == sft[0]["messages"][:-1]
    assert prefs[0]["rejected"] == [{"role": "assistant", "content": served}]


def test_the_served_chat_is_logged_as_its_messages(tmp_path, chat_model_dir):
    store, _ = _serve_chat(tmp_path, chat_model_dir, TRICKY)
    (ex,) = list(FeedbackStore(store).exchanges())
    assert ex["messages"] == _masked(TRICKY)  # the assistant's "\nuser: ..." line stays inside its turn
