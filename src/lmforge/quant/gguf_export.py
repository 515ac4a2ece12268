"""GGUF export for the CPU ecosystem (llama.cpp and the tools built on it), with the `gguf` package.

A Hugging Face folder (Llama / Mistral / Qwen2 / Qwen3, dense or our compressed-tensors, which is
dequantized first) becomes one `.gguf` file: llama.cpp's metadata keys for the architecture, its
tensor names (`blk.N.attn_q.weight`, ...), and the byte-level BPE vocabulary and merges of
`tokenizer.json` when the folder has one. Matrices are stored as `bf16`, `q8_0` (blocks of 32
int8 + an f16 scale) or `q4_0` (blocks of 32 int4 + an f16 scale); 1-D tensors (norms, biases) and
matrices whose rows are not a multiple of 32 stay f32. Llama/Mistral q and k rows are permuted from
Hugging Face's rotate-half RoPE layout to GGML's interleaved one (what llama.cpp's own converter
does; `unpermute_qk` inverts it for read-back). This module knows nothing about the engine, and only
an export imports it (`lmforge export --format gguf` does so when asked), so `gguf` loads with it.

    lmforge export runs/tiny --out models/tiny --format gguf --type q8_0   # HF folder + model-q8_0.gguf
    python -m lmforge.quant.gguf_export models/tiny models/tiny/model-q4_0.gguf --type q4_0
    llama-cli -m models/tiny/model-q8_0.gguf -p "def fib(n):" -n 32       # in a llama.cpp build
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
import typer

from lmforge.model.checkpoint import read_hf_config

from .gguf_load import ARCH, PERMUTED, permute_qk, tensor_names, unpermute_qk  # noqa: F401 (unpermute_qk: read-back)
from .linear import quantized_linears
from .load import load_pretrained

GGUF_TYPES = ("bf16", "q8_0", "q4_0", "f32")
def _qtype(gguf_type: str, t: torch.Tensor):
    Q = gguf.GGMLQuantizationType
    if t.ndim == 1 or gguf_type == "f32" or t.shape[-1] % 32:
        return Q.F32
    return {"bf16": Q.BF16, "q8_0": Q.Q8_0, "q4_0": Q.Q4_0}[gguf_type]


def _add_tokenizer(writer, model_dir: Path, hf: dict) -> bool:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return False
    tok = json.loads(path.read_text())
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{path}: model.type={model.get('type')!r}; GGUF export handles byte-level BPE tokenizers")
    vocab = dict(model["vocab"])
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    special = {a["id"] for a in tok.get("added_tokens", []) if a.get("special")}
    size = max(hf["vocab_size"], max(vocab.values()) + 1)
    tokens, types = [f"[PAD{i}]" for i in range(size)], [5] * size  # 5: unused, for padding rows
    for text, i in vocab.items():
        tokens[i], types[i] = text, 3 if i in special else 1  # 3: control, 1: normal
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, fn in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                    ("pad_token_id", writer.add_pad_token_id)):
        v = hf.get(key)
        if isinstance(v, list):
            v = v[0] if v else None
        if v is not None:
            fn(int(v))
    cfg = model_dir / "tokenizer_config.json"
    if cfg.is_file() and json.loads(cfg.read_text()).get("chat_template"):
        writer.add_chat_template(json.loads(cfg.read_text())["chat_template"])
    return True


def export_gguf(model_dir: str | Path, out_file: str | Path, gguf_type: str = "bf16") -> dict:
    """Write `out_file` from the HF folder `model_dir`; returns a summary (arch, type, tensors, bytes)."""
    if gguf_type not in GGUF_TYPES:
        raise ValueError(f"--type {gguf_type!r}: choose one of {', '.join(GGUF_TYPES)}")
    model_dir, out_file = Path(model_dir), Path(out_file)
    hf = read_hf_config(model_dir)
    arch = ARCH.get(hf.get("model_type"))
    if arch is None:
        raise ValueError(f"{model_dir}: model_type {hf.get('model_type')!r} has no GGUF mapping here "
                         f"(supported: {', '.join(ARCH)})")
    model = load_pretrained(model_dir, dtype="float32", device="cpu")
    state = _float_state(model)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(f".{out_file.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    _add_hparams(writer, model_dir, model.config, gguf_type)
    has_tokenizer = _add_tokenizer(writer, model_dir, hf)
    counts = _add_tensors(writer, state, model_dir, arch, model.config, gguf_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out_file)
    return {"file": str(out_file), "arch": arch, "type": gguf_type, "tensors": counts, "tokenizer": has_tokenizer,
            "bytes": out_file.stat().st_size}


def _float_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state with every quantized linear dequantized (GGUF re-quantizes in its own blocks)."""
    state = {k: v for k, v in model.state_dict().items()}
    for parent, name, q in quantized_linears(model):  # compressed-tensors: write the dequantized weights
        prefix = next(k for k, m in model.named_modules() if m is q)
        state.pop(f"{prefix}.qweight"), state.pop(f"{prefix}.weight_scale")
        state[f"{prefix}.weight"] = q.dequantized_weight()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # llama.cpp reuses token_embd when output is absent
    return state


def _add_hparams(writer, model_dir: Path, c, gguf_type: str) -> None:
    """llama.cpp's architecture keys from the model config, and the file type."""
    writer.add_name(model_dir.name)
    for add, value in ((writer.add_context_length, c.max_position_embeddings),
                       (writer.add_embedding_length, c.hidden_size), (writer.add_block_count, c.num_hidden_layers),
                       (writer.add_feed_forward_length, c.intermediate_size),
                       (writer.add_head_count, c.num_attention_heads), (writer.add_head_count_kv, c.num_key_value_heads),
                       (writer.add_key_length, c.head_dim), (writer.add_value_length, c.head_dim),
                       (writer.add_rope_dimension_count, c.head_dim), (writer.add_rope_freq_base, c.rope_theta),
                       (writer.add_layer_norm_rms_eps, c.rms_norm_eps), (writer.add_vocab_size, c.vocab_size)):
        add(value)
    if c.rope_scaling and c.rope_scaling.get("rope_type") == "llama3":
        raise ValueError(f"{model_dir}: llama3 RoPE scaling is not exported to GGUF yet (it needs rope_freqs)")
    ftype = {"bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
             "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "f32": gguf.LlamaFileType.ALL_F32}[gguf_type]
    writer.add_file_type(ftype)


def _add_tensors(writer, state: dict[str, torch.Tensor], model_dir: Path, arch: str, c,
                 gguf_type: str) -> dict[str, int]:
    """Every tensor under its GGUF name (q/k rows permuted for GGML's RoPE); returns counts per type."""
    names = tensor_names(c.num_hidden_layers)
    counts: dict[str, int] = {}
    for name, t in state.items():
        if name not in names:
            raise ValueError(f"{model_dir}: tensor {name} has no GGUF name")
        t = t.float()
        if arch in PERMUTED and name.endswith(("q_proj.weight", "q_proj.bias")):
            t = permute_qk(t, c.num_attention_heads)
        elif arch in PERMUTED and name.endswith(("k_proj.weight", "k_proj.bias")):
            t = permute_qk(t, c.num_key_value_heads)
        qtype = _qtype(gguf_type, t)
        data = t.numpy()
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(names[name], data.astype(np.float32))
        else:
            writer.add_tensor(names[name], gguf.quants.quantize(data, qtype), raw_dtype=qtype)  # bytes: shape from them
        counts[qtype.name] = counts.get(qtype.name, 0) + 1
    return counts


def read_gguf(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """Read back: (metadata fields as Python values where scalar, tensors dequantized to float32 in our
    orientation, (out, in) for matrices)."""
    reader = gguf.GGUFReader(str(path))
    fields = {}
    for key, f in reader.fields.items():
        if len(f.types) == 1 and f.types[0] != gguf.GGUFValueType.ARRAY:
            v = f.parts[f.data[0]]
            fields[key] = bytes(v).decode() if f.types[0] == gguf.GGUFValueType.STRING else v.tolist()[0]
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))  # GGUF lists dims fastest-first
        tensors[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    return fields, tensors


def main(model_dir: Path, out_file: Path, type: str = "bf16") -> None:  # noqa: A002 (the CLI's word)
    print(json.dumps(export_gguf(model_dir, out_file, type), indent=2))


if __name__ == "__main__":
    typer.run(main)
