"""The compiled CPU kernels (`lmforge.engine.kernels`): paged decode attention and the K/V write
agree with the torch paths, in both the vectorized and the portable build; without a compiler (or
with LMFORGE_KERNELS=0) the engine falls back to torch and says so."""

import random

import pytest
import torch

from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.engine.attention import KernelBackend, KVPool, SdpaBackend

from hf_models import save_hf_model

HAVE_CC = kernels._compiler() is not None


def _case(rng, N, K, H, B, lens, reference=True):
    """bf16 pools with each sequence's blocks scattered at random, queries and the reference output."""
    P = sum(-(-n // B) for n in lens) + 3
    k_pool = torch.randn(P * B, K, H).bfloat16()
    v_pool = torch.randn(P * B, K, H).bfloat16()
    free = list(range(P))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-n // B))] for n in lens]
    S = len(lens)
    q = torch.randn(S + 2, N, H).bfloat16()  # two extra rows the kernel must leave alone
    rows = rng.sample(range(S + 2), S)
    ref = torch.zeros(S + 2, N, H)
    for s, (table, n) in enumerate(zip(tables, lens) if reference else []):
        slots = torch.tensor([table[j // B] * B + j % B for j in range(n)])
        k = k_pool[slots].float().repeat_interleave(N // K, dim=1).transpose(0, 1)  # (N, n, H)
        v = v_pool[slots].float().repeat_interleave(N // K, dim=1).transpose(0, 1)
        probs = (q[rows[s]].float()[:, None, :] @ k.transpose(1, 2) / H ** 0.5).softmax(-1)  # (N, 1, n)
        ref[rows[s]] = (probs @ v)[:, 0]
    return q, k_pool, v_pool, tables, rows, ref


def _run_decode(lib, q, k_pool, v_pool, tables, rows, lens, B, threads=1):
    N, H = q.shape[1:]
    K = k_pool.shape[1]
    M = max(len(t) for t in tables)
    tables_SM = torch.tensor([t + [0] * (M - len(t)) for t in tables], dtype=torch.int32)
    lens_S, rows_S = torch.tensor(lens, dtype=torch.int32), torch.tensor(rows, dtype=torch.long)
    out = torch.full_like(q, 7.0)
    rc = lib.decode(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), tables_SM.data_ptr(), M, lens_S.data_ptr(),
                    rows_S.data_ptr(), len(lens), N, K, H, B, H ** -0.5, out.data_ptr(), threads)
    return rc, out


@pytest.mark.parametrize("portable", [False, True])
@pytest.mark.parametrize("N,K,H,B", [(8, 8, 64, 16), (8, 2, 64, 4), (4, 1, 128, 16), (6, 3, 32, 5)])
def test_paged_decode_matches_reference(portable, N, K, H, B):
    lib = kernels.load(("-DLMF_PORTABLE",) if portable else ())
    if not HAVE_CC:
        assert lib is None
        return
    assert lib is not None, kernels._status
    rng = random.Random(N * 1000 + H + B)
    lens = [1, B - 1 or 1, B, B + 1, 2 * B + 3, 17, 100, 301]  # partial tiles and blocks, one token, long
    q, k_pool, v_pool, tables, rows, ref = _case(rng, N, K, H, B, lens)
    rc, out = _run_decode(lib, q, k_pool, v_pool, tables, rows, lens, B)
    assert rc == 0
    untouched = [r for r in range(q.shape[0]) if r not in rows]
    assert (out[untouched] == 7.0).all()
    # bf16 output of a float32 computation: within a couple of bf16 ulps of the float32 reference
    torch.testing.assert_close(out[rows].float(), ref[rows], rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("threads,flags", [(2, ()), (3, ()), (64, ()), (3, ("-U_OPENMP",))])
def test_paged_decode_threads_give_the_same_bits(threads, flags):
    """Sequences cut into ranges of about equal context, one thread each (torch's OpenMP team, or
    pthreads in a build without OpenMP): every sequence's output is computed the same way, so the
    result equals the one-thread call bit for bit."""
    lib = kernels.load(flags)
    if not HAVE_CC:
        assert lib is None
        return
    rng = random.Random(threads)
    lens = [rng.randint(1, 400) for _ in range(41)]  # > 4,096 tokens in all (threads start from 256)
    q, k_pool, v_pool, tables, rows, _ = _case(rng, 8, 2, 64, 16, lens, reference=False)
    rc1, one = _run_decode(lib, q, k_pool, v_pool, tables, rows, lens, 16, threads=1)
    rcn, many = _run_decode(lib, q, k_pool, v_pool, tables, rows, lens, 16, threads=threads)
    assert rc1 == rcn == 0 and sum(lens) >= 4096
    assert torch.equal(one, many)


def test_paged_decode_refuses_unsupported_shapes():
    lib = kernels.load()
    if not HAVE_CC:
        assert lib is None and "compiler" in kernels.status()
        return
    q, k_pool, v_pool, tables, rows, _ = _case(random.Random(0), 8, 3, 64, 16, [5], reference=False)  # 8 heads over 3 kv heads
    assert _run_decode(lib, q, k_pool, v_pool, tables, rows, [5], 16)[0] == -1
    assert not kernels.supports(8, 3, 64) and not kernels.supports(8, 8, 48) and kernels.supports(32, 8, 128)


def test_write_kv_matches_index_copy():
    lib = kernels.load()
    if not HAVE_CC:
        assert lib is None
        return
    pool_a, pool_b = torch.zeros(2, 40, 2, 32, dtype=torch.bfloat16)
    k, v = torch.randn(2, 9, 2, 32).bfloat16()
    slots = torch.randperm(40)[:9]
    lib.write_kv(k.data_ptr(), v.data_ptr(), slots.data_ptr(), 9, 64, pool_a.data_ptr(), pool_b.data_ptr())
    assert torch.equal(pool_a, torch.zeros(40, 2, 32, dtype=torch.bfloat16).index_copy_(0, slots, k))
    assert torch.equal(pool_b, torch.zeros(40, 2, 32, dtype=torch.bfloat16).index_copy_(0, slots, v))


def test_paged_attention_with_kernel_matches_torch_path():
    """The whole C-kernel backend step (K/V write, decode rows by the kernel, prefill chunks by SDPA)
    against the same step on the torch SDPA backend."""
    lib = kernels.load()
    if not HAVE_CC:
        assert lib is None
        return
    rng = random.Random(3)
    Lyr, P, B, K, N, H = 2, 96, 4, 2, 4, 32
    computed, q_lens = [0, 3, 9, 17, 30, 5], [7, 1, 1, 1, 1, 4]
    free = list(range(P))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + q) // B))] for c, q in zip(computed, q_lens)]
    T = sum(q_lens)
    q, k, v = torch.randn(1, T, N, H).bfloat16(), torch.randn(1, T, K, H).bfloat16(), torch.randn(1, T, K, H).bfloat16()
    outs, pools = [], []
    for use in (lib, None):
        kv = KVPool(Lyr, P, B, K, H, torch.bfloat16, torch.device("cpu"), kernels=use)
        attn = SdpaBackend(kv) if use is None else KernelBackend(kv, use)
        torch.manual_seed(1)
        for pool in kv.k_pools_PBKH + kv.v_pools_PBKH:
            pool.normal_()
        attn.prepare(tables, computed, q_lens)
        assert (getattr(attn.meta, "decode", None) is not None) == (use is not None)
        outs.append(torch.cat([attn(layer, q, k, v) for layer in range(Lyr)]).float())
        pools.append(kv.k_pools_PBKH + kv.v_pools_PBKH)
    for a, b in zip(*pools):
        assert torch.equal(a, b)
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=1e-2)


def test_engine_uses_kernel_or_says_why(tmp_path, monkeypatch):
    """bf16 on CPU: greedy generation through the kernel stays within bf16 noise of the torch path
    (the first decode logprobs agree), and LMFORGE_KERNELS=0 keeps the torch path."""
    model_dir = save_hf_model("llama", tmp_path / "m", hidden_size=128)  # 4 heads of 32 over 2 kv heads
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    prompts = [[3, 7, 11, 13, 17, 19, 23, 29, 31, 37][:n] for n in (1, 4, 10)]
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("LMFORGE_KERNELS", flag)
        monkeypatch.setattr(kernels, "_cache", {})
        llm = LLM(str(model_dir), dtype="bfloat16", device="cpu", block_size=4)
        backend = llm.llm_engine.model_runner.attention_backend
        assert backend == ("paged-decode kernel (C)" if flag == "1" and HAVE_CC else "torch")
        results[flag] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(results["1"], results["0"]):
        assert a.outputs[0].token_ids[0] == b.outputs[0].token_ids[0]  # from the prefill: the same SDPA
        # the distribution after the first decode step (same inputs; kernel vs SDPA over the pool)
        first_a, first_b = a.outputs[0].logprobs[1], b.outputs[0].logprobs[1]
        assert first_a.keys() & first_b.keys()
        for tok in first_a.keys() & first_b.keys():
            assert abs(first_a[tok] - first_b[tok]) < 0.05


def test_no_compiler_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_cache", {})
    monkeypatch.setattr(kernels, "_compiler", lambda: None)
    assert kernels.load() is None
    assert kernels.status().startswith("off (no C compiler")


def _ulps_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bfloat16 ulps (same-sign values), elementwise; values both below 1e-30 count as equal."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    tiny = (a.float().abs() < 1e-30) & (b.float().abs() < 1e-30)
    return (ia - ib).abs().masked_fill(tiny, 0)


@pytest.mark.parametrize("portable", [False, True])
def test_elementwise_kernels_round_as_torch(portable):
    """RoPE is bit-identical to `apply_rope`; RMSNorm and silu*mul differ from the torch ops by at
    most one bf16 ulp, and only in rare elements (float32 summation order / exp approximation)."""
    from lmforge.model.transformer import RMSNorm, apply_rope

    lib = kernels.load(("-DLMF_PORTABLE",) if portable else ())
    if not HAVE_CC:
        assert lib is None
        return
    torch.manual_seed(0)
    T, N, H, D = 37, 3, 64, 200  # D not a multiple of 16: the scalar tail runs too
    x = (torch.randn(1, T, N, H) * 3).bfloat16()
    pos = torch.arange(T)[None].float()
    inv = 1.0 / (10000 ** (torch.arange(0, H, 2).float() / H))
    emb = torch.cat([pos[..., None] * inv] * 2, dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    want = apply_rope(x, cos, sin)
    got = x.clone()
    lib.rope(got.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, N, H, 1)
    assert torch.equal(got, want)

    norm = RMSNorm(D).bfloat16()
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D))
    h = (torch.randn(T, D) * 5).bfloat16()
    want = norm(h).detach()
    got = torch.empty_like(h)
    lib.rmsnorm(h.data_ptr(), norm.weight.data_ptr(), got.data_ptr(), T, D, norm.variance_epsilon, 1)
    d = _ulps_bf16(got, want)
    assert d.max() <= 1 and (d > 0).float().mean() < 0.02

    g, u = (torch.randn(T, 1000) * 4).bfloat16(), torch.randn(T, 1000).bfloat16()
    g[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and signed zeros
    want = torch.nn.functional.silu(g) * u
    got = torch.empty_like(g)
    lib.silu_mul(g.data_ptr(), u.data_ptr(), got.data_ptr(), g.numel())
    d = _ulps_bf16(got, want)
    assert d.max() <= 1 and (d > 0).float().mean() < 0.02


def test_fused_model_matches_torch_model(tmp_path):
    """The runner's fused modules (RMSNorm, RoPE, silu*mul in C) in a whole bf16 forward: logits
    within bf16 noise of the plain model's (skipping k's RoPE fails this), and every norm,
    attention block and MLP swapped."""
    from lmforge.engine.fused import FusedAttention, FusedMLP, FusedRMSNorm, fuse_elementwise
    from lmforge.model import Transformer

    lib = kernels.load()
    if not HAVE_CC:
        assert lib is None
        return
    model_dir = save_hf_model("qwen3", tmp_path / "m", hidden_size=64)  # q/k norms, head_dim 24
    plain = Transformer.from_pretrained(model_dir, dtype="bfloat16")
    fused = Transformer.from_pretrained(model_dir, dtype="bfloat16")
    L = plain.config.num_hidden_layers
    assert fuse_elementwise(fused, lib) == L * 6 + 1  # 4 norms, attention, MLP per layer; the final norm
    kinds = [type(m) for m in fused.modules()]
    assert kinds.count(FusedRMSNorm) == 4 * L + 1 and kinds.count(FusedAttention) == kinds.count(FusedMLP) == L
    ids = torch.randint(0, plain.config.vocab_size, (1, 50))
    with torch.no_grad():
        a, b = plain(ids).float(), fused(ids).float()
    # measured: identical here; bf16 noise would be a few percent of the largest logit
    assert (a - b).abs().max() <= 0.03 * a.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95


def test_bench_attention_reports_both_paths(tmp_path):
    """`python -m lmforge.bench.attention`: both paths timed, outputs within bf16 noise."""
    from lmforge.bench.attention import bench_attention, to_markdown

    report = bench_attention(seqs=3)
    if not HAVE_CC:
        assert report["skipped"] and report["rows"] == []
        return
    paths = {r["path"] for r in report["rows"]}
    assert paths == {"SDPA per sequence (torch)", "paged-decode kernel (C)"}
    for r in report["rows"]:
        assert r["ms_per_step"] > 0 and r["gb_per_s"] > 0 and r["max_abs_diff_vs_sdpa"] < 0.02
    assert "paged-decode kernel (C)" in to_markdown(report)
    # the prefill section: causal SDPA over the chunk's K/V against the paged prefill kernel over the pool
    from lmforge.bench.attention import bench_prefill

    report["prefill"] = bench_prefill(tokens=40)
    assert {r["path"] for r in report["prefill"]["rows"]} == {"causal SDPA (torch)", "paged prefill kernel (C)"}
    for r in report["prefill"]["rows"]:
        assert r["ms_per_layer"] > 0 and r["gflops"] > 0 and r["max_abs_diff_vs_sdpa"] < 1e-4
    assert "paged prefill kernel (C)" in to_markdown(report)


# ---- float32 activations and the int8 KV cache (lmf_paged_decode_any, lmf_write_kv_int8, *_f32) ------


def _run_decode_any(lib, q, k_pool, v_pool, tables, rows, lens, B, k_scale=None, v_scale=None, threads=1):
    N, H = q.shape[1:]
    K = k_pool.shape[1]
    M = max(len(t) for t in tables)
    tables_SM = torch.tensor([t + [0] * (M - len(t)) for t in tables], dtype=torch.int32)
    lens_S, rows_S = torch.tensor(lens, dtype=torch.int32), torch.tensor(rows, dtype=torch.long)
    out = torch.full_like(q, 7.0)
    kv = 2 if k_scale is not None else int(k_pool.dtype == torch.float32)
    rc = lib.decode_any(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(),
                        None if k_scale is None else k_scale.data_ptr(), None if v_scale is None else v_scale.data_ptr(),
                        tables_SM.data_ptr(), M, lens_S.data_ptr(), rows_S.data_ptr(), len(lens), N, K, H, B,
                        H ** -0.5, out.data_ptr(), threads, int(q.dtype == torch.float32), kv)
    return rc, out


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("flags", [(), ("-DLMF_ATTN_AVX2",), ("-DLMF_PORTABLE",)], ids=["auto", "avx2", "portable"])
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("N,K,H,B", [(8, 2, 64, 4), (6, 3, 32, 5), (6, 2, 48, 5)])
def test_paged_decode_any_float32_and_int8(kv, N, K, H, B, flags):
    """float32 q and K/V: the float32 reference to float32 rounding; a bf16 pool under float32 q: the very
    bits of the float32 pool holding the same (widened) values; int8 K/V (codes * scale): the same
    reference over the dequantized cache, and within int8 error of the float32 one. The build this CPU runs
    (float32 q, float32 or bf16 K/V: with AVX-512 and H % 16 == 0 the 16-wide body, else with H % 8 == 0 on AVX2
    the 8-wide one; odd G, pairs of query heads), the AVX2 body kept by -DLMF_ATTN_AVX2, and the portable build."""
    from lmforge.engine.attention import quantize_kv

    lib = kernels.load(flags)
    rng = random.Random(1)
    lens = [1, 7, 33, 64, 5]
    q, k_pool, v_pool, tables, rows, ref = _case(rng, N, K, H, B, lens)
    q, k_pool, v_pool = q.float(), k_pool.float(), v_pool.float()
    if kv == "float32":
        rc, out = _run_decode_any(lib, q, k_pool, v_pool, tables, rows, lens, B)
        assert rc == 0
        torch.testing.assert_close(out[rows], ref[rows], rtol=1e-5, atol=1e-5)
        return
    if kv == "bfloat16":
        k16, v16 = (k_pool * 1.37).bfloat16(), (v_pool * 0.61).bfloat16()  # values a bf16 pool does round
        rc, out = _run_decode_any(lib, q, k16, v16, tables, rows, lens, B)
        rc32, out32 = _run_decode_any(lib, q, k16.float(), v16.float(), tables, rows, lens, B)
        assert rc == rc32 == 0 and torch.equal(out, out32)
        return
    (kq, ks), (vq, vs) = quantize_kv(k_pool), quantize_kv(v_pool)
    rc, out = _run_decode_any(lib, q, kq, vq, tables, rows, lens, B, ks, vs)
    assert rc == 0
    assert torch.equal(out[[r for r in range(len(q)) if r not in rows]], torch.full((2, N, H), 7.0))
    err = (out[rows] - ref[rows]).abs().max().item()
    assert 0 < err < 0.03, err
    # the same kernel over the dequantized cache in float32 gives the same numbers
    rc, out_deq = _run_decode_any(lib, q, kq.float() * ks.float()[..., None], vq.float() * vs.float()[..., None],
                                  tables, rows, lens, B)
    torch.testing.assert_close(out[rows], out_deq[rows], rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("kv", ["float32", "bfloat16", "int8"])
def test_paged_decode_any_fewer_sequences_than_threads(kv):
    """Fewer sequences than threads (batch 1). float32 q over a float32 or bf16 pool on the AVX2 body: from
    2 x 128 tokens each sequence's context is cut into fixed 128-token partitions merged in order (flash-decoding),
    so any thread count from 2 gives the same bits, within float32 rounding of one thread's. int8 K/V (and a
    CPU without AVX2): the kv heads are cut into ranges from 512 cached (token, kv head) pairs, bit-identical
    to one thread. Short contexts stay on one thread."""
    from lmforge.engine.attention import quantize_kv

    lib = kernels.load()
    N, K, H, B = 8, 4, 64, 16
    for lens in ([3], [130], [300], [300, 70]):
        q, k_pool, v_pool, tables, rows, ref = _case(random.Random(sum(lens)), N, K, H, B, lens)
        q, k_pool, v_pool = q.float(), k_pool.float(), v_pool.float()
        scales = (None, None)
        if kv == "int8":
            (k_pool, ks), (v_pool, vs) = quantize_kv(k_pool), quantize_kv(v_pool)
            scales = (ks, vs)
        if kv == "bfloat16":
            k_pool, v_pool = k_pool.bfloat16(), v_pool.bfloat16()
        outs = {t: _run_decode_any(lib, q, k_pool, v_pool, tables, rows, lens, B, *scales, threads=t)
                for t in (1, 3, 5)}
        assert all(rc == 0 for rc, _ in outs.values())
        (_, one), (_, three), (_, five) = outs.values()
        assert torch.equal(three, five), lens
        if kv == "int8" or lens == [3]:
            assert torch.equal(one, three), lens
        torch.testing.assert_close(one[rows], three[rows], rtol=1e-5, atol=1e-6)
        tol = {"float32": 1e-5, "bfloat16": 0.02, "int8": 0.03}[kv]
        torch.testing.assert_close(three[rows], ref[rows], rtol=tol, atol=tol)
    if kv != "int8":  # one kv head (MQA): the partitions still use every thread, the bits still do not move
        q, k_pool, v_pool, tables, rows, ref = _case(random.Random(9), 4, 1, H, B, [300])
        q, k_pool, v_pool = q.float(), k_pool.to(getattr(torch, kv)), v_pool.to(getattr(torch, kv))
        (rc2, two), (rc3, three) = (_run_decode_any(lib, q, k_pool, v_pool, tables, rows, [300], B, threads=t)
                                    for t in (2, 3))
        assert rc2 == rc3 == 0 and torch.equal(two, three)
        torch.testing.assert_close(three[rows], ref[rows], rtol=0.02, atol=0.02)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_write_kv_f32_bf16_rounds_as_torch():
    """float32 K/V into a bf16 pool: the bits of torch's `.to(torch.bfloat16)` (nearest, ties to even),
    infinities and values that round up into the next binade included; other rows untouched."""
    lib = kernels.load()
    T, K, H, rows = 7, 2, 64, 30
    k, v = torch.randn(T, K, H) * 100, torch.randn(T, K, H)
    k[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8])  # ties: down, up
    v[1, 1, :2] = torch.tensor([3.3895e38, -0.0])
    slots = torch.tensor(random.Random(2).sample(range(rows), T), dtype=torch.long)
    pools = [torch.full((rows, K, H), 5.0, dtype=torch.bfloat16) for _ in range(2)]
    lib.write_kv_f32_bf16(k.data_ptr(), v.data_ptr(), slots.data_ptr(), T, K * H, pools[0].data_ptr(),
                          pools[1].data_ptr())
    for x, pool in ((k, pools[0]), (v, pools[1])):
        assert torch.equal(pool[slots].view(torch.int16), x.bfloat16().view(torch.int16))
        others = [r for r in range(rows) if r not in slots.tolist()]
        assert torch.equal(pool[others], torch.full((len(others), K, H), 5.0, dtype=torch.bfloat16))


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("threads", [1, 2])
def test_rope_and_kv_write_in_place_in_the_qkv_rows(threads):
    """q and k rotated where they lie in a fused q/k/v output (rows N*H + 2*K*H floats apart) and k/v written
    into a bf16 pool from there: the bits of the packed-row calls on copies; the rest of the rows untouched."""
    from lmforge.engine.attention.kv_pool import token_rows

    lib = kernels.load()
    T, N, K, H, rows = 37, 4, 2, 64, 50
    qkv = torch.randn(T, (N + 2 * K) * H) * 3
    q, k, v = (t.view(T, -1, H) for t in qkv.split([N * H, K * H, K * H], dim=-1))
    assert token_rows(q) and token_rows(k) and not token_rows(torch.randn(T, H, N).transpose(1, 2))
    emb = torch.cat([torch.arange(T)[:, None].float() * (1.0 / 10000 ** (torch.arange(0, H, 2) / H))] * 2, -1)
    cos, sin = emb.cos(), emb.sin()
    want_q, want_k, want_v = (t.contiguous() for t in (q, k, v))  # copies: the views are not dense
    for t, heads in ((want_q, N), (want_k, K)):
        lib.rope_f32(t.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, heads, H, threads)
    for t, heads in ((q, N), (k, K)):
        assert lib.rope_f32_strided(t.data_ptr(), t.stride(0), cos.data_ptr(), sin.data_ptr(), T, heads, H,
                                    threads) == 0
    assert torch.equal(q, want_q) and torch.equal(k, want_k) and torch.equal(v, want_v)
    slots = torch.tensor(random.Random(3).sample(range(rows), T), dtype=torch.long)
    got = [torch.full((rows, K, H), 5.0, dtype=torch.bfloat16) for _ in range(2)]
    want = [t.clone() for t in got]
    assert lib.write_kv_f32_bf16_strided(k.data_ptr(), v.data_ptr(), slots.data_ptr(), T, K * H, k.stride(0),
                                         v.stride(0), got[0].data_ptr(), got[1].data_ptr()) == 0
    lib.write_kv_f32_bf16(want_k.data_ptr(), want_v.data_ptr(), slots.data_ptr(), T, K * H, want[0].data_ptr(),
                          want[1].data_ptr())
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_int8_equals_torch_quantize(dtype):
    from lmforge.engine.attention import quantize_kv

    lib = kernels.load()
    T, K, H, rows = 9, 2, 64, 40
    k, v = (torch.randn(T, K, H) * torch.rand(T, K, 1) * 8).to(dtype), torch.randn(T, K, H).to(dtype)
    k[0, 0] = 0  # an all-zero head: the scale's floor
    slots = torch.tensor(random.Random(0).sample(range(rows), T), dtype=torch.long)
    pools = [torch.zeros(rows, K, H, dtype=torch.int8) for _ in range(2)]
    scales = [torch.zeros(rows, K, dtype=torch.bfloat16) for _ in range(2)]
    assert lib.write_kv_int8(k.data_ptr(), v.data_ptr(), slots.data_ptr(), T, K, H, int(dtype == torch.float32),
                             pools[0].data_ptr(), pools[1].data_ptr(), scales[0].data_ptr(), scales[1].data_ptr()) == 0
    for x, pool, scale in ((k, pools[0], scales[0]), (v, pools[1], scales[1])):
        q, s = quantize_kv(x)
        assert torch.equal(pool[slots], q) and torch.equal(scale[slots], s)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
def test_elementwise_float32_bodies_match_torch():
    from lmforge.model.transformer import RMSNorm, apply_rope

    lib = kernels.load()
    torch.manual_seed(0)
    T, N, H, D = 13, 3, 64, 200
    x = torch.randn(1, T, N, H) * 3
    emb = torch.cat([torch.arange(T)[None, :, None].float() * (1.0 / 10000 ** (torch.arange(0, H, 2) / H))] * 2, -1)
    got, cos, sin = x.clone(), emb.cos(), emb.sin()  # named: a temporary's memory could be freed before the call
    lib.rope_f32(got.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, N, H, 1)
    torch.testing.assert_close(got, apply_rope(x, cos, sin), rtol=1e-6, atol=1e-6)
    norm = RMSNorm(D)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(D))
    h = torch.randn(T, D) * 5
    got = torch.empty_like(h)
    lib.rmsnorm_f32(h.data_ptr(), norm.weight.data_ptr(), got.data_ptr(), T, D, norm.variance_epsilon, 1)
    torch.testing.assert_close(got, norm(h).detach(), rtol=1e-5, atol=1e-5)
    g, u = torch.randn(T, 999) * 4, torch.randn(T, 999)
    got = torch.empty_like(g)
    lib.silu_mul_f32(g.data_ptr(), u.data_ptr(), got.data_ptr(), g.numel())
    torch.testing.assert_close(got, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)
    # on a fused gate_up output as it is (each row [gate | up]), float32 and bf16, as silu_mul on its halves
    gu = torch.cat([g, u], dim=-1)
    got = torch.full_like(g, float("nan"))
    lib.silu_mul_rows_f32(gu.data_ptr(), got.data_ptr(), T, 999, 1)
    torch.testing.assert_close(got, torch.nn.functional.silu(g) * u, rtol=1e-5, atol=1e-6)
    gu16, want16 = gu.bfloat16(), torch.empty(T, 999, dtype=torch.bfloat16)
    g16, u16 = (t.contiguous() for t in gu16.chunk(2, dim=-1))
    lib.silu_mul(g16.data_ptr(), u16.data_ptr(), want16.data_ptr(), g16.numel())
    got16 = torch.empty_like(want16)
    lib.silu_mul_rows(gu16.data_ptr(), got16.data_ptr(), T, 999, 1)
    assert torch.equal(got16, want16)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_elementwise_rows_split_across_threads_change_no_bit(dtype):
    """A prefill chunk's row ops split their rows across threads: 1, 2 and 3 threads give the same bytes (each row
    computed alike whatever its share), on a call large enough to be split (rows x width >= 65,536) and one not."""
    lib = kernels.load()
    torch.manual_seed(1)
    sfx = "_f32" if dtype == torch.float32 else ""
    for T in (7, 300):  # 300 x 1,000 wide: split; 7 rows: on the calling thread
        D, N, H, I = 1000, 8, 64, 1000
        x, w = (torch.randn(T, D) * 3).to(dtype), torch.randn(D).to(dtype)
        q0 = (torch.randn(T, N, H) * 3).to(dtype)
        cos, sin = torch.randn(T, H).to(dtype), torch.randn(T, H).to(dtype)
        gu = (torch.randn(T, 2 * I) * 3).to(dtype)
        outs = []
        for threads in (1, 2, 3):
            norm, q, h = torch.full_like(x, float("nan")), q0.clone(), torch.full((T, I), float("nan"), dtype=dtype)
            getattr(lib, "rmsnorm" + sfx)(x.data_ptr(), w.data_ptr(), norm.data_ptr(), T, D, 1e-6, threads)
            getattr(lib, "rope" + sfx)(q.data_ptr(), cos.data_ptr(), sin.data_ptr(), T, N, H, threads)
            getattr(lib, "silu_mul_rows" + sfx)(gu.data_ptr(), h.data_ptr(), T, I, threads)
            outs.append((norm, q, h))
        for other in outs[1:]:
            for a, b in zip(outs[0], other):
                assert not a.float().isnan().any() and torch.equal(a, b)


@pytest.mark.skipif(not HAVE_CC, reason="no C compiler")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_float32_engine_uses_kernels_and_matches_torch_path(tmp_path, monkeypatch, kv_cache_dtype):
    """float32 on CPU: decode kernel + fused float32 elementwise ops, greedy tokens equal to the torch
    path's (float32 summation-order noise only); the int8 cache's C write/decode equals its torch path."""
    model_dir = save_hf_model("llama", tmp_path / "m", hidden_size=128)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [[3, 7, 11, 13, 17, 19, 23, 29, 31, 37][:n] for n in (1, 4, 10)]
    results = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("LMFORGE_KERNELS", flag)
        monkeypatch.setattr(kernels, "_cache", {})
        llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, kv_cache_dtype=kv_cache_dtype)
        runner = llm.llm_engine.model_runner
        if flag == "1":
            assert runner.attention_backend.startswith("paged-decode kernel (C)") and runner.fused_modules > 0
        results[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert results["1"] == results["0"]
