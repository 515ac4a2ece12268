"""LoRA through peft: only adapters train, merge parity through `transformers`, adapter round trips.

The model is a tiny random Llama (hidden 64, 2 layers); the merged checkpoint is read back by
`transformers.AutoModelForCausalLM` and compared, logits to logits, with the unmerged model.

    python -m pytest -q tests/test_train_lora.py
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmforge.model import ModelConfig, Transformer
from lmforge.train.lora import (LoraConfig, apply_lora, is_lora, load_lora_state_dict, lora_state_dict,
                                merge_lora, trainable_parameters)

VOCAB = 512  # the size of the tiny tokenizers the other training tests train


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(tie: bool = True) -> Transformer:
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tie)
    return Transformer(cfg).init_weights(seed=0)


def train_steps(model: torch.nn.Module, steps: int = 4, seed: int = 0) -> None:
    """A few AdamW steps on random tokens, through the packed-row call the trainer makes."""
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
        doc_ids = torch.tensor([[0] * 9 + [1] * 8] * 2)[:, :16]
        logits = model(ids[:, :-1], doc_ids=doc_ids)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


@pytest.fixture(scope="module")
def trained() -> tuple[dict, Transformer]:
    model = tiny()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    model = apply_lora(model, cfg)
    train_steps(model)
    return base, model


def base_name(lora_name: str) -> str:
    return lora_name.replace(".base_layer.", ".")


def test_apply_lora_keeps_the_model_and_freezes_the_base():
    model = tiny()
    x = torch.randint(0, VOCAB, (1, 12))
    before = model(x)
    lora = apply_lora(model, LoraConfig())
    assert isinstance(lora, Transformer) and lora.config.vocab_size == VOCAB
    torch.testing.assert_close(lora(x), before, atol=0, rtol=0)  # B starts at zero: same model
    for name, p in lora.named_parameters():
        assert p.requires_grad == (".lora_" in name), name
    trainable, total = trainable_parameters(lora)
    # 2 layers x 4 attention projections x rank 8 x (in + out); q/o are 64x64, k/v 64->32 (GQA)
    assert trainable == 2 * 8 * ((64 + 64) * 2 + (64 + 32) * 2)
    assert total == tiny().num_parameters() + trainable
    with pytest.raises(ValueError, match="already"):
        apply_lora(lora, LoraConfig())


def test_training_changes_only_adapters(trained):
    base, model = trained
    for name, t in model.state_dict().items():
        if ".lora_" in name:
            continue
        assert torch.equal(t, base[base_name(name)]), name
    lora_b = [t for n, t in model.state_dict().items() if ".lora_B." in n]
    assert lora_b and all(t.abs().sum() > 0 for t in lora_b)


def test_merged_checkpoint_loads_in_transformers_with_the_same_logits(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    _, model = trained
    x = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(x)
        merged = merge_lora(model)
        assert type(merged) is Transformer and not is_lora(merged) and is_lora(model)
        assert set(merged.state_dict()) == set(tiny().state_dict())  # HF names again
        torch.testing.assert_close(merged(x), want, atol=1e-5, rtol=1e-5)
        merged.save_pretrained(tmp_path / "merged")
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        got = hf(x).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(tiny()(x), want, atol=1e-3)  # the adapters did change the model


def test_lora_state_dict_round_trips(trained):
    _, model = trained
    sd = lora_state_dict(model)
    assert sd and all(".lora_A." in k or ".lora_B." in k for k in sd)
    assert sum(t.numel() for t in sd.values()) == trainable_parameters(model)[0]
    fresh = apply_lora(tiny(), LoraConfig(rank=4, alpha=8,
                                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]))
    load_lora_state_dict(fresh, sd)
    x = torch.randint(0, VOCAB, (1, 15))
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x), model(x), atol=0, rtol=0)
    with pytest.raises(ValueError, match="does not match"):
        load_lora_state_dict(apply_lora(tiny(), LoraConfig(rank=4)), sd)


def test_merge_in_place_consumes_adapters():
    model = apply_lora(tiny(), LoraConfig(rank=2, alpha=4, dropout=0.1))
    train_steps(model, steps=2)
    x = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        want = model(x)
        merged = merge_lora(model, inplace=True)
        assert merged is model and not is_lora(model)
        torch.testing.assert_close(merged(x), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg, match", [
    (LoraConfig(rank=0), "rank"),
    (LoraConfig(dropout=1.0), "dropout"),
    (LoraConfig(target_modules=["qproj"]), "qproj"),
    (LoraConfig(target_modules=["lm_head"]), "tie"),
])
def test_bad_config_is_refused(cfg, match):
    with pytest.raises(ValueError, match=match):
        apply_lora(tiny(), cfg)


def test_lm_head_adapter_on_untied_model_merges():
    model = apply_lora(tiny(tie=False), LoraConfig(rank=2, target_modules=["lm_head", "up_proj"]))
    train_steps(model, steps=2)
    x = torch.randint(0, VOCAB, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(merge_lora(model)(x), model(x), atol=1e-5, rtol=1e-5)
