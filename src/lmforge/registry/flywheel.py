"""The data flywheel: scored, corrected exchanges -> the next round's SFT and preference data.

    lmforge flywheel build --feedback runs/serve/feedback.db --registry R --model tiny --out runs/fw-1 \\
        [--min-count 50] [--train-data runs/data]

Every exchange of the store is one record, and each ends in exactly one place: kept (it feeds
`sft.jsonl` or `preferences.jsonl`) or dropped with one reason, in this order:

    other_model                 served under another model name
    no_feedback                 nobody scored it
    neutral_score               scored, neither low (thumbs down, 1-2 stars) nor high (thumbs up, 4-5), no correction
    control_tokens              a chat control token (<|im_start|>, <|im_end|>) in a message: SFT cannot encode it
    empty                       nothing to learn from (no response and no correction)
    duplicate_of_training_data  exact or MinHash near duplicate (data prepare's rule) of a training document
    duplicate                   ... of an earlier kept record
    contamination               shares a 13-gram with any frozen eval suite, or contains a whole eval
                                prompt/question of 4-12 words (too short for 13-grams)
    low_score_unpaired          low score, no correction, and no high-scored answer to the same prompt
    high_score_unpaired         high score, no correction, and no low-scored answer to pair it with

Texts are scrubbed again with the data package's PII masks (the store masked them at write time;
this catches rows stored under an older rule). A corrected record gives one SFT conversation (the
prompt's messages + the correction as the assistant turn, `train.stage=sft`'s format) and, when
the served answer differs, one preference pair (chosen = correction, rejected = served answer).
A low-scored record without a correction pairs with a high-scored answer to the same prompt.
Pairs use TRL's conversational preference format. `sft-lora.yaml` is a ready `lmforge train`
config (SFT, LoRA on the champion's folder), and `dpo-lora.yaml` one for DPO on the pairs (LoRA on
the champion, which is also the frozen reference); `stats.json` reconciles (in = kept + every drop);
`rejected.jsonl` lists each drop. Nothing is trained: the verdict says whether the SFT count
reached `--min-count`. It knows nothing about HTTP or the training loop.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from lmforge.config import dump_yaml, load_config
from lmforge.data.config import ContaminationConfig, NearDedupConfig, PiiConfig
from lmforge.data.contamination import ContaminationIndex, eval_strings
from lmforge.data.dedup import NearDedup, exact_key, signatures
from lmforge.data.normalize import normalize_text
from lmforge.data.pii import mask_pii_many
from lmforge.registry.feedback import FeedbackStore, is_high, is_low
from lmforge.registry.store import Registry, RegistryError
from lmforge.tasks.suite import BUILTIN_DIR
from lmforge.track.io import atomic_write_json, atomic_write_text, sha256_file
from lmforge.track.run import RunDir
from lmforge.train.config import TrainConfig

DROP_REASONS = ("other_model", "no_feedback", "neutral_score", "control_tokens", "empty",
                "duplicate_of_training_data", "duplicate", "contamination", "low_score_unpaired",
                "high_score_unpaired")
SHORT_EVAL_MIN_WORDS = 4  # shorter eval prompts ("What is 2?") would match ordinary questions
SHORT_EVAL_FIELDS = ("prompt", "question", "text")  # never answers/choices: "45" or "Saturday" alone is no leak
CONTROL = ("<|im_start|>", "<|im_end|>")  # lmforge.tokenizer.special's IM_START / IM_END
_CHATML = re.compile(r"<\|im_start\|>([^\n<]+)\n(.*?)<\|im_end\|>", re.S)
SFT_FILE, PREF_FILE, CONFIG_FILE, DPO_CONFIG_FILE, STATS_FILE, REJECTED_FILE = (
    "sft.jsonl", "preferences.jsonl", "sft-lora.yaml", "dpo-lora.yaml", "stats.json", "rejected.jsonl")


# ---- records ------------------------------------------------------------------------------------

def prompt_messages(kind: str, prompt: str, messages: list[dict] | None = None) -> list[dict[str, Any]]:
    """The conversation before the answer: the logged message list when the store kept one; else (older
    logs) a chat prompt stored as a JSON list of messages, as rendered ChatML or as the request log's
    `role: content` lines is split into its messages; anything else is one user turn."""
    if messages:
        return [dict(m, content=m.get("content") or "") for m in messages]
    if kind == "chat":
        try:
            value = json.loads(prompt)
        except ValueError:
            value = None
        if isinstance(value, list) and value and all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                                     and isinstance(m.get("content"), str) for m in value):
            return [{"role": m["role"], "content": m["content"]} for m in value]
        if CONTROL[0] in prompt:
            found = [{"role": r.strip(), "content": c} for r, c in _CHATML.findall(prompt)]
            if found:
                return found
        if found := _role_lines(prompt):
            return found
    return [{"role": "user", "content": prompt}]


_ROLE_LINE = re.compile(r"^(system|developer|user|assistant|tool): ", re.M)


def _role_lines(prompt: str) -> list[dict[str, str]] | None:
    """The request log's old flattened chat (`role: content` per message, joined by newlines) back into
    messages; None when the text does not open with a role."""
    starts = list(_ROLE_LINE.finditer(prompt))
    if not starts or starts[0].start() != 0:
        return None
    ends = [m.start() - 1 for m in starts[1:]] + [len(prompt)]  # each message ends before the newline
    return [{"role": m.group(1), "content": prompt[m.end():end]} for m, end in zip(starts, ends)]


def flat(messages: list[dict[str, str]]) -> str:
    return "\n".join(m["content"] for m in messages)


def _key(text: str) -> bytes:
    return exact_key(" ".join(normalize_text(text).lower().split()))


def _label(fb: dict) -> str:
    if fb.get("correction"):
        return "corrected"
    if is_low(fb["normalized"]):
        return "low"
    return "high" if is_high(fb["normalized"]) else "neutral"


class Accounts:
    """Every record ends kept or dropped with one reason; `rejected.jsonl` gets each drop."""

    def __init__(self) -> None:
        self.n_in = 0
        self.dropped: Counter = Counter({r: 0 for r in DROP_REASONS})
        self.rejected: list[dict[str, Any]] = []

    def drop(self, rec: dict[str, Any], reason: str, **detail: Any) -> None:
        self.dropped[reason] += 1
        self.rejected.append({"id": rec["id"], "reason": reason, **detail})


# ---- the filters --------------------------------------------------------------------------------

def select(rows: Iterable[dict], model: str, acc: Accounts) -> list[dict]:
    """Exchanges of `model` that carry a usable signal, as records with messages and a label."""
    out = []
    for ex in rows:
        acc.n_in += 1
        fb = ex["feedback"]
        if ex["model"] != model:
            acc.drop(ex, "other_model", model=ex["model"])
        elif fb is None:
            acc.drop(ex, "no_feedback")
        elif (label := _label(fb)) == "neutral":
            acc.drop(ex, "neutral_score", score=fb["score"], scale=fb["scale"])
        else:
            out.append({"id": ex["id"], "kind": ex["kind"], "model_version": ex["model_version"],
                        "created": ex["created"],
                        "messages": prompt_messages(ex["kind"], ex["prompt"], ex.get("messages")),
                        "response": ex["response"], "correction": fb.get("correction") or None,
                        "score": fb["score"], "scale": fb["scale"], "label": label})
    return out


def scrub(records: list[dict], pii_counts: Counter) -> None:
    """Mask PII again in every text a record could put in a training file (in place)."""
    texts: list[str] = []
    for r in records:
        texts += [m["content"] for m in r["messages"]] + [r["response"], r["correction"] or ""]
    masked = iter(mask_pii_many(texts, PiiConfig()))
    for r in records:
        for m in r["messages"]:
            m["content"], c = next(masked)
            pii_counts.update(c)
        r["response"], c = next(masked)
        pii_counts.update(c)
        corr, c = next(masked)
        r["correction"] = corr or None
        pii_counts.update(c)


def well_formed(records: list[dict], acc: Accounts) -> list[dict]:
    out = []
    for r in records:
        texts = [m["content"] for m in r["messages"]] + [r["response"], r["correction"] or ""]
        if any(t in s for s in texts for t in CONTROL):
            acc.drop(r, "control_tokens")
        elif not (r["correction"] or r["response"]).strip():
            acc.drop(r, "empty")
        else:
            out.append(r)
    return out


def training_texts(paths: list[Path]) -> Iterator[str]:
    """Documents of a `data prepare` folder's splits, or of a JSONL file (`text`, `messages` or
    `prompt`/`answer` lines); a bad line stops with file and line."""
    for path in paths:
        path = Path(path)
        if path.is_dir():
            files = sorted((path / "splits").glob("*.jsonl"))
            if not files:
                raise RegistryError(f"--train-data {path}: no splits/*.jsonl; pass a `lmforge data prepare` "
                                    f"folder or a JSONL file")
        elif path.is_file():
            files = [path]
        else:
            raise RegistryError(f"--train-data {path}: no such file or folder")
        for f in files:
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, start=1):
                    if not line.strip():
                        continue
                    try:
                        doc = json.loads(line)
                    except ValueError as e:
                        raise RegistryError(f"{f}:{lineno}: not JSON ({e}); fix or drop the line") from None
                    if isinstance(doc, dict) and isinstance(doc.get("text"), str):
                        yield doc["text"]
                    elif isinstance(doc, dict) and isinstance(doc.get("messages"), list):
                        yield flat([m for m in doc["messages"] if isinstance(m, dict)
                                    and isinstance(m.get("content"), str)])
                    elif isinstance(doc, dict) and isinstance(doc.get("prompt"), str):
                        yield doc["prompt"] + "\n" + str(doc.get("answer", ""))
                    else:
                        raise RegistryError(f"{f}:{lineno}: no 'text', 'messages' or 'prompt' field")


def record_text(r: dict) -> str:
    """What the record would teach: its prompt and its target (the correction, else the answer)."""
    return flat(r["messages"]) + "\n" + (r["correction"] or r["response"])


def dedup(records: list[dict], train: Iterable[str], acc: Accounts, cfg: NearDedupConfig) -> tuple[list[dict], int]:
    """Exact (normalized, lowercased) then MinHash-LSH near duplicates, training documents first so a
    record matching one is dropped as such; among records the first survives. Returns (kept, docs)."""
    near, exact, n_docs = NearDedup(cfg), {}, 0
    batch: list[str] = []

    def flush() -> None:
        nonlocal n_docs
        if not batch:
            return
        for text, sig in zip(batch, signatures(batch, cfg)):
            key = f"train:{n_docs}"
            exact.setdefault(_key(text), key)
            near.add(key, sig)  # a duplicate among training docs changes nothing here
            n_docs += 1
        batch.clear()

    for text in train:
        batch.append(text)
        if len(batch) >= 1024:
            flush()
    flush()
    texts = [record_text(r) for r in records]
    kept = []
    for r, text, sig in zip(records, texts, signatures(texts, cfg) if texts else []):
        key = f"rec:{r['id']}"
        first = exact.get(_key(text))
        match, sim = (first, 1.0) if first else near.add(key, sig)
        if match is None:
            exact[_key(text)] = key
            kept.append(r)
        else:
            reason = "duplicate_of_training_data" if match.startswith("train:") else "duplicate"
            acc.drop(r, reason, of=match.removeprefix("rec:"), similarity=round(sim, 3))
    return kept, n_docs


def suite_files() -> list[Path]:
    return sorted(BUILTIN_DIR.glob("*.jsonl"))


def contamination_indexes(files: list[Path], cfg: ContaminationConfig) -> tuple[list[ContaminationIndex], int]:
    """The 13-gram index of every eval string, plus one index per word count 4..12 holding the short
    prompts/questions whole (an L-gram index of L-word strings: a hit contains the whole string)."""
    long = ContaminationIndex(cfg.ngram)
    by_len: dict[int, list[str]] = {}
    too_short = 0
    for f in files:
        long.add_many(list(eval_strings(f, cfg.eval_fields)))
        for s in eval_strings(f, SHORT_EVAL_FIELDS):
            n = len(re.findall(r"\w+", s.lower()))
            if SHORT_EVAL_MIN_WORDS <= n < cfg.ngram:
                by_len.setdefault(n, []).append(s)
            elif n < SHORT_EVAL_MIN_WORDS:
                too_short += 1
    indexes = [long]
    for n, strings in sorted(by_len.items()):
        idx = ContaminationIndex(n)
        idx.add_many(strings)
        indexes.append(idx)
    return indexes, too_short


def decontaminate(records: list[dict], indexes: list[ContaminationIndex], acc: Accounts) -> list[dict]:
    texts = [record_text(r) + "\n" + r["response"] for r in records]
    hits = [0] * len(records)
    for idx in indexes:
        hits = [h + x for h, x in zip(hits, idx.hits_many(texts))] if texts else hits
    kept = []
    for r, h in zip(records, hits):
        if h:
            acc.drop(r, "contamination", ngram_hits=h)
        else:
            kept.append(r)
    return kept


# ---- the products -------------------------------------------------------------------------------

def _meta(r: dict) -> dict[str, Any]:
    return {"exchange": r["id"], "model_version": r["model_version"], "score": r["score"], "scale": r["scale"],
            "created": r["created"], "kind": r["kind"]}


def assemble(records: list[dict], acc: Accounts) -> tuple[list[dict], list[dict], set[str]]:
    """(SFT conversations, preference pairs, ids of the records used)."""
    sft, prefs, used = [], [], set()
    lows: dict[bytes, list[dict]] = {}
    highs: dict[bytes, list[dict]] = {}
    for r in records:
        if r["label"] == "corrected":
            used.add(r["id"])
            sft.append({"id": f"fw-{r['id']}", "messages": r["messages"] + [
                {"role": "assistant", "content": r["correction"]}], "meta": _meta(r)})
            if r["response"].strip() and r["response"].strip() != r["correction"].strip():
                prefs.append(_pair(r["messages"], r["correction"], r["response"], r, r, "correction"))
        else:
            (lows if r["label"] == "low" else highs).setdefault(_key(flat(r["messages"])), []).append(r)
    for key, group in lows.items():
        partners = highs.get(key, [])
        for i, low in enumerate(group):
            if not partners:
                acc.drop(low, "low_score_unpaired")
                continue
            high = partners[i % len(partners)]
            prefs.append(_pair(low["messages"], high["response"], low["response"], high, low, "scores"))
            used.update((low["id"], high["id"]))
    for group in highs.values():
        for high in group:
            if high["id"] not in used:
                acc.drop(high, "high_score_unpaired")
    return sft, prefs, used


def _pair(messages: list[dict], chosen: str, rejected: str, c: dict, r: dict, source: str) -> dict:
    return {"id": f"fw-{c['id']}-{r['id']}" if c is not r else f"fw-{r['id']}", "prompt": messages,
            "chosen": [{"role": "assistant", "content": chosen}],
            "rejected": [{"role": "assistant", "content": rejected}],
            "meta": {"source": source, "chosen": _meta(c), "rejected": _meta(r)}}


def longest_conversation(model_dir: str | os.PathLike, sft: list[dict]) -> int | None:
    """Tokens of the longest SFT conversation under the champion's tokenizer, with a margin of 6 per
    message for the ChatML header and `<|im_end|>\n`; None when the folder has no loadable tokenizer.json."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file() or not sft:
        return None
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - a folder whose tokenizer does not load: size rows by the context
        return None
    contents = [m["content"] for row in sft for m in row["messages"]]
    lengths = iter(len(e.ids) for e in tok.encode_batch(contents, add_special_tokens=False))
    return max(sum(next(lengths) + 6 for _ in row["messages"]) for row in sft)


def _row_shape(champion: Any, conversations: list[dict], n: int) -> tuple[int, int, int]:
    """(seq_len, batch, steps) for n examples: rows as long as the longest conversation (rounded up
    to 64, at most the champion's context and 2048), one example per row at most n to a batch (so a
    batch never needs more rows than there are examples), about 3 epochs."""
    cfg = json.loads((Path(champion.path) / "config.json").read_text())
    context = int(cfg.get("max_position_embeddings") or 2048)
    longest = longest_conversation(champion.path, conversations)
    seq_len = min(context, 2048, 64 * math.ceil(longest / 64) if longest else 1024)
    batch = max(1, min(8, n))
    return seq_len, batch, int(min(1000, max(10, math.ceil(3 * n / batch))))


def train_config(champion: Any, sft_path: Path, sft: list[dict], name: str) -> dict[str, Any]:
    """A LoRA SFT config on the champion's folder, sized to the data (`_row_shape`)."""
    seq_len, batch, steps = _row_shape(champion, sft, len(sft))
    return {
        "run": {"name": f"flywheel-{name}-v{champion.version}"},
        "data": {"path": str(sft_path.resolve())},
        "model": {"init": champion.path},
        "train": {"stage": "sft", "method": "lora", "max_steps": steps, "batch_size": batch, "seq_len": seq_len,
                  "lr": 2.0e-4, "warmup_steps": max(1, steps // 10), "min_lr_ratio": 0.1, "weight_decay": 0.0,
                  "dtype": "float32", "seed": 0, "ckpt_every": 0, "keep_last": 1, "eval_every": 0,
                  "log_every": 10},
        "lora": {"rank": 8, "alpha": 16, "dropout": 0.05, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "sft": {"packed": False},
    }


def dpo_config(champion: Any, pref_path: Path, prefs: list[dict], name: str) -> dict[str, Any]:
    """A LoRA DPO config on the champion's folder (configs/dpo.yaml's settings), sized to the pairs:
    rows as long as the prompt with its longer answer, batches of at most 4 pairs (8 rows)."""
    convs = [{"messages": p["prompt"] + p[side]} for p in prefs for side in ("chosen", "rejected")]
    seq_len, batch, steps = _row_shape(champion, convs, len(prefs))
    batch = min(batch, 4)
    steps = int(min(1000, max(10, math.ceil(3 * len(prefs) / batch))))
    return {
        "run": {"name": f"flywheel-dpo-{name}-v{champion.version}"},
        "data": {"path": str(pref_path.resolve()), "val_path": None},
        "model": {"init": champion.path},
        "train": {"stage": "dpo", "method": "lora", "max_steps": steps, "batch_size": batch, "seq_len": seq_len,
                  "lr": 5.0e-5, "warmup_steps": max(1, steps // 10), "decay": "linear", "min_lr_ratio": 0.0,
                  "weight_decay": 0.0, "dtype": "float32", "grad_clip": 1.0, "seed": 0, "ckpt_every": 0,
                  "keep_last": 1, "eval_every": 0, "log_every": 10},
        "lora": {"rank": 16, "alpha": 32, "dropout": 0.0,
                 "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
        "dpo": {"beta": 0.1, "loss_type": "sigmoid", "precompute_ref_log_probs": False},
    }


def _jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)


def build(feedback: str | os.PathLike, registry: Registry, model: str, out: str | os.PathLike, *,
          min_count: int = 50, train_data: list[Path] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Run every filter, write the products into the run folder `out`; returns stats (also stats.json)."""
    if min_count < 1:
        raise RegistryError(f"--min-count {min_count}: must be >= 1")
    feedback = Path(feedback)
    if not feedback.is_file():
        raise RegistryError(f"--feedback {feedback}: no such file; pass the store the server wrote "
                            f"(`lmforge serve --log-requests`)")
    champion = registry.get(model, "champion")
    registry.verify(champion)  # the config will train on its weights
    train_data = [Path(p) for p in train_data or []]
    files = suite_files()
    with RunDir(out, overwrite=overwrite) as run:
        run.write_config({"feedback": str(feedback.resolve()), "registry": str(registry.path), "model": model,
                          "min_count": min_count, "train_data": [str(p) for p in train_data],
                          "champion": {"version": champion.version, "sha256": champion.sha256},
                          "near_dedup": NearDedupConfig().__dict__, "contamination": ContaminationConfig().__dict__})
        acc, pii = Accounts(), Counter()
        records = select(FeedbackStore(feedback, create=False).exchanges(), model, acc)
        scrub(records, pii)
        records = well_formed(records, acc)
        records, n_docs = dedup(records, training_texts(train_data), acc, NearDedupConfig())
        indexes, too_short = contamination_indexes(files, ContaminationConfig())
        records = decontaminate(records, indexes, acc)
        sft, prefs, used = assemble(records, acc)
        stats = _stats(acc, records, sft, prefs, used, pii, n_docs, files, too_short, champion, model, min_count)
        out = Path(out)
        outputs = _write_products(out, acc, sft, prefs, champion, model)
        stats["verdict"] = _verdict(stats, out)
        atomic_write_json(out / STATS_FILE, stats)
        run.write_record({"inputs": {"feedback": str(feedback.resolve()), "champion": stats["champion"],
                                     "train_data": [str(p) for p in train_data], "eval_suites": stats["eval_suites"]},
                          "outputs": {f: sha256_file(out / f) for f in [*outputs, STATS_FILE]}})
        run.finish(**{k: stats[k] for k in ("in", "kept", "dropped", "sft", "preferences", "ready")})
    return stats


def _stats(acc: Accounts, records: list[dict], sft: list[dict], prefs: list[dict], used: set, pii: Counter,
           n_docs: int, files: list[Path], too_short: int, champion: Any, model: str,
           min_count: int) -> dict[str, Any]:
    """stats.json's counts, after checking that every record landed somewhere exactly once."""
    kept = len(used)
    by_version = Counter(str(r["model_version"]) for r in records if r["id"] in used)
    stats: dict[str, Any] = {
        "in": acc.n_in, "kept": kept, "dropped": dict(acc.dropped), "sft": len(sft), "preferences": len(prefs),
        "preferences_from_corrections": sum(p["meta"]["source"] == "correction" for p in prefs),
        "preferences_from_scores": sum(p["meta"]["source"] == "scores" for p in prefs),
        "kept_by_version": dict(sorted(by_version.items())),
        "pii_masked": dict(sorted(pii.items())), "train_documents": n_docs,
        "eval_suites": {f.stem: sha256_file(f) for f in files}, "eval_strings_too_short": too_short,
        "champion": {"name": model, "version": champion.version, "sha256": champion.sha256,
                     "path": champion.path},
        "min_count": min_count, "ready": len(sft) >= min_count}
    if acc.n_in != kept + sum(acc.dropped.values()):  # every record lands somewhere, exactly once
        raise RuntimeError(f"flywheel accounting does not reconcile: in {acc.n_in} != kept {kept} + dropped "
                           f"{sum(acc.dropped.values())} (a bug: please report it)")
    return stats


def _write_products(out: Path, acc: Accounts, sft: list[dict], prefs: list[dict], champion: Any,
                    model: str) -> list[str]:
    """sft.jsonl, preferences.jsonl, rejected.jsonl and, with any SFT example (preference pair), the
    LoRA SFT (DPO) config (validated: "ready" means `lmforge train` accepts it); returns the files written."""
    atomic_write_text(out / SFT_FILE, _jsonl(sft))
    atomic_write_text(out / PREF_FILE, _jsonl(prefs))
    atomic_write_text(out / REJECTED_FILE, _jsonl(acc.rejected))
    outputs = [SFT_FILE, PREF_FILE, REJECTED_FILE]
    if sft:
        header = (f"# LoRA SFT on {model} v{champion.version} (champion, sha256 {champion.sha256[:12]}) from "
                  f"{len(sft)} corrected exchanges; made by `lmforge flywheel build`.\n"
                  f"#   lmforge train {out / CONFIG_FILE} --out runs/{model}-flywheel\n")
        atomic_write_text(out / CONFIG_FILE, header + dump_yaml(train_config(champion, out / SFT_FILE, sft, model)))
        load_config(TrainConfig, out / CONFIG_FILE).validate()  # "ready" means `lmforge train` accepts it
        outputs.append(CONFIG_FILE)
    if prefs:
        header = (f"# LoRA DPO on {model} v{champion.version} (champion and frozen reference, sha256 "
                  f"{champion.sha256[:12]}) from {len(prefs)} preference pairs; made by `lmforge flywheel build`.\n"
                  f"#   lmforge train {out / DPO_CONFIG_FILE} --out runs/{model}-flywheel-dpo\n")
        atomic_write_text(out / DPO_CONFIG_FILE,
                          header + dump_yaml(dpo_config(champion, out / PREF_FILE, prefs, model)))
        load_config(TrainConfig, out / DPO_CONFIG_FILE).validate()
        outputs.append(DPO_CONFIG_FILE)
    return outputs


def _verdict(stats: dict[str, Any], out: Path) -> str:
    n, m = stats["sft"], stats["min_count"]
    if stats["ready"]:
        return (f"READY: {n} SFT examples >= --min-count {m}. Review {out / SFT_FILE}, then train with "
                f"`lmforge train {out / CONFIG_FILE} --out RUN`, export, eval, `registry add` and promote. "
                f"Nothing was trained.")
    return f"not ready: {n} SFT examples < --min-count {m}; collect more corrected feedback. Nothing was trained."
