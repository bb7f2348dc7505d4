import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from trl.experimental.async_grpo import async_grpo_trainer, packing

from trainer_bridge import cpu_attention
from trainer_bridge.cpu_attention import flash_attn_varlen_func, install_cpu_attention

HEADS = [(1, 1), (2, 1), (4, 1), (4, 2), (6, 3), (2, 2)]


def reference_segment(q, k, v, scale, causal, window):
    """Explicit softmax(QK^T)V for one segment, head by head, with a bottom-right aligned mask."""
    len_q, heads, _ = q.shape
    len_k, kv_heads, _ = k.shape
    group = heads // kv_heads
    left, right = window
    if causal:
        right = 0
    out = torch.zeros_like(q)
    for h in range(heads):
        kh, vh = k[:, h // group], v[:, h // group]
        scores = (q[:, h] @ kh.T) * scale
        for i in range(len_q):
            pos = i + len_k - len_q
            allowed = [
                (right < 0 or j <= pos + right) and (left < 0 or j >= pos - left)
                for j in range(len_k)
            ]
            if not any(allowed):
                continue
            row = scores[i].masked_fill(~torch.tensor(allowed), -math.inf)
            out[i, h] = torch.softmax(row, dim=0) @ vh
    return out


@st.composite
def varlen_case(draw):
    heads, kv_heads = draw(st.sampled_from(HEADS))
    dim = draw(st.sampled_from([4, 8, 16]))
    lengths = draw(
        st.lists(st.tuples(st.integers(1, 9), st.integers(0, 6)), min_size=1, max_size=5)
    )
    # Each segment: len_q queries against len_q + extra keys (a path is never shorter than its
    # segment in the tree packing, and extra > 0 is the "q shorter than k" case).
    seg = [(lq, lq + extra) for lq, extra in lengths]
    causal = draw(st.booleans())
    window = draw(st.sampled_from([(-1, -1), (2, -1), (0, 0), (3, 1), (-1, 2)]))
    scale = draw(st.one_of(st.none(), st.floats(0.05, 2.0)))
    seed = draw(st.integers(0, 2**31 - 1))
    return heads, kv_heads, dim, seg, causal, window, scale, seed


@settings(max_examples=80, deadline=None)
@given(varlen_case())
def test_matches_explicit_attention_per_segment(case):
    heads, kv_heads, dim, seg, causal, window, scale, seed = case
    gen = torch.Generator().manual_seed(seed)
    total_q = sum(lq for lq, _ in seg)
    total_k = sum(lk for _, lk in seg)
    q = torch.randn(total_q, heads, dim, generator=gen, dtype=torch.float64)
    k = torch.randn(total_k, kv_heads, dim, generator=gen, dtype=torch.float64)
    v = torch.randn(total_k, kv_heads, dim, generator=gen, dtype=torch.float64)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum([lq for lq, _ in seg])]), dtype=torch.int32)
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum([lk for _, lk in seg])]), dtype=torch.int32)

    out = flash_attn_varlen_func(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lq for lq, _ in seg),
        max(lk for _, lk in seg),
        softmax_scale=scale,
        causal=causal,
        window_size=window,
    )

    used_scale = scale if scale is not None else 1 / math.sqrt(dim)
    expected = torch.cat(
        [
            reference_segment(q[a:b], k[c:d], v[c:d], used_scale, causal, window)
            for a, b, c, d in zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:], strict=True)
        ]
    )
    assert out.shape == (total_q, heads, dim)
    torch.testing.assert_close(out, expected, rtol=1e-9, atol=1e-9)


def test_query_block_shorter_than_keys_sees_the_whole_prefix():
    # One query against 5 keys with causal=True: bottom-right alignment lets it read all 5.
    # A top-left aligned mask would restrict it to key 0 and return v[0] exactly.
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 8, generator=gen)
    k = torch.randn(5, 1, 8, generator=gen)
    v = torch.randn(5, 1, 8, generator=gen)
    out = flash_attn_varlen_func(
        q, k, v, torch.tensor([0, 1]), torch.tensor([0, 5]), 1, 5, causal=True
    )
    weights = torch.softmax(torch.einsum("hd,kd->hk", q[0], k[:, 0]) / math.sqrt(8), dim=-1)
    torch.testing.assert_close(out[0], weights @ v[:, 0])
    assert not torch.allclose(out[0], v[0, 0].expand(2, 8))


def test_gradients_flow_to_queries_keys_and_values():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(7, 4, 8, generator=gen, requires_grad=True)
    k = torch.randn(9, 1, 8, generator=gen, requires_grad=True)
    v = torch.randn(9, 1, 8, generator=gen, requires_grad=True)
    out = flash_attn_varlen_func(
        q, k, v, torch.tensor([0, 3, 7]), torch.tensor([0, 3, 9]), 4, 6, causal=True
    )
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0


def test_softcap_is_refused_rather_than_ignored():
    x = torch.randn(2, 1, 4)
    with pytest.raises(NotImplementedError):
        flash_attn_varlen_func(
            x, x, x, torch.tensor([0, 2]), torch.tensor([0, 2]), 2, 2, softcap=30.0
        )


def test_install_patches_the_trainer_seams_idempotently():
    assert install_cpu_attention() is True
    assert install_cpu_attention() is True
    assert packing._flash_attn() is cpu_attention
    assert async_grpo_trainer.get_peak_flops_per_device(None, "float32") is None


def _sample(ids, group_id=0):
    ids = np.asarray(ids, dtype=np.int64)
    return {
        "input_ids": ids,
        "completion_mask": np.ones_like(ids),
        "old_log_probs": np.zeros(len(ids), dtype=np.float32),
        "advantage": 0.0,
        "group_id": group_id,
        "metrics": {},
    }


@st.composite
def shared_prefix_samples(draw):
    """Samples that share prefixes (a prompt, then forks), so the trie has real branches."""
    prompt = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
    samples = []
    for _ in range(draw(st.integers(1, 5))):
        fork_at = draw(st.integers(0, len(prompt)))
        tail = draw(st.lists(st.integers(0, 5), min_size=1, max_size=6))
        samples.append(prompt[:fork_at] + tail)
    return samples


@settings(max_examples=40, deadline=None)
@given(shared_prefix_samples(), st.sampled_from(HEADS), st.integers(0, 2**31 - 1))
def test_tree_attention_over_packed_trie_matches_each_sample_alone(samples, heads_kv, seed):
    """Drive TRL's own packing and tree_attention with this kernel installed: every token of the
    packed trie must see exactly what it saw in its own unpacked sample."""
    install_cpu_attention()
    heads, kv_heads = heads_kv
    dim = 8
    row = packing.TreeRow()
    for ids in samples:
        row.add(_sample(ids))
    packed = row.pack()
    n = len(packed["input_ids"])
    gen = torch.Generator().manual_seed(seed)
    # (batch=1, heads, tokens, dim) as the model hands it to the attention interface.
    q = torch.randn(1, heads, n, dim, generator=gen)
    k = torch.randn(1, kv_heads, n, dim, generator=gen)
    v = torch.randn(1, kv_heads, n, dim, generator=gen)
    max_q, max_k = packed["tree_max_seqlens"].tolist()
    # The module only tells tree_attention the weight dtype (through its Linear layers).
    module = torch.nn.Linear(1, 1)
    module.config = SimpleNamespace()
    out, _ = packing.tree_attention(
        module,
        q,
        k,
        v,
        None,
        tree_kv_index=packed["tree_kv_index"],
        tree_cu_seqlens_q=packed["tree_cu_seqlens_q"],
        tree_cu_seqlens_k=packed["tree_cu_seqlens_k"],
        tree_max_seqlen_q=max_q,
        tree_max_seqlen_k=max_k,
        scaling=dim**-0.5,
    )
    out = out[0]  # (tokens, heads, dim)
    # Every token but the first is trained, so token_index lists, per sample, the packed
    # positions of its tokens 0..L-2 in order: the sample's own causal sequence in the trie.
    for i, ids in enumerate(samples):
        positions = packed["token_index"][packed["segment_id"] == i]
        assert len(positions) == len(ids) - 1
        if len(positions) == 0:
            continue
        qs, ks, vs = (t[0].transpose(0, 1)[positions] for t in (q, k, v))
        expected = reference_segment(qs, ks, vs, dim**-0.5, True, (-1, -1))
        torch.testing.assert_close(out[positions], expected, rtol=1e-5, atol=1e-5)
