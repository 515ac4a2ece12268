"""PII masking (`lmforge.data.pii`): recall and false positives on a hand-labelled set, the forms
issue 24 found missed, look-alikes that must survive, and the gates' contract for the new rules.

tests/pii_labelled.jsonl was written before the masking code it measures: one line per text,
`pii` the [kind, value] pairs a reader would mask (empty: a tricky negative), `split` "dev" (looked
at while building the rules) or "heldout" (scored once the rules were done; one miss there, a
Belgian IBAN refused by python-stdnum's bank registry, changed the rules afterwards, and it
counts as seen since). At the time of writing: recall 52/52 dev, 62/63 held-out before that
change; negatives changed 0/60 dev, 2/54 held-out (`version 1.2.3.4` read as an IPv4 address,
`ssh://git@github.com` as an email: both as before issue 24).
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest

from lmforge.data import pii
from lmforge.data.config import PiiConfig
from lmforge.data.pii import PLACEHOLDERS, mask_pii, mask_pii_many

LABELLED = Path(__file__).with_name("pii_labelled.jsonl")


def _rows() -> list[dict]:
    return [json.loads(line) for line in LABELLED.read_text(encoding="utf-8").splitlines()]


def _score(rows: list[dict]) -> dict[str, float]:
    """recall: labelled values gone from the output; fp: negatives changed at all; exact: positives
    whose output is the text with each value replaced by its kind's placeholder and nothing else."""
    found = missed = changed = exact = 0
    cfg = PiiConfig()
    outputs = mask_pii_many([r["text"] for r in rows], cfg)
    for r, (out, counts) in zip(rows, outputs):
        assert sum(counts.values()) == sum(out.count(p) for p in set(PLACEHOLDERS.values())) - \
            sum(r["text"].count(p) for p in set(PLACEHOLDERS.values())), (r["id"], out, counts)
        if not r["pii"]:
            changed += out != r["text"]
            continue
        for _, value in r["pii"]:
            found, missed = (found + 1, missed) if value not in out else (found, missed + 1)
        want = r["text"]
        for kind, value in r["pii"]:
            want = want.replace(value, PLACEHOLDERS[kind], 1)
        exact += out == want
    negatives = sum(not r["pii"] for r in rows)
    return {"recall": found / (found + missed), "fp": changed / negatives,
            "exact": exact / (len(rows) - negatives), "values": found + missed, "negatives": negatives}


def test_labelled_set_recall_and_false_positives():
    rows = _rows()
    kinds = Counter(kind for r in rows for kind, _ in r["pii"])
    assert len(rows) >= 200 and set(kinds) == set(PLACEHOLDERS), kinds
    score = _score(rows)
    assert score["values"] >= 100 and score["negatives"] >= 100, score
    assert score["recall"] >= 0.95, score
    assert score["fp"] <= 0.02, score
    assert score["exact"] >= 0.95, score  # the right placeholder, and nothing around it masked
    held = _score([r for r in rows if r["split"] == "heldout"])
    assert held["recall"] >= 0.95 and held["fp"] <= 0.04, held


# Each form issue 24 (finding 8) found unmasked, as a user would type it; before the fix every one
# came back unchanged or, for URL credentials, as `http://user:<EMAIL>/`.
MISSED_FORMS = [
    ("SSN 123-45-6789 on file", "SSN <SSN> on file", {"ssn": 1}),
    ("IBAN DE89 3704 0044 0532 0130 00, thanks", "IBAN <IBAN>, thanks", {"iban": 1}),
    ("pay GB82WEST12345698765432", "pay <IBAN>", {"iban": 1}),
    ("call me at 4155550132", "call me at <PHONE>", {"phone": 1}),
    ("UK office 0044 20 7946 0958", "UK office <PHONE>", {"phone": 1}),
    ("my cell is 415 555 0132", "my cell is <PHONE>", {"phone": 1}),
    ("phone: 020 7946 0958", "phone: <PHONE>", {"phone": 1}),
    ("login with password=hunter2 now", "login with password=<SECRET> now", {"secret": 1}),
    ('{"api_key": "7fj39Dk2LmQ0x"}', '{"api_key": "<SECRET>"}', {"secret": 1}),
    ("token: Zx9Yw8Vu7Ts6", "token: <SECRET>", {"secret": 1}),
    ("my password is hunter2", "my password is <SECRET>", {"secret": 1}),
    ("key 9f8e7d6c5b4a39281706f5e4d3c2b1a0 works", "key <SECRET> works", {"secret": 1}),
    ("clone http://user:pass@host/repo.git", "clone http://<CREDENTIALS>@host/repo.git", {"url_credentials": 1}),
    ("proxy https://bob:hunter2@proxy.example.com:8080", "proxy https://<CREDENTIALS>@proxy.example.com:8080",
     {"url_credentials": 1}),  # was `https://bob:<EMAIL>:8080`
    ("postgres://admin:S3cret!@db.internal:5432/app", "postgres://<CREDENTIALS>@db.internal:5432/app",
     {"url_credentials": 1}),
    ("Mastercard 2223 0031 2200 3222", "Mastercard <CREDIT_CARD>", {"credit_card": 1}),
]


@pytest.mark.parametrize("text,want,counts", MISSED_FORMS)
def test_forms_missed_before_are_masked(text, want, counts):
    assert mask_pii(text, PiiConfig()) == (want, counts)


# Issue 43: forms a hostile re-test found unmasked (or mislabelled), as a user would type them. The AWS
# secret is detect-secrets' shape (40 base64 characters, near an access key id or an AWS word); the PEM
# block is its PrivateKeyDetector's headers, masked with the body; SSNs keep python-stdnum's area, group
# and serial rules (its three publicly known numbers included: they are typed as SSNs too).
AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
PEM = ("-----BEGIN RSA PRIVATE KEY-----\nMIIEpAIBAAKCAQEA7Yq1sRZh3Tfc+0h4vKp9QyB2xM5aXoWwq1TnRr\n"
       "ZmF1bHR5S2V5Qm9keUxpbmVUd28=\n-----END RSA PRIVATE KEY-----")
ROUND4_FORMS = [
    (f"AKIAIOSFODNN7EXAMPLE {AWS_SECRET}", "<API_KEY> <SECRET>", {"api_key": 1, "secret": 1}),
    (f"Access key ID,Secret access key\nAKIAIOSFODNN7EXAMPLE,{AWS_SECRET}\n",
     "Access key ID,Secret access key\n<API_KEY>,<SECRET>\n", {"api_key": 1, "secret": 1}),
    (f'{{"SecretAccessKey": "{AWS_SECRET}"}}', '{"SecretAccessKey": "<SECRET>"}', {"secret": 1}),
    (f"export AWS_SECRET_ACCESS_KEY={AWS_SECRET}", "export AWS_SECRET_ACCESS_KEY=<SECRET>", {"secret": 1}),
    (f"my key:\n{PEM}\nthanks", "my key:\n<PRIVATE_KEY>\nthanks", {"private_key": 1}),
    ("-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ\nAAAAAAABAAAAMwAAAAtzc2gtZW\n\nbye",
     "<PRIVATE_KEY>\n\nbye", {"private_key": 1}),  # cut off before its END line: masked to the body's end
    ("-----BEGIN PRIVATE KEY-----\nMIIEvQIBADANBgkqhkiG9w0BAQEFAASC\n-----END PRIVATE KEY-----", "<PRIVATE_KEY>",
     {"private_key": 1}),
    ("ssn 123456789", "ssn <SSN>", {"ssn": 1}),
    ("My SSN is 536221234.", "My SSN is <SSN>.", {"ssn": 1}),
    ("my ssn is 123 45 6789", "my ssn is <SSN>", {"ssn": 1}),
    ("my social security number is 078-05-1120", "my social security number is <SSN>", {"ssn": 1}),  # was <PHONE>
    ("Your answer leaked my SSN 219-09-9999!", "Your answer leaked my SSN <SSN>!", {"ssn": 1}),
]


@pytest.mark.parametrize("text,want,counts", ROUND4_FORMS)
def test_round4_forms_are_masked_with_their_label(text, want, counts):
    assert mask_pii(text, PiiConfig()) == (want, counts)


@pytest.mark.parametrize("text", [
    "order 123456789 shipped; invoice 536221234",  # 9 digits without an SSN word
    "base64 QUJDREVGR0hJSktMTU5PUFFSU1RVVldYWVo0NTY3 and a path a/B/c/D/e/F/g/H/i/J/k/L/m/N/o/P/q/R/s/1",
    "-----BEGIN PUBLIC KEY-----\nMFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAE\n-----END PUBLIC KEY-----",
    "-----BEGIN CERTIFICATE-----\nMIIBszCCAVmgAwIBAgIUEXAMPLE\n-----END CERTIFICATE-----",
])
def test_round4_look_alikes_survive(text):
    assert mask_pii(text, PiiConfig()) == (text, {})


def test_a_feedback_comment_holding_an_ssn_is_labelled_ssn(tmp_path):
    from lmforge.registry.feedback import FeedbackStore

    store = FeedbackStore(tmp_path / "fb.db")
    store.log_exchanges([{"id": "cmpl-1", "created": "2026-12-05T00:00:00Z", "model": "tiny", "model_version": "1",
                          "user": "u", "kind": "completion", "prompt": "p", "response": "r"}])
    assert store.add_feedback("cmpl-1", -1, comment="it printed my social security number is 078-05-1120 and "
                              f"ssn 123456789 and my AWS key {AWS_SECRET}")
    row = store._db().execute("SELECT comment, pii FROM feedback").fetchone()
    store.close()
    assert row[0] == "it printed my social security number is <SSN> and ssn <SSN> and my AWS key <SECRET>"
    assert json.loads(row[1]) == {"ssn": 2, "secret": 1}


def test_every_form_in_one_text_counts_each():
    text = ("Name J. Roe, +44 20 7946 0958 or (415) 555-0132, j.roe@example.com, SSN 536-22-1234, IBAN "
            "FR14 2004 1010 0505 0001 3M02 606, card 4111 1111 1111 1111, DB_PASSWORD=Winter2024! "
            "https://bob:hunter2@proxy.example.com key sk-abcdefghijklmnopqrstuvwxyz123456 from 203.0.113.42")
    out, counts = mask_pii(text, PiiConfig())
    assert counts == {"api_key": 1, "url_credentials": 1, "email": 1, "secret": 1, "ssn": 1, "iban": 1,
                      "credit_card": 1, "ipv4": 1, "phone": 2}, (out, counts)
    assert not re.search(r"\d{3}", out), out


LOOK_ALIKES = [
    "The model used 4096 tokens, max_tokens=256 and max_token=512.",
    "2147483647 is INT_MAX; UINT32_MAX = 4294967295; unix time 1701234567",
    "batch sizes 512 768 1024 2048 and a matrix 1 2 3 4 5 6 7 8 9 10",
    ">>> Decimal(1) / Decimal(3)\nDecimal('0.333333333') and 3.1415926535897932",
    "api_key = os.environ['OPENAI_API_KEY']; password = getpass.getpass(); token = tok.encode(text)",
    "Enter your password: the field must not be empty. API key: see the dashboard. token: a unit of text",
    "password: ********, secret = None, password=\"\", token: ${{ secrets.GITHUB_TOKEN }}",
    "sha256 e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855 and md5: d41d8cd98f00b204e9800998ecf8427e",
    "git commit 3f786850e387550fdab836ed7e6dc881de23001b",
    "uuid 123e4567-e89b-12d3-a456-426614174000",
    "ISBN 978-3-16-148410-0, released 2024-01-15 at 12:30:45, costs $1,299.99",
    "ES2015 modules, CO2 in 2019, GB2024 hall DE12",
    "from 1990 to 2010; pages 100-250; the range 10000-99999; Item #123456789",
    "postgres://localhost:5432/app and https://example.com:8443/api/v1",
    "The SSN format is AAA-GG-SSSS; 000-12-3456 and 666-12-3456 are never issued",
    "an IBAN like DE00 3704 0044 0532 0130 00 fails its check digits",
]


@pytest.mark.parametrize("text", LOOK_ALIKES)
def test_look_alikes_survive(text):
    assert mask_pii(text, PiiConfig()) == (text, {})


def test_switches_leave_their_kind():
    text = "call 415-555-0132, SSN 536-22-1234"
    assert mask_pii(text, PiiConfig(phone=False)) == ("call 415-555-0132, SSN <SSN>", {"ssn": 1})


def _reference(text: str) -> tuple[str, dict[str, int]]:
    """Every rule over the whole text: no gates, no windows around secret keys or "@"."""
    counts: dict[str, int] = {}
    for rule in pii._RULES:
        placeholder, n = PLACEHOLDERS[rule.kind], 0

        def replace(m: re.Match) -> str:
            nonlocal n
            new = rule.mask(m)
            n += new.count(placeholder) - m.group(0).count(placeholder)
            return new

        text = rule.pattern.sub(replace, text)
        if n:
            counts[rule.kind] = counts.get(rule.kind, 0) + n
    return text, counts


def test_gates_and_windows_change_nothing_for_the_new_rules():
    """Fuzzed text around each new rule's shape: the batch gates (`pii.gates`) and the windows around
    secret keys are only necessary conditions, so the output equals running every rule on all of it."""
    rng = random.Random(0)
    pieces = ["password", "PASSWORD", "passwd", "pwd", "api_key", "Token", "KEY", "secret", "DB_", "x", "_",
              "=", ":", " is ", " ", "\t", "  ", '"', "'", "hunter2", "S3cr3t!", "None", "os.environ", "(", "[",
              "&", "?", ";", "\n", "\u212a", "ſ", "é", "123-45-6789", "536-22-1234", "212 67 1234", "SSN ", "DE89",
              " 3704 0044 0532 0130 00", "GB82WEST12345698765432", "AB12", "9f8e7d6c5b4a3928", "1706f5e4d3c2b1a0",
              "sha256 ", "://", "http", "user:pass", "@", "host", ".com", "ftp://a:b", "https://u:p@", "@db.io",
              "call ", "4155550132", "0044 20 7946 0958",
              "+44", " 20 ", "7946", "0958", "(415) ", "555-0132", "1", "0", "13812345678", "2223 0031 2200 3222",
              "٣", "4111 1111 1111 1111", "10.0.0.1", "0.333333333"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))) for _ in range(3000)]
    texts += ["SSN 536-22-1234, IBAN DE89 3704 0044 0532 0130 00, password=hunter2"[:n] for n in range(80)]
    expected = [_reference(t) for t in texts]
    assert mask_pii_many(texts, PiiConfig()) == expected
    assert [mask_pii(t, PiiConfig()) for t in texts[-80:]] == expected[-80:]  # a batch of one short text
    open_gates = pii.Gates(*[True] * len(pii.Gates._fields))  # as registry/feedback.py masks one or two texts
    assert [pii._mask(t, PiiConfig(), open_gates) for t in texts[:500]] == expected[:500]
    kinds = Counter(kind for _, counts in expected for kind in counts)
    new_kinds = ("secret", "ssn", "iban", "url_credentials", "phone", "credit_card", "email")
    assert min(kinds[k] for k in new_kinds) > 20, kinds


def test_gates_change_nothing_for_the_round4_rules():
    """The same contract for issue 43's rules (PEM blocks, AWS secrets, 9-digit SSNs after an SSN word)."""
    rng = random.Random(1)
    pieces = ["-----BEGIN RSA PRIVATE KEY-----", "-----END RSA PRIVATE KEY-----", "-----BEGIN PRIVATE KEY-----",
              "\n", "MIIEpAIBAAKCAQEA7Yq1", "abc+/=", " ", ":", "Proc-Type: 4,ENCRYPTED", AWS_SECRET, AWS_SECRET[:39],
              "AKIAIOSFODNN7EXAMPLE", "ASIA", "aws", "AWS_", "secret_access_key", "SecretAccessKey", "x", "/", "+",
              "ssn ", "SSN is ", "social security number: ", "536221234", "123456789", "1234567890", "078-05-1120",
              "212 67 1234", ",", '"', "é", "٣"]
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 10))) for _ in range(2000)]
    expected = [_reference(t) for t in texts]
    assert mask_pii_many(texts, PiiConfig()) == expected
    open_gates = pii.Gates(*[True] * len(pii.Gates._fields))
    assert [pii._mask(t, PiiConfig(), open_gates) for t in texts[:500]] == expected[:500]
    kinds = Counter(kind for _, counts in expected for kind in counts)
    assert min(kinds[k] for k in ("private_key", "secret", "ssn")) > 20, kinds


def test_logged_exchanges_keep_none_of_the_missed_forms_on_disk(tmp_path):
    """`--log-requests` stores exchanges through FeedbackStore, which masks before writing: none of
    finding 8's values reaches the database file, its WAL or shm."""
    from lmforge.registry.feedback import FeedbackStore

    store = FeedbackStore(tmp_path / "fb.db")
    prompt = " | ".join(text for text, _, _ in MISSED_FORMS)
    store.log_exchanges([{"id": "cmpl-0", "created": "2026-12-02T00:00:00Z", "model": "tiny", "model_version": "1",
                          "user": "u", "kind": "completion", "prompt": prompt, "response": "ok"}])
    [row] = list(store.exchanges())
    store.close()
    on_disk = b"".join(p.read_bytes() for p in tmp_path.glob("fb.db*"))
    for value in ("123-45-6789", "DE89 3704", "GB82WEST", "4155550132", "0044 20 7946", "415 555 0132",
                  "020 7946", "hunter2", "7fj39Dk2LmQ0x", "Zx9Yw8Vu7Ts6", "9f8e7d6c5b4a3928", "user:pass",
                  "S3cret!", "2223 0031"):
        assert value.encode() not in on_disk, value
    assert b"<CREDENTIALS>" in on_disk and row["pii"]["phone"] == 4
