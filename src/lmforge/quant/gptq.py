"""GPTQ (Frantar et al. 2022, "Accurate Post-Training Quantization for Generative Pre-trained
Transformers"): quantize a weight matrix column by column, each column's rounding error pushed onto
the columns not yet quantized through the inverse Hessian of the layer's inputs, H = 2 XᵀX / n.

Calibration: the model runs (float32) over a few sequences from `python-docs` or a JSONL file's
`text` field; forward hooks on every decoder projection accumulate XᵀX. All projections see the
*unquantized* model's activations (one forward pass, not the layer-by-layer sequential variant; on
the small models this project trains that is the cheap choice: one pass). Scales are RTN's (absmax
per output channel or group), each computed when its group's first column is reached, from the
weights as the earlier columns' errors left them (the reference implementation without
`static_groups`); the stored layout stays plain compressed-tensors, no g_idx.
This module knows nothing about files beyond reading the calibration text.

    codes = gptq_codes(model_dir, state, scheme, calibration="python-docs", samples=64, seq_len=256)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lmforge.data.sources import iter_python_docs
from lmforge.tokenizer.load import load_tokenizer

from .load import load_pretrained
from .scheme import QuantScheme, compute_scales
from .targets import is_quantizable

DAMP = 0.01  # fraction of mean(diag(H)) added to H's diagonal (the paper's percdamp)
BLOCK = 128  # columns updated together (lazy batch updates)


def gptq_quantize(w_NK: torch.Tensor, h_KK: torch.Tensor, scheme: QuantScheme,
                  scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 (N, K), scales (N, G)) minimizing ||X W^T - X W'^T|| greedily column by column."""
    W = w_NK.float().clone()
    N, K = W.shape
    H = h_KK.float().clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0
    H += torch.eye(K) * DAMP * torch.diag(H).mean()
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    gs = scheme.group_size or K
    G = K // gs
    scales = torch.empty(N, G, dtype=scale_dtype)
    Q = torch.empty(N, K, dtype=torch.int8)
    for b0 in range(0, K, BLOCK):
        b1 = min(b0 + BLOCK, K)
        W1, Err = W[:, b0:b1].clone(), torch.zeros(N, b1 - b0)
        for i in range(b1 - b0):
            col = b0 + i
            if col % gs == 0:  # a new group: its scale from the weights as they are now
                g = col // gs
                block = torch.cat([W1[:, i:], W[:, b1:]], dim=1)[:, :gs]
                scales[:, g] = compute_scales(block, QuantScheme(scheme.num_bits, None), scale_dtype)[:, 0]
            s = scales[:, col // gs].float()
            w = W1[:, i]
            q = torch.round(w / s).clamp_(scheme.qmin, scheme.qmax)
            Q[:, col] = q.to(torch.int8)
            err = (w - q * s) / Hinv[col, col]
            W1[:, i:] -= err[:, None] * Hinv[col, col:b1][None, :]
            Err[:, i] = err
        W[:, b0:b1] = W1
        W[:, b1:] -= Err @ Hinv[b0:b1, b1:]
    return Q, scales


def calibration_texts(source: str, samples: int) -> list[str]:
    if source == "python-docs":
        texts = []
        for doc in iter_python_docs():
            texts.append(doc["text"])
            if len(texts) >= samples:
                break
        return texts
    path = Path(source)
    if not path.is_file():
        raise FileNotFoundError(f"--calibration {source}: not python-docs and not a file")
    texts = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            obj = json.loads(line)
            if not isinstance(obj.get("text"), str):
                raise ValueError(f"{path}:{i}: each line needs a string 'text' field")
            texts.append(obj["text"])
        if len(texts) >= samples:
            break
    if not texts:
        raise ValueError(f"{path}: no calibration texts")
    return texts


def hessians(model: torch.nn.Module, batches: list[torch.Tensor], names: set[str]) -> dict[str, torch.Tensor]:
    """2 XᵀX / n for the input X of every nn.Linear whose weight name is in `names`."""
    acc: dict[str, list] = {}
    hooks = []
    for mod_name, mod in model.named_modules():
        if f"{mod_name}.weight" in names:
            def hook(m, inp, out, key=f"{mod_name}.weight"):
                x = inp[0].detach().reshape(-1, inp[0].shape[-1]).float()
                h, n = acc.get(key, (0, 0))
                acc[key] = (h + 2 * x.t() @ x, n + x.shape[0])
            hooks.append(mod.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for ids in batches:
                model(ids)
    finally:
        for h in hooks:
            h.remove()
    return {k: h / n for k, (h, n) in acc.items()}


def gptq_codes(model_dir: str | Path, state: dict[str, torch.Tensor], scheme: QuantScheme, calibration: str,
               samples: int = 64, seq_len: int = 256, names: set[str] | None = None) -> dict:
    """weight name -> (codes, scales) for every quantizable weight of `state`, by GPTQ on `calibration`."""
    tok = load_tokenizer(Path(model_dir), optional=True)
    if tok is None:
        raise ValueError(f"{model_dir}: GPTQ needs the model's tokenizer to encode the calibration text")
    ids = [tok.encode(t)[:seq_len] for t in calibration_texts(calibration, samples)]
    batches = [torch.tensor([i]) for i in ids if len(i) > 1]
    model = load_pretrained(model_dir, dtype="float32", device="cpu")
    names = names or {k for k in state if is_quantizable(k)}
    hs = hessians(model, batches, names)
    return {k: gptq_quantize(state[k], hs[k], scheme, state[k].dtype) for k in sorted(names)}
