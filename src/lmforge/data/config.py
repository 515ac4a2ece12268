"""Typed configuration of `lmforge data prepare`, one dataclass per step, validated once.

Defaults are the published ones (Gopher: Rae et al. 2021, appendix A; MinHash LSH as in
datatrove/FineWeb) so `lmforge data prepare INPUT --out DIR` does something useful with no
config. Override from YAML (`--config`) or with dotted `key=value` (`near_dedup.threshold=0.7`).
It knows nothing about how the steps run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from lmforge.config import ConfigError


@dataclass
class ReadConfig:
    text_field: str = "text"  # JSONL / parquet field holding the text
    txt_mode: Literal["file", "blocks"] = "file"  # .txt/.md: one document per file, or per blank-line block


@dataclass
class BoilerplateConfig:
    enabled: bool = True
    min_docs: int = 10  # a line must appear in at least this many documents...
    min_doc_fraction: float = 0.01  # ...and in at least this fraction of all documents
    min_line_chars: int = 20  # shorter lines ("Returns:", "}") are never treated as boilerplate


@dataclass
class GopherQualityConfig:
    enabled: bool = True
    min_words: int = 50
    max_words: int = 100_000
    min_mean_word_length: float = 3.0
    max_mean_word_length: float = 10.0
    max_symbol_word_ratio: float = 0.1  # '#' and '...' per word
    max_bullet_lines_ratio: float = 0.9
    max_ellipsis_lines_ratio: float = 0.3
    min_alpha_words_ratio: float = 0.8
    min_stop_words: int = 2  # of: the, be, to, of, and, that, have, with


@dataclass
class GopherRepetitionConfig:
    enabled: bool = True
    dup_line_frac: float = 0.30
    dup_para_frac: float = 0.30
    dup_line_char_frac: float = 0.20
    dup_para_char_frac: float = 0.20
    top_ngram_char_fracs: list[float] = field(default_factory=lambda: [0.20, 0.18, 0.16])  # n = 2, 3, 4
    dup_ngram_char_fracs: list[float] = field(
        default_factory=lambda: [0.15, 0.14, 0.13, 0.12, 0.11, 0.10])  # n = 5 .. 10


@dataclass
class QualityConfig:
    min_chars: int = 50
    max_chars: int = 200_000
    long_docs: Literal["split", "drop"] = "split"  # split at paragraph boundaries into <= max_chars parts
    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)


@dataclass
class PiiConfig:
    enabled: bool = True
    email: bool = True
    phone: bool = True
    ip_address: bool = True
    credit_card: bool = True
    cn_id: bool = True
    api_key: bool = True
    ssn: bool = True
    iban: bool = True
    secret: bool = True  # password= / token: pairs, 32+ hex secrets, credentials in URLs


@dataclass
class NearDedupConfig:
    enabled: bool = True
    threshold: float = 0.8  # Jaccard similarity of word 5-gram shingle sets
    recall_margin: float = 0.1  # LSH indexes at threshold - margin, confirms at threshold - margin / 2
    num_perm: int = 128
    ngram: int = 5
    seed: int = 1


@dataclass
class SplitConfig:
    val: float = 0.01
    test: float = 0.01
    seed: int = 0  # salt of the cluster-id hash; changing it reshuffles the assignment


@dataclass
class ContaminationConfig:
    enabled: bool = True
    ngram: int = 13  # words, lowercased, punctuation dropped (GPT-3 / Brown et al. 2020)
    eval_fields: list[str] = field(default_factory=lambda: ["text", "prompt", "question", "answer",
                                                            "target", "choices"])


@dataclass
class PrepareConfig:
    read: ReadConfig = field(default_factory=ReadConfig)
    normalize: bool = True
    boilerplate: BoilerplateConfig = field(default_factory=BoilerplateConfig)
    quality: QualityConfig = field(default_factory=QualityConfig)
    pii: PiiConfig = field(default_factory=PiiConfig)
    exact_dedup: bool = True
    near_dedup: NearDedupConfig = field(default_factory=NearDedupConfig)
    split: SplitConfig = field(default_factory=SplitConfig)
    contamination: ContaminationConfig = field(default_factory=ContaminationConfig)

    def validate(self) -> PrepareConfig:
        s = self.split
        if not (0 <= s.val and 0 <= s.test and s.val + s.test < 1):
            raise ConfigError(f"split.val={s.val} and split.test={s.test} must be >= 0 and sum to < 1")
        if not 0 < self.near_dedup.threshold <= 1:
            raise ConfigError(f"near_dedup.threshold={self.near_dedup.threshold} must lie in (0, 1]")
        if self.quality.min_chars > self.quality.max_chars:
            raise ConfigError(f"quality.min_chars={self.quality.min_chars} exceeds quality.max_chars")
        if len(self.quality.gopher_repetition.top_ngram_char_fracs) != 3 or \
                len(self.quality.gopher_repetition.dup_ngram_char_fracs) != 6:
            raise ConfigError("quality.gopher_repetition: top_ngram_char_fracs needs 3 values (n=2..4), "
                              "dup_ngram_char_fracs 6 values (n=5..10)")
        return self
