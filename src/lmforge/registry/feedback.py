"""The feedback store: served exchanges (PII masked before anything is written) and users' scores.

Its own SQLite file (WAL, so the server writes while `lmforge flywheel build` reads), apart from
the registry: exchanges arrive at serving rate and are not registry state. Two tables:

    exchanges (id, created, model, model_version, user, kind, prompt, messages, response, pii)
    feedback  (seq, exchange_id, created, score, scale, normalized, comment, correction)

A chat's prompt may be logged as its message list (`prompt` a list of `{role, content}` dicts, or a
`messages` field beside the text): `messages` keeps it (JSON, every content masked on its own, roles as
roles), and `prompt` its text (`role: content` lines) for reading; a completion (or an older row) has
`messages` NULL. `log_exchanges` masks the prompt (each message), the response and the `user` field
with the data package's scrubber (`lmforge.data.pii.mask_pii_many`, every PII type on) inside the call,
before the transaction starts; `pii` keeps the per-type counts. One transaction per call: the server batches.
`add_feedback` appends a row (a user may change their vote; the latest counts) and returns False
for an unknown id. An exchange takes at most `MAX_FEEDBACK_PER_EXCHANGE` rows: past that
`FeedbackLimitError` (the server's 409), so one client cannot grow the table, or weigh on anything
counted per row, by re-scoring one completion in a loop. The `user` field is an end-user id: it is
stored up to `MAX_USER_CHARS` characters (masked first, then cut).

Scores, the one scale rule that the store, the server's `/metrics` and its canary guard share:
-1 / +1 are thumbs, 1..5 stars. 1 is both a thumbs-up and one star, so it reads as a thumbs-up
unless `scale="stars"` says otherwise; anything else (0, 0.5, 2.5, NaN) is refused by
`normalize_score`. Each score maps to `normalized` in [0, 1] (thumbs 0 / 1, stars (s - 1) / 4);
`is_low(normalized)` (below 0.5: thumbs down, 1-2 stars) and `is_high` (0.75 and up: thumbs up,
4-5 stars) classify it. It knows nothing about HTTP or training.

    store = FeedbackStore("runs/serve/feedback.db")
    store.log_exchanges([{"id": "cmpl-1", "created": "...", "model": "tiny", "model_version": "3",
                          "user": "u1", "kind": "chat", "prompt": [{"role": "user", "content": "hi"}],
                          "response": "hello"}])
    store.add_feedback("cmpl-1", -1, correction="Hello! How can I help?")
"""

from __future__ import annotations

import json
import math
import os
import sqlite3
import threading
from contextlib import contextmanager
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmforge.data.config import PiiConfig
from lmforge.data import pii
from lmforge.data.pii import mask_pii_many
from lmforge.registry.store import BUSY_TIMEOUT_MS, RegistryError, commit_or_rollback, now, refuse_foreign

LOW, HIGH = 0.5, 0.75  # normalized score: below LOW is low, at or above HIGH is high
MAX_FEEDBACK_PER_EXCHANGE = 10  # rows one exchange takes: a few changes of mind, not a loop
MAX_USER_CHARS = 256  # OpenAI's `user` is an end-user id; a longer one is cut (after masking)
ALLOWED_SCORES = "-1 or +1 (thumbs down / up) or an integer 1..5 (stars)"
KINDS = ("completion", "chat")
FIELDS = ("id", "created", "model", "model_version", "user", "kind", "prompt", "response")
SCHEMA = """
CREATE TABLE IF NOT EXISTS exchanges (
    id TEXT PRIMARY KEY,
    created TEXT NOT NULL,
    model TEXT NOT NULL,
    model_version TEXT,
    user TEXT,
    kind TEXT NOT NULL,
    prompt TEXT NOT NULL,
    response TEXT NOT NULL,
    pii TEXT NOT NULL DEFAULT '{}',
    messages TEXT
);
CREATE TABLE IF NOT EXISTS feedback (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    exchange_id TEXT NOT NULL REFERENCES exchanges(id),
    created TEXT NOT NULL,
    score REAL NOT NULL,
    scale TEXT NOT NULL,
    normalized REAL NOT NULL,
    comment TEXT,
    correction TEXT,
    pii TEXT NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS feedback_by_exchange ON feedback(exchange_id, seq);
CREATE INDEX IF NOT EXISTS exchanges_by_version ON exchanges(model_version);
"""
MESSAGE_KEYS = ("role", "content", "name", "tool_call_id", "tool_calls")  # what a logged message keeps
_PII = PiiConfig()
_OPEN_GATES = pii.Gates(*[True] * len(pii.Gates._fields))
_FEW_CHARS = 4096


def mask_texts(texts: list[str]) -> list[tuple[str, dict[str, int]]]:
    """`mask_pii_many(texts)`, faster for the one or two short texts of a feedback call: the batch
    gates cost ~1 ms of numpy set-up, more than running every pattern on a short text. With every
    gate open `pii._mask` runs every pattern, which gives the same output (the gates are only
    necessary conditions: lmforge.data.pii's contract, checked in tests/test_registry.py)."""
    if len(texts) <= 2 and sum(map(len, texts)) <= _FEW_CHARS:
        return [pii._mask(t, _PII, _OPEN_GATES) for t in texts]
    return mask_pii_many(texts, _PII)


class FeedbackLimitError(RegistryError):
    """An exchange already has `MAX_FEEDBACK_PER_EXCHANGE` feedback rows."""


def normalize_score(score: float, scale: str | None = None) -> tuple[float, str, float]:
    """(score, "thumbs" | "stars", normalized in [0, 1]); RegistryError naming the allowed values."""
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise RegistryError(f"score {score!r}: must be a number, {ALLOWED_SCORES}")
    if not math.isfinite(score):
        raise RegistryError(f"score {score!r}: not a finite number; send {ALLOWED_SCORES}")
    if scale not in (None, "thumbs", "stars"):
        raise RegistryError(f"scale {scale!r}: must be 'thumbs', 'stars' or omitted")
    if scale is None:
        if score not in (-1, 1, 2, 3, 4, 5):
            raise RegistryError(f"score {score:g}: neither a thumbs nor a star score; send {ALLOWED_SCORES}")
        scale = "thumbs" if score in (-1, 1) else "stars"
    if scale == "thumbs":
        if score not in (-1, 1):
            raise RegistryError(f"score {score!r}: a thumbs score is -1 (down) or +1 (up)")
        return float(score), scale, float(score > 0)
    if score != int(score) or not 1 <= score <= 5:
        raise RegistryError(f"score {score!r}: a star score is an integer 1..5")
    return float(score), scale, (score - 1) / 4


def is_low(normalized: float) -> bool:
    """A low score (thumbs down, 1-2 stars): what the flywheel corrects and the canary guard counts."""
    return normalized < LOW


def is_high(normalized: float) -> bool:
    return normalized >= HIGH


def histogram_key(score: float, scale: str) -> str:
    return ("thumbs_up" if score > 0 else "thumbs_down") if scale == "thumbs" else f"stars_{int(score)}"


class FeedbackStore:
    def __init__(self, path: str | os.PathLike, create: bool = True):
        """`create=False` for readers (`flywheel build`): a path that names no file is an error, not a
        new empty store."""
        self.path = Path(path)
        if self.path.is_dir():
            raise RegistryError(f"{self.path}: is a folder; the feedback store is a file (e.g. "
                                f"{self.path / 'feedback.db'})")
        if not create and not self.path.is_file():
            raise RegistryError(f"{self.path}: no feedback store there; check the path (`lmforge serve "
                                f"--log-requests --feedback-db PATH` creates one)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()  # one connection per thread (and per process: see _db)
        db = self._db()
        if db.execute("PRAGMA journal_mode=WAL").fetchone()[0].lower() != "wal":
            raise RegistryError(f"{self.path}: SQLite refused WAL mode; put the store on a local file system")
        with self._tx() as db:
            refuse_foreign(db, self.path, "exchanges", "a feedback store")
            for statement in filter(str.strip, SCHEMA.split(";")):
                db.execute(statement)
            if "messages" not in {r[1] for r in db.execute("PRAGMA table_info(exchanges)")}:
                db.execute("ALTER TABLE exchanges ADD COLUMN messages TEXT")  # a store from before messages

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None or getattr(self._local, "pid", None) != os.getpid():  # never share one across fork
            try:
                db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None,
                                     check_same_thread=False)
                db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
                # NORMAL under WAL: a commit is durable once the WAL is checkpointed; a power cut may lose
                # the last few feedback rows but never corrupts the file (SQLite's documented trade-off).
                db.execute("PRAGMA synchronous=NORMAL")
                db.execute("PRAGMA foreign_keys=ON")
                db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # reads the header: junk fails here
            except sqlite3.DatabaseError as e:
                raise RegistryError(f"{self.path}: cannot open the feedback store ({e})") from None
            db.row_factory = sqlite3.Row
            self._local.db, self._local.pid = db, os.getpid()
        return db

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT on this thread's connection; ROLLBACK when the body raises."""
        db = self._db()
        try:
            db.execute("BEGIN IMMEDIATE")
        except sqlite3.DatabaseError as e:
            raise RegistryError(f"{self.path}: not a feedback store, or not writable ({e})") from None
        with commit_or_rollback(db):
            yield db

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    # -- writing

    def log_exchanges(self, rows: list[dict]) -> None:
        """Store served exchanges, PII masked first; one transaction for the whole batch. An id already
        stored is kept as it was (a retried batch does not duplicate). A row's `prompt` is its text, or a
        chat's message list (also accepted as a `messages` field)."""
        if not rows:
            return
        chats = [_check_row(i, row) for i, row in enumerate(rows)]
        texts: list[str] = []
        plans = [_plan_texts(r, msgs, texts) for r, msgs in zip(rows, chats)]
        masked = mask_pii_many(texts, _PII)
        values = []
        for r, msgs, plan in zip(rows, chats, plans):
            counts: dict[str, int] = {}
            for j in plan["all"]:
                for k, v in masked[j][1].items():
                    counts[k] = counts.get(k, 0) + v
            messages = None if msgs is None else _masked_messages(msgs, plan["messages"], masked)
            prompt = masked[plan["prompt"]][0] if messages is None else flatten_messages(messages)
            user = masked[plan["user"]][0]
            values.append((r["id"], str(r["created"]), str(r["model"]),
                           None if r["model_version"] is None else str(r["model_version"]),
                           user[:MAX_USER_CHARS] if isinstance(r["user"], str) else None, r["kind"], prompt,
                           None if messages is None else json.dumps(messages, ensure_ascii=False),
                           masked[plan["response"]][0], json.dumps(counts, sort_keys=True)))
        with self._tx() as db:
            db.executemany("INSERT INTO exchanges (id, created, model, model_version, user, kind, prompt, messages, "
                           "response, pii) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING", values)

    def add_feedback(self, id: str, score: float, comment: str | None = None, correction: str | None = None,
                     scale: str | None = None) -> bool:
        """Append a score (and optional comment / corrected answer, PII masked) to exchange `id`;
        False when no exchange has that id, `FeedbackLimitError` when it already has
        `MAX_FEEDBACK_PER_EXCHANGE` rows. The latest feedback of an exchange is the one that counts."""
        score, scale, normalized = normalize_score(score, scale)
        for f, v in (("comment", comment), ("correction", correction)):
            if v is not None and not isinstance(v, str):
                raise RegistryError(f"feedback {f}: must be a string or null, got {type(v).__name__}")
        texts = [t for t in (comment, correction) if t]
        masked = iter(mask_texts(texts))
        counts: dict[str, int] = {}
        out = []
        for t in (comment, correction):
            if not t:
                out.append(t)
                continue
            text, c = next(masked)
            out.append(text)
            for k, v in c.items():
                counts[k] = counts.get(k, 0) + v
        with self._tx() as db:
            cur = db.execute("INSERT INTO feedback (exchange_id, created, score, scale, normalized, comment, "
                             "correction, pii) SELECT ?, ?, ?, ?, ?, ?, ?, ? "
                             "WHERE EXISTS (SELECT 1 FROM exchanges WHERE id = ?) "
                             "AND (SELECT COUNT(*) FROM feedback WHERE exchange_id = ?) < ?",
                             (id, now(), score, scale, normalized, out[0], out[1], json.dumps(counts), id, id,
                              MAX_FEEDBACK_PER_EXCHANGE))
            if cur.rowcount == 1:
                return True
            if db.execute("SELECT 1 FROM exchanges WHERE id = ?", (id,)).fetchone() is None:
                return False
        raise FeedbackLimitError(f"exchange {id!r} already has {MAX_FEEDBACK_PER_EXCHANGE} feedback rows, the most "
                                 f"one exchange takes; its latest score counts, and no more are stored for it")

    # -- reading

    _LATEST = ("SELECT f.* FROM feedback f JOIN (SELECT exchange_id, MAX(seq) AS seq FROM feedback "
               "GROUP BY exchange_id) last ON f.seq = last.seq")

    def stats(self, model_version: str | None = None) -> dict:
        """Counts over exchanges (of one version when given) and their latest feedback: score histogram,
        low/high counts, low-score ratio (low / exchanges with feedback; None without feedback)."""
        where, args = ("WHERE e.model_version = ?", (str(model_version),)) if model_version is not None else ("", ())
        db = self._db()
        exchanges = db.execute(f"SELECT COUNT(*) FROM exchanges e {where}", args).fetchone()[0]
        rows = db.execute(f"SELECT f.score, f.scale, f.normalized, f.correction IS NOT NULL AND f.correction != '' "
                          f"AS corrected FROM ({self._LATEST}) f JOIN exchanges e ON e.id = f.exchange_id {where}",
                          args).fetchall()
        feedback_rows = db.execute(f"SELECT COUNT(*) FROM feedback f JOIN exchanges e ON e.id = f.exchange_id {where}",
                                   args).fetchone()[0]
        histogram: dict[str, int] = {}
        for r in rows:
            key = histogram_key(r["score"], r["scale"])
            histogram[key] = histogram.get(key, 0) + 1
        low = sum(is_low(r["normalized"]) for r in rows)
        return {"model_version": model_version, "exchanges": exchanges, "with_feedback": len(rows),
                "feedback_rows": feedback_rows, "histogram": dict(sorted(histogram.items())), "low": low,
                "high": sum(is_high(r["normalized"]) for r in rows), "corrected": sum(r["corrected"] for r in rows),
                "low_score_ratio": low / len(rows) if rows else None,
                "mean_normalized": sum(r["normalized"] for r in rows) / len(rows) if rows else None}

    def exchanges(self) -> Iterator[dict]:
        """Every exchange in insertion order with its latest feedback (`feedback` None when it has none)."""
        db = self._db()
        cur = db.execute(f"SELECT e.*, f.score, f.scale, f.normalized, f.comment, f.correction, "
                         f"f.created AS feedback_created FROM exchanges e LEFT JOIN ({self._LATEST}) f "
                         f"ON f.exchange_id = e.id ORDER BY e.rowid")
        while batch := cur.fetchmany(1024):
            for r in batch:
                d = dict(r)
                fb = None if d["score"] is None else {k: d[k] for k in ("score", "scale", "normalized", "comment",
                                                                      "correction", "feedback_created")}
                for k in ("score", "scale", "normalized", "comment", "correction", "feedback_created"):
                    d.pop(k)
                d["pii"] = json.loads(d["pii"])
                d["messages"] = None if d["messages"] is None else json.loads(d["messages"])
                d["feedback"] = fb
                yield d


def flatten_messages(messages: list[dict]) -> str:
    """A chat as text, `role: content` a message (how the request log stored chats before it kept messages)."""
    return "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages)


def _check_row(i: int, row: dict) -> list[dict] | None:
    """The row's message list (None: a text prompt), after checking its fields (RegistryError naming them)."""
    missing = [f for f in FIELDS if f not in row and not (f == "prompt" and "messages" in row)]
    if missing:
        raise RegistryError(f"log_exchanges row {i}: missing field(s) {', '.join(missing)} (need {', '.join(FIELDS)})")
    if row["kind"] not in KINDS:
        raise RegistryError(f"log_exchanges row {i} ({row['id']}): kind {row['kind']!r} must be 'completion' or 'chat'")
    for f in ("id", "response"):
        if not isinstance(row[f], str):
            raise RegistryError(f"log_exchanges row {i}: field {f!r} must be a string, got {type(row[f]).__name__}")
    msgs = row.get("messages", row.get("prompt"))
    if isinstance(msgs, str) and "messages" not in row:
        return None
    if not (isinstance(msgs, list) and msgs and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), (str, type(None)))
            for m in msgs)):
        raise RegistryError(f"log_exchanges row {i}: 'prompt' must be a string or a non-empty list of "
                            f"{{role, content}} messages (content a string or null)")
    return msgs


def _arguments(call: dict) -> str:
    args = (call.get("function") or {}).get("arguments")
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def _plan_texts(row: dict, msgs: list[dict] | None, texts: list[str]) -> dict[str, Any]:
    """Append the row's texts to `texts` (one masking batch for all rows); returns where each went."""
    def put(text: str) -> int:
        texts.append(text)
        return len(texts) - 1

    plan: dict[str, Any] = {"response": put(row["response"]),
                            "user": put(row["user"][:4 * MAX_USER_CHARS] if isinstance(row["user"], str) else "")}
    # (a margin past MAX_USER_CHARS is masked, so a secret cut at the margin is beyond the final cut)
    if msgs is None:
        plan["prompt"] = put(row["prompt"])
        plan["all"] = [plan["prompt"], plan["response"], plan["user"]]
        return plan
    plan["messages"] = [(put(m.get("content") or ""), [put(_arguments(c)) for c in m.get("tool_calls") or []])
                        for m in msgs]
    plan["all"] = [j for c, calls in plan["messages"] for j in (c, *calls)] + [plan["response"], plan["user"]]
    return plan


def _masked_messages(msgs: list[dict], where: list[tuple[int, list[int]]], masked: list) -> list[dict]:
    """Each message with its content (and tool-call arguments) masked, keeping only MESSAGE_KEYS."""
    out = []
    for m, (content, calls) in zip(msgs, where):
        kept = {k: m[k] for k in MESSAGE_KEYS if k in m and m[k] is not None}
        kept["content"] = masked[content][0]
        if calls:
            kept["tool_calls"] = [{**c, "function": {**(c.get("function") or {}), "arguments": masked[j][0]}}
                                  for c, j in zip(m["tool_calls"], calls)]
        out.append(kept)
    return out
