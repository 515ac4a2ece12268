"""LoRA on a light frozen base (lora.base_dtype / lora.base_quant): only the adapters train, the base
holds fewer bytes, and the merged export loads in `transformers` with our merged model's logits."""

from __future__ import annotations

import pytest
import torch

from lmforge.model import Transformer
from lmforge.model.reference import save_hf_model
from lmforge.train.lora import FrozenLinear, LoraConfig, apply_lora, merge_lora


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return save_hf_model("llama", tmp_path_factory.mktemp("lora") / "m", seed=6, hidden_size=64)


def _base_bytes(model) -> int:
    return sum(b.numel() * b.element_size() for m in model.modules() if isinstance(m, FrozenLinear)
               for b in m.buffers())


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
def test_light_base_trains_only_adapters_and_merges(src, tmp_path, kind):
    import transformers

    torch.manual_seed(0)
    model = Transformer.from_pretrained(src, dtype="float32", device="cpu")
    dense = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = LoraConfig(rank=4, target_modules=["q_proj", "v_proj", "up_proj"],
                     base_dtype="bfloat16" if kind == "bfloat16" else "float32",
                     base_quant=None if kind == "bfloat16" else kind)
    model = apply_lora(model, cfg)
    ratio = _base_bytes(model) / dense
    assert ratio < {"bfloat16": 0.51, "int8": 0.27, "int4": 0.17}[kind], ratio
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(3, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert changed and all(".lora_" in k for k in changed)  # codes, scales, norms, embeddings untouched
    merged = merge_lora(model)
    with torch.no_grad():
        torch.testing.assert_close(merged(ids), model(ids), rtol=1e-4, atol=1e-4)
    merged.save_pretrained(tmp_path / "merged")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, merged(ids), rtol=1e-4, atol=1e-4)


def test_bad_base_settings_are_refused(src):
    model = Transformer.from_pretrained(src, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="base_quant"):
        apply_lora(model, LoraConfig(base_quant="nf4"))
    with pytest.raises(ValueError, match="base_dtype"):
        apply_lora(model, LoraConfig(base_dtype="fp8"))
