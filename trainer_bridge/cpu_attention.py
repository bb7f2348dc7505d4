"""Plain PyTorch stand-in for the flash-attention 3 varlen kernel, so AsyncGRPO trains on a CPU.

TRL's tree packing (`trl.experimental.async_grpo.packing`) forwards each micro-batch row as a
prefix trie: the packed row holds every unique token once, cut into segments, and each segment's
queries attend to the keys of its root-to-segment path (gathered end to end by `tree_kv_index`).
It asks `packing._flash_attn()` for a kernel and calls its `flash_attn_varlen_func` with
`cu_seqlens_q` over the segments and `cu_seqlens_k` over the paths, `causal=True`. A path ends
with the segment itself, so the causal mask is aligned to the bottom right, as flash-attention
aligns it whenever a query block is shorter than its key block.
"""

import sys

import torch
import torch.nn.functional as F


def flash_attn_varlen_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention over variable-length segments, with flash-attention's varlen conventions.

    `q` is `(total_q, heads, dim)`, `k` and `v` are `(total_k, kv_heads, dim)`; segment `s` is
    `q[cu_seqlens_q[s]:cu_seqlens_q[s+1]]` against `k[cu_seqlens_k[s]:cu_seqlens_k[s+1]]`.
    Query head `h` reads key/value head `h // (heads // kv_heads)`. `window_size` is `(left,
    right)` in tokens, -1 for unbounded. Returns `(total_q, heads, dim)` (the kernel's output
    without its log-sum-exp, which the tree attention discards).
    """
    if softcap:
        # Logit soft-capping (Gemma 2) would need explicit scores; no model trained here uses it.
        raise NotImplementedError("cpu_attention does not implement softcap")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"{q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    bounds_q = cu_seqlens_q.tolist()
    bounds_k = cu_seqlens_k.tolist()
    outputs = []
    for q0, q1, k0, k1 in zip(
        bounds_q[:-1], bounds_q[1:], bounds_k[:-1], bounds_k[1:], strict=True
    ):
        out = F.scaled_dot_product_attention(
            q[q0:q1].transpose(0, 1),
            k[k0:k1].transpose(0, 1),
            v[k0:k1].transpose(0, 1),
            attn_mask=_segment_mask(q1 - q0, k1 - k0, causal, window_size, q.device),
            scale=softmax_scale,
            enable_gqa=True,
        )
        outputs.append(out.transpose(0, 1))
    return torch.cat(outputs) if outputs else q.new_empty(q.shape)


def _segment_mask(
    len_q: int, len_k: int, causal: bool, window_size: tuple[int, int], device: torch.device
) -> torch.Tensor | None:
    """Boolean `(len_q, len_k)` mask, True where a query may attend; None when it sees everything.

    Query `i` sits at key position `i + len_k - len_q` (bottom-right alignment). A query that may
    attend to no key gets a zero output, as in flash-attention.
    """
    left, right = window_size
    if causal:
        right = 0
    if left < 0 and right < 0:
        return None
    query_pos = torch.arange(len_q, device=device)[:, None] + (len_k - len_q)
    key_pos = torch.arange(len_k, device=device)[None, :]
    mask = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if right >= 0:
        mask &= key_pos <= query_pos + right
    if left >= 0:
        mask &= key_pos >= query_pos - left
    return mask


def _no_peak_flops(*_args, **_kwargs) -> None:
    # The trainer reads the peak FLOPs from the CUDA device name; None just turns MFU logging off.
    return None


def install_cpu_attention() -> bool:
    """Route AsyncGRPO's tree attention to this module when there is no CUDA device.

    Returns whether it patched anything. Safe to call any number of times.
    """
    if torch.cuda.is_available():
        return False
    from trl.experimental.async_grpo import async_grpo_trainer, packing

    packing._flash_attn = _this_module
    async_grpo_trainer.get_peak_flops_per_device = _no_peak_flops  # pyright: ignore[reportPrivateImportUsage]
    return True


def _this_module():
    return sys.modules[__name__]
