"""The model registry: versions, aliases, attached evals, eval-gated promotion, rollback, events.

One SQLite file (stdlib `sqlite3`, WAL mode, so readers never block the writer and a server can
read while a CLI writes), default `$LMFORGE_HOME/registry.db`. Four tables:

    names     (name, last_version)                     the version counter: max+1, never reused
    versions  (name, version, path, sha256, files, created, notes, lineage, evals)
    aliases   (name, alias, version, updated)          champion, previous, challenger, any user alias
    events    (id, name, kind, created, details)       every change and every promotion decision

Every write is one `BEGIN IMMEDIATE` transaction (the write lock is taken before anything is
read, so two processes can never both compute "max + 1" or both promote) that also appends its
event; a crash leaves the database as it was before the call. Readers and writers wait for the
lock (`busy_timeout`) instead of failing. A version's `sha256` hashes the files that decide its
outputs (`*.safetensors`, `config.json`, `generation_config.json`, tokenizer files), each
streamed; `verify` recomputes it and names what changed, so a changed file is refused at load.

Promotion compares the candidate's attached eval with the champion's, task by task, on suites
both scored with the same sha256 (`lmforge eval compare`'s rule) and the task's primary metric;
lower is better for bits per byte / perplexity / NLL, higher for the rest. A regression beyond
`max_regression` (absolute, in the metric's units) refuses the promotion unless forced; so does
having no shared suite at all (there is no evidence either way).

It knows nothing about engines or HTTP: the server asks it for paths and records events.

    reg = Registry()                          # or Registry("runs/registry.db")
    mv = reg.add("tiny", "runs/model")        # v1, champion
    reg.attach_eval("tiny", 1, "runs/eval-1")
    reg.promote("tiny", 2, max_regression=0.01)
    reg.rollback("tiny")
"""

from __future__ import annotations

import builtins
import datetime as dt
import hashlib
import json
import math
import os
import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmforge.tasks.suite import BUILTIN_DIR, LOCK_FILE
from lmforge.track.io import sha256_file

# Files whose bytes decide what a model folder outputs (Hugging Face layout, as `lmforge export` writes).
HASHED_NAMES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json")
HASHED_GLOBS = ("*.safetensors",)
RESERVED = ("champion", "previous")  # moved only by promote / rollback, so `previous` is always a former champion
CHALLENGER = "challenger"
LOWER_IS_BETTER = ("bits_per_byte", "token_perplexity", "nll_per_token")
_ALIAS = re.compile(r"[A-Za-z][A-Za-z0-9_.-]{0,63}")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
BUSY_TIMEOUT_MS = 60_000

SCHEMA = """
CREATE TABLE IF NOT EXISTS names (
    name TEXT PRIMARY KEY,
    last_version INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS versions (
    name TEXT NOT NULL REFERENCES names(name),
    version INTEGER NOT NULL,
    path TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    files TEXT NOT NULL,
    created TEXT NOT NULL,
    notes TEXT NOT NULL DEFAULT '',
    lineage TEXT NOT NULL DEFAULT '{}',
    evals TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (name, version)
);
CREATE TABLE IF NOT EXISTS aliases (
    name TEXT NOT NULL,
    alias TEXT NOT NULL,
    version INTEGER NOT NULL,
    updated TEXT NOT NULL,
    PRIMARY KEY (name, alias),
    FOREIGN KEY (name, version) REFERENCES versions(name, version)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    created TEXT NOT NULL,
    details TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_by_name ON events(name, id);
"""


class RegistryError(ValueError):
    """A registry request that cannot be honoured; the message names the model, version, alias or file."""


@dataclass
class ModelVersion:
    name: str
    version: int
    path: str
    sha256: str
    created: str
    notes: str
    lineage: dict
    evals: dict  # task -> {metric, value, stderr, n, suite_sha256, suite_version, kind, metrics, run, attached}
    aliases: list[str]
    files: dict = field(default_factory=dict)  # relative path -> sha256, so `verify` can name what changed

    @property
    def ref(self) -> str:
        return f"{self.name} v{self.version}"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "path": self.path, "sha256": self.sha256,
                "created": self.created, "notes": self.notes, "aliases": self.aliases, "lineage": self.lineage,
                "evals": self.evals, "files": self.files}


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def default_path() -> Path:
    home = os.environ.get("LMFORGE_HOME") or Path.home() / ".cache" / "lmforge"  # as perf/hardware.py
    return Path(home) / "registry.db"


def refuse_foreign(db: sqlite3.Connection, path: Path, table: str, what: str) -> None:
    """Stop before adding our tables to somebody else's database (a registry passed as --feedback)."""
    tables = {t for (t,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' "
                                       "AND name NOT LIKE 'sqlite_%'")}
    if tables and table not in tables:
        raise RegistryError(f"{path}: a SQLite file with tables {', '.join(sorted(tables))}, not {what}; "
                            f"check the path")


# ---- content hashes ------------------------------------------------------------------------------

@contextmanager
def commit_or_rollback(db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """The body of a transaction the caller has begun: COMMIT after it, ROLLBACK when it raises."""
    try:
        yield db
    except BaseException:
        db.execute("ROLLBACK")
        raise
    db.execute("COMMIT")


def model_files(folder: str | os.PathLike) -> list[Path]:
    root = Path(folder)
    found = {root / n for n in HASHED_NAMES if (root / n).is_file()}
    for pattern in HASHED_GLOBS:
        found.update(p for p in root.rglob(pattern) if p.is_file())
    return sorted(found)


def hash_model(folder: str | os.PathLike) -> tuple[str, dict[str, str]]:
    """(sha256 over the sorted relative names and per-file sha256s, {relative name: sha256})."""
    root = Path(folder)
    files = {str(p.relative_to(root)): sha256_file(p) for p in model_files(root)}  # streamed, 1 MiB blocks
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(rel.encode() + b"\0" + files[rel].encode() + b"\n")
    return h.hexdigest(), files


def _check_model_folder(path: Path) -> None:
    if not path.exists():
        raise RegistryError(f"{path}: no such folder; pass a model folder written by `lmforge export`")
    if not path.is_dir():
        raise RegistryError(f"{path}: not a folder; pass the model folder (config.json + *.safetensors), "
                            f"not a file in it")
    missing = [w for w, ok in (("config.json", (path / "config.json").is_file()),
                               ("*.safetensors", any(path.rglob("*.safetensors")))) if not ok]
    if missing:
        raise RegistryError(f"{path}: no {' and no '.join(missing)}: not a Hugging Face model folder; "
                            f"make one with `lmforge export RUN --out {path}`")


# ---- lineage from the export record --------------------------------------------------------------

def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_lineage(folder: str | os.PathLike) -> dict[str, Any]:
    """Where the weights came from: `export.json` (written by `lmforge export`) or a `record.json` in
    the folder or next to it, followed to the training run's record.json when it names one.
    Empty when there is no record (a folder from elsewhere); missing fields are None."""
    root = Path(folder)
    export = _read_json(root / "export.json")
    record = _read_json(root / "record.json") or _read_json(root.parent / "record.json")
    lineage: dict[str, Any] = {}
    if export:
        lineage.update({"export": {k: export.get(k) for k in ("run", "checkpoint", "step", "method", "val_loss",
                                                              "weights_sha256")},
                        "training_run": export.get("run"), "git": export.get("git")})
        run = Path(export["run"]) if export.get("run") else None
        if run is not None and not run.is_absolute() and not run.exists():
            run = root / run  # export.json names the run as given on export's command line
        if run is not None and run.exists():
            lineage["training_run"] = str(run.resolve())
        record = (_read_json(run / "record.json") if run else None) or record
    if record:
        cfg = record.get("config") if isinstance(record.get("config"), dict) else {}
        lineage.update({
            "training_run": lineage.get("training_run") or record.get("out") or str(root),
            "experiment_id": record.get("experiment_id"), "stage": record.get("stage"),
            "method": record.get("method"), "data_hash": record.get("data_hash"),
            "tokenizer_hash": record.get("tokenizer_hash"),
            "base_model": (cfg.get("model") or {}).get("init") if isinstance(cfg.get("model"), dict) else None,
            "git": lineage.get("git") or record.get("git"),
            "final_val_loss": record.get("final_val_loss", (record.get("results") or {}).get("final_val_loss"))})
    return lineage


# ---- eval summaries and the promotion gate -------------------------------------------------------

def summarize_eval(eval_dir: str | os.PathLike) -> tuple[dict[str, Any], str | None]:
    """({task: summary}, the model hash the eval recorded) from an `lmforge eval` run folder."""
    root = Path(eval_dir)
    results_path = root / "results.json" if root.is_dir() else root
    results = _read_json(results_path)
    if results is None:
        raise RegistryError(f"{results_path}: missing or not JSON; pass an `lmforge eval` run folder (its --out)")
    record = _read_json(results_path.parent / "record.json") or {}
    if record.get("status") not in (None, "finished"):
        raise RegistryError(f"{results_path.parent}: the eval run's record.json says status "
                            f"{record.get('status')!r}; attach a finished eval run")
    tasks = results.get("tasks")
    if not isinstance(tasks, dict) or not tasks:
        raise RegistryError(f"{results_path}: no 'tasks' in the results; is this an `lmforge eval` run folder?")
    out, run, attached = {}, str(results_path.parent.resolve()), now()
    for task, t in tasks.items():
        try:
            out[task] = {"metric": t["metric"], "value": t["value"], "stderr": t.get("stderr"), "n": t["n"],
                         "suite_sha256": t["suite_sha256"], "suite_version": t.get("version"), "kind": t.get("kind"),
                         "metrics": {k: v.get("value") for k, v in (t.get("metrics") or {}).items()},
                         "run": run, "attached": attached}
        except (KeyError, TypeError) as e:
            raise RegistryError(f"{results_path}: task {task!r} lacks field {e}; rerun `lmforge eval`") from None
    return out, (results.get("model") or {}).get("hash")


def builtin_suite_hashes() -> dict[str, str]:
    """{suite name: sha256} of the frozen built-in suites (tasks/suites/suites.lock.json)."""
    lock = _read_json(BUILTIN_DIR / LOCK_FILE) or {}
    return {name: entry.get("sha256") for name, entry in lock.items() if isinstance(entry, dict)}


def gate(champion: dict[str, Any], candidate: dict[str, Any], max_regression: float) -> dict[str, Any]:
    """Compare two `evals` dicts task by task. A task counts when both scored the same suite bytes
    with the same primary metric; `regression` is how much worse the candidate is (> 0 = worse).
    `frozen_builtin` marks tasks scored on a built-in suite that matches its lock."""
    rows, not_comparable = [], []
    frozen = builtin_suite_hashes()
    for task in sorted(champion.keys() & candidate.keys()):
        a, b = champion[task], candidate[task]
        if a["suite_sha256"] != b["suite_sha256"] or a["metric"] != b["metric"]:
            not_comparable.append({"task": task, "why": "suite changed" if a["suite_sha256"] != b["suite_sha256"]
                                   else f"metric {a['metric']} vs {b['metric']}"})
            continue
        if a["value"] is None or b["value"] is None or not all(map(math.isfinite, (a["value"], b["value"]))):
            not_comparable.append({"task": task, "why": "no finite value"})
            continue
        sign = -1.0 if a["metric"] in LOWER_IS_BETTER else 1.0
        delta = b["value"] - a["value"]
        regression = -sign * delta
        both = a.get("stderr") is not None and b.get("stderr") is not None
        se = math.hypot(a["stderr"], b["stderr"]) if both else None
        rows.append({"task": task, "metric": a["metric"], "frozen_builtin": frozen.get(task) == a["suite_sha256"],
                     "champion": a["value"], "candidate": b["value"],
                     "delta": delta, "regression": regression, "z": delta / se if se else None,
                     "higher_is_better": sign > 0, "regressed": regression > max_regression})
    only = sorted(champion.keys() ^ candidate.keys())
    return {"tasks": rows, "not_comparable": not_comparable, "one_side_only": only,
            "regressed": [r["task"] for r in rows if r["regressed"]]}


# ---- the registry --------------------------------------------------------------------------------

class Registry:
    def __init__(self, path: str | os.PathLike | None = None, create: bool = True):
        """`create=False` for the verbs that only read or move what exists (everything but `add`): a
        path that names no file is an error naming it, not a new empty registry (a typo in --registry
        would otherwise print an empty table and leave a stray file)."""
        self.path = Path(path) if path is not None else default_path()
        if self.path.is_dir():
            raise RegistryError(f"{self.path}: is a folder; --registry takes the database file "
                                f"(e.g. {self.path / 'registry.db'})")
        if not create and not self.path.is_file():
            raise RegistryError(f"{self.path}: no registry database there; check --registry (`lmforge registry "
                                f"add NAME MODEL_DIR --registry {self.path}` creates one)")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self._connect() as db:
            mode = db.execute("PRAGMA journal_mode=WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise RegistryError(f"{self.path}: SQLite refused WAL mode (got {mode!r}); put the registry on a "
                                    f"local file system")
            with self._write(db):
                refuse_foreign(db, self.path, "versions", "a registry database")
                for statement in filter(str.strip, SCHEMA.split(";")):
                    db.execute(statement)

    # -- connections and transactions

    @contextmanager
    def _connect(self) -> Iterator[sqlite3.Connection]:
        """One connection per call: safe across threads and forked processes, and cheap for SQLite."""
        try:
            db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_MS / 1000, isolation_level=None)
        except sqlite3.Error as e:
            raise RegistryError(f"{self.path}: cannot open the registry database ({e})") from None
        try:
            try:
                db.row_factory = sqlite3.Row
                db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
                db.execute("PRAGMA foreign_keys=ON")
                db.execute("PRAGMA synchronous=FULL")  # registry writes are rare; each one survives power loss
                db.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()  # reads the header: junk fails here
            except sqlite3.DatabaseError as e:
                raise RegistryError(f"{self.path}: cannot open as a registry database ({e}); pass another "
                                    f"--registry, or move this file away") from None
            yield db
        except sqlite3.DatabaseError as e:
            if "not a database" in str(e) or "malformed" in str(e):
                raise RegistryError(f"{self.path}: not a registry database ({e}); pass another --registry "
                                    f"or move this file away") from None
            raise
        finally:
            db.close()

    @contextmanager
    def _write(self, db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        """BEGIN IMMEDIATE ... COMMIT: the write lock first, so reads inside see what the write changes."""
        for attempt in range(50):  # busy_timeout covers most waits; BEGIN itself can still report busy under WAL
            try:
                db.execute("BEGIN IMMEDIATE")
                break
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) and "busy" not in str(e):
                    raise
                time.sleep(0.01 * (attempt + 1))
        else:
            raise RegistryError(f"{self.path}: the registry stayed locked by another writer; retry")
        with commit_or_rollback(db):
            yield db

    @contextmanager
    def _transaction(self) -> Iterator[sqlite3.Connection]:
        with self._connect() as db, self._write(db):
            yield db

    @staticmethod
    def _event(db: sqlite3.Connection, name: str, kind: str, details: dict) -> None:
        db.execute("INSERT INTO events (name, kind, created, details) VALUES (?, ?, ?, ?)",
                   (name, kind, now(), json.dumps(details, default=str, sort_keys=True)))

    # -- reading

    def _row(self, db: sqlite3.Connection, name: str, version: int) -> ModelVersion:
        r = db.execute("SELECT * FROM versions WHERE name = ? AND version = ?", (name, version)).fetchone()
        if r is None:
            self._known_name(db, name)
            have = [v for (v,) in db.execute("SELECT version FROM versions WHERE name = ? ORDER BY version", (name,))]
            raise RegistryError(f"{name}: no version {version} in {self.path} (versions: "
                                f"{', '.join(map(str, have)) or 'none left'})")
        return self._version(db, r)

    def _version(self, db: sqlite3.Connection, r: sqlite3.Row) -> ModelVersion:
        aliases = [a for (a,) in db.execute("SELECT alias FROM aliases WHERE name = ? AND version = ? ORDER BY alias",
                                            (r["name"], r["version"]))]
        return ModelVersion(r["name"], r["version"], r["path"], r["sha256"], r["created"], r["notes"],
                            json.loads(r["lineage"]), json.loads(r["evals"]), aliases, json.loads(r["files"]))

    def _known_name(self, db: sqlite3.Connection, name: str) -> None:
        if db.execute("SELECT 1 FROM names WHERE name = ?", (name,)).fetchone() is None:
            names = [n for (n,) in db.execute("SELECT name FROM names ORDER BY name")]
            raise RegistryError(f"no model named {name!r} in {self.path} (registered: {', '.join(names) or 'none'}); "
                                f"add one with `lmforge registry add {name} MODEL_DIR`")

    def _alias_version(self, db: sqlite3.Connection, name: str, alias: str) -> int | None:
        r = db.execute("SELECT version FROM aliases WHERE name = ? AND alias = ?", (name, alias)).fetchone()
        return None if r is None else r[0]

    def _resolve(self, db: sqlite3.Connection, name: str, ref: str | int) -> ModelVersion:
        if isinstance(ref, bool):
            raise RegistryError(f"{name}: version reference {ref!r} is neither a version number nor an alias")
        if isinstance(ref, int) or (isinstance(ref, str) and ref.strip().lstrip("v").isdigit()):
            return self._row(db, name, int(str(ref).strip().lstrip("v")))
        version = self._alias_version(db, name, str(ref))
        if version is None:
            self._known_name(db, name)
            rows = db.execute("SELECT alias, version FROM aliases WHERE name = ? ORDER BY alias", (name,))
            have = [f"{a}=v{v}" for a, v in rows]
            raise RegistryError(f"{name}: no alias {ref!r} (aliases: {', '.join(have) or 'none'}); pass a version "
                                f"number or set the alias with `lmforge registry alias {name} {ref} VERSION`")
        return self._row(db, name, version)

    def get(self, name: str, ref: str | int) -> ModelVersion:
        with self._connect() as db:
            return self._resolve(db, name, ref)

    def list(self, name: str | None = None) -> builtins.list[ModelVersion]:
        with self._connect() as db:
            if name is not None:
                self._known_name(db, name)
                rows = db.execute("SELECT * FROM versions WHERE name = ? ORDER BY version", (name,)).fetchall()
            else:
                rows = db.execute("SELECT * FROM versions ORDER BY name, version").fetchall()
            return [self._version(db, r) for r in rows]

    def names(self) -> builtins.list[str]:
        with self._connect() as db:
            return [n for (n,) in db.execute("SELECT name FROM names ORDER BY name")]

    def aliases(self, name: str) -> dict[str, int]:
        with self._connect() as db:
            self._known_name(db, name)
            return {a: v for a, v in db.execute("SELECT alias, version FROM aliases WHERE name = ? ORDER BY alias",
                                                (name,))}

    def events(self, name: str) -> builtins.list[dict]:
        with self._connect() as db:
            self._known_name(db, name)
            return [{"id": r["id"], "name": r["name"], "kind": r["kind"], "created": r["created"],
                     "details": json.loads(r["details"])}
                    for r in db.execute("SELECT * FROM events WHERE name = ? ORDER BY id", (name,))]

    # -- writing

    def add(self, name: str, path: str | os.PathLike, notes: str = "") -> ModelVersion:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise RegistryError(f"model name {name!r}: use letters, digits, '.', '_' or '-' (up to 128, "
                                f"starting with a letter or digit)")
        folder = Path(path).resolve()
        _check_model_folder(folder)
        sha, files = hash_model(folder)  # outside the transaction: hashing may take seconds
        lineage = read_lineage(folder)
        with self._transaction() as db:
            r = db.execute("SELECT last_version FROM names WHERE name = ?", (name,)).fetchone()
            version = (r[0] if r else 0) + 1
            if r:
                db.execute("UPDATE names SET last_version = ? WHERE name = ?", (version, name))
            else:
                db.execute("INSERT INTO names (name, last_version) VALUES (?, ?)", (name, version))
            same = [v for (v,) in db.execute("SELECT version FROM versions WHERE name = ? AND sha256 = ?", (name, sha))]
            db.execute("INSERT INTO versions (name, version, path, sha256, files, created, notes, lineage, evals) "
                       "VALUES (?, ?, ?, ?, ?, ?, ?, ?, '{}')",
                       (name, version, str(folder), sha, json.dumps(files, sort_keys=True), now(), notes,
                        json.dumps(lineage, default=str, sort_keys=True)))
            details: dict[str, Any] = {"version": version, "path": str(folder), "sha256": sha,
                                       "same_weights_as": same}
            if self._alias_version(db, name, "champion") is None:  # the first version (or none left): champion
                self._move_alias(db, name, "champion", version)
                details["champion"] = True
            self._event(db, name, "add", details)
            return self._row(db, name, version)

    def _move_alias(self, db: sqlite3.Connection, name: str, alias: str, version: int | None) -> int | None:
        before = self._alias_version(db, name, alias)
        if version is None:
            db.execute("DELETE FROM aliases WHERE name = ? AND alias = ?", (name, alias))
        else:
            db.execute("INSERT INTO aliases (name, alias, version, updated) VALUES (?, ?, ?, ?) "
                       "ON CONFLICT (name, alias) DO UPDATE SET version = excluded.version, updated = excluded.updated",
                       (name, alias, version, now()))
        return before

    def set_alias(self, name: str, alias: str, version: int) -> None:
        if alias in RESERVED:
            raise RegistryError(f"{name}: alias {alias!r} is moved only by `registry promote` (which checks the eval "
                                f"gate and keeps `previous`) and `registry rollback`; use `lmforge registry promote "
                                f"{name} {version}` (add --force to skip the gate)")
        if not isinstance(alias, str) or not _ALIAS.fullmatch(alias):
            raise RegistryError(f"{name}: alias {alias!r}: start with a letter, then letters, digits, '.', '_' "
                                f"or '-' (a number would read as a version)")
        with self._transaction() as db:
            self._row(db, name, int(version))
            if alias == CHALLENGER and self._alias_version(db, name, "champion") == int(version):
                raise RegistryError(f"{name}: v{version} is the champion; a challenger is another version (a server "
                                    f"would load the same weights twice to compare them with themselves)")
            before = self._move_alias(db, name, alias, int(version))
            self._event(db, name, "alias", {"alias": alias, "version": int(version), "before": before})

    def delete_alias(self, name: str, alias: str) -> None:
        if alias in RESERVED:
            raise RegistryError(f"{name}: alias {alias!r} cannot be deleted; `registry rollback` moves it")
        with self._transaction() as db:
            self._known_name(db, name)
            before = self._move_alias(db, name, alias, None)
            if before is None:
                raise RegistryError(f"{name}: no alias {alias!r} to delete")
            self._event(db, name, "alias", {"alias": alias, "version": None, "before": before})

    def attach_eval(self, name: str, version: int, eval_dir: str | os.PathLike) -> None:
        """Attach an `lmforge eval` run's per-task results; a later eval of a task replaces the earlier
        one. Refused when the eval scored other weights (its recorded model hash differs)."""
        tasks, eval_hash = summarize_eval(eval_dir)
        mv = self.get(name, version)
        if eval_hash is not None:
            # deferred: the eval package (~0.1 s), which the registry's other verbs never load
            from lmforge.eval.backends import model_hash  # the eval's own recipe, not ours

            if Path(mv.path).is_dir() and model_hash(mv.path) != eval_hash:
                raise RegistryError(f"{eval_dir}: this eval scored a model with hash {eval_hash[:12]}, not {mv.ref} "
                                    f"({mv.path}); attach the eval run of this version's folder")
        with self._transaction() as db:
            current = self._row(db, name, int(version))
            evals = {**current.evals, **tasks}
            db.execute("UPDATE versions SET evals = ? WHERE name = ? AND version = ?",
                       (json.dumps(evals, sort_keys=True), name, int(version)))
            self._event(db, name, "attach_eval", {"version": int(version), "run": str(Path(eval_dir).resolve()),
                                                  "tasks": sorted(tasks), "model_hash": eval_hash})

    def promote(self, name: str, version: int, max_regression: float = 0.0, force: bool = False) -> dict:
        """champion <- version, previous <- the old champion, if the eval gate passes or `force`.
        The decision (allowed or refused, with the reason and per-task table) is an event either way."""
        if not (isinstance(max_regression, (int, float)) and math.isfinite(max_regression) and max_regression >= 0):
            raise RegistryError(f"max_regression={max_regression!r}: must be a finite number >= 0 (metric units)")
        candidate = self.get(name, int(version))
        self.verify(candidate)  # never promote weights that changed since `add`
        with self._transaction() as db:
            candidate = self._row(db, name, int(version))
            champ_v = self._alias_version(db, name, "champion")
            if champ_v == candidate.version:
                raise RegistryError(f"{candidate.ref} is already the champion; nothing to promote")
            decision: dict[str, Any] = {"name": name, "version": candidate.version, "champion_before": champ_v,
                                        "max_regression": max_regression, "forced": bool(force)}
            if champ_v is None:
                decision.update(allowed=True, reason="no champion yet", gate=None)
            else:
                champion = self._row(db, name, champ_v)
                g = gate(champion.evals, candidate.evals, max_regression)
                decision["gate"] = g
                if not g["tasks"]:
                    why = (f"no eval suite scored by both {champion.ref} (champion) and {candidate.ref} with the same "
                           f"suite file; attach one with `lmforge registry attach-eval {name} VERSION EVAL_RUN` "
                           f"for each")
                elif g["regressed"]:
                    worst = max((r for r in g["tasks"] if r["regressed"]), key=lambda r: r["regression"])
                    why = (f"{candidate.ref} regresses on {', '.join(g['regressed'])} beyond --max-regression "
                           f"{max_regression:g} (worst: {worst['task']} {worst['metric']} {worst['champion']:.4g} -> "
                           f"{worst['candidate']:.4g})")
                else:
                    why = None
                if why is None:
                    decision.update(allowed=True, reason=f"no regression beyond {max_regression:g} on "
                                                         f"{len(g['tasks'])} task(s)")
                elif force:
                    decision.update(allowed=True, reason=f"forced: {why}")
                else:
                    decision.update(allowed=False, reason=why)
            if decision["allowed"]:
                if champ_v is not None:
                    self._move_alias(db, name, "previous", champ_v)
                self._move_alias(db, name, "champion", candidate.version)
                if self._alias_version(db, name, CHALLENGER) == candidate.version:
                    self._move_alias(db, name, CHALLENGER, None)  # it is the champion now, no longer challenging
                    decision["challenger_cleared"] = True
            decision["decided"] = now()
            self._event(db, name, "promote" if decision["allowed"] else "promote_refused", decision)
        if not decision["allowed"]:
            raise RegistryError(f"promotion of {candidate.ref} refused: {decision['reason']}; pass --force to "
                                f"promote anyway (recorded)")
        return decision

    def rollback(self, name: str) -> ModelVersion:
        """champion <- previous in one transaction; `previous` is then cleared, so a second rollback
        refuses rather than flipping back to the version just rolled away from. A challenger that is
        the version rolled back to is cleared too (as `promote` does): champion and challenger are
        never one version, which a server would load twice."""
        target = self.get(name, self._require_alias(name, "previous"))
        self.verify(target)
        with self._transaction() as db:
            prev = self._alias_version(db, name, "previous")
            if prev != target.version:
                raise RegistryError(f"{name}: `previous` moved while rolling back (now {prev}); run rollback again")
            champ = self._move_alias(db, name, "champion", prev)
            self._move_alias(db, name, "previous", None)
            details = {"from": champ, "to": prev, "sha256": target.sha256}
            if self._alias_version(db, name, CHALLENGER) == prev:
                self._move_alias(db, name, CHALLENGER, None)
                details["challenger_cleared"] = True
            self._event(db, name, "rollback", details)
            return self._row(db, name, prev)

    def _require_alias(self, name: str, alias: str) -> int:
        with self._connect() as db:
            self._known_name(db, name)
            v = self._alias_version(db, name, alias)
        if v is None:
            raise RegistryError(f"{name}: no `{alias}` version to roll back to (set by `registry promote`; cleared "
                                f"by a rollback); promote the version you want with "
                                f"`lmforge registry promote {name} N`")
        return v

    def record_event(self, name: str, kind: str, details: dict) -> None:
        if not isinstance(kind, str) or not kind:
            raise RegistryError(f"{name}: event kind must be a non-empty string, got {kind!r}")
        with self._transaction() as db:
            self._known_name(db, name)
            self._event(db, name, kind, dict(details))

    def verify(self, mv: ModelVersion) -> None:
        """Recompute the folder's hash; RegistryError naming the changed, missing or new files."""
        folder = Path(mv.path)
        if not folder.is_dir():
            raise RegistryError(f"{mv.ref}: its folder {folder} is gone; restore it or register the new location")
        sha, files = hash_model(folder)
        if sha == mv.sha256:
            return
        changed = sorted(f for f in files.keys() & mv.files.keys() if files[f] != mv.files[f])
        missing, new = sorted(mv.files.keys() - files.keys()), sorted(files.keys() - mv.files.keys())
        parts = [f"{what}: {', '.join(fs)}" for what, fs in (("changed", changed), ("missing", missing),
                                                              ("new", new)) if fs]
        raise RegistryError(f"{mv.ref}: the files in {folder} no longer match the registered sha256 "
                            f"{mv.sha256[:12]} (now {sha[:12]}; {'; '.join(parts) or 'contents differ'}); refusing "
                            f"to load them. Restore the files, or register the folder again as a new version")

    def gc(self, keep: int = 3) -> builtins.list[ModelVersion]:
        """Drop the rows of versions that are neither among the `keep` newest of their name nor aliased.
        Files are never touched; version numbers are never reused."""
        if not isinstance(keep, int) or keep < 0:
            raise RegistryError(f"gc keep={keep!r}: must be an integer >= 0")
        dropped = []
        with self._transaction() as db:
            for (name,) in db.execute("SELECT name FROM names ORDER BY name").fetchall():
                rows = db.execute("SELECT * FROM versions WHERE name = ? ORDER BY version DESC", (name,)).fetchall()
                aliased = {v for (v,) in db.execute("SELECT version FROM aliases WHERE name = ?", (name,))}
                gone = [self._version(db, r) for r in rows[keep:] if r["version"] not in aliased]
                for mv in gone:
                    db.execute("DELETE FROM versions WHERE name = ? AND version = ?", (name, mv.version))
                if gone:
                    self._event(db, name, "gc", {"dropped": [mv.version for mv in gone], "keep": keep,
                                                 "paths": [mv.path for mv in gone]})
                dropped += gone
        return dropped
