"""lmforge.train: the training stage (pretrain / SFT, full / LoRA, 1 or N processes), checkpoints, export.

    python -m lmforge.train configs/tiny.yaml data.path=runs/packed --out runs/tiny [--resume]
    from lmforge.train.loop import train; from lmforge.train.config import TrainConfig

Importing this package is cheap: torch loads only when `loop`, `checkpoint` or `export` is imported.
"""
