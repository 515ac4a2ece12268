"""Weight-only quantization: the math against its bounds, our packing against the compressed-tensors
package's own, the folder `lmforge quantize` writes against `transformers`, and refusals."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.model import Transformer, UnsupportedConfigError
from lmforge.model.reference import save_hf_model
from lmforge.quant import QuantScheme, dequantize, load_pretrained, pack_int32, quantize_rtn, scratch, unpack_int32, unpack_int32_into
from lmforge.quant.quantize import QuantizeConfig, quantize_model

SCHEMES = [QuantScheme(8, None), QuantScheme(4, 32), QuantScheme(4, 128)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: f"{s.name}-g{s.group_size}")
def test_rtn_error_is_within_half_a_step(scheme):
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    q, s = quantize_rtn(w, scheme, scale_dtype=torch.float32)
    assert q.dtype == torch.int8 and int(q.min()) >= scheme.qmin and int(q.max()) <= scheme.qmax
    assert s.shape == (64, scheme.groups(256))
    step = s.repeat_interleave(256 // s.shape[1], dim=1)
    err = (dequantize(q, s) - w).abs()
    # |w| <= 7.5 steps (int4) / 127.5 (int8), and q clips at qmax: at most half a step plus the clip's half
    assert bool((err <= step * 0.5 + 1e-6).all() | ((err <= step + 1e-6) & (q == scheme.qmax)).all())
    rel = (err.norm() / w.norm()).item()
    assert rel < {8: 0.01, 4: 0.12}[scheme.num_bits]


@pytest.mark.parametrize("bits,cols", [(8, 96), (4, 96), (4, 90), (8, 30)])
def test_packing_equals_compressed_tensors(bits, cols):
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = torch.randint(lo, hi + 1, (16, cols), dtype=torch.int8, generator=torch.Generator().manual_seed(bits))
    ours = pack_int32(q, bits)
    assert torch.equal(ours, pack_to_int32(q, bits))
    assert torch.equal(unpack_int32(ours, bits, cols), q)
    assert torch.equal(unpack_from_int32(ours, bits, torch.Size([16, cols])), q)
    if cols % (32 // bits) == 0:  # the in-place unpack (whole words only) writes the same codes as floats
        assert torch.equal(unpack_int32_into(ours, bits, torch.empty(16, cols)), q.float())


def test_scratch_is_reused_within_a_thread_and_separate_across_threads():
    import threading

    a = scratch(64, torch.float32, torch.device("cpu"))
    assert scratch(32, torch.float32, torch.device("cpu")).data_ptr() == a.data_ptr()  # no new allocation
    other = []
    t = threading.Thread(target=lambda: other.append(scratch(64, torch.float32, torch.device("cpu")).data_ptr()))
    t.start()
    t.join()
    assert other[0] != a.data_ptr()  # two engines stepping in two threads never share a weight buffer
    with torch.inference_mode():  # the engine's buffer is an inference tensor, which training could not write
        engine_buf = scratch(64, torch.float32, torch.device("cpu"))
    assert engine_buf.data_ptr() != a.data_ptr()
    scratch(64, torch.float32, torch.device("cpu")).add_(1)  # outside inference mode: writable


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    src = save_hf_model("llama", root / "src", seed=3, hidden_size=64)
    out = {"src": src}
    for name, scheme, gs in (("w8", "w8a16", 128), ("w4", "w4a16", 32)):
        quantize_model(QuantizeConfig(model=str(src), out=str(root / name), scheme=scheme, group_size=gs))
        out[name] = root / name
    return out


@pytest.mark.parametrize("name", ["w8", "w4"])
def test_transformers_loads_our_folder_with_our_logits(folders, name):
    """transformers + compressed-tensors decompress the folder; its float32 logits equal ours (the
    dequantized reference) to float32 rounding (measured: identical)."""
    import transformers

    cfg = json.loads((folders[name] / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == "pack-quantized"
    ours = load_pretrained(folders[name], dtype="float32", device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(folders[name], dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, rtol=0, atol=1e-5)
    # and ours is the source model within the scheme's error, not the source itself
    src = load_pretrained(folders["src"], dtype="float32", device="cpu")
    with torch.no_grad():
        diff = (ours(ids) - src(ids)).abs().max().item()
    assert 0 < diff < {"w8": 0.02, "w4": 0.2}[name]


def test_record_reports_bytes_and_errors(folders):
    rec = json.loads((folders["w4"] / "record.json").read_text())
    res = rec["results"]
    assert rec["status"] == "finished" and res["scheme"] == "w4a16" and res["group_size"] == 32
    # int4 codes plus one 4-byte fp32 scale per 32 weights: (0.5 + 4/32) / 4 of the float32 bytes
    assert res["linear_bytes_after"] / res["linear_bytes_before"] == pytest.approx((0.5 + 4 / 32) / 4, rel=0.01)
    assert set(res["worst_relative_error"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"}


@pytest.mark.parametrize("path,value,field", [
    (("quant_method",), "bitsandbytes", "quantization_config.quant_method"),
    (("format",), "naive-quantized", "quantization_config.format"),
    (("config_groups", "group_0", "weights", "symmetric"), False,
     "quantization_config.config_groups.group_0.weights.symmetric"),
    (("config_groups", "group_0", "weights", "num_bits"), 3,
     "quantization_config.config_groups.group_0.weights.num_bits"),
    (("config_groups", "group_0", "input_activations"), {"num_bits": 8, "type": "int"},
     "quantization_config.config_groups.group_0.input_activations"),
])
def test_unsupported_quantization_is_refused_by_field(folders, tmp_path, path, value, field):
    import shutil

    d = shutil.copytree(folders["w4"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    node = cfg["quantization_config"]
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError) as err:
        load_pretrained(d, device="cpu")
    assert err.value.field == field


def test_the_plain_model_loader_refuses_a_quantized_folder_naming_the_quant_loader(folders):
    """The model package sits below quant: its loader reads float folders and points to the one that
    decompresses; quant's loader reads both (a float folder through the plain loader, same numbers)."""
    with pytest.raises(ValueError, match=r"lmforge\.quant\.load_pretrained"):
        Transformer.from_pretrained(folders["w4"], device="cpu")
    plain, via_quant = (f(folders["src"], dtype="float32", device="cpu") for f in (Transformer.from_pretrained,
                                                                                 load_pretrained))
    a, b = plain.state_dict(), via_quant.state_dict()
    assert list(a) == list(b)  # the same names in the same order, none missing on either side
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_quantize_refuses_bad_group_size_naming_the_layer(folders, tmp_path):
    """(In process: `lmforge eval diff`'s test runs the CLI as a subprocess; the quantize verb only
    passes these options through and prints `error: <this message>` with exit code 2.)"""
    with pytest.raises(ValueError, match=r"model\.layers\.0\..*group size 48"):
        quantize_model(QuantizeConfig(model=str(folders["src"]), out=str(tmp_path / "x"), scheme="w4a16",
                                      group_size=48))
    with pytest.raises(ValueError, match="--calibration"):  # gptq without data: refused before any work
        quantize_model(QuantizeConfig(model=str(folders["src"]), out=str(tmp_path / "y"), method="gptq"))
    assert not (tmp_path / "y").exists()
