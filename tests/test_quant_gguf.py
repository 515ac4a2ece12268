"""GGUF export, read back with the `gguf` package: llama.cpp's names and metadata, shapes, values
(q/k rows un-permuted), the byte-level BPE vocabulary; a compressed-tensors folder exports too."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lmforge.model.reference import save_hf_model
from lmforge.quant import load_pretrained
from lmforge.quant.gguf_export import export_gguf, read_gguf, unpermute_qk
from lmforge.quant.quantize import QuantizeConfig, quantize_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    path = save_hf_model("llama", tmp_path_factory.mktemp("gguf") / "m", seed=2, hidden_size=64, vocab_size=320)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(["def fib(n): return n if n < 2 else fib(n - 1) + fib(n - 2)"] * 20,
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("gguf_type,tol", [("bf16", 1e-2), ("q8_0", 1e-2), ("q4_0", 0.15)])
def test_gguf_reads_back_names_shapes_values(model_dir, tmp_path, gguf_type, tol):
    info = export_gguf(model_dir, tmp_path / "m.gguf", gguf_type)
    fields, tensors = read_gguf(tmp_path / "m.gguf")
    assert fields["general.architecture"] == "llama" and fields["llama.block_count"] == 2
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.embedding_length"] == 64 and fields["tokenizer.ggml.model"] == "gpt2"
    model = load_pretrained(model_dir, dtype="float32", device="cpu")
    state = model.state_dict()
    assert len(tensors) == len(state) == sum(info["tensors"].values())
    pairs = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
             "output_norm.weight": "model.norm.weight", "blk.1.ffn_down.weight": "model.layers.1.mlp.down_proj.weight",
             "blk.0.attn_norm.weight": "model.layers.0.input_layernorm.weight"}
    for ours, theirs in pairs.items():
        want = state[theirs].numpy()
        assert tensors[ours].shape == want.shape
        assert np.abs(tensors[ours] - want).max() <= tol * np.abs(want).max()
    for name, heads in (("q_proj", 4), ("k_proj", 2)):  # stored in GGML's interleaved RoPE order
        want = state[f"model.layers.0.self_attn.{name}.weight"]
        got = torch.from_numpy(tensors[f"blk.0.attn_{name[0]}.weight"])
        assert (unpermute_qk(got, heads) - want).abs().max() <= tol * want.abs().max()
        assert (got - want).abs().max() > 10 * tol * want.abs().max() or gguf_type == "q4_0"


def test_gguf_vocabulary_and_quantized_source(model_dir, tmp_path):
    import gguf

    w8 = tmp_path / "w8"
    quantize_model(QuantizeConfig(model=str(model_dir), out=str(w8), scheme="w8a16"))
    export_gguf(w8, tmp_path / "w8.gguf", "q8_0")
    reader = gguf.GGUFReader(str(tmp_path / "w8.gguf"))
    f = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(f.parts[i]).decode() for i in f.data]
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(tokens) == 320 and all(tokens[i] == t for t, i in vocab.items())
    q8 = {t.name: t for t in reader.tensors}["blk.0.ffn_up.weight"]
    assert q8.tensor_type == gguf.GGMLQuantizationType.Q8_0
    _, tensors = read_gguf(tmp_path / "w8.gguf")
    ours = load_pretrained(w8, dtype="float32", device="cpu").model.layers[0].mlp.up_proj
    want = ours.dequantized_weight().numpy()
    assert np.abs(tensors["blk.0.ffn_up.weight"] - want).max() <= 1e-2 * np.abs(want).max()


def test_gguf_refuses_unknown_type(model_dir, tmp_path):
    with pytest.raises(ValueError, match="--type 'q5_k'"):
        export_gguf(model_dir, tmp_path / "x.gguf", "q5_k")
