"""The host synchronisations of every entry point, counted (host_syncs.HostSyncs)
against the table in docs/python.md ("Host synchronisations").

On the CPU (CI) the counting machinery is checked on calls whose counts are
known, and each entry point's library calls and torch host reads are counted:
every library call validates once, and on a GPU that validation is what waits
for the device (THD: one copy of each cu_seqlens tensor to the host; strict
ids: one more). On a GPU with the cuda backend the synchronisations
themselves are counted (torch's sync-debug mode and the extension's count of
the CUDA runtime's waits) and must equal the table, which is then true as
written; without one those tests skip. The extension's wait counter is linked
here with the CUDA toolkit's static runtime, where the toolkit is installed,
to see each wrapped call counted (the GPU tests' machinery), and without the
wrapping to see the count stay 0.
"""
import os
import pathlib
import re
import shutil
import subprocess

import pytest

torch = pytest.importorskip("torch")

import dsaib  # noqa: E402
import dsaib.torch as dt  # noqa: E402
from dsaib import _dsaib  # noqa: E402
from host_syncs import HostSyncs  # noqa: E402
from torch_reference import cuda_skip_reason, make_torch_problem  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[2]
SM = 0.125
GPU = cuda_skip_reason() is None


def documented():
    """{call: (library calls, torch syncs, BSHD, THD)} from docs/python.md's table."""
    section = (REPO / "docs" / "python.md").read_text().split("## Host synchronisations", 1)[1]
    rows = {}
    for line in section.splitlines():
        m = re.match(r"^\| (.+?) \| (\d+) \| (\d+) \| (\d+) \| (\d+) \|$", line)
        if m:
            rows[m.group(1)] = tuple(int(m.group(i)) for i in range(2, 6))
        elif rows and not line.startswith("|"):
            break
    return rows


def problem(layout, device, ids_dtype=torch.int32):
    """Tensors of a small problem (cuda-sized: H 8, D 64; attention target Hq 16, Dqk 64) and its layout's options."""
    q, w, k, ids, T = make_torch_problem(B=2, S=16, S_kv=32, H=8, D=64, topk=8, seed=3, device=device,
                                         invalid=False)
    g = torch.Generator(device="cpu").manual_seed(4)
    query = torch.randn(2, 16, 16, 64, generator=g).to(device=device, dtype=torch.bfloat16)
    kv = torch.randn(2, 32, 64, generator=g).to(device=device, dtype=torch.bfloat16)
    lse = torch.full((2, 16, 16), 6.0, device=device)
    opts = {}
    if layout == "thd":
        flat = lambda x: x.reshape((-1,) + tuple(x.shape[2:])).contiguous()  # noqa: E731
        gids = torch.where(ids >= 0, ids + 32 * torch.arange(2, device=device).view(2, 1, 1), ids)
        q, w, k, T, query, kv, lse = map(flat, (q, w, k, T, query, kv, lse))
        ids = flat(gids).to(torch.int32)
        cu_q = torch.tensor([0, 16, 32], dtype=torch.int32, device=device)
        cu_k = torch.tensor([0, 32, 64], dtype=torch.int32, device=device)
        opts = dict(layout="thd", id_mode="global", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    P = torch.softmax(torch.randn(ids.shape, generator=g).to(device), -1)
    return dict(q=q, w=w, k=k, ids=ids.to(ids_dtype), T=T, P=P, query=query, kv=kv, lse=lse, opts=opts)


def runners(p):
    """{call: prepare}, prepare() doing what is not counted and returning the counted call."""
    q, w, k, ids, T, P, o = p["q"], p["w"], p["k"], p["ids"], p["T"], p["P"], p["opts"]
    target = (p["query"], p["kv"], p["lse"], ids)
    leaves = lambda: [x.detach().float().requires_grad_() for x in (q, w, k)]  # noqa: E731

    def backward_of(**kw):
        def prepare():
            loss = dt.indexer_kl_loss(*leaves(), ids, T, sm_scale=SM, **o, **kw)
            return lambda: loss.backward()
        return prepare

    def call(fn, *args, **kw):
        return lambda: lambda: fn(*args, sm_scale=SM, **o, **kw)

    return {
        "`dsaib.indexer_backward`": call(dsaib.indexer_backward, q, w, k, ids, T, P),
        "`dsaib.indexer_backward(strict_indices=True)`": call(dsaib.indexer_backward, q, w, k, ids, T, P,
                                                              strict_indices=True),
        "`dsaib.indexer_kl_forward`": call(dsaib.indexer_kl_forward, q, w, k, ids, T),
        "`dsaib.indexer_kl_loss`": call(dsaib.indexer_kl_loss, q, w, k, ids, T),
        "`dsaib.indexer_kl_loss_and_grad`": call(dsaib.indexer_kl_loss_and_grad, q, w, k, ids, T),
        "`dsaib.attention_target`": call(dsaib.attention_target, *target),
        "`dsaib.torch.indexer_backward`": call(dt.indexer_backward, q, w, k, ids, T, P),
        "`dsaib.torch.indexer_kl_forward`": call(dt.indexer_kl_forward, q, w, k, ids, T),
        "`dsaib.torch.indexer_kl_loss` (forward)": lambda: lambda: dt.indexer_kl_loss(*leaves(), ids, T, sm_scale=SM,
                                                                                       **o),
        "`loss.backward()` of `dsaib.torch.indexer_kl_loss`": backward_of(),
        "`dsaib.torch.indexer_kl_loss(gradients=\"backward\")` (forward)": lambda: lambda: dt.indexer_kl_loss(
            *leaves(), ids, T, sm_scale=SM, gradients="backward", **o),
        "`loss.backward()` of `dsaib.torch.indexer_kl_loss(gradients=\"backward\")`": backward_of(gradients="backward"),
        "`dsaib.torch.indexer_kl_loss(strict_indices=True)` (forward)": lambda: lambda: dt.indexer_kl_loss(
            *leaves(), ids, T, sm_scale=SM, strict_indices=True, **o),
        "`dsaib.torch.indexer_kl_loss(strict_indices=True)` (forward), int64 ids": lambda: lambda: dt.indexer_kl_loss(
            *leaves(), ids.long(), T, sm_scale=SM, strict_indices=True, **o),
        "`loss.backward()` of `dsaib.torch.indexer_kl_loss(strict_indices=True)`": backward_of(strict_indices=True),
        "`dsaib.torch.indexer_kl_loss_and_grad`": call(dt.indexer_kl_loss_and_grad, q, w, k, ids, T),
        "`dsaib.torch.attention_target`": call(dt.attention_target, *target),
        "`dsaib.torch.indexer_kl_loss_and_grad_from_attention`": lambda: lambda: (
            dt.indexer_kl_loss_and_grad_from_attention(q, w, k, *target[:3], ids, sm_scale=SM, softmax_scale=0.1,
                                                       **o)),
        "`dsaib.indexer_topk`": lambda: lambda: dsaib.indexer_topk(q, w, k, 8, **o),
        "`dsaib.torch.indexer_topk`": lambda: lambda: dt.indexer_topk(q, w, k, 8, **o),
        "`dsaib.torch.indexer_topk(return_logits=True, return_lengths=True)`": lambda: lambda: dt.indexer_topk(
            q, w, k, 8, return_logits=True, return_lengths=True, **o),
        "`dsaib.torch.index_scores`": lambda: lambda: dt.index_scores(
            q, w, k, ids, sm_scale=SM, **{n: v for n, v in o.items()}),
    }


def test_the_table_and_the_runners_name_the_same_calls():
    table = documented()
    assert set(table) == set(runners(problem("bshd", "cpu"))), sorted(set(table) ^ set(runners(problem("bshd", "cpu"))))
    for call, (calls, from_torch, bshd, thd) in table.items():
        # On a GPU each library call waits once per cu_seqlens tensor (THD), strict mode
        # once more for the ids; torch's own synchronisations come on top.
        strict = 1 if "strict_indices=True)` (forward)" in call or "indexer_backward(strict" in call else 0
        assert bshd == from_torch + strict and thd == from_torch + 2 * calls + strict, call


# ---- the counting machinery ---------------------------------------------------------


def test_torch_host_reads_are_counted_by_kind():
    x = torch.arange(6)
    with HostSyncs(cuda=False) as s:
        x.sum().item()
        bool(x.any())
        x.nonzero()
        x.tolist()
        y = (x + 1) * 2  # on-device work: no read
        y.clone()
    assert s.torch_reads == dict(scalar=2, data_dependent=1, to_host=0, tolist=1), s.torch_reads
    assert s.torch_total == 4 and s.library_calls == 0 and s.library_waits == 0
    with HostSyncs(cuda=False) as s:
        pass
    assert s.torch_total == 0
    assert torch.Tensor.tolist is not None and torch.arange(2).tolist() == [0, 1]  # restored


def test_library_calls_are_counted_per_call():
    p = problem("bshd", "cpu")
    with HostSyncs(cuda=False) as s:
        dsaib.indexer_backward(p["q"], p["w"], p["k"], p["ids"], p["T"], p["P"], sm_scale=SM)
        dsaib.indexer_kl_forward(p["q"], p["w"], p["k"], p["ids"], p["T"], sm_scale=SM)
    assert s.library_calls == 2 and s.torch_total == 0
    with HostSyncs(cuda=False) as s, pytest.raises(ValueError):
        dsaib.indexer_backward(p["q"], p["w"], p["k"], p["ids"], p["T"], p["P"], sm_scale=SM, normalization_count=-1)
    assert s.library_calls == 1
    with HostSyncs(cuda=False) as s, pytest.raises(ValueError):  # refused in Python: no library call
        dsaib.indexer_backward(p["q"], p["w"], p["k"], p["ids"], p["T"], p["P"], sm_scale=SM, layout="sbhd")
    assert s.library_calls == 0


def _toolkit():
    """(compiler, CUDA include dir, dir of libcudart_static.a) or None."""
    cxx = shutil.which("g++") or shutil.which("c++")
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and cxx and (pathlib.Path(root) / "include" / "cuda_runtime.h").exists():
            for lib in ("lib64", "lib", "targets/x86_64-linux/lib"):
                if (pathlib.Path(root) / lib / "libcudart_static.a").exists():
                    return cxx, str(pathlib.Path(root) / "include"), str(pathlib.Path(root) / lib)
    return None


DRIVER = r"""
#include <cstdio>
#include <cuda_runtime.h>
#include "host_waits.hpp"
int main() {
  char buf[16] = {};
  (void)cudaStreamSynchronize(nullptr);
  (void)cudaDeviceSynchronize();
  (void)cudaEventSynchronize(nullptr);
  (void)cudaMemcpy(buf, buf + 8, 4, cudaMemcpyDeviceToHost);
  (void)cudaMemcpy2D(buf, 4, buf + 8, 4, 4, 1, cudaMemcpyDeviceToHost);
  (void)cudaGetLastError();
  std::printf("%d %llu\n", int(dsaib_py::counts_host_waits()), (unsigned long long)dsaib_py::host_waits());
}
"""


@pytest.mark.skipif(_toolkit() is None, reason="needs a C++ compiler and the CUDA toolkit's static runtime")
def test_the_extensions_wait_counter_counts_each_wrapped_runtime_call(tmp_path):
    """host_waits.cpp linked as python/CMakeLists.txt links the extension: each of
    the five runtime calls counted once (they fail without a GPU, and are counted
    all the same); linked without --wrap, nothing is counted."""
    src = REPO / "python" / "src"
    wrapped = re.findall(r"cudaError_t __wrap_(\w+)\(", (src / "host_waits.cpp").read_text())
    cmake = re.search(r"set\(DSAIB_PY_WAIT_CALLS ([^)]*)\)", (REPO / "python" / "CMakeLists.txt").read_text())
    assert cmake and cmake.group(1).split() == wrapped, (cmake and cmake.group(1), wrapped)
    cxx, include, lib = _toolkit()
    (tmp_path / "driver.cpp").write_text(DRIVER)
    base = [cxx, "-std=c++17", f"-I{src}", f"-I{include}", str(tmp_path / "driver.cpp"), str(src / "host_waits.cpp")]
    link = [f"-L{lib}", "-lcudart_static", "-ldl", "-lpthread", "-lrt"]
    wrap = [f"-Wl,--wrap={c}" for c in wrapped]
    subprocess.run(base + ["-DDSAIB_PY_COUNT_HOST_WAITS=1", "-o", str(tmp_path / "counted")] + wrap + link,
                   check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "counted")], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["1", str(len(wrapped))], out.stdout + out.stderr
    subprocess.run(base + ["-o", str(tmp_path / "plain")] + link, check=True, capture_output=True)
    out = subprocess.run([str(tmp_path / "plain")], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["0", "0"], out.stdout + out.stderr


# ---- every entry point ---------------------------------------------------------------


@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_each_entry_point_makes_its_documented_library_calls_and_no_torch_read_on_cpu(layout):
    table = documented()
    for call, prepare in runners(problem(layout, "cpu")).items():
        counted = prepare()
        with HostSyncs(cuda=False) as s:
            counted()
        calls, from_torch, _, _ = table[call]
        assert (s.library_calls, s.torch_total) == (calls, from_torch), (call, s.library_calls, s.torch_reads)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and dsaib's cuda backend")
@pytest.mark.parametrize("layout", ["bshd", "thd"])
def test_each_entry_point_synchronises_as_documented_on_a_gpu(layout):
    assert _dsaib.counts_host_waits, "this CUDA build does not count the library's waits (linked without --wrap)"
    table = documented()
    for call, prepare in runners(problem(layout, "cuda")).items():
        counted = prepare()
        torch.cuda.synchronize()
        with HostSyncs(cuda=True) as s:
            counted()
        torch.cuda.synchronize()
        calls, from_torch, bshd, thd = table[call]
        assert s.library_calls == calls and s.torch_syncs == s.torch_total == from_torch, \
            (call, s.torch_reads, s.torch_sync_messages)
        assert s.torch_syncs + s.library_waits == (bshd if layout == "bshd" else thd), (call, s.library_waits)


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and dsaib's cuda backend")
def test_a_captured_bshd_topk_replays_to_the_eager_result():
    # BSHD: no host synchronisation, so the op (its outputs and workspace from
    # torch's caching allocator) is captured and replayed.
    p = problem("bshd", "cuda")
    q, w, k = p["q"], p["w"], p["k"]
    eager = dt.indexer_topk(q, w, k, 8, return_logits=True, return_lengths=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with HostSyncs(cuda=True) as s, torch.cuda.graph(graph):
        captured = dt.indexer_topk(q, w, k, 8, return_logits=True, return_lengths=True)
    assert s.library_calls == 1 and s.library_waits == 0 and s.torch_total == 0
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(eager, captured))


@pytest.mark.skipif(not GPU, reason="needs a CUDA device and dsaib's cuda backend")
def test_captured_thd_calls_do_not_synchronise():
    # Inside a CUDA-graph capture the library checks THD cu_seqlens on the device.
    p = problem("thd", "cuda")
    q, w, k, ids, T, P, o = p["q"], p["w"], p["k"], p["ids"], p["T"], p["P"], p["opts"]
    calls = [lambda: dt.indexer_backward(q, w, k, ids, T, P, sm_scale=SM, **o),
             lambda: dt.indexer_topk(q, w, k, 8, return_logits=True, **o),
             lambda: dt.indexer_kl_loss_and_grad(q, w, k, ids, T, sm_scale=SM, **o),
             lambda: dt.attention_target(p["query"], p["kv"], p["lse"], ids, sm_scale=SM, **o)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    for c in calls:
        graph = torch.cuda.CUDAGraph()
        with HostSyncs(cuda=True) as s, torch.cuda.graph(graph):
            c()
        assert s.library_calls == 1 and s.library_waits == 0 and s.torch_total == 0
        graph.replay()
    torch.cuda.synchronize()
