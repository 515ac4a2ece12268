"""Load a llama.cpp `.gguf` file as a lmforge model, from the one parse every reader shares (`gguf_file`).

What a llama.cpp user has is one file: `LLM(model="model-q4_0.gguf")` and `lmforge serve model.gguf`
come here (through `lmforge.quant.load_pretrained`). Each tensor keeps what it is:

  * the block types people download (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) become
    `QuantizedLinear`s holding the same codes, scales and zeros, repacked from the file's blocks without
    requantization (`gguf_types`: the dequantized weight equals llama.cpp's bit for bit), so the
    engine runs them on its integer kernels where they take the layout;
  * F32 / F16 / BF16 tensors load as floats in the model's dtype;
  * other types (Q2_K, Q3_K, IQ*, ...) are dequantized at load with `gguf.quants.dequantize`, with a
    warning naming the type; the summary names how many tensors took each path;
  * an embedding stored as codes is dequantized (a lookup, not a matmul); when it is tied, the LM head
    keeps the codes (its own `QuantizedLinear`), as llama.cpp runs it.

Llama/Mistral q and k rows are stored in GGML's interleaved RoPE order and are un-permuted here
(row permutations: a group lies inside one row, so codes, scales and zeros move with their row).
The architecture comes from the file's metadata (`general.architecture`, `<arch>.block_count`, ...).
A tensor whose shape disagrees with the metadata is an error naming both. This module knows nothing
about tokenizers (`lmforge.tokenizer.gguf` reads the vocabulary from the same parse), the engine or
serving.

    from lmforge.quant import load_pretrained
    model = load_pretrained("models/tiny/model-q8_0.gguf", dtype="float32", device="cpu")

Shape legend: N output features (rows), K input features.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import torch

from lmforge.model import ModelConfig, Transformer
from lmforge.model import checkpoint

from .gguf_file import GGUFError, GGUFFile, TensorInfo, open_gguf
from .gguf_types import ROWS_F32, UNPACK, GroupCodes
from .linear import QuantizedEmbedding, QuantizedLinear

Q = gguf.GGMLQuantizationType
log = logging.getLogger("lmforge.quant")
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # HF model_type -> GGUF
MODEL_TYPE = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # GGUF architecture -> HF model_type
PERMUTED = ("llama",)  # GGML's llama RoPE rotates interleaved pairs; HF's rotates halves
FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)


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


def _float(f: GGUFFile, t: TensorInfo) -> torch.Tensor:
    """Any tensor as float32 in our orientation ((out, in) for matrices): stored floats as they are, block
    types through their unpacker (`scale * code + zero`, bit for bit llama.cpp's dequantization), other
    types through `gguf.quants.dequantize`."""
    data = f.tensor_data(t.name)
    if t.type == Q.F32:
        out = data.view(np.float32)
    elif t.type == Q.F16:
        out = data.view(np.float16).astype(np.float32)
    elif t.type == Q.BF16:
        return torch.from_numpy(data.view(np.int16).copy()).view(torch.bfloat16).float().reshape(t.shape)
    elif t.type in UNPACK:
        out = UNPACK[t.type](data).dequantize()
    else:
        out = gguf.quants.dequantize(data.reshape(-1), t.type)
    return torch.from_numpy(np.array(out, dtype=np.float32, copy=True)).reshape(t.shape)


def _codes_state(g: GroupCodes, module: str, heads: int | None) -> dict[str, torch.Tensor]:
    """A `QuantizedLinear`'s buffers from unpacked codes; q/k rows un-permuted (a group lies in one row,
    so codes, scales and zeros move with their row)."""
    parts = {"qweight": g.codes, "weight_scale": g.scale, "weight_zero": g.zero, "weight_scale_super": g.scale_super,
             "weight_zero_super": g.zero_super}
    parts = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in parts.items() if v is not None}
    return {f"{module}.{k}": (unpermute_qk(v, heads) if heads else v).contiguous() for k, v in parts.items()}


class BlockEmbedding(torch.nn.Module):
    """A token embedding kept as the file's blocks, one row of bytes a token: a lookup unpacks only the rows it
    reads (`gguf_types`, the same unpacker as the matrices: `gguf.quants.dequantize`'s values bit for bit) and
    casts them to `dtype`. Nothing is repacked into the kernels' layout, which only a matmul reads (a Q6_K table of
    49,152 x 2,048 took 0.37 s to repack). The random 300M's Q4_0 table: a one-token lookup ~43 us (72 as a
    `QuantizedEmbedding`), a 512-token prompt's ~4.3 ms; a Q6_K table's 512 rows ~11 ms. Engine only, as
    `QuantizedEmbedding`; a tied table stays the LM head's layer, which needs the kernels' layout."""

    def __init__(self, blocks: np.ndarray, qtype: gguf.GGMLQuantizationType, dim: int, dtype: torch.dtype,
                 device: str | torch.device = "cpu"):
        super().__init__()
        self.qtype, self.dtype = qtype, dtype
        # a copy: `blocks` is a view of the file's map, which the loader releases
        self.register_buffer("blocks", torch.from_numpy(np.array(blocks)).to(device), persistent=False)
        self.num_embeddings, self.embedding_dim = blocks.shape[0], dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.blocks.device.type == "cpu" and self.qtype in ROWS_F32:  # Q4_0 / Q8_0: a direct row lookup
            w = torch.from_numpy(ROWS_F32[self.qtype](self.blocks.numpy()[ids.reshape(-1).cpu().numpy()]))
            return w.to(self.dtype).to(ids.device).reshape(*ids.shape, w.shape[1])
        rows = self.blocks[ids.reshape(-1).to(self.blocks.device)].cpu().numpy()
        w = torch.from_numpy(UNPACK[self.qtype](rows).dequantize()).to(self.dtype)
        return w.to(ids.device).reshape(*ids.shape, w.shape[1])

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name} blocks"


def _read_tensors(f: GGUFFile, model: Transformer, arch: str, torch_dtype: torch.dtype,
                  keep_codes: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """Our state dict (with `keep_codes`, quantized linears installed in `model` for every block type with
    an unpacker; else every tensor as floats) and counts of tensors per path taken ('Q4_K codes', 'Q2_K
    dequantized', 'F32', ...)."""
    c = model.config
    by_gguf = {g: ours for ours, g in tensor_names(c.num_hidden_layers).items()}
    linears = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    state, counts, warned = {}, {}, set()
    for t in f.tensors.values():
        name = by_gguf.get(t.name)
        if name is None:
            raise GGUFError(f"{f.path}: tensor {t.name} has no lmforge name (unsupported layout for {arch})")
        module = name.rpartition(".")[0]
        heads = {"q_proj": c.num_attention_heads, "k_proj": c.num_key_value_heads}.get(module.rpartition(".")[2]) \
            if arch in PERMUTED else None
        _check_shape(f, t, model, name)
        if keep_codes and t.type in UNPACK and name == "model.embed_tokens.weight":
            continue  # the lookup table stays codes (`load_gguf`)
        if keep_codes and t.type in UNPACK and module in linears:
            g = UNPACK[t.type](f.tensor_data(t.name))
            _install(model, module, g)
            state.update(_codes_state(g, module, heads))
            kind = f"{t.type.name} codes"
        else:
            w = _float(f, t)
            state[name] = (unpermute_qk(w, heads) if heads else w).to(torch_dtype)
            kind = t.type.name if t.type in FLOAT_TYPES or t.type in UNPACK else f"{t.type.name} dequantized"
            if keep_codes and kind.endswith("dequantized") and module in linears and t.type not in warned:
                warned.add(t.type)
                log.warning("%s: %s tensors have no integer kernel in lmforge; dequantized to %s at load "
                            "(more memory, slower decode)", f.path, t.type.name, str(torch_dtype)[6:])
        counts[kind] = counts.get(kind, 0) + 1
    return state, counts


def _check_shape(f: GGUFFile, t: TensorInfo, model: Transformer, name: str) -> None:
    """The tensor's shape is the one the metadata's config gives (a corrupt header says so, naming both)."""
    try:
        want = tuple(model.get_parameter(name).shape)
    except AttributeError:
        return
    if tuple(t.shape) != want:
        raise GGUFError(f"{f.path}: tensor {t.name} has shape {t.shape}, but the metadata's config needs {want}")


def quantized_linear(g: GroupCodes, bias: bool = False, device: str | torch.device = "cpu") -> QuantizedLinear:
    """A `QuantizedLinear` holding `g` as the loader installs it (tests and benchmarks build layers with it)."""
    N, K = g.codes.shape[0], g.scale.shape[1] * g.scheme.group_size
    q = QuantizedLinear(K, N, g.scheme, bias, torch.float16, device=device, packed=g.packed, scale_per=g.per)
    for name, t in _codes_state(g, "", None).items():
        getattr(q, name.lstrip(".")).copy_(t)
    return q


def _install(model: Transformer, module: str, g: GroupCodes) -> None:
    """`module` (an `nn.Linear` on the meta device) replaced by a `QuantizedLinear` of `g`'s scheme, holding its
    scales as the file does (float16 a block, or int8 under float16 super-block scales)."""
    m = model.get_submodule(module)
    parent_name, _, child = module.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, QuantizedLinear(m.in_features, m.out_features, g.scheme, m.bias is not None,
                                           torch.float16, device=m.weight.device, packed=g.packed, scale_per=g.per))


def file_dtype(path: str | Path) -> tuple[str | None, bool]:
    """(float dtype of the file's matrices or None, whether they are int codes) from `general.file_type`:
    ALL_F32 float32, MOSTLY_F16 float16, MOSTLY_BF16 bfloat16; the block types lmforge keeps as codes
    (`gguf_types.UNPACK`) int codes; others (dequantized at load) float32."""
    return _file_dtype(open_gguf(path).metadata)


CODE_FILE_TYPES = {"MOSTLY_Q8_0", "MOSTLY_Q4_0", "MOSTLY_Q4_1", "MOSTLY_Q5_0", "MOSTLY_Q5_1", "MOSTLY_Q4_K_S",
                   "MOSTLY_Q4_K_M", "MOSTLY_Q5_K_S", "MOSTLY_Q5_K_M", "MOSTLY_Q6_K"}


def _file_dtype(meta: dict) -> tuple[str | None, bool]:
    ftype, F = meta.get("general.file_type"), gguf.LlamaFileType
    floats = {F.ALL_F32: "float32", F.MOSTLY_F16: "float16", F.MOSTLY_BF16: "bfloat16"}
    try:
        name = F(ftype).name
    except ValueError:
        name = None
    if name in CODE_FILE_TYPES:
        return None, True
    return floats.get(ftype, "float32"), False


def load_gguf(path: str | Path, dtype: str | torch.dtype = "auto", device: str | torch.device = "auto",
              keep_codes: bool = True) -> Transformer:
    """The file's model; `dtype="auto"` is the file's float type (`file_dtype`; float32 for quantized
    files). Matrices of a block type with an unpacker (`gguf_types`) keep their codes, the embedding too (a
    `QuantizedEmbedding`; tied, the LM head's layer is its table). `keep_codes=False`:
    every tensor dequantized (bit for bit llama.cpp's), embeddings kept tied (`lmforge convert`).
    `model.gguf_summary` says which tensors kept their codes and which were dequantized."""
    f = open_gguf(path)
    meta = f.metadata
    names = set(f.tensors)
    hf = hf_config(meta, f.path, names)
    tied = "output.weight" not in names
    embd = f.tensors.get("token_embd.weight")
    untie = keep_codes and tied and embd is not None and embd.type in UNPACK  # the LM head runs on the codes
    hf["tie_word_embeddings"] = tied and not untie
    config = ModelConfig.from_hf(hf)
    torch_dtype = checkpoint.resolve_dtype(dtype, _file_dtype(meta)[0] or "float32")
    model = Transformer.on_meta(config)
    state, counts = _read_tensors(f, model, meta["general.architecture"], torch_dtype, keep_codes)
    if untie:
        g = UNPACK[embd.type](f.tensor_data(embd.name))
        _install(model, "lm_head", g)
        state.update(_codes_state(g, "lm_head", None))
        counts[f"{embd.type.name} codes (lm_head, tied)"] = 1
    device = checkpoint.resolve_device(device)
    if keep_codes and embd is not None and embd.type in UNPACK:  # the lookup table stays codes too: the tied
        # head's own layer (stored once), or the file's blocks as they are
        model.model.embed_tokens = (QuantizedEmbedding(model.lm_head, torch_dtype, owns=False) if untie else
                                    BlockEmbedding(f.tensor_data(embd.name), embd.type, config.hidden_size,
                                                   torch_dtype, device))
    state = {k: v.to(device) for k, v in state.items()}
    model = checkpoint.assign_weights(model, state, f.path)
    model.gguf_summary = {"file": str(f.path), "architecture": meta["general.architecture"],
                          "file_type": meta.get("general.file_type"), "tensors": counts, "tied": tied}
    return model
