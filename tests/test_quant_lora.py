"""LoRA on a light frozen base (lora.base_dtype / lora.base_quant): only the adapters train, the base
holds fewer bytes, and the merged export loads in `transformers` with our merged model's logits."""

from __future__ import annotations

import pytest
import torch

from lmforge.model.reference import save_hf_model
from lmforge.quant import load_pretrained
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
    model = load_pretrained(src, dtype="float32", device="cpu")
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
    model = load_pretrained(src, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match="base_quant"):
        apply_lora(model, LoraConfig(base_quant="nf4"))
    with pytest.raises(ValueError, match="base_dtype"):
        apply_lora(model, LoraConfig(base_dtype="fp8"))


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
def test_rebuilt_weight_is_the_reference_dequantization_in_one_shared_buffer(kind):
    from lmforge.quant import dequantize, unpack_int32

    torch.manual_seed(2)
    layers = [FrozenLinear(torch.nn.Linear(k, n, bias=False), kind) for n, k in ((48, 64), (64, 32))]
    for layer in layers:
        if kind == "bfloat16":
            want = layer.weight_bf16.float()
        else:
            q = layer.qweight if kind == "int8" else unpack_int32(layer.qweight, 4, layer.in_features)
            want = dequantize(q, layer.weight_scale, torch.float32)
        assert torch.equal(layer.weight_for(torch.float32), want)
        assert torch.equal(layer.rebuilt(torch.float32), want)
        assert torch.equal(layer.rebuilt(torch.bfloat16), want.bfloat16())  # float32 math, then one rounding
        x = torch.randn(3, layer.in_features, requires_grad=True)
        y = layer(x)
        y.backward(torch.ones_like(y))
        torch.testing.assert_close(y, x @ want.t(), rtol=0, atol=1e-5)
        torch.testing.assert_close(x.grad, torch.ones_like(y) @ want, rtol=0, atol=1e-5)
    # both layers rebuild into the same float32 storage: no weight-sized allocation per call
    assert layers[0].rebuilt(torch.float32).data_ptr() == layers[1].rebuilt(torch.float32).data_ptr()


@pytest.mark.parametrize("kind", ["bfloat16", "int4"])
def test_a_16_bit_checkpoint_builds_the_same_light_base_without_a_float32_copy(tmp_path, kind):
    from lmforge.train.lora import base_load_dtype

    path = save_hf_model("llama", tmp_path / "bf16", seed=7, hidden_size=64, dtype=torch.bfloat16)
    cfg = LoraConfig(rank=4, base_dtype="bfloat16" if kind == "bfloat16" else "float32",
                     base_quant=None if kind == "bfloat16" else kind)
    assert base_load_dtype(path, LoraConfig(rank=4), torch.device("cpu")) == "float32"  # a float32 base: as before
    assert base_load_dtype(path, cfg, torch.device("cpu")) == "bfloat16"
    light = apply_lora(load_pretrained(path, dtype="bfloat16", device="cpu"), cfg)
    ref = apply_lora(load_pretrained(path, dtype="float32", device="cpu"), cfg)
    assert all(p.dtype == torch.float32 for p in light.parameters())  # embeddings, norms, adapters train in float32
    ref_buffers = dict(ref.named_buffers())
    for name, b in light.named_buffers():  # bf16 weights, int4 codes and scales: identical
        assert torch.equal(b, ref_buffers[name]), name
    ref_params = dict(ref.named_parameters())
    for name, p in light.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(p, ref_params[name]), name
    ids = torch.randint(3, 256, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # lora_B starts at zero, so both are the base model
        assert torch.equal(light(ids), ref(ids))


@pytest.mark.parametrize("kind", ["bfloat16", "int8", "int4"])
def test_a_wide_layer_rebuilds_block_by_block_with_the_same_result(kind, monkeypatch):
    import lmforge.train.lora as lora

    torch.manual_seed(4)
    layer = FrozenLinear(torch.nn.Linear(32, 100, bias=True), kind)
    want = layer.weight_for(torch.float32)
    monkeypatch.setattr(lora, "REBUILD_ELEMENTS", 32 * 16)  # 16 rows a block: 7 blocks, the last ragged
    assert len(layer.blocks(torch.float32)) == 7
    x = torch.randn(2, 5, 32, requires_grad=True)
    y = layer(x)
    g = torch.randn_like(y)
    y.backward(g)
    torch.testing.assert_close(y, x @ want.t() + layer.bias, rtol=0, atol=1e-5)
    torch.testing.assert_close(x.grad, g @ want, rtol=0, atol=1e-5)
