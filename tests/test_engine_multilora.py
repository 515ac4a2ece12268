"""Multi-LoRA serving in the engine (engine/lora.py): adapters are the peft folders
`lmforge.train.lora_adapter.save_adapter` writes; greedy output on an adapter equals the model merged
by peft's own `merge_and_unload` from the same folder, with adapters mixed in one batch, with LRU slot
swapping, and the prefix cache is keyed by adapter. Tiny random Llama, float32.

    python -m pytest -q tests/test_engine_multilora.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lmforge.engine import LLM, EngineConfig, LLMEngine, LoRARequest, SamplingParams
from lmforge.engine.lora import read_adapter
from lmforge.model import Transformer
from lmforge.model.reference import save_hf_model
from lmforge.train.lora import LoraConfig, apply_lora
from lmforge.train.lora_adapter import save_adapter

pytestmark = pytest.mark.usefixtures("one_thread")

TARGETS = {"a": ["q_proj", "v_proj", "down_proj"], "b": ["k_proj", "o_proj", "gate_proj", "up_proj"],
           "c": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}
RANKS = {"a": 4, "b": 8, "c": 2}
PROMPTS = [[5, 17, 99, 3, 42, 7, 8, 120], [9, 9, 200, 31, 64, 2, 77, 5, 11, 13, 250, 6, 1, 3, 3, 4, 90, 91]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_adapter(base: Path, out: Path, name: str, seed: int) -> Path:
    """An adapter whose B is random (trained adapters start at B = 0): it changes the greedy tokens."""
    cfg = LoraConfig(rank=RANKS[name], alpha=2 * RANKS[name], target_modules=TARGETS[name])
    model = apply_lora(Transformer.from_pretrained(base, dtype="float32"), cfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".lora_" in n:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if ".lora_B." in n else 1.0))
    return save_adapter(model, cfg, out, base=str(base))


def merged_by_peft(base: Path, adapter: Path, out: Path) -> Path:
    """The adapter merged into the base by peft itself (transformers model + PeftModel.merge_and_unload)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    PeftModel.from_pretrained(hf, adapter).merge_and_unload().save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("multilora")
    base = save_hf_model("llama", tmp / "base", vocab_size=256, hidden_size=64, layers=2)
    out = {"base": base}
    for i, name in enumerate(TARGETS):
        out[name] = make_adapter(base, tmp / f"adapter-{name}", name, seed=i + 1)
        out[f"merged-{name}"] = merged_by_peft(base, out[name], tmp / f"merged-{name}")
    return out


def greedy(llm: LLM, prompts, lora=None) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)]


@pytest.fixture(scope="module")
def want(folders) -> dict[str, list[list[int]]]:
    """Each merged model served alone, and the base."""
    return {name: greedy(LLM(str(folders[f"merged-{name}" if name != "base" else "base"]), dtype="float32"),
                         PROMPTS) for name in ["base", *TARGETS]}


def req(folders, name: str, lid: int) -> LoRARequest:
    return LoRARequest(name, lid, str(folders[name]))


def test_adapters_change_the_output(want):
    assert len({str(v) for v in want.values()}) == 4  # the test below could fail


def test_each_adapter_equals_its_merged_model(folders, want):
    llm = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    for i, name in enumerate(TARGETS):
        assert greedy(llm, PROMPTS, req(folders, name, i + 1)) == want[name], name
    assert greedy(llm, PROMPTS) == want["base"]


def test_mixed_batch_with_lru_swapping_and_keyed_prefix_cache(folders, want):
    """Base and three adapters in one generate call over 2 slots: every prompt x adapter equals its merged
    model; slots are swapped (more loads than slots); the prefix cache never crosses adapters."""
    llm = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, block_size=4)
    names = ["base", *TARGETS] * 2
    prompts = [p for _ in names for p in PROMPTS]
    loras = [None if n == "base" else req(folders, n, 1 + list(TARGETS).index(n)) for n in names for _ in PROMPTS]
    got = greedy(llm, prompts, loras)
    for k, n in enumerate(names):
        assert got[2 * k:2 * k + 2] == want[n], (k, n)
    stats = llm.stats()
    assert stats["lora_slot_loads"] > 2 and stats["lora_resident"] == 2
    assert stats["prefix_cache_hits"] > 0  # repeats of the same (prompt, adapter) hit ...
    before = stats["prefix_cache_hits"]
    greedy(llm, [PROMPTS[1]], req(folders, "c", 9))  # ... the same folder under a new id does not
    assert llm.stats()["prefix_cache_hits"] == before


def test_one_slot_two_adapters_take_turns(folders, want):
    """max_loras=1: the scheduler admits the second adapter's requests only once the first's are done."""
    llm = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8)
    got = greedy(llm, PROMPTS * 2, [req(folders, "a", 1)] * 2 + [req(folders, "b", 2)] * 2)
    assert got == want["a"] + want["b"]
    stats = llm.stats()
    assert stats["lora_max_adapters_in_step"] == 1 and stats["lora_slot_loads"] == 2


def test_bad_adapters_are_refused(folders, tmp_path):
    llm = LLM(str(folders["base"]), dtype="float32", enable_lora=True, max_lora_rank=4)
    with pytest.raises(ValueError, match="r=8 is above --max-lora-rank 4"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=req(folders, "b", 1))
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((folders["a"] / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**cfg, "target_modules": ["lm_head", "q_proj"]}))
    with pytest.raises(ValueError, match=r"target_modules \['lm_head'\] cannot be served"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("bad", 2, str(bad)))
    with pytest.raises(ValueError, match="not found"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("none", 3, str(tmp_path / "nowhere")))
    plain = LLM(str(folders["base"]), dtype="float32")
    with pytest.raises(ValueError, match="runs without LoRA"):
        plain.generate(PROMPTS[0], GREEDY, lora_request=req(folders, "a", 1))


def test_adapter_for_another_base_is_refused(folders, tmp_path):
    other = save_hf_model("llama", tmp_path / "other", vocab_size=256, hidden_size=32, layers=2)
    with pytest.raises(ValueError, match="do not fit rank 4 over this base"):
        read_adapter(folders["a"], Transformer.from_pretrained(other).config, 16)


def run_engine(engine: LLMEngine, prompts, loras) -> list[list[int]]:
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        engine.add_request(str(i), p, GREEDY, lora_request=lora)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return [done[str(i)] for i in range(len(prompts))]


@pytest.mark.parametrize("extra", [dict(num_kv_blocks=10, block_size=4),  # preemptions: recompute on readmission
                                   dict(speculative_method="ngram", num_speculative_tokens=3)])
def test_adapters_survive_preemption_and_speculative_decoding(folders, want, extra):
    engine = LLMEngine(EngineConfig(model=str(folders["base"]), dtype="float32", enable_lora=True, max_loras=3,
                                    max_lora_rank=8, **extra))
    names = [*TARGETS, "base"]
    loras = [None if n == "base" else req(folders, n, 1 + list(TARGETS).index(n)) for n in names for _ in PROMPTS]
    got = run_engine(engine, PROMPTS * len(names), loras)
    assert got == [w for n in names for w in want[n]]
    stats = engine.stats()
    assert stats["preemptions"] > 0 if "num_kv_blocks" in extra else stats["spec_decode_num_drafts"] > 0


@pytest.mark.slow
def test_a_lora_run_exported_as_adapter_serves_like_lmforge_export(tmp_path):
    """`lmforge train` (method lora, in process) -> `export_adapter` (peft folder) served over the base the run
    started from == `lmforge export` (merged) served alone."""
    from test_train_loop import TINY, make_packed

    from lmforge.config import load_config
    from lmforge.train.config import TrainConfig
    from lmforge.train.export import export_run
    from lmforge.train.lora_adapter import export_adapter
    from lmforge.train.loop import train

    base = save_hf_model("llama", tmp_path / "base", vocab_size=384, hidden_size=64, layers=2, intermediate_size=176,
                         num_attention_heads=4, num_key_value_heads=2)
    packed = make_packed(tmp_path / "data", n_docs=40)
    cfg = load_config(TrainConfig, TINY, [f"data.path={packed}", f"model.init={base}", "train.max_steps=3",
                                          "train.method=lora", "lora.rank=4", "train.lr=3e-2", "train.eval_every=3",
                                          "train.ckpt_every=3"])
    train(cfg, tmp_path / "run")
    adapter = export_adapter(tmp_path / "run", tmp_path / "adapter")
    merged = export_run(tmp_path / "run", tmp_path / "merged")
    prompts = [[5, 9, 30, 7, 100, 3, 8], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
    want = greedy(LLM(str(merged), dtype="float32"), prompts)
    lora = LLM(str(base), dtype="float32", enable_lora=True)
    assert greedy(lora, prompts, LoRARequest("run", 1, str(adapter))) == want
    assert greedy(lora, prompts) != want  # training did move the model
