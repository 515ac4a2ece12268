"""`lmforge registry ...` and `lmforge flywheel build`: the command-line face of `lmforge.registry`.

    lmforge registry add NAME MODEL_DIR [--notes TEXT]          # vN; the first version is champion
    lmforge registry list [NAME] [--json]
    lmforge registry show NAME [REF] [--events] [--json]        # REF: a version or an alias (champion)
    lmforge registry alias NAME ALIAS VERSION | --delete        # challenger, staging, ... (not champion/previous)
    lmforge registry attach-eval NAME VERSION EVAL_RUN
    lmforge registry promote NAME VERSION [--max-regression X] [--force]
    lmforge registry rollback NAME
    lmforge registry verify NAME [REF]
    lmforge registry gc [--keep 3]
    lmforge flywheel build --feedback FEEDBACK_DB --model NAME --out DIR [--min-count N] [--train-data DIR]

Every verb takes `--registry PATH` (default `$LMFORGE_HOME/registry.db`); only `add` creates the
file, every other verb refuses a path that names none. Errors print one line and exit 2.
`python -m lmforge.registry ...` runs the same verbs without loading the other stages.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.console import Console
from rich.table import Table

from lmforge.registry.store import Registry, RegistryError

app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown",
                  help="Model versions, aliases, eval-gated promotion and rollback (SQLite).")
flywheel_app = typer.Typer(no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                           rich_markup_mode="markdown",
                           help="Turn scored, corrected exchanges into the next round's training data.")

RegistryOpt = Annotated[Optional[Path], typer.Option(
    "--registry", help="Registry database file [default: $LMFORGE_HOME/registry.db].")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]


def _fail(e: Exception) -> None:
    Console(stderr=True).print(f"[red]error:[/red] {e}", highlight=False, markup=True, soft_wrap=True)
    raise typer.Exit(code=2)


def _open(registry: Path | None, create: bool = False) -> Any:
    """The registry; only `add` creates one (a mistyped --registry is an error, not a new empty file)."""
    try:
        return Registry(registry, create=create)
    except RegistryError as e:
        _fail(e)


def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except RegistryError as e:
        _fail(e)


def _echo_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, default=str))


def _table(versions: list, title: str) -> None:
    table = Table(title=title)
    for col in ("name", "version", "aliases", "sha256", "created", "evals", "training run", "notes", "path"):
        table.add_column(col)
    for mv in versions:
        evals = ", ".join(f"{t} {e['metric']}={e['value']:.4g}" for t, e in sorted(mv.evals.items()))
        table.add_row(mv.name, str(mv.version), ", ".join(mv.aliases), mv.sha256[:12], mv.created[:19],
                      evals or "—", str(mv.lineage.get("training_run") or "—"), mv.notes, mv.path)
    Console(width=220).print(table)


@app.command("add")
def add_cmd(name: str = typer.Argument(..., help="Model name (letters, digits, . _ -)."),
            model_dir: Path = typer.Argument(..., help="A Hugging Face model folder (from `lmforge export`)."),
            notes: str = typer.Option("", "--notes", help="Free text kept with the version."),
            registry: RegistryOpt = None) -> None:
    """Register MODEL_DIR as the next version of NAME: hashes its weights, config and tokenizer files,
    reads the lineage from its export record. The first version of a name becomes `champion`."""
    mv = _call(_open(registry, create=True).add, name, model_dir, notes)
    typer.echo(f"{mv.ref} sha256 {mv.sha256[:12]} {', '.join(mv.aliases) or '(no alias)'} <- {mv.path}")


@app.command("list")
def list_cmd(name: Optional[str] = typer.Argument(None, help="Only this model's versions."),
             registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """Every version (of NAME, or of all names) with its aliases, hash, evals and lineage."""
    reg = _open(registry)
    versions = _call(reg.list, name)
    if as_json:
        _echo_json([mv.as_dict() for mv in versions])
    else:
        _table(versions, f"{reg.path}" + (f": {name}" if name else ""))


@app.command("show")
def show_cmd(name: str = typer.Argument(...), ref: str = typer.Argument("champion", help="Version or alias."),
             events: bool = typer.Option(False, "--events", help="Also print the model's event log."),
             registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """One version in full: path, hashes per file, lineage, attached evals, aliases."""
    reg = _open(registry)
    mv = _call(reg.get, name, ref)
    out: dict[str, Any] = mv.as_dict()
    if events:
        out["events"] = _call(reg.events, name)
    if as_json:
        _echo_json(out)
        return
    typer.echo(f"{mv.ref}  [{', '.join(mv.aliases) or 'no alias'}]  created {mv.created}")
    typer.echo(f"  path     {mv.path}")
    typer.echo(f"  sha256   {mv.sha256}  ({len(mv.files)} files: {', '.join(sorted(mv.files))})")
    if mv.notes:
        typer.echo(f"  notes    {mv.notes}")
    for key, value in mv.lineage.items():
        if value not in (None, {}, ""):
            typer.echo(f"  lineage  {key}: {json.dumps(value, default=str) if isinstance(value, dict) else value}")
    for task, e in sorted(mv.evals.items()):
        se = "" if e.get("stderr") is None else f" ± {e['stderr']:.4g}"
        typer.echo(f"  eval     {task} {e['metric']} = {e['value']:.4g}{se} (n {e['n']}, "
                   f"suite v{e.get('suite_version')} "
                   f"{e['suite_sha256'][:12]}) from {e['run']}")
    for ev in out.get("events", []):
        typer.echo(f"  event    #{ev['id']} {ev['created']} {ev['kind']} {json.dumps(ev['details'], default=str)}")


@app.command("alias")
def alias_cmd(name: str = typer.Argument(...), alias: str = typer.Argument(..., help="e.g. challenger, staging."),
              version: Optional[int] = typer.Argument(None, help="The version the alias points at."),
              delete: bool = typer.Option(False, "--delete", help="Remove the alias instead."),
              registry: RegistryOpt = None) -> None:
    """Point ALIAS of NAME at VERSION (or --delete it). `champion` and `previous` move only through
    `promote` and `rollback`."""
    reg = _open(registry)
    if delete:
        _call(reg.delete_alias, name, alias)
        typer.echo(f"{name}: alias {alias} deleted")
        return
    if version is None:
        _fail(ValueError(f"{name}: give the VERSION for alias {alias!r}, or --delete"))
    _call(reg.set_alias, name, alias, version)
    typer.echo(f"{name}: {alias} -> v{version}")


@app.command("attach-eval")
def attach_eval_cmd(name: str = typer.Argument(...), version: int = typer.Argument(...),
                    eval_run: Path = typer.Argument(..., help="An `lmforge eval` run folder (its --out)."),
                    registry: RegistryOpt = None) -> None:
    """Attach an eval run's per-task results to NAME VERSION (refused if it scored other weights)."""
    reg = _open(registry)
    _call(reg.attach_eval, name, version, eval_run)
    mv = reg.get(name, version)
    typer.echo(f"{mv.ref}: " + ", ".join(f"{t} {e['metric']}={e['value']:.4g}" for t, e in sorted(mv.evals.items())))


@app.command("promote")
def promote_cmd(name: str = typer.Argument(...), version: int = typer.Argument(...),
                max_regression: float = typer.Option(
                    0.0, "--max-regression", help="Largest allowed drop on any shared suite's primary metric "
                                                  "(absolute, metric units: 0.01 = one accuracy point)."),
                force: bool = typer.Option(False, "--force", help="Promote even when the gate refuses (recorded)."),
                registry: RegistryOpt = None, as_json: JsonOpt = False) -> None:
    """champion <- VERSION, previous <- the old champion, when VERSION's attached eval does not regress
    against the champion's on a suite both scored. The decision and its reason are recorded either way."""
    reg = _open(registry)
    try:
        decision = reg.promote(name, version, max_regression=max_regression, force=force)
    except RegistryError as e:
        refused = [ev for ev in reg.events(name) if ev["kind"] == "promote_refused"] if name in reg.names() else []
        if refused and refused[-1]["details"].get("version") == version:
            _print_gate(refused[-1]["details"])
        _fail(e)
    if as_json:
        _echo_json(decision)
        return
    _print_gate(decision)
    typer.echo(f"{name}: champion -> v{version} ({decision['reason']})")


def _print_gate(decision: dict) -> None:
    g = decision.get("gate") or {}
    if not g.get("tasks"):
        return
    table = Table(title=f"{decision['name']}: v{decision['champion_before']} (champion) vs v{decision['version']}")
    for col in ("task", "metric", "champion", "candidate", "delta", "z", "verdict"):
        table.add_column(col)
    for r in g["tasks"]:
        table.add_row(r["task"] + (" (frozen)" if r.get("frozen_builtin") else ""),
                      r["metric"] + ("" if r["higher_is_better"] else " (lower is better)"),
                      f"{r['champion']:.4g}", f"{r['candidate']:.4g}", f"{r['delta']:+.4g}",
                      "—" if r["z"] is None else f"{r['z']:+.2f}", "REGRESSED" if r["regressed"] else "ok")
    Console(width=160).print(table)


@app.command("rollback")
def rollback_cmd(name: str = typer.Argument(...), registry: RegistryOpt = None) -> None:
    """champion <- previous, atomically, after checking previous's files still hash as registered."""
    mv = _call(_open(registry).rollback, name)
    typer.echo(f"{name}: champion -> v{mv.version} (rolled back; sha256 {mv.sha256[:12]} verified)")


@app.command("verify")
def verify_cmd(name: str = typer.Argument(...), ref: str = typer.Argument("champion"),
               registry: RegistryOpt = None) -> None:
    """Recompute a version's hash; exit 2 naming the changed files when they differ."""
    reg = _open(registry)
    mv = _call(reg.get, name, ref)
    _call(reg.verify, mv)
    typer.echo(f"{mv.ref}: {len(mv.files)} files match sha256 {mv.sha256[:12]}")


@app.command("gc")
def gc_cmd(keep: int = typer.Option(3, "--keep", help="Newest versions kept per name (aliased ones always are)."),
           registry: RegistryOpt = None) -> None:
    """Drop the rows of old, unaliased versions. Files are never deleted; numbers are never reused."""
    dropped = _call(_open(registry).gc, keep)
    for mv in dropped:
        typer.echo(f"dropped {mv.ref} ({mv.path}; files kept)")
    typer.echo(f"{len(dropped)} version(s) dropped")


@flywheel_app.command("build")
def flywheel_build_cmd(
    feedback: Path = typer.Option(..., "--feedback", help="The feedback store (the server's --log-requests db)."),
    model: str = typer.Option(..., "--model", help="Registry model name: its exchanges, and its champion to tune."),
    out: Path = typer.Option(..., "--out", help="Run folder: sft.jsonl, preferences.jsonl, sft-lora.yaml, "
                                                "dpo-lora.yaml (with pairs), stats.json."),
    min_count: int = typer.Option(50, "--min-count", help="SFT examples needed before the data is called ready."),
    train_data: Annotated[Optional[list[Path]], typer.Option(
        "--train-data", help="Training data to dedup against: a `data prepare` folder (its splits) or a JSONL "
                             "file (text or messages); repeat.")] = None,
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace a finished run in --out."),
    registry: RegistryOpt = None,
) -> None:
    """Low-scored and corrected exchanges -> PII scrub -> dedup (training data, each other) ->
    contamination check (every frozen eval suite) -> sft.jsonl + preferences.jsonl + a LoRA SFT config
    on the champion. stats.json accounts for every exchange. Nothing is trained."""
    from lmforge.registry.flywheel import build  # deferred: numpy data steps, not for the other verbs
    from lmforge.track.run import RunExistsError  # deferred: run folders (yaml, provenance), only the flywheel's

    try:
        stats = build(feedback, _open(registry), model, out, min_count=min_count, train_data=list(train_data or []),
                      overwrite=overwrite)
    except (RegistryError, RunExistsError, FileNotFoundError) as e:
        _fail(e)
    dropped = ", ".join(f"{k} {v}" for k, v in stats["dropped"].items() if v) or "none"
    typer.echo(f"{stats['in']} exchanges: {stats['kept']} kept, dropped: {dropped}")
    typer.echo(f"sft.jsonl {stats['sft']} examples, preferences.jsonl {stats['preferences']} pairs -> {out}")
    typer.echo(stats["verdict"])
