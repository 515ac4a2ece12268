"""The training loss without the (tokens × vocabulary) logits: LM head + cross-entropy in chunks.

For a small model with a large vocabulary the step's time goes to the logits, not to the layers:
with hidden 128 and vocabulary 8192, 4,096 tokens make a 134 MB float32 logit matrix that
`log_softmax`, its backward, `nll_loss`'s zero-filled gradient and the dtype casts each sweep
through memory (about 60% of a bfloat16 step on 2 CPU cores, torch.profiler). `chunked_lm_loss`
computes the same summed loss chunk by chunk of tokens, and in the same pass the gradient of each
chunk's logits (softmax − one-hot), which it multiplies straight into the gradients of the hidden
states and of the head's weight; a chunk's logits (rows × V float32) stay in cache. The backward
only scales those saved gradients by the incoming scalar (the loss is a sum, so it is linear in
it), as in Liger-Kernel's fused linear cross-entropy.

The numbers are the ones the plain path computes (hidden states and weight in the autocast
dtype, logits and softmax in float32) up to the order of float additions. Knows nothing of the
trainer; `TrainLoss` is the module the trainer calls (and wraps in DDP or `torch.compile`).

    loss_sum = TrainLoss(model)(input_ids, labels, position_ids, doc_ids)  # == token_losses(...).sum()
"""

from __future__ import annotations

import torch
from torch import nn

IGNORE = -100
CHUNK_TOKENS = 256  # 256 x 8192 float32 logits = 8 MB per chunk; 128-512 measured within 5%


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor, dtype: torch.dtype,
                chunk: int) -> torch.Tensor:
        """h and w as given (float32 master weights); matmuls in `dtype`, gradients summed in float32."""
        N = h_ND.shape[0]
        hc_ND, wc_VD = h_ND.to(dtype), w_VD.to(dtype)
        loss = torch.zeros((), dtype=torch.float32, device=h_ND.device)
        grad_h_ND = torch.empty(h_ND.shape, dtype=torch.float32, device=h_ND.device)
        grad_w_VD = torch.zeros(w_VD.shape, dtype=torch.float32, device=w_VD.device)
        for lo in range(0, N, chunk):
            h_CD, labels_C = hc_ND[lo:lo + chunk], labels_N[lo:lo + chunk]
            logprobs_CV = torch.log_softmax(h_CD @ wc_VD.t(), dim=-1, dtype=torch.float32)
            valid_C = labels_C != IGNORE
            target_C = labels_C.clamp(min=0)
            loss -= (logprobs_CV.gather(1, target_C[:, None])[:, 0] * valid_C).sum()
            probs_CV = logprobs_CV.exp_()  # softmax, in place
            rows = torch.arange(len(labels_C), device=h_ND.device)
            probs_CV[rows, target_C] -= 1.0  # d loss / d logits = softmax - one-hot
            probs_CV.mul_(valid_C[:, None])  # ignored positions contribute nothing
            g_CV = probs_CV.to(dtype)
            grad_h_ND[lo:lo + chunk] = g_CV @ wc_VD
            grad_w_VD += (g_CV.t() @ h_CD).float()
        ctx.save_for_backward(grad_h_ND.to(h_ND.dtype), grad_w_VD.to(w_VD.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h_ND, grad_w_VD = ctx.saved_tensors
        return grad_h_ND * grad_loss.to(grad_h_ND.dtype), grad_w_VD * grad_loss.to(grad_w_VD.dtype), None, None, None


def chunked_lm_loss(hidden_BTD: torch.Tensor, weight_VD: torch.Tensor, labels_BT: torch.Tensor,
                    chunk: int = CHUNK_TOKENS) -> torch.Tensor:
    """Summed next-token cross-entropy of `hidden @ weight.T` over the labels != -100, in float32.
    Under autocast the matmuls run in the autocast dtype, as `nn.Linear` would."""
    device = hidden_BTD.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight_VD.dtype
    with torch.autocast(device, enabled=False):
        return _ChunkedLinearCrossEntropy.apply(hidden_BTD.flatten(0, 1), weight_VD, labels_BT.flatten(), dtype,
                                                chunk)


def can_fuse(model: nn.Module) -> bool:
    """A plain bias-free `nn.Linear` LM head (not a LoRA layer) over `hidden_states`."""
    head = getattr(model, "lm_head", None)
    return type(head) is nn.Linear and head.bias is None and hasattr(model, "hidden_states")


class TrainLoss(nn.Module):
    """`forward(input_ids, labels, position_ids, doc_ids)` = the batch's summed training loss, a scalar;
    what DDP and compile wrap."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, labels, position_ids=None, doc_ids=None) -> torch.Tensor:
        h_BTD = self.model.hidden_states(input_ids, position_ids, doc_ids)
        return chunked_lm_loss(h_BTD, self.model.lm_head.weight, labels)
