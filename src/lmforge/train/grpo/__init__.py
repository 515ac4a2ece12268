"""GRPO (group-relative policy optimisation) on the engine's own rollouts: `train.stage=grpo`.

    config.py   the `grpo` config section
    rollout.py  samples through `lmforge.engine.LLM` in the trainer's process, weights synced every step
    reward.py   built-in `format` / `correct` rewards and `module:function` ones
    loss.py     group-relative advantages, the clipped ratio, the k3 KL estimator
    trainer.py  the stage: Stateful components, checkpointing, metrics, the reward curve

See docs/reasoning.md. Knows nothing about the command line.
"""
