"""Tasks with checkable answers: seeded generators, the reasoning format, answer extraction, the one
`normalize_answer`, and the eval-suite file format with the frozen built-in suites.

One small module per task (nanochat's `tasks/`), each generating items from a seed:

    arith_cot    arithmetic with written-out steps (`lmforge data synth`, the `arith-cot` suite)
    arith        one- and two-step word problems (`arith`, `arith-stability`)
    choice       four-way everyday questions (`choice-basics`)
    tiny_text    paragraphs from a fixed grammar (`tiny-text`)

and what every user of them shares: `reasoning` (render a trace and answer, extract the answer,
`normalize_answer`: data synthesis, GRPO rewards, distillation and eval all score through it),
`rng` (SplitMix64: the same seed, the same bytes everywhere) and `suite` (the suite JSONL format,
loading with validation, `suites/` and its lock).

This package imports nothing else from lmforge (a test enforces it): it knows nothing about
models, tokenizers, training or writing run records.
"""
