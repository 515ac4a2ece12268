"""`lmforge data prepare` on generated corpora: dedup recall, PII, splits, contamination,
quarantine, reconciliation and determinism across workers and runs.

The corpus is generated (random pseudo-words plus stop words, so Gopher rules pass), with
planted exact duplicates, near duplicates (1-3% of words substituted), PII and eval items.
One module-scope run with 1 worker and one with 2 workers, plus fuzz tests of every fast path
against its slow reference; the file takes ~25 s on 2 shared cores.

    python -m pytest -q tests/test_data_prepare.py
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from lmforge.data.config import PiiConfig
from lmforge.data.pii import mask_pii, mask_pii_many
from lmforge.data.prepare import prepare_dataset
from lmforge.data.quality import split_long


def lmforge_data(*args: str) -> list[str]:
    """The CLI as users run it (switch to ["lmforge", "data", *args] once cli.py mounts it)."""
    return [str(Path(sys.executable).with_name("lmforge")), "data", *args]


STOP = ["the", "and", "of", "to", "with", "that"]


def vocab(rng: random.Random, n: int = 6000) -> list[str]:
    return ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))) for _ in range(n)]


def random_doc(rng: random.Random, words: list[str], n: int = 250) -> str:
    out = [rng.choice(STOP) if rng.random() < 0.15 else rng.choice(words) for _ in range(n)]
    return " ".join(out).capitalize() + "."


def edit(rng: random.Random, text: str, frac: float, words: list[str]) -> str:
    toks = text.split()
    for i in rng.sample(range(len(toks)), max(1, int(frac * len(toks)))):
        toks[i] = rng.choice(words)
    return " ".join(toks)


def jaccard(a: str, b: str, n: int = 5) -> float:
    sa = {tuple(a.lower().split()[i:i + n]) for i in range(len(a.split()) - n + 1)}
    sb = {tuple(b.lower().split()[i:i + n]) for i in range(len(b.split()) - n + 1)}
    return len(sa & sb) / len(sa | sb)


EVAL_ITEMS = [{"prompt": f"Question {k}: " + " ".join(f"evalword{k}x{j}" for j in range(20)) + " the and of",
               "answer": "forty two", "choices": ["a", "b"]} for k in range(6)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    rng = random.Random(0)
    words = vocab(rng)
    root = tmp_path_factory.mktemp("corpus")
    base = [random_doc(rng, words) for _ in range(240)]
    rows = [{"id": f"doc{i}", "text": t} for i, t in enumerate(base)]
    near_pairs = []
    for i in range(40):
        copy = edit(rng, base[i], rng.choice([0.01, 0.02, 0.03]), words)
        rows.append({"id": f"near{i}", "text": copy})
        near_pairs.append((f"doc{i}", f"near{i}", jaccard(base[i], copy)))
    for i in range(40, 55):  # exact duplicates, one with different whitespace (normalization makes it equal)
        rows.append({"id": f"exact{i}", "text": base[i] if i % 2 else base[i].replace(" ", "  \u00a0", 3)})
    for k, item in enumerate(EVAL_ITEMS):  # eval items planted inside raw documents
        rows.append({"id": f"contam{k}", "text": random_doc(rng, words, 80) + " " + item["prompt"] + " "
                     + random_doc(rng, words, 80)})
    rows.append({"id": "pii0", "text": random_doc(rng, words, 80) + " Contact jane.roe@example.org or "
                 "+44 20 7946 0958, server 10.0.0.12, card 4111 1111 1111 1111, token "
                 "ghp_abcdefghijklmnopqrstuvwxyzABCDEFGHIJ in 2024 with version 3.11.2."})
    rng.shuffle(rows)
    path = root / "corpus.jsonl"
    lines = [json.dumps(r) for r in rows]
    lines.insert(7, '{"id": "broken", "text": "unterminated')
    lines.insert(20, '{"id": "notext", "body": "x"}')
    lines.insert(33, "[1, 2, 3]")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    evals = root / "eval.jsonl"
    evals.write_text("\n".join(json.dumps(i) for i in EVAL_ITEMS) + "\n")
    return {"path": path, "eval": evals, "near_pairs": near_pairs, "n_rows": len(lines)}


OVERRIDES = ["split.val=0.1", "split.test=0.1"]


@pytest.fixture(scope="module")
def run1(corpus, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("run1") / "out"
    stats = prepare_dataset([str(corpus["path"])], out, eval_sets=[str(corpus["eval"])], overrides=OVERRIDES,
                            workers=1)
    return out, stats


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def kept(out: Path) -> dict[str, list[dict]]:
    return {s: read_jsonl(out / "splits" / f"{s}.jsonl") for s in ("train", "val", "test")}


def test_near_and_exact_duplicates(run1, corpus):
    out, stats = run1
    rejected = {r["id"]: r for r in read_jsonl(out / "rejected.jsonl")}
    high = [(a, b) for a, b, j in corpus["near_pairs"] if j >= 0.8]
    assert len(high) >= 20
    merged = [(a, b) for a, b in high  # whichever came first in the file survives
              if rejected.get(b, {}).get("duplicate_of") == a or rejected.get(a, {}).get("duplicate_of") == b]
    assert len(merged) >= 0.95 * len(high)
    unrelated = [f"doc{i}" for i in range(55, 240)]
    dropped = [i for i in unrelated if rejected.get(i, {}).get("reason") in ("near_duplicate", "exact_duplicate")]
    assert len(dropped) < 0.01 * len(unrelated)
    texts = [d["text"] for split in kept(out).values() for d in split]
    assert len(texts) == len(set(texts))  # no exact duplicate survives
    for i in range(40, 55):
        pair = {f"exact{i}", f"doc{i}"}
        lost = [rejected[x] for x in pair if x in rejected]
        assert len(lost) == 1 and lost[0]["reason"] == "exact_duplicate" and {lost[0]["id"], lost[0]["duplicate_of"]} == pair
    assert stats["steps"]["near_dedup"]["duplicate_rate"] > 0


def test_splits_disjoint_and_contamination(run1):
    out, stats = run1
    splits = kept(out)
    ids = {s: {d["id"] for d in docs} for s, docs in splits.items()}
    clusters = {s: {d["meta"]["cluster_id"] for d in docs} for s, docs in splits.items()}
    for a, b in (("train", "val"), ("train", "test"), ("val", "test")):
        assert not ids[a] & ids[b] and not clusters[a] & clusters[b]
    assert all(len(v) > 0 for v in ids.values())
    rejected = {r["id"]: r for r in read_jsonl(out / "rejected.jsonl")}
    for k in range(len(EVAL_ITEMS)):
        assert f"contam{k}" not in ids["train"]
        if f"contam{k}" not in ids["val"] | ids["test"]:
            assert rejected[f"contam{k}"]["reason"] == "contamination"
    assert stats["steps"]["contamination"]["hits"] >= 1
    assert stats["steps"]["contamination"]["eval_sets"]


def test_quarantine_and_reconciliation(run1, corpus):
    out, stats = run1
    bad = read_jsonl(out / "quarantine.jsonl")
    assert [b["line"] for b in bad] == [8, 21, 34]
    assert all(b["path"] == str(corpus["path"]) and b["error"] for b in bad)
    assert "malformed JSON" in bad[0]["error"] and "'text'" in bad[1]["error"]
    t = stats["totals"]
    assert t["read"] == corpus["n_rows"]
    assert t["read"] + t["parts_added"] == t["kept"] + t["rejected"] + t["quarantined"]
    assert t["kept"] == sum(len(v) for v in kept(out).values())
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"][0]["sha256"] and manifest["data_hash"]
    for name in ("stats.json", "report.md", "record.json", "config.yaml"):
        assert (out / name).is_file()
    assert not (out / ".work").exists()
    for name, s in stats["steps"].items():  # every step's drops account for its in - out
        if name not in ("read", "split"):
            assert s["in"] - s["out"] == sum(s["dropped"].values()), name


def test_pii_counted_in_pipeline(run1):
    out, stats = run1
    doc = next(d for s in kept(out).values() for d in s if d["id"] == "pii0")
    for placeholder in ("<EMAIL>", "<PHONE>", "<IP_ADDRESS>", "<CREDIT_CARD>", "<API_KEY>"):
        assert placeholder in doc["text"]
    assert "2024" in doc["text"] and "3.11.2" in doc["text"]
    assert stats["steps"]["pii"]["counts"]["email"] >= 1


def test_deterministic_across_workers_and_runs(run1, corpus, tmp_path, monkeypatch):
    from lmforge.data import prepare

    out1, _ = run1
    out2 = tmp_path / "two"
    stats = prepare_dataset([str(corpus["path"])], out2, eval_sets=[str(corpus["eval"])], overrides=OVERRIDES,
                            workers=2)
    assert stats["workers"] == 1 and stats["workers_requested"] == 2  # too small to pay for a pool
    monkeypatch.setattr(prepare, "MIN_BYTES_PER_WORKER", 1)
    stats = prepare_dataset([str(corpus["path"])], out2, eval_sets=[str(corpus["eval"])], overrides=OVERRIDES,
                            workers=2, overwrite=True)
    assert stats["workers"] == 2
    for name in ("splits/train.jsonl", "splits/val.jsonl", "splits/test.jsonl", "rejected.jsonl",
                 "quarantine.jsonl", "manifest.json"):
        assert (out1 / name).read_bytes() == (out2 / name).read_bytes(), name


PII_POSITIVE = {
    "email": "write to john.doe+list@mail.example.co.uk today",
    "phone": "call +1 415 555 2671 or (415) 555-2671",
    "cn_mobile": "手机13812345678，或 +86 139 1234 5678",
    "ipv4": "host 192.168.1.20 answered",
    "ipv6": "host 2001:db8::8a2e:370:7334 answered",
    "credit_card": "card 4111-1111-1111-1111 and 378282246310005",
    "cn_id": "身份证 11010519491231002X",
    "api_key": "keys sk-abcdefghijklmnopqrstuvwxyz123456 AKIAIOSFODNN7EXAMPLE "
               "xoxb-1234567890-abcdefghij hf_abcdefghijklmnopqrstuvwxyzABCD",
}
LOOK_ALIKES = ["in 1999 and 2024", "Python 3.11.2 and 3.12", "release 1.2.3", "on 2024-01-15",
               "at 12:30:45", "localhost:8080", "port 443", "4111 1111 1111 1112 fails Luhn",
               "1234567890123456", "a[1::2]", "pi is 3.14159", "ISBN 978-3-16-148410-0", "ext 555-1234",
               "about 100000 rows", "2023-12-31T23:59:59Z", "std::vector", "ratio 1:2:3", "id 110105194912310021",
               "chmod 0755", "10.5 MB"]


def test_pii_every_type_masked_and_look_alikes_survive():
    cfg = PiiConfig()
    expected = {"email": "<EMAIL>", "phone": "<PHONE>", "cn_mobile": "<PHONE>", "ipv4": "<IP_ADDRESS>",
                "ipv6": "<IP_ADDRESS>", "credit_card": "<CREDIT_CARD>", "cn_id": "<CN_ID>", "api_key": "<API_KEY>"}
    for kind, text in PII_POSITIVE.items():
        masked, counts = mask_pii(text, cfg)
        assert expected[kind] in masked, (kind, masked)
        assert not any(ch.isdigit() for ch in masked.split(expected[kind])[0][-3:]), masked
    assert mask_pii(PII_POSITIVE["api_key"], cfg)[1] == {"api_key": 4}
    assert mask_pii(PII_POSITIVE["cn_mobile"], cfg)[1] == {"phone": 2}
    for text in LOOK_ALIKES:
        assert mask_pii(text, cfg) == (text, {}), text


def test_long_documents_split_at_boundaries():
    text = "\n\n".join(f"paragraph {i} " + "word " * 30 for i in range(20))
    parts = split_long(text, 400)
    assert all(len(p) <= 400 for p in parts) and len(parts) > 3
    assert " ".join(" ".join(parts).split()) == " ".join(text.split())


def test_cli_errors_before_work(tmp_path, corpus):
    missing = subprocess.run(lmforge_data("prepare", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")),
                             capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr and not (tmp_path / "o").exists()
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        pq = subprocess.run(lmforge_data("prepare", str(tmp_path / "x.parquet"), "--out", str(tmp_path / "p")),
                            capture_output=True, text=True)
        assert pq.returncode == 2 and "pip install pyarrow" in " ".join(pq.stderr.split())
    bad_key = subprocess.run(lmforge_data("prepare", str(corpus["path"]), "--out", str(tmp_path / "k"),
                                          "near_dedup.treshold=0.5"), capture_output=True, text=True)
    assert bad_key.returncode == 2 and "treshold" in bad_key.stderr


def test_cli_txt_blocks_and_exit_zero(tmp_path):
    rng = random.Random(3)
    words = vocab(rng, 500)
    (tmp_path / "a.txt").write_text("\n\n".join(random_doc(rng, words, 80) for _ in range(5)), encoding="utf-8")
    res = subprocess.run(lmforge_data("prepare", str(tmp_path / "a.txt"), "--out", str(tmp_path / "o"),
                                      "--workers", "1", "--no-progress", "read.txt_mode=blocks"),
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    stats = json.loads((tmp_path / "o" / "stats.json").read_text())
    assert stats["totals"]["read"] == 5


def test_minhash_and_lsh_match_datasketch():
    """dedup.py re-implements datasketch's affine32 MinHash and LSH band choice in numpy (no scipy
    import per process); both must agree with datasketch itself, the slow reference."""
    import numpy as np
    from datasketch import MinHash
    from datasketch.lsh import _optimal_param

    from lmforge.data import dedup

    rng = np.random.default_rng(0)
    for n in (1, 7, 70000):  # 70000: more than one block of shingles
        hashes = np.unique(rng.integers(0, 2**32, n, dtype=np.uint64))
        for num_perm, seed in ((128, 1), (64, 7)):
            ref = MinHash(num_perm=num_perm, seed=seed, scheme="affine32", hashfunc=lambda x: x)
            ref.update_batch(hashes)
            assert np.array_equal(dedup.minhash(hashes, num_perm, seed), ref.hashvalues)
    for threshold in (0.05, 0.5, 0.7, 0.75, 0.9):
        for num_perm in (64, 128):
            assert dedup.lsh_params(threshold, num_perm) == _optimal_param(threshold, num_perm, 0.5, 0.5)


def test_python_docs_cache(tmp_path, monkeypatch):
    """python-docs is extracted once per stdlib and read back from $LMFORGE_HOME; a partial read
    leaves no cache, and a changed file is a new key."""
    import itertools
    import sysconfig

    from lmforge.data import sources

    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "a.py").write_text('"""Module a: the first documented module."""\n')
    (lib / "b.py").write_text('def f():\n    """Function f of module b."""\n')
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "home"))
    list(itertools.islice(sources.iter_python_docs(), 1))
    cache_dir = tmp_path / "home" / "sources"
    assert not list(cache_dir.glob("*.jsonl"))
    cold = list(sources.iter_python_docs())
    assert [d["id"] for d in cold[:2]] == ["python-docs/a.py", "python-docs/b.py"]
    assert len(list(cache_dir.glob("*.jsonl"))) == 1
    monkeypatch.setattr(sources, "_module_docs", lambda *a: pytest.fail("cache not used"))
    assert list(sources.iter_python_docs()) == cold
    monkeypatch.undo()
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    monkeypatch.setenv("LMFORGE_HOME", str(tmp_path / "home"))
    (lib / "a.py").write_text('"""Module a, edited: a new cache key."""\n')
    assert list(sources.iter_python_docs())[0]["text"] == "Module a, edited: a new cache key."
    assert len(list(cache_dir.glob("*.jsonl"))) == 2


def _repetition_reference(text: str, cfg) -> str | None:
    """Gopher n-gram repetition rules on word tuples, no hashing (datatrove's loops): the slow
    reference for the vectorized rules in quality.py."""
    from collections import Counter

    words, size = text.split(), max(len(text), 1)
    for n, frac in zip((2, 3, 4), cfg.top_ngram_char_fracs):
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        if grams:
            gram, count = Counter(grams).most_common(1)[0]
            if count > 1 and len(" ".join(gram)) * count > frac * size:
                return f"gopher_top_{n}gram"
    for n, frac in zip(range(5, 11), cfg.dup_ngram_char_fracs):
        grams = [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]
        seen, chars, i = set(), 0, 0
        while i < len(grams):
            if grams[i] in seen:
                chars, i = chars + sum(map(len, grams[i])), i + n
            else:
                seen.add(grams[i])
                i += 1
        if chars > frac * size:
            return f"gopher_dup_{n}gram"
    return None


def test_repetition_rules_match_reference():
    from lmforge.data.config import GopherRepetitionConfig
    from lmforge.data.quality import gopher_repetition_reason

    rng = random.Random(5)
    reasons = set()
    for _ in range(1500):
        cfg = GopherRepetitionConfig(dup_line_frac=1, dup_para_frac=1, dup_line_char_frac=1, dup_para_char_frac=1,
                                     top_ngram_char_fracs=sorted((rng.random() * 0.4 for _ in range(3)), reverse=True),
                                     dup_ngram_char_fracs=sorted((rng.random() * 0.6 for _ in range(6)), reverse=True))
        vocab = [f"w{i}" * rng.randint(1, 3) for i in range(rng.randint(2, 80))]
        words = [rng.choice(vocab) for _ in range(rng.randint(0, 300))]
        if len(words) > 20 and rng.random() < 0.5:  # a repeated span
            i = rng.randrange(len(words) - 12)
            words[rng.randrange(len(words)):0] = words[i:i + rng.randint(5, 12)]
        text = " ".join(words)
        expected = _repetition_reference(text, cfg)
        assert gopher_repetition_reason(text, cfg) == expected, text
        reasons.add(expected)
    assert len(reasons) >= 6  # the fuzz reaches most rules


def test_repetition_rules_batched_match_reference():
    """Many texts in one batch (one sort per n over all of them) decide as each text alone."""
    from lmforge.data.config import GopherRepetitionConfig
    from lmforge.data.quality import gopher_repetition_reasons

    rng = random.Random(6)
    cfg = GopherRepetitionConfig(dup_line_frac=1, dup_para_frac=1, dup_line_char_frac=1, dup_para_char_frac=1,
                                 top_ngram_char_fracs=[0.3, 0.25, 0.2], dup_ngram_char_fracs=[0.3, 0.25, 0.2, 0.15,
                                                                                                0.12, 0.1])
    texts = []
    for _ in range(400):
        vocab = [f"w{i}" * rng.randint(1, 3) for i in range(rng.randint(2, 60))]
        words = [rng.choice(vocab) for _ in range(rng.randint(0, 200))]
        if len(words) > 20 and rng.random() < 0.5:
            i = rng.randrange(len(words) - 12)
            words[rng.randrange(len(words)):0] = words[i:i + rng.randint(5, 12)]
        texts.append(" ".join(words))
    expected = [_repetition_reference(t, cfg) for t in texts]
    assert gopher_repetition_reasons(texts, cfg) == expected
    assert len(set(expected)) >= 5


def test_signatures_batched_match_minhash():
    """dedup.signatures (many texts, one array of shingles) equals MinHash of each text's shingle set."""
    import numpy as np

    from lmforge.data import dedup
    from lmforge.data.config import NearDedupConfig

    rng = random.Random(2)
    words = vocab(rng, 300)
    texts = ["", "one", "Two Words", "a b c d", "x " * 70000] + fuzz_texts(rng, 30) + \
        [random_doc(rng, words, rng.randint(1, 400)) for _ in range(60)]
    rng.shuffle(texts)
    for cfg in (NearDedupConfig(), NearDedupConfig(ngram=3, num_perm=64, seed=7)):
        got = dedup.signatures(texts, cfg)
        for text, sig in zip(texts, got):
            assert np.array_equal(sig, dedup.minhash(dedup.shingle_hashes(text, cfg.ngram), cfg.num_perm, cfg.seed))


def test_contamination_hits_match_reference():
    """13-gram hits, batched and hashed in words.py, against sets of word tuples."""
    import re

    from lmforge.data.contamination import ContaminationIndex

    def grams(text: str, n: int) -> list[tuple[str, ...]]:
        w = re.findall(r"\w+", text.lower())
        return [tuple(w[i:i + n]) for i in range(len(w) - n + 1)]

    rng = random.Random(4)
    words = [*vocab(rng, 40), "É", "ß", "中文", "İx", "_"]
    docs = [" ".join(rng.choice(words) + rng.choice([" ", ", ", ". ", "\n", "-"]) for _ in range(rng.randint(0, 60)))
            for _ in range(200)]
    for n in (3, 13):
        index = ContaminationIndex(n)
        index.add_many(docs[:20])
        index.add("short")
        held = {g for d in docs[:20] for g in grams(d, n)}
        assert index.too_short == sum(not grams(d, n) for d in docs[:20]) + 1
        assert len(index.ngrams) == len(held)
        assert index.hits_many(docs) == [sum(g in held for g in grams(d, n)) for d in docs]
        assert n == 13 or sum(index.hits_many(docs[20:])) > 0


def _mask_reference(text: str) -> tuple[str, dict[str, int]]:
    """Every PII rule on the whole text (no gates, no windows), with the lookbehind-first spellings of
    cn_id, card and phone."""
    import re

    from lmforge.data import pii

    original = {"cn_id": re.compile(r"(?<![0-9A-Za-z])[1-9]\d{5}(?:19|20)\d{2}(?:0[1-9]|1[0-2])"
                                    r"(?:0[1-9]|[12]\d|3[01])\d{3}[0-9Xx](?![0-9A-Za-z])"),
                "credit_card": re.compile(r"(?<![\d.-])[2-6]\d{3}(?:[ -]?\d){9,15}(?![\d.])"),
                "phone": re.compile(r"(?<![0-9A-Za-z_.+-])(?=(?:[+(\d][\d ().-]{0,20}?)?(?:\+\d|\d{3}[ .-]\d{4}|\d(?:[ .-]?\d){7}))"
                                    r"[+(\d][\d ().-]{6,26}(?<=[\d)])(?![0-9A-Za-z_]|[.:-]\d)")}
    counts: dict[str, int] = {}
    for rule in pii._RULES:
        n = 0

        def replace(m: re.Match) -> str:
            nonlocal n
            new = rule.mask(m)
            n += new.count(pii.PLACEHOLDERS[rule.kind]) - m.group(0).count(pii.PLACEHOLDERS[rule.kind])
            return new

        text = original.get(rule.name, rule.pattern).sub(replace, text)
        if n:
            counts[rule.kind] = counts.get(rule.kind, 0) + n
    return text, counts


def test_pii_gates_change_nothing():
    rng = random.Random(0)
    pieces = ["1", "3", "4", "5", "0", "9", "13", "86", "86 ", "+", "(", ")", "-", ".", ":", "::", " ", "a", "f", "X", "@",
              "x.com", "4111", "192.168.", "2001:db8", "sk-", "AKIA", "Bearer ", "hf_", "abcdefghijklmnopqrstuvwxyz",
              "ABCDEF0123456789", "手机", "\n", "٣", "１", "eyJ", "xoxb-", "_-", "111", "5555", "555-", "1234567"]
    cfg, masked = PiiConfig(), 0
    texts = [*PII_POSITIVE.values(), *LOOK_ALIKES] + \
        ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 40))) for _ in range(8000)]
    expected = [_mask_reference(text) for text in texts]
    for text, want in zip(texts, expected):
        assert mask_pii(text, cfg) == want, text
        masked += bool(want[1])
    assert masked > 500
    assert mask_pii_many(texts, cfg) == expected  # the gates of one batch, as of each text alone
    # numbers near each pattern's shape: the digit, dot and colon runs the gates count
    pieces = ["11010519491231002X", "4111 1111 1111 1111", "4111-1111-1111", "(555) 123-4567", "555.123.4567",
              "13812345678", "+86 138", "10.0.0.1", "2001:db8::1", "fe80::1:2:3", "1", "12", "123", "1234", "٣",
              " ", "-", ".", ":", "X", "a", "(", ")", "+", "\n", "é"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))) for _ in range(3000)]
    expected = [_mask_reference(text) for text in texts]
    assert mask_pii_many(texts, cfg) == expected
    kinds = Counter(kind for _, counts in expected for kind in counts)
    assert min(kinds[k] for k in ("cn_id", "credit_card", "ipv6", "ipv4", "phone")) > 20, kinds
    # emails are substituted in the tokens around each "@" (or the whole text when a token is long)
    pieces = ["jane.roe@example.org", "@", "a@b.co", ".", "-", "x", "é", " ", "\n", "\t", "\u2028", "x" * 300,
              "@x.com"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 10))) for _ in range(2000)]
    expected = [_mask_reference(text) for text in texts]
    assert mask_pii_many(texts, cfg) == expected
    assert sum("email" in counts for _, counts in expected) > 500


def test_normalize_matches_reference():
    """normalize.py's gated, prefix-spelled regexes against the plain rules."""
    import re
    import unicodedata

    from lmforge.data.normalize import _TABLE, normalize_text

    def reference(text: str) -> str:
        text = unicodedata.normalize("NFC", text.replace("\r\n", "\n").replace("\r", "\n")).translate(_TABLE)
        text = re.sub(r"(?<=\S) {2,}(?=\S)", " ", re.sub(r"[ \t]+\n", "\n", text))
        return re.sub(r"\n{3,}", "\n\n", text).strip()

    rng = random.Random(0)
    pieces = ["a", "b", " ", "  ", "\t", "\n", "\r", "\r\n", "\x00", "\x1f", "\x85", "\u00a0", "\u3000", "e\u0301",
              "\u2028", "\x7f", "\x0b", " \t", "\t "]
    for _ in range(20000):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(0, 30)))
        assert normalize_text(text) == reference(text), repr(text)


WORD_PIECES = ["a", "b1", "Z", "_", "9", " ", "  ", "\n", "\t", "-", "*", "...", "…", "#", "(", ")", "•", "»", "é",
               "²", "½", "中", "ß", "\u00a0", "\u2028", "\u3000", "\x1c", "\x0b", "\x85", "the", "With", "İ",
               "\U0001d400"]


def fuzz_texts(rng: random.Random, n: int, max_pieces: int = 30) -> list[str]:
    return ["".join(rng.choice(WORD_PIECES) for _ in range(rng.randint(0, max_pieces))) for _ in range(n)]


def test_split_words_match_python():
    r"""words.py's vectorized tokenizations equal str.split and re.findall(r"\w+"), batched."""
    import re
    import sys as _sys

    from lmforge.data.words import _TABLE_SIZE, split_words

    assert not [c for c in range(_TABLE_SIZE, _sys.maxunicode + 1) if chr(c).isspace()]
    rng = random.Random(0)
    for _ in range(300):
        texts = fuzz_texts(rng, rng.randint(1, 12))
        if rng.random() < 0.5:
            texts = [t.encode("latin-1", "ignore").decode("latin-1") for t in texts]  # the uint8 path
        for pattern, reference in (("split", str.split), (r"\w+", re.compile(r"\w+").findall)):
            w = split_words(texts, pattern)
            joined = "\n".join(texts) + "\n"
            got = [[] for _ in texts]
            for d, a, b in zip(w.doc.tolist(), w.starts.tolist(), w.ends.tolist()):
                got[d].append(joined[a:b])
            assert got == [reference(t) for t in texts], texts
            h = w.hashes().tolist()  # equal words, equal hashes (and here no collisions)
            assert len({(joined[a:b]) for a, b in zip(w.starts.tolist(), w.ends.tolist())}) == len(set(h))


def _gopher_quality_reference(text: str, cfg) -> str | None:
    """Gopher quality rules spelled plainly, per word in Python: the reference for quality.py."""
    import re

    from lmforge.data.quality import STOP_WORDS
    from lmforge.data.words import PUNCTUATION

    words = text.split()
    if not words:
        return "gopher_word_count"
    content = [w for w in words if not all(c in PUNCTUATION for c in w)]
    if not cfg.min_words <= len(content) <= cfg.max_words:
        return "gopher_word_count"
    if not cfg.min_mean_word_length <= sum(map(len, content)) / max(len(content), 1) <= cfg.max_mean_word_length:
        return "gopher_mean_word_length"
    if text.count("#") / len(words) > cfg.max_symbol_word_ratio:
        return "gopher_hash_ratio"
    n_ellipses = text.count("...") + text.count("…")
    if n_ellipses / len(words) > cfg.max_symbol_word_ratio:
        return "gopher_ellipsis_ratio"
    lines = text.split("\n")
    if sum(line.lstrip(" \t")[:1] in ("•", "*", "-") for line in lines) > cfg.max_bullet_lines_ratio * len(lines):
        return "gopher_bullet_lines"
    if sum(line.rstrip(" \t").endswith(("...", "…")) for line in lines) > cfg.max_ellipsis_lines_ratio * len(lines):
        return "gopher_ellipsis_lines"
    if sum(bool(re.search(r"[^\W\d_]", w)) for w in words) < cfg.min_alpha_words_ratio * len(words):
        return "gopher_alpha_words"
    if len(re.findall(r"\b(?:" + "|".join(STOP_WORDS) + r")\b", text, re.IGNORECASE)) < cfg.min_stop_words:
        return "gopher_stop_words"
    return None


def test_gopher_quality_matches_reference():
    from lmforge.data.config import GopherQualityConfig
    from lmforge.data.quality import gopher_quality_reasons

    rng = random.Random(1)
    pieces = [*WORD_PIECES, "the", "of", "and", "word", "...", "#", "\n- ", "\n* ", "...\n", "1", "22"]
    reasons = set()
    for _ in range(60):
        cfg = GopherQualityConfig(min_words=rng.randint(0, 8), max_words=rng.randint(10, 60),
                                  min_mean_word_length=rng.random() * 2, max_mean_word_length=rng.uniform(2, 8),
                                  max_symbol_word_ratio=rng.random() * 0.3, max_bullet_lines_ratio=rng.random(),
                                  max_ellipsis_lines_ratio=rng.random(), min_alpha_words_ratio=rng.random(),
                                  min_stop_words=rng.randint(0, 3))
        texts = [" ".join(rng.choice(pieces) for _ in range(rng.randint(0, 60))) for _ in range(40)]
        expected = [_gopher_quality_reference(t, cfg) for t in texts]
        assert gopher_quality_reasons(texts, cfg) == expected
        reasons.update(expected)
    assert len(reasons) >= 9  # the fuzz reaches every rule


def test_sort_groups_exact_when_high_bits_collide():
    """quality._sort_groups keys a value sort by the hash's high bits: hashes that differ only in
    the low bits (where the index rides) must still form exact groups, first occurrence first."""
    import numpy as np

    from lmforge.data.quality import _sort_groups

    rng = np.random.default_rng(0)
    for low_only in (False, True):
        base = rng.integers(0, 1 << 63, 50, dtype=np.uint64)
        h = base[rng.integers(0, 50, 1000)]
        if low_only:  # same high bits, different low bits: a collision of the sort keys
            h = (h & np.uint64(~1023 & (1 << 64) - 1)) | rng.integers(0, 4, 1000, dtype=np.uint64)
        order, new = _sort_groups(h)
        assert np.array_equal(h[order], np.sort(h))
        starts = np.flatnonzero(new)
        assert np.array_equal(h[order][starts], np.unique(h))
        assert all(np.all(np.diff(g) > 0) for g in np.split(order, starts[1:]))  # index order within a group
        assert np.array_equal(order[starts], [np.flatnonzero(h == v)[0] for v in np.unique(h)])


def test_word_crcs_match_zlib():
    """dedup.word_crcs (numpy CRC-32 over a batch) equals zlib.crc32 of each `text.lower().split()` word."""
    import zlib

    import numpy as np

    from lmforge.data.dedup import word_crcs

    rng = random.Random(8)
    ascii_pieces = [p for p in WORD_PIECES if p.isascii()] + ["ABCDEFGHIJKLMNOPQRSTUVWXYZ_0123456789", "x" * 40]
    texts = fuzz_texts(rng, 200) + ["".join(rng.choice(ascii_pieces) for _ in range(rng.randint(0, 30)))
                                    for _ in range(200)] + ["", " ", "Supercalifragilistic" * 3]
    rng.shuffle(texts)
    crcs, first = word_crcs(texts)
    for k, text in enumerate(texts):
        want = [zlib.crc32(w.encode()) for w in text.lower().split()]
        assert crcs[first[k]:first[k + 1]].tolist() == want, text
    assert first[-1] == len(crcs) == sum(len(t.split()) for t in texts)
    assert crcs.dtype == np.uint64


def test_json_lines_same_as_ensure_ascii_false():
    """prepare._dumps picks the faster ASCII escaper only where it writes the same bytes."""
    from lmforge.data.prepare import _dumps

    rng = random.Random(9)
    chars = ["a", "Z", " ", "\n", "\t", "\x00", "\x1f", '"', "\\", "/", "\x7f", "é", "中", "\u2028", "\U0001d400",
             "u"]
    for _ in range(2000):
        text = "".join(rng.choice(chars) for _ in range(rng.randint(0, 12)))
        obj = {"id": text[:3], "text": text, "meta": {"k": [text[-2:], 1, 2.5, None], text[:1]: {"pii": {"email": 1}}}}
        assert _dumps(obj) == json.dumps(obj, ensure_ascii=False)
        assert _dumps(obj, sort_keys=True) == json.dumps(obj, ensure_ascii=False, sort_keys=True)


def test_char_class_table_matches_per_character_rule():
    import numpy as np

    from lmforge.data import words

    words._table = None
    words.char_classes(np.zeros(1, dtype=np.uint32))
    assert words._table.tolist() == [words._class(chr(c)) for c in range(words._TABLE_SIZE)]


def test_python_docs_snapshot_follows_its_cache(tmp_path, monkeypatch):
    """The marshal snapshot serves the JSONL cache's documents and saved digest only while that
    file is unchanged (size, mtime) and the digest tag matches; else both are computed again."""
    import os

    from lmforge.data import sources
    from lmforge.data.prepare import _BUILTIN_DIGEST, _builtin_digest

    cache = tmp_path / "python-docs-3.11-test.jsonl"
    docs = [{"id": f"python-docs/m{i}.py", "text": f"Doc {i} é", "meta": {"source": "python-docs", "path": f"m{i}"}}
            for i in range(5)]
    cache.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    monkeypatch.setattr(sources, "_cache_path", lambda *a: cache)
    calls = []

    def digest(ds):
        calls.append(1)
        return _builtin_digest(ds)

    first = sources.python_docs_snapshot(_BUILTIN_DIGEST, digest)
    assert first == (docs, _builtin_digest(docs)) and len(calls) == 1
    assert sources._snapshot_path(cache).is_file()
    assert sources.python_docs_snapshot(_BUILTIN_DIGEST, digest) == first and len(calls) == 1  # from the snapshot
    assert sources.python_docs_snapshot("other tag", digest) == first and len(calls) == 2
    docs[1]["text"] = "changed"
    cache.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs), encoding="utf-8")
    os.utime(cache, ns=(1, 1))
    again = sources.python_docs_snapshot(_BUILTIN_DIGEST, digest)
    assert again == (docs, _builtin_digest(docs)) and len(calls) == 3
    sources._snapshot_path(cache).write_bytes(b"\x00garbage")  # a damaged snapshot is recomputed
    assert sources.python_docs_snapshot(_BUILTIN_DIGEST, digest) == again and len(calls) == 4


def test_quality_of_a_text_does_not_depend_on_its_batch():
    """A text's repetition counts are its own: "1 apple" once in one text and "0 apple" 80 times in
    the next once shared a hash (per-text salts linear in the index), failing the first text's
    top 2-gram rule in a batch but not alone; the Ray executor batches by shard, so it showed."""
    from lmforge.data.config import QualityConfig
    from lmforge.data.quality import quality_reasons

    rng = random.Random(3)
    words = vocab(rng)
    a = random_doc(rng, words, 250) + " 1 apple and the end."
    b = " ".join(["0 apple"] * 80) + " " + random_doc(rng, words, 250)
    texts = [random_doc(rng, words, 200) for _ in range(3)] + [a, b]
    cfg = QualityConfig()
    assert quality_reasons([a], cfg) == [None]
    assert quality_reasons(texts, cfg)[3] is None
    assert quality_reasons(texts, cfg) == [quality_reasons([t], cfg)[0] for t in texts]
