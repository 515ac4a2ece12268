"""The model against `transformers`: logits, packed rows, checkpoint round trips, refusals."""

from __future__ import annotations

import json

import pytest
import torch

from hf_models import VARIANTS, hf_config, make_hf_model, save_hf_model
from lmforge.model import ModelConfig, Transformer, UnsupportedConfigError

TOL = 1e-5


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    """(variant, HF model, our model loaded from the HF model's saved checkpoint)."""
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, seed=1)
    hf.save_pretrained(path)
    return request.param, hf, Transformer.from_pretrained(path, dtype="float32", device="cpu")


@torch.no_grad()
def test_logits_match_transformers(pair):
    variant, hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (3, 70), generator=torch.Generator().manual_seed(0))
    ref, got = hf(ids).logits, ours(ids)
    assert got.shape == ref.shape == (3, 70, hf.config.vocab_size)
    torch.testing.assert_close(got, ref, atol=TOL, rtol=0)
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@torch.no_grad()
def test_llama3_rope_scaling_changes_the_model(tmp_path):
    """The llama3 variant's parity is not vacuous: without the scaling the logits differ."""
    hf = make_hf_model("llama3-rope", seed=2)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    ours = Transformer.from_pretrained(tmp_path, device="cpu")
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    cfg.pop("rope_scaling", None)
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg["rope_parameters"]["rope_theta"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plain = Transformer.from_pretrained(tmp_path, device="cpu")
    ids = torch.arange(100).unsqueeze(0) % 256
    assert (ours(ids) - plain(ids)).abs().max() > 1e-3


def test_parameter_count_matches_config(pair):
    _, hf, ours = pair
    assert ours.num_parameters() == hf.num_parameters() == ours.config.num_parameters()


@torch.no_grad()
def test_packed_row_equals_documents_alone(pair):
    """Three documents in one row, with document ids: each sees only itself, from position 0."""
    _, _, ours = pair
    g = torch.Generator().manual_seed(3)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (11, 25, 7)]
    row = torch.cat(docs).unsqueeze(0)
    doc_ids = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)]).unsqueeze(0)
    packed = ours(row, doc_ids=doc_ids)[0]
    alone = torch.cat([ours(d.unsqueeze(0))[0] for d in docs])
    torch.testing.assert_close(packed, alone, atol=TOL, rtol=0)
    # and without document ids the later documents do see the earlier ones
    assert (ours(row)[0, 11:] - alone[11:]).abs().max() > 1e-3


@torch.no_grad()
def test_ours_to_transformers_round_trip(tmp_path):
    import transformers

    for variant in ("llama", "qwen3"):
        cfg = ModelConfig.from_hf(hf_config(variant).to_dict())
        ours = Transformer(cfg).init_weights(seed=4).eval()
        ours.save_pretrained(tmp_path / variant)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / variant, dtype=torch.float32).eval()
        assert type(hf).__name__ == cfg.architecture
        ids = torch.randint(0, 256, (2, 33))
        torch.testing.assert_close(hf(ids).logits, ours(ids), atol=TOL, rtol=0)


@torch.no_grad()
def test_transformers_to_ours_to_transformers(tmp_path):
    import transformers

    hf = make_hf_model("qwen2", seed=5)
    hf.save_pretrained(tmp_path / "a")
    Transformer.from_pretrained(tmp_path / "a", device="cpu").save_pretrained(tmp_path / "b")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b", dtype=torch.float32).eval()
    ids = torch.randint(0, 256, (1, 50))
    torch.testing.assert_close(back(ids).logits, hf(ids).logits, atol=0, rtol=0)


@torch.no_grad()
def test_sharded_checkpoint_loads(tmp_path):
    ours = Transformer(ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4)).init_weights(seed=6)
    ours.save_pretrained(tmp_path, max_shard_bytes=100_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    back = Transformer.from_pretrained(tmp_path, device="cpu")
    ids = torch.randint(0, 256, (1, 20))
    assert torch.equal(back(ids), ours(ids))


def test_bfloat16_load_keeps_dtype_and_rope_table(tmp_path):
    save_hf_model("llama", tmp_path, seed=7)
    model = Transformer.from_pretrained(tmp_path, dtype="bfloat16", device="cpu")
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model(torch.tensor([[1, 2, 3]])).dtype == torch.bfloat16


@pytest.mark.parametrize("variant,change,field", [
    ("mistral", {"sliding_window": 64}, "sliding_window"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, "sliding_window"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("llama", {"model_type": "mixtral"}, "model_type"),
    ("llama", {"num_local_experts": 8}, "num_local_experts"),
    ("llama", {"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config.quant_method"),
])
def test_unsupported_configs_are_refused_by_field(tmp_path, variant, change, field):
    save_hf_model(variant, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(change)
    if field == "rope_scaling.rope_type":
        cfg["rope_parameters"] = {**cfg["rope_parameters"], **change["rope_scaling"]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedConfigError) as err:
        Transformer.from_pretrained(tmp_path, device="cpu")
    assert err.value.field == field
    assert field in str(err.value)


def test_missing_and_mismatched_weights_are_clear_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf_model("llama", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    state.pop("model.layers.1.mlp.up_proj.weight")
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing tensors.*up_proj"):
        Transformer.from_pretrained(tmp_path, device="cpu")
    with pytest.raises(FileNotFoundError, match="config.json"):
        Transformer.from_pretrained(tmp_path / "nowhere", device="cpu")
