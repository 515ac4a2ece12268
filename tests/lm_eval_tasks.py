"""The lm-eval tasks and model behind `tests/fixtures/lm_eval_local_completions.json`: the same tiny random
model as the serving tests' `chat_model_dir` (`make_model_with_tokenizer`'s defaults: seeded weights, a
tokenizer trained on a seeded corpus), a multiple-choice task (loglikelihood) and a loglikelihood_rolling
task over local JSONL files. `scripts/lm_eval_fixture.py` runs lm-eval on them; the test replays its record.
"""

from __future__ import annotations

import json
from pathlib import Path

from lmforge.serve.testing import make_model_with_tokenizer

MULTIPLE_CHOICE = [
    {"question": "The city of", "choices": [" the river", " python code", " data model"], "answer": 0},
    {"question": "A school in the", "choices": [" world", " state", " university of the city"], "answer": 1},
    {"question": "The engine returns", "choices": [" a value", " an error", " the cache block"], "answer": 2},
    {"question": "Python code and data", "choices": [" were used", " is known", " first"], "answer": 0},
]
ROLLING = ["The river of the city was known for its school and its national university.",
           "An engine returns a value or an error; the server streams the tokens of each request."]
TASKS = {
    "lmforge_mc": ("mc.jsonl", MULTIPLE_CHOICE, "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\n"
                   "doc_to_choice: \"{{choices}}\"\ndoc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n"),
    "lmforge_rolling": ("rolling.jsonl", [{"text": t} for t in ROLLING],
                        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
                        "metric_list:\n  - metric: word_perplexity\n"),
}


def build_model(out: Path) -> Path:
    return make_model_with_tokenizer(Path(out) / "model", Path(out) / "tok")


def write_tasks(folder: Path) -> Path:
    """The tasks' JSONL files and YAML configs (lm-eval's `--include_path FOLDER`)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, (data, rows, spec) in TASKS.items():
        (folder / data).write_text("".join(json.dumps(r) + "\n" for r in rows))
        (folder / f"{name}.yaml").write_text(f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                             f"    test: {folder.resolve() / data}\ntest_split: test\n{spec}")
    return folder
