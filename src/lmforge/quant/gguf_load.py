"""Load a llama.cpp `.gguf` file as a lmforge model, with the `gguf` package's reader.

What a llama.cpp user has is one file: `LLM(model="model-q4_0.gguf")` and `lmforge serve model.gguf`
come here (through `lmforge.quant.load_pretrained`). Each tensor keeps what it is:

  * Q8_0 (blocks of 32 int8 codes + an f16 scale) and Q4_0 (blocks of 32 4-bit codes stored u + 8
    + an f16 scale) become `QuantizedLinear`s with `QuantScheme(8, 32)` / `QuantScheme(4, 32)`: the
    same codes and scales, repacked into our layout (no requantization), so the engine runs them on
    its integer kernels (`lmf_qmm_f32` / `lmf_qmm_a8`) and the dequantized weight is llama.cpp's.
  * F32 / F16 / BF16 tensors load as floats in the model's dtype.
  * every other type (K-quants: Q4_K, Q5_K, Q6_K, ...; Q5_0, IQ*) is dequantized at load with
    `gguf.quants.dequantize` into a float weight of the model's dtype (the nearest lmforge format
    that keeps its values: requantizing 6-bit K blocks to our 4/8-bit would change them). The summary
    names how many tensors took each path.
  * an embedding stored quantized is dequantized (a lookup, not a matmul).

Llama/Mistral q and k rows are stored in GGML's interleaved RoPE order and are un-permuted here
(row permutations: a block of 32 lies inside one row, so codes and scales move with their row).
The architecture comes from the file's metadata (`general.architecture`, `<arch>.block_count`, ...).
This module knows nothing about tokenizers (lmforge.tokenizer.load reads the vocabulary), the
engine or serving.

    from lmforge.quant import load_pretrained
    model = load_pretrained("models/tiny/model-q8_0.gguf", dtype="float32", device="cpu")

Shape legend: N output features (rows), K input features, B blocks of 32 a row.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from lmforge.model import ModelConfig, Transformer
from lmforge.model import checkpoint

from .linear import QuantizedLinear
from .scheme import QuantScheme

Q = gguf.GGMLQuantizationType
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # HF model_type -> GGUF
MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF architecture -> HF model_type
PERMUTED = ("llama",)  # GGML's llama RoPE rotates interleaved pairs; HF's rotates halves
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)
CODE_TYPES = {Q.Q8_0: QuantScheme(8, 32), Q.Q4_0: QuantScheme(4, 32)}  # run on the integer kernels as stored


def tensor_names(layers: int) -> dict[str, str]:
    """Our (HF) parameter names -> GGUF names, from gguf's own table."""
    T, M = gguf.TENSOR_NAMES, gguf.MODEL_TENSOR
    out = {"model.embed_tokens.weight": T[M.TOKEN_EMBD] + ".weight", "model.norm.weight": T[M.OUTPUT_NORM] + ".weight",
           "lm_head.weight": T[M.OUTPUT] + ".weight"}
    per = {"input_layernorm": M.ATTN_NORM, "self_attn.q_proj": M.ATTN_Q, "self_attn.k_proj": M.ATTN_K,
           "self_attn.v_proj": M.ATTN_V, "self_attn.o_proj": M.ATTN_OUT, "post_attention_layernorm": M.FFN_NORM,
           "mlp.gate_proj": M.FFN_GATE, "mlp.up_proj": M.FFN_UP, "mlp.down_proj": M.FFN_DOWN,
           "self_attn.q_norm": M.ATTN_Q_NORM, "self_attn.k_norm": M.ATTN_K_NORM}
    for i in range(layers):
        for ours, t in per.items():
            for suffix in ("weight", "bias"):
                out[f"model.layers.{i}.{ours}.{suffix}"] = T[t].format(bid=i) + f".{suffix}"
    return out


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of each head from [first halves | second halves] to interleaved pairs (GGML's NORM RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def metadata(reader: gguf.GGUFReader) -> dict:
    """Scalar and string fields as Python values; arrays of strings or numbers as lists."""
    out = {}
    for key, f in reader.fields.items():
        if not f.types:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            if len(f.types) > 1 and f.types[1] == gguf.GGUFValueType.STRING:
                out[key] = [bytes(f.parts[i]).decode("utf-8", "replace") for i in f.data]
            else:
                out[key] = [f.parts[i].tolist()[0] for i in f.data]
        else:
            v = f.parts[f.data[0]]
            out[key] = bytes(v).decode("utf-8", "replace") if f.types[0] == gguf.GGUFValueType.STRING \
                else v.tolist()[0]
    return out


def hf_config(meta: dict, path: Path, tensors: set[str] = frozenset()) -> dict:
    """A `config.json` dict from llama.cpp's architecture keys (`tensors`: the file's tensor names); a
    missing key, or RoPE scaling we do not read, is an error naming it."""
    arch = meta.get("general.architecture")
    if arch not in MODEL_TYPE:
        raise ValueError(f"{path}: general.architecture={arch!r}; lmforge loads GGUF {', '.join(MODEL_TYPE)} models")

    def need(key: str):
        if f"{arch}.{key}" not in meta:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.{key}; the file is not a complete {arch} model")
        return meta[f"{arch}.{key}"]

    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None) or "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: RoPE scaling ({arch}.rope.scaling.type={scaling!r} or a rope_freqs tensor, as "
                         "Llama 3.1+ files have) is not read from GGUF yet; load the Hugging Face folder instead")
    heads, hidden = need("attention.head_count"), need("embedding_length")
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or ()) or None
    if vocab is None:
        raise ValueError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    hf = {"model_type": MODEL_TYPE[arch], "vocab_size": vocab, "hidden_size": hidden,
          "intermediate_size": need("feed_forward_length"), "num_hidden_layers": need("block_count"),
          "num_attention_heads": heads, "num_key_value_heads": meta.get(f"{arch}.attention.head_count_kv", heads),
          "head_dim": meta.get(f"{arch}.attention.key_length", hidden // heads),
          "max_position_embeddings": meta.get(f"{arch}.context_length", 2048),
          "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
          "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0)}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if f"tokenizer.ggml.{key}" in meta:
            hf[key] = meta[f"tokenizer.ggml.{key}"]
    return hf


def _codes(t) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 / Q4_0 blocks as (codes int8 (N, K), scales float32 (N, B)): the stored values, repacked.
    Q8_0 block: f16 d, 32 int8. Q4_0 block: f16 d, 16 bytes; byte j holds element j (low nibble) and
    element j + 16 (high nibble), each stored as code + 8 (llama.cpp's dequantize_row_q4_0)."""
    N, K = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims fastest-first
    block = np.asarray(t.data, dtype=np.uint8).reshape(N, K // 32, -1)  # (N, B, bytes a block)
    d_NB = block[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
    if t.tensor_type == Q.Q8_0:
        q_NK = block[..., 2:].copy().view(np.int8).reshape(N, K)
    else:
        qs = block[..., 2:]
        q_NK = (np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int8) - 8).reshape(N, K)
    return torch.from_numpy(q_NK), torch.from_numpy(d_NB)


def _float(t) -> torch.Tensor:
    """Any tensor as float32 in our orientation ((out, in) for matrices): stored floats as they are,
    every other type dequantized with `gguf.quants.dequantize`."""
    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    data = np.asarray(t.data)
    if t.tensor_type == Q.F32:
        out = data.astype(np.float32)
    elif t.tensor_type == Q.F16:
        out = data.view(np.float16).astype(np.float32)
    else:  # BF16 and every quantized type: gguf's reference dequantization
        out = gguf.quants.dequantize(data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(shape).astype(np.float32))


def _read_tensors(reader: gguf.GGUFReader, model: Transformer, arch: str, path: Path,
                  torch_dtype: torch.dtype) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Our state dict (quantized linears installed in `model` for Q8_0 / Q4_0 matrices) and counts of
    tensors per path taken ('Q8_0 codes', 'Q6_K dequantized', 'F32', ...)."""
    c = model.config
    by_gguf = {g: ours for ours, g in tensor_names(c.num_hidden_layers).items()}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    state, counts = {}, {}
    for t in reader.tensors:
        name = by_gguf.get(t.name)
        if name is None:
            raise ValueError(f"{path}: tensor {t.name} has no lmforge name (unsupported layout for {arch})")
        module = name.rpartition(".")[0]
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(module.rpartition(".")[2]) \
            if arch in PERMUTED else None
        if t.tensor_type in CODE_TYPES and module in linears and int(t.shape[0]) % 32 == 0:
            q_NK, d_NB = _codes(t)
            if heads:
                q_NK, d_NB = unpermute_qk(q_NK, heads), unpermute_qk(d_NB, heads)
            _install(model, module, CODE_TYPES[t.tensor_type])
            state[f"{module}.qweight"], state[f"{module}.weight_scale"] = q_NK.contiguous(), d_NB.contiguous()
            kind = f"{t.tensor_type.name} codes"
        else:
            w = _float(t)
            state[name] = (unpermute_qk(w, heads) if heads else w).to(torch_dtype)
            kind = t.tensor_type.name if t.tensor_type in FLOAT_TYPES else f"{t.tensor_type.name} dequantized"
        counts[kind] = counts.get(kind, 0) + 1
    return state, counts


def _install(model: Transformer, module: str, scheme: QuantScheme) -> None:
    """`module` (an `nn.Linear` on the meta device) replaced by a `QuantizedLinear` with float32 scales
    (an f16 scale is exact in float32)."""
    m = model.get_submodule(module)
    parent_name, _, child = module.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, QuantizedLinear(m.in_features, m.out_features, scheme, m.bias is not None,
                                           torch.float32, device=m.weight.device))


def file_dtype(path: str | Path) -> tuple[str | None, bool]:
    """(float dtype of the file's matrices or None, whether they are int codes) from `general.file_type`:
    ALL_F32 float32, MOSTLY_F16 float16, MOSTLY_BF16 bfloat16; Q8_0 / Q4_0 int codes; K-quants and
    others (dequantized at load) float32."""
    return _file_dtype(metadata(gguf.GGUFReader(str(path))))


def _file_dtype(meta: dict) -> tuple[str | None, bool]:
    ftype, F = meta.get("general.file_type"), gguf.LlamaFileType
    floats = {F.ALL_F32: "float32", F.MOSTLY_F16: "float16", F.MOSTLY_BF16: "bfloat16"}
    if ftype in (F.MOSTLY_Q8_0, F.MOSTLY_Q4_0):
        return None, True
    return floats.get(ftype, "float32"), False


def load_gguf(path: str | Path, dtype: str | torch.dtype = "auto",
              device: str | torch.device = "auto") -> Transformer:
    """The file's model; `dtype="auto"` is the file's float type (`file_dtype`; float32 for quantized
    files). `model.gguf_summary` says which tensors kept their codes and which were dequantized."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a readable GGUF file ({e})") from e
    meta = metadata(reader)
    names = {t.name for t in reader.tensors}
    hf = hf_config(meta, path, names)
    hf["tie_word_embeddings"] = "output.weight" not in names
    config = ModelConfig.from_hf(hf)
    torch_dtype = checkpoint.resolve_dtype(dtype, _file_dtype(meta)[0] or "float32")
    with torch.device("meta"):
        model = Transformer(config)
    state, counts = _read_tensors(reader, model, meta["general.architecture"], path, torch_dtype)
    device = checkpoint.resolve_device(device)
    state = {k: v.to(device) for k, v in state.items()}
    model = checkpoint.assign_weights(model, state, path)
    model.gguf_summary = {"file": str(path), "architecture": meta["general.architecture"],
                          "file_type": meta.get("general.file_type"), "tensors": counts}
    return model
