"""GPTQ and AWQ checkpoints: their packing against hand-computed words, our own quantized folders
rewritten in each layout load to the same codes, scales and logits (and through the engine to the same
greedy tokens), and what does not map (activation order, asymmetric zeros, other packings) is refused
naming the field or tensor."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmforge.model import UnsupportedConfigError
from lmforge.model.reference import save_hf_model
from lmforge.quant import QuantScheme, load_pretrained, unpack_int32
from lmforge.quant.gptq_awq import AWQ_ORDER, _pack, _unpack, gptq_tensors
from lmforge.quant.quantize import QuantizeConfig, quantize_model


def test_gptq_packs_along_k_and_awq_interleaves_along_n():
    u = torch.arange(1, 9, dtype=torch.int32)  # codes 1..8
    word = sum(int(v) << (4 * i) for i, v in enumerate(u.tolist()))
    word -= 1 << 32 if word >= 1 << 31 else 0
    assert _pack(u.reshape(8, 1), 4, 0).item() == word  # GPTQ qweight: 8 rows of K in one word
    assert _pack(u.reshape(1, 8), 4, 1).item() == word  # GPTQ qzeros: 8 columns of N in one word
    awq = sum(int(u[AWQ_ORDER[i]]) << (4 * i) for i in range(8))  # slot i holds column AWQ_ORDER[i]
    awq -= 1 << 32 if awq >= 1 << 31 else 0
    assert _pack(u.reshape(1, 8), 4, 1, AWQ_ORDER).item() == awq
    x = torch.randint(0, 16, (16, 24), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    assert torch.equal(_unpack(_pack(x, 4, 0), 4, 0), x)
    assert torch.equal(_unpack(_pack(x, 4, 1, AWQ_ORDER), 4, 1, AWQ_ORDER), x)
    y = torch.randint(0, 256, (8, 12), dtype=torch.int32, generator=torch.Generator().manual_seed(1))
    assert torch.equal(_unpack(_pack(y, 8, 0), 8, 0), y)


def _rewrite(ours, out, layout: str) -> None:
    """Our compressed-tensors folder, re-stored in a GPTQ (v1/v2) or AWQ layout with its config."""
    shutil.copytree(ours, out)
    cfg = json.loads((out / "config.json").read_text())
    w = cfg["quantization_config"]["config_groups"]["group_0"]["weights"]
    scheme = QuantScheme(w["num_bits"], w["group_size"] if w["strategy"] == "group" else None)
    src = load_file(str(out / "model.safetensors"))
    dst = {}
    for name, t in src.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            N, K = src[f"{prefix}.weight_shape"].tolist()
            q = unpack_int32(t, scheme.num_bits, K)
            dst.update(gptq_tensors(prefix, q, src[f"{prefix}.weight_scale"].float(), scheme,
                                    "awq" if layout == "awq" else layout))
        elif leaf not in ("weight_scale", "weight_shape"):
            dst[name] = t
    save_file(dst, str(out / "model.safetensors"))
    gs = scheme.group_size or -1
    cfg["quantization_config"] = (
        {"quant_method": "awq", "bits": 4, "group_size": gs, "zero_point": True, "version": "gemm"}
        if layout == "awq" else
        {"quant_method": "gptq", "bits": scheme.num_bits, "group_size": gs, "desc_act": False, "sym": True,
         "checkpoint_format": layout})
    (out / "config.json").write_text(json.dumps(cfg))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    src = save_hf_model("llama", root / "src", seed=5, hidden_size=64)
    out = {}
    for name, scheme, gs in (("w8", "w8a16", 128), ("w4", "w4a16", 32)):
        quantize_model(QuantizeConfig(model=str(src), out=str(root / name), scheme=scheme, group_size=gs))
        out[name] = root / name
    for name, layout in (("w4-gptq", "gptq"), ("w4-gptq_v2", "gptq_v2"), ("w4-awq", "awq"), ("w8-gptq", "gptq")):
        _rewrite(out[name.split("-")[0]], root / name, layout)
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", ["w4-gptq", "w4-gptq_v2", "w4-awq", "w8-gptq"])
def test_gptq_and_awq_folders_load_to_our_codes_scales_and_logits(folders, name):
    ours = load_pretrained(folders[name.split("-")[0]], dtype="float32", device="cpu")
    theirs = load_pretrained(folders[name], dtype="float32", device="cpu")
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for k in a:  # scales went through float16 in the GPTQ/AWQ files: equal to its rounding
        same = (torch.allclose(a[k].float(), b[k].float(), rtol=1e-3, atol=1e-6) if "scale" in k
                else torch.equal(a[k], b[k]))
        assert same, k
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), theirs(ids), rtol=2e-3, atol=2e-3)


def test_the_engine_serves_a_gptq_folder_with_the_same_greedy_tokens(folders):
    from lmforge.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = [[1, 5, 9, 2], [3, 3, 8, 1, 4, 6]]
    a = [o.outputs[0].token_ids for o in LLM(str(folders["w4"]), dtype="float32", device="cpu").generate(
        prompts, params, use_tqdm=False)]
    llm = LLM(str(folders["w4-gptq"]), dtype="float32", device="cpu")
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert a == b
    assert llm.stats()["linear_backend"] != "dense"


@pytest.mark.parametrize("key,value,field", [
    ("desc_act", True, "quantization_config.desc_act"),
    ("sym", False, "quantization_config.sym"),
    ("checkpoint_format", "marlin", "quantization_config.checkpoint_format"),
    ("bits", 3, "quantization_config.bits"),
])
def test_gptq_configs_that_do_not_map_are_refused_by_field(folders, tmp_path, key, value, field):
    d = shutil.copytree(folders["w4-gptq"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"][key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError) as err:
        load_pretrained(d, device="cpu")
    assert err.value.field == field


def test_awq_gemv_packing_is_refused(folders, tmp_path):
    d = shutil.copytree(folders["w4-awq"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["version"] = "gemv"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError) as err:
        load_pretrained(d, device="cpu")
    assert err.value.field == "quantization_config.version"


@pytest.mark.parametrize("tensor", ["qzeros", "g_idx"])
def test_asymmetric_zeros_and_activation_order_are_refused_naming_the_tensor(folders, tmp_path, tensor):
    d = shutil.copytree(folders["w4-gptq"], tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.mlp.up_proj." + tensor
    if tensor == "qzeros":
        t[name] = t[name] + 1  # every packed zero point moves off the midpoint
    else:
        t[name] = t[name].flip(0).contiguous()  # groups no longer in column order
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(UnsupportedConfigError) as err:
        load_pretrained(d, device="cpu")
    assert err.value.field == name
