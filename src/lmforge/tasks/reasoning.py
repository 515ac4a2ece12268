"""The one reasoning format, the answer extractors and the one `normalize_answer`, shared by data
synthesis, SFT, eval, GRPO rewards and distillation.

An assistant turn that reasons looks like

    <think>
    7+5=12 carry 1
    4+8+1=13 carry 1
    ...
    </think>
    Answer: 432

`ReasoningFormat` holds the three markers (configurable: `think_open`, `think_close`,
`answer_prefix`), renders a turn from (reasoning, answer) and parses one back. The chat template
(`lmforge.tokenizer.chat`) renders an assistant message's `reasoning_content` the same way, and
SFT rows built from task rows use `render`, so what the model is trained on is what is parsed.

Extraction rules (rewards, eval and distillation all call `extract_answer`):
- the answer is the text after the answer prefix on the one line outside the think block that
  starts with it; no such line, or two of them (a model hedging "Answer: 3 / Answer: 4"), is no
  answer (None). A number inside the reasoning never counts.
- numbers are normalised before comparing: `1,000` = `1000`, `12.0` = `12`, `+5` = `5`, `$3` = `3`,
  one trailing period dropped; anything non-numeric is compared as trimmed text. This is the only
  normaliser: eval's `exact_match` and `regex` metrics use it too, so a reward and an eval score
  the same answer the same way.
- `extract_last_match` is the `regex` eval metric's extractor: the last match of a pattern in the
  output (commas dropped first, so `-?\\d+` reads `1,024` as one number), normalised.
`is_well_formed` is the `format` reward: one think block at the start, closed, then exactly one
non-empty answer line and nothing else.

This module knows nothing about models, tokens or files.

    from lmforge.tasks.reasoning import DEFAULT_FORMAT, extract_answer, answers_match
    answers_match(extract_answer(text), "432")
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

_NUMBER = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)$")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}\b)")


@dataclass(frozen=True)
class ReasoningFormat:
    think_open: str = "<think>"
    think_close: str = "</think>"
    answer_prefix: str = "Answer:"

    def render(self, reasoning: str, answer: str) -> str:
        """The assistant turn for (reasoning, answer); empty reasoning still gets the think block."""
        return f"{self.think_open}\n{reasoning.strip()}\n{self.think_close}\n{self.answer_prefix} {answer.strip()}"

    def split(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when there is no closed think block, the text after it)."""
        start = text.find(self.think_open)
        end = text.find(self.think_close, start + len(self.think_open)) if start >= 0 else -1
        if start < 0 or end < 0:
            return None, text
        return text[start + len(self.think_open):end].strip(), text[end + len(self.think_close):]

    def habit(self, text: str) -> str:
        """`steps` (a think block with reasoning), `direct` (an empty one: the answer alone) or `none` (no
        closed think block)."""
        reasoning, _ = self.split(text)
        return "none" if reasoning is None else ("direct" if reasoning == "" else "steps")

    def answer_lines(self, text: str) -> list[str]:
        """What follows the prefix on each line after the think block (the whole text without one)."""
        _, rest = self.split(text)
        return [line.strip()[len(self.answer_prefix):].strip() for line in rest.splitlines()
                if line.strip().startswith(self.answer_prefix)]

    def extract(self, text: str) -> str | None:
        """The normalised final answer, or None (no answer line, two of them, or an empty one)."""
        lines = self.answer_lines(text)
        if len(lines) != 1 or not lines[0]:
            return None
        return normalize_answer(lines[0])

    def is_well_formed(self, text: str) -> bool:
        """Think block first and closed, then exactly one non-empty answer line and nothing more."""
        if not text.lstrip().startswith(self.think_open):
            return False
        reasoning, rest = self.split(text)
        if reasoning is None or self.think_open in rest or self.think_close in rest:
            return False
        lines = [line.strip() for line in rest.strip().splitlines() if line.strip()]
        return (len(lines) == 1 and lines[0].startswith(self.answer_prefix)
                and bool(lines[0][len(self.answer_prefix):].strip()))


DEFAULT_FORMAT = ReasoningFormat()


def normalize_answer(text: str) -> str:
    """Canonical form: numbers as plain decimals without separators or trailing zeros; else trimmed text."""
    s = text.strip()
    if s.endswith(".") and not _NUMBER.match(s):
        s = s[:-1].strip()
    s = _THOUSANDS.sub("", s).lstrip("$").strip()
    if _NUMBER.match(s):
        try:
            d = Decimal(s)
        except InvalidOperation:
            return s
        if d == d.to_integral_value():
            return str(int(d))
        return format(d.normalize(), "f")
    return s


def extract_answer(text: str, fmt: ReasoningFormat = DEFAULT_FORMAT) -> str | None:
    return fmt.extract(text)


def answers_match(given: str | None, target: str) -> bool:
    return given is not None and given == normalize_answer(target)


def extract_last_match(output: str, pattern: str) -> str | None:
    """The last match of `pattern` in the output (group 1 when the pattern has a group), normalised; or None.

    The last, not the first: a model that reasons before answering ("3 + 5 = 8, so 8") ends with it.
    Commas are dropped before matching so that a number pattern reads `1,024` whole."""
    matches = list(re.finditer(pattern, output.replace(",", "")))
    if not matches:
        return None
    m = matches[-1]
    return normalize_answer(m.group(1) if m.groups() else m.group(0))


def qa_prompt(question: str) -> str:
    """The plain prompt of the `arith` and `choice-basics` suites (no reasoning format): the answer follows."""
    return f"Question: {question}\nAnswer:"
