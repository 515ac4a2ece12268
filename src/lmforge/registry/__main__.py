"""`python -m lmforge.registry VERB ...`: the registry verbs (and `flywheel build`) without loading
the other stages' command modules; the same Typer apps `lmforge registry` / `lmforge flywheel` mount."""

import typer

from lmforge.registry.commands import app, flywheel_app

group = typer.main.get_group(app)
group.add_command(typer.main.get_group(flywheel_app), "flywheel")

if __name__ == "__main__":
    group(prog_name="python -m lmforge.registry")
