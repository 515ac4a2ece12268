"""`python -m lmforge.train CONFIG [KEY=VALUE ...] [--out DIR] [--resume]`; also the torchrun entry point."""

from lmforge.train.commands import train_app

if __name__ == "__main__":
    train_app()
