"""The kernels' dispatch table (`engine/kernels/dispatch.c`, `lmf_kernels_chosen`) and the build of the split
sources: the table names, for every kernel with more than one body, a body this CPU and build run (the A8 one
is the one `lmf_qmm_a8` runs when not told, and what `status()` reports); the portable build
(-DLMF_PORTABLE) still loads, names only plain C bodies and computes what the default build's portable body
does; the build is keyed by every source and header."""

from __future__ import annotations

import shutil

import pytest
import torch

from lmforge.engine import kernels

LIB = kernels.load()
pytestmark = pytest.mark.skipif(LIB is None, reason=f"no compiled kernels: {kernels.status()}")
KERNELS = {"attention_bf16", "attention_f32", "attention_prefill", "elementwise_bf16", "qmm_f32", "gemm_f32", "gemm_bf16",
           "qmm_a8", "qmm_a8_panel"}
# the CPU flags each body needs (from /proc/cpuinfo's names)
NEEDS = {"avx512_bf16": {"avx512f", "avx512_bf16"}, "avx512": {"avx512f"}, "avx2": {"avx2", "fma"},
         "portable": set(), "none": set()}


def _cpu_flags() -> set[str]:
    return set(kernels._cpu_flags().split())


def test_dispatch_names_a_body_this_cpu_runs(monkeypatch):
    monkeypatch.delenv("LMFORGE_A8_ISA", raising=False)
    bodies = LIB.bodies
    assert set(bodies) == KERNELS
    for kernel, body in bodies.items():
        if kernel not in ("qmm_a8", "qmm_a8_panel", "gemm_bf16"):
            assert NEEDS[body] <= _cpu_flags(), (kernel, body)
    # the A8 panel GEMM: AVX-512 VNNI and from how many rows, where the CPU has it; else none
    has_vnni512 = {"avx512_vnni", "avx512bw", "avx512vl"} <= _cpu_flags()
    rows = LIB.a8_panel_rows(-1)
    assert bodies["qmm_a8_panel"] == (f"avx512_vnni/{rows}rows" if has_vnni512 else "none") and (rows > 0) is has_vnni512
    if has_vnni512:  # the threshold can be moved (tests, A/B runs) and the line follows it
        before = LIB.a8_panel_rows(0)
        assert kernels._bind(LIB.path).bodies["qmm_a8_panel"] == "none"  # the same library, read again
        LIB.a8_panel_rows(before)
    # the bf16 panel GEMM: AVX512-BF16 and from how many rows, where the CPU has it; else none
    has_bf16 = {"avx512_bf16", "avx512bw", "avx512vl"} <= _cpu_flags()
    rows = LIB.bf16_panel_rows(-1)
    assert bodies["gemm_bf16"] == (f"avx512_bf16/{rows}rows" if has_bf16 else "none") and (rows > 0) is has_bf16
    a8 = bodies["qmm_a8"]
    assert a8 in kernels.A8_ISAS and LIB.a8_isa_supported(kernels.A8_ISAS[a8])
    assert a8 == LIB.a8_isas()[0] == kernels.a8_isa(LIB)  # the most preferred body this CPU runs
    assert bodies["gemm_f32"] == ("avx2" if LIB.gemm_ok else "none")
    status = kernels.status()
    assert f"int8-activation matmul: {a8}" in status
    assert all(f"{kernel} {body}" in status for kernel, body in bodies.items() if kernel != "qmm_a8")


def test_portable_build_loads_and_names_plain_c():
    lib = kernels.load(("-DLMF_PORTABLE",))
    assert lib is not None, kernels._status
    assert lib.bodies == {**dict.fromkeys(KERNELS, "portable"), "gemm_f32": "none", "gemm_bf16": "none",
                          "qmm_a8_panel": "none"}
    assert lib.a8_isas() == ["portable"] and not lib.gemm_ok
    gen = torch.Generator().manual_seed(0)
    M, N, K = 3, 40, 128
    x = torch.randn(M, K, generator=gen)
    codes = torch.randint(-127, 128, (N, K), dtype=torch.int8, generator=gen)
    scales = torch.rand(N, K // 32, generator=gen)
    outs = []
    for matmul in (lib.a8(), LIB.a8("portable")):  # the same C body in both builds
        out = torch.empty(M, N)
        assert matmul(x.data_ptr(), 1, codes.data_ptr(), scales.data_ptr(), out.data_ptr(), M, N, K, 8, 32, 2,
                      None) == 0
        outs.append(out)
    assert torch.equal(*outs)


def test_build_is_keyed_by_every_source_and_header(tmp_path):
    c_files, headers = kernels.sources()
    assert {f.name for f in c_files} >= {"attention.c", "dispatch.c", "qmm_a8.c"}
    assert [h.name for h in headers] == ["common.h"]
    for f in c_files + headers:
        shutil.copy(f, tmp_path / f.name)
    key = lambda: kernels._key("cc", kernels.FLAGS, [f for group in kernels.sources(tmp_path) for f in group])  # noqa: E731
    before = key()
    assert before == kernels._key("cc", kernels.FLAGS, c_files + headers)
    for name in ("common.h", "qmm_a8_avx256.c"):
        with open(tmp_path / name, "a") as f:
            f.write("/* a change */\n")
        assert key() != before
        before = key()
    (tmp_path / "new_concern.c").write_text("/* a new file */\n")
    assert key() != before
