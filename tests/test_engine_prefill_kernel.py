"""The paged prefill attention kernel (`lmf_paged_prefill`, attention_prefill.c): every prefill chunk of a
step, causal, over the pool in place. Against a float64 reference, its threads, its refusals, and the
engine's greedy tokens against the torch path with chunked prefill and prefix-cache hits."""

import random

import pytest
import torch

from lmforge.engine import LLM, SamplingParams, kernels
from lmforge.engine.attention import cpu_kernels
from lmforge.model.reference import save_hf_model

HAVE_CC = kernels._compiler() is not None
pytestmark = pytest.mark.skipif(not HAVE_CC, reason="no C compiler")


def _case(seed, N, K, H, B, chunks, kv_dtype, q_round=False):
    """Pools with each chunk's blocks scattered at random; q a strided view (as the fused qkv projection's
    output is), with rows no chunk owns; the float64 reference of every chunk row (of q / sqrt(H) rounded to
    bf16 with `q_round`)."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks = [-(-(ctx + q_len) // B) for _, q_len, ctx in chunks]
    P = sum(blocks) + 3
    k_pool = torch.randn(P * B, K, H, generator=g).to(kv_dtype)
    v_pool = torch.randn(P * B, K, H, generator=g).to(kv_dtype)
    free = list(range(P))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(m)] for m in blocks]
    T = max(row + q_len for row, q_len, _ in chunks) + 1
    qkv = torch.randn(T, (N + 2 * K) * H, generator=g) * 2
    q = qkv[:, :N * H].view(T, N, H)  # row stride (N + 2K) H, as the model hands it over
    ref = torch.full((T, N, H), float("nan"), dtype=torch.float64)
    for (row, q_len, ctx), table in zip(chunks, tables):
        slots = torch.tensor([table[j // B] * B + j % B for j in range(ctx + q_len)])
        k = k_pool[slots].double().repeat_interleave(N // K, dim=1).transpose(0, 1)  # (N, L, H)
        v = v_pool[slots].double().repeat_interleave(N // K, dim=1).transpose(0, 1)
        qc = q[row:row + q_len].double().transpose(0, 1) / H ** 0.5  # (N, Q, H)
        if q_round:
            qc = qc.float().bfloat16().double()
        scores = qc @ k.transpose(1, 2)  # (N, Q, L)
        allowed = torch.arange(ctx + q_len)[None, :] <= (ctx + torch.arange(q_len))[:, None]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        ref[row:row + q_len] = (probs @ v).transpose(0, 1)
    return q, k_pool, v_pool, tables, ref


def _run(lib, q, k_pool, v_pool, tables, chunks, B, threads=1, out=None, bf16_dots=False):
    N, H = q.shape[1:]
    K = k_pool.shape[1]
    M = max(len(t) for t in tables)
    tables_CM = torch.tensor([t + [0] * (M - len(t)) for t in tables], dtype=torch.int32)
    chunks_C3 = torch.tensor(chunks, dtype=torch.int64)
    out = torch.full(q.shape, 7.0) if out is None else out
    rc = lib.prefill(q.data_ptr(), q.stride(0), q.stride(1), k_pool.data_ptr(), v_pool.data_ptr(),
                     2 if bf16_dots else int(k_pool.dtype == torch.float32), tables_CM.data_ptr(), M,
                     chunks_C3.data_ptr(), len(chunks),
                     N, K, H, B, H ** -0.5, out.data_ptr(), threads)
    return rc, out


# (q row, q len, tokens before): fresh prompts, a prompt after a prefix-cache hit, a later chunk of a long
# prompt, lengths on and off the 8- and 16-lane blocks, a one-row chunk
CHUNKS = [(0, 37, 0), (37, 16, 0), (53, 9, 24), (62, 40, 61), (102, 1, 5)]


@pytest.mark.parametrize("portable", [False, True], ids=["auto", "portable"])
@pytest.mark.parametrize("kv", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("N,K,H,B", [(16, 8, 64, 16), (8, 2, 64, 4), (4, 1, 128, 32), (6, 3, 32, 5)])
def test_paged_prefill_matches_float64_reference(portable, kv, N, K, H, B):
    lib = kernels.load(("-DLMF_PORTABLE",) if portable else ())
    q, k_pool, v_pool, tables, ref = _case(N * 100 + B, N, K, H, B, CHUNKS, kv)
    rc, out = _run(lib, q, k_pool, v_pool, tables, CHUNKS, B, threads=2)
    assert rc == 0
    rows = [row + i for row, q_len, _ in CHUNKS for i in range(q_len)]
    torch.testing.assert_close(out[rows].double(), ref[rows], rtol=0, atol=2e-5)
    others = sorted(set(range(q.shape[0])) - set(rows))
    assert others and torch.all(out[others] == 7.0)  # rows no chunk owns are left alone


@pytest.mark.parametrize("flags", [(), ("-U_OPENMP",)], ids=["openmp", "pthreads"])
def test_paged_prefill_threads_give_the_same_bits(flags):
    """A work item (chunk, kv head, block of queries) is one thread's from start to end: any thread count
    gives the same bits."""
    lib = kernels.load(flags)
    q, k_pool, v_pool, tables, _ = _case(3, 8, 2, 64, 16, CHUNKS, torch.bfloat16)
    outs = [_run(lib, q, k_pool, v_pool, tables, CHUNKS, 16, threads=t) for t in (1, 2, 3, 64)]
    assert all(rc == 0 for rc, _ in outs)
    assert all(torch.equal(outs[0][1], o) for _, o in outs[1:])


def _bf16_dots(lib) -> bool:
    return lib.bf16_panel_rows is not None and lib.bf16_panel_rows(-1) > 0


@pytest.mark.parametrize("portable", [False, True], ids=["auto", "portable"])
@pytest.mark.parametrize("N,K,H,B", [(16, 8, 64, 16), (4, 1, 128, 32), (6, 3, 32, 5)])
def test_paged_prefill_bf16_dots(portable, N, K, H, B):
    """kv 2 (a bf16 pool on the CPU's bf16 dot products): within bf16 rounding of a float64 reference whose
    queries are rounded to bf16 as the kernel rounds them (what is left is the probabilities' rounding), any
    thread count the same bits; where the CPU or build lacks the instruction (a portable build, an AVX2 CPU)
    or the head size is not 64 or 128, exactly kv 0's float32 arithmetic."""
    lib = kernels.load(("-DLMF_PORTABLE",) if portable else ())
    q, k_pool, v_pool, tables, ref = _case(N * 10 + B, N, K, H, B, CHUNKS, torch.bfloat16)
    rows = [row + i for row, q_len, _ in CHUNKS for i in range(q_len)]
    outs = [_run(lib, q, k_pool, v_pool, tables, CHUNKS, B, threads=t, bf16_dots=True) for t in (1, 2, 3)]
    assert all(rc == 0 for rc, _ in outs) and all(torch.equal(outs[0][1], o) for _, o in outs[1:])
    got = outs[0][1]
    rc, exact = _run(lib, q, k_pool, v_pool, tables, CHUNKS, B, threads=2)
    assert rc == 0
    if portable or not _bf16_dots(lib) or H not in (64, 128):
        assert torch.equal(got, exact)
        return
    _, _, _, _, ref_q16 = _case(N * 10 + B, N, K, H, B, CHUNKS, torch.bfloat16, q_round=True)
    err = (got[rows].double() - ref_q16[rows]).abs()
    assert err.max() < 2e-2 and err.mean() < 2e-3
    assert not torch.equal(got, exact)  # the bf16 body ran
    others = sorted(set(range(q.shape[0])) - set(rows))
    assert torch.all(got[others] == 7.0)


def test_paged_prefill_refuses_unsupported_shapes():
    lib = kernels.load()
    q, k_pool, v_pool, tables, _ = _case(5, 8, 2, 64, 16, CHUNKS, torch.bfloat16)
    M = max(len(t) for t in tables)
    tables_CM = torch.tensor([t + [0] * (M - len(t)) for t in tables], dtype=torch.int32)
    out = torch.full(q.shape, 7.0)

    def call(chunks, N=8, K=2, H=64, kv=0, tables_M=M):
        c = torch.tensor(chunks, dtype=torch.int64)
        return lib.prefill(q.data_ptr(), q.stride(0), q.stride(1), k_pool.data_ptr(), v_pool.data_ptr(), kv,
                           tables_CM.data_ptr(), tables_M, c.data_ptr(), len(chunks), N, K, H, 16, 0.125,
                           out.data_ptr(), 2)

    assert call([(0, 37, 0)]) == 0
    out.fill_(7.0)
    assert call([(0, 37, 0)], N=7) == -1  # query heads not a multiple of kv heads
    assert call([(0, 37, 0)], H=6) == -1  # head dim not a multiple of 4
    assert call([(0, 37, 0)], N=64, K=2) == -1  # 32 query heads a kv head: over MAX_G
    assert call([(0, 37, 0)], kv=3) == -1  # int8 pools go to attend_groups
    assert call([(0, 37, 0)], tables_M=2) == -1  # 37 tokens need 3 blocks
    assert call([(0, 0, 0)]) == -1  # an empty chunk
    assert torch.all(out == 7.0)


def _greedy(model_dir, monkeypatch, flag, prompts, **kw):
    monkeypatch.setenv("LMFORGE_KERNELS", flag)
    monkeypatch.setattr(kernels, "_cache", {})
    llm = LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, **kw)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    again = [o.outputs[0].token_ids for o in llm.generate(prompts[::-1], params, use_tqdm=False)]  # cached now
    return llm, first, again


def test_engine_prefill_kernel_chunked_and_cached_matches_torch_path(tmp_path, monkeypatch):
    """Long prompts prefilled in chunks of 8 tokens (each chunk after the cached ones), prompts sharing a
    prefix (prefix-cache hits), a decode in the same step: greedy tokens equal the torch path's."""
    model_dir = save_hf_model("llama", tmp_path / "m", hidden_size=128)
    base = [3, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89, 97]
    prompts = [base, base[:9] + [5, 6], [2], base[:17]]
    calls = []
    real = cpu_kernels.KernelBackend._prefill

    def counted(self, layer_idx, q, out):
        calls.append(self.meta.prefill[0].tolist())
        return real(self, layer_idx, q, out)

    monkeypatch.setattr(cpu_kernels.KernelBackend, "_prefill", counted)
    llm, got, got_again = _greedy(model_dir, monkeypatch, "1", prompts, max_num_batched_tokens=8)
    assert llm.llm_engine.model_runner.attention_backend.startswith("paged-decode kernel (C)")
    assert any(ctx > 0 for step in calls for _, _, ctx in step)  # chunks after cached tokens ran on the kernel
    _, want, want_again = _greedy(model_dir, monkeypatch, "0", prompts, max_num_batched_tokens=8)
    assert got == want and got_again == want_again


def test_engine_prefill_attention_on_bf16_dots_where_the_linears_round(tmp_path, monkeypatch):
    """A bf16 checkpoint under `--dtype auto` (bf16 weights on the bf16 panel GEMM, which rounds activations to
    bf16): prefill attention on the CPU's bf16 dot products where it has them, named in the backend's line, greedy
    tokens equal to float32 prefill attention's (`LMFORGE_PREFILL_BF16=0`); a float32 checkpoint (exact linears)
    keeps float32 attention; a CPU without AVX512-BF16 never names it."""
    src = save_hf_model("llama", tmp_path / "bf16", seed=3, hidden_size=128, dtype=torch.bfloat16)
    f32 = save_hf_model("llama", tmp_path / "f32", seed=3, hidden_size=128)
    prompts = [list(range(5, 45)), [9, 8, 7, 6, 5, 4], list(range(100, 133))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    label = "prefill attention on bf16 dot products"
    on = _bf16_dots(kernels.load())
    got = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("LMFORGE_PREFILL_BF16", flag)
        llm = LLM(str(src), enable_prefix_caching=False)
        runner = llm.llm_engine.model_runner
        assert (label in runner.attention_backend) == (on and flag == "1")
        assert runner.attn.prefill_bf16 == (on and flag == "1")
        got[flag] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got["1"] == got["0"]
    monkeypatch.setenv("LMFORGE_PREFILL_BF16", "1")
    runner = LLM(str(f32), dtype="float32", enable_prefix_caching=False).llm_engine.model_runner
    assert label not in runner.attention_backend and not runner.attn.prefill_bf16
