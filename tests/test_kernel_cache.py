"""Eager kernels kept on disk as executables: a second process loads them instead of tracing."""

import json
import os
import subprocess
import sys

import pytest

RUN = r"""
import json, sys, torch, torchpjrt
from torchpjrt import fusion
traced = []  # kernels fused mode traced to learn their results' shapes
_eval_shape = fusion._eval_shape
fusion._eval_shape = lambda *a: traced.append(1) or _eval_shape(*a)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("pjrt")
opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
x, y = torch.randn(8, 16).to("pjrt"), torch.randn(8, 4).to("pjrt")
losses = []
for _ in range(3):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(m(x), y)
    loss.backward()
    opt.step()
    losses.append(loss.item())
s = torchpjrt.compile_stats()
e = torchpjrt.eager_stats()
print(json.dumps({"losses": losses, "hits": s["kernel_cache_hits"], "misses": s["kernel_cache_misses"],
                  "traced": len(traced), "graphs_compiled": e["graphs_compiled"],
                  "graphs_fused": e["cache_hits"] + e["cache_misses"], "flushes": e["flushes"]}))
"""


def _run(env, mode="strict"):
    r = subprocess.run([sys.executable, "-c", RUN], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TORCHPJRT_KERNEL_CACHE": "on", **env, "TORCHPJRT_EAGER_MODE": mode})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # fresh processes
def test_a_second_process_loads_eager_kernels_and_gets_the_same_numbers(tmp_path):
    env = {"TORCHPJRT_CACHE_DIR": str(tmp_path / "cache")}
    cold = _run(env)
    warm = _run(env)
    assert cold["hits"] == 0 and cold["misses"] > 0
    assert warm["hits"] == cold["misses"] and warm["misses"] == 0
    assert warm["losses"] == cold["losses"]
    # an unreadable entry is rebuilt, not trusted
    entries = [os.path.join(d, f) for d, _, files in os.walk(tmp_path / "cache" / "kernels") for f in files]
    assert len(entries) == cold["misses"]
    for path in entries:
        with open(path, "wb") as f:
            f.write(b"not an executable")
    broken = _run(env)
    assert broken["losses"] == cold["losses"] and broken["hits"] == 0
    assert not any(os.path.exists(p) and open(p, "rb").read() == b"not an executable" for p in entries)
    # fused eager mode traces the same kernels into larger programs: unaffected
    assert _run(env, "fused")["losses"] == pytest.approx(cold["losses"], rel=1e-5)
    off = _run({"TORCHPJRT_CACHE_DIR": "off"})
    assert off["hits"] == 0 and off["misses"] == 0 and off["losses"] == cold["losses"]


@pytest.mark.slow  # fresh processes
def test_fused_mode_in_a_second_process_traces_nothing_and_runs_its_graphs_from_the_first_step(tmp_path):
    env = {"TORCHPJRT_CACHE_DIR": str(tmp_path / "cache")}
    cold = _run(env, "fused")
    warm = _run(env, "fused")
    strict = _run({"TORCHPJRT_CACHE_DIR": "off"})
    # the first process learns its kernels' results by tracing them, compiles the training step's
    # graphs when they come back, and keeps them
    assert cold["traced"] > 0 and cold["graphs_compiled"] > 0 and cold["misses"] > 0
    # the next one reads the results' shapes from the kept kernels and loads the kept graphs: it
    # traces nothing, and runs fused more of the flushes, from the first step on
    assert warm["traced"] == 0 and warm["graphs_compiled"] == 0 and warm["misses"] == 0
    assert warm["graphs_fused"] > cold["graphs_fused"] and warm["flushes"] == cold["flushes"]
    # a fused graph rounds as XLA fuses it, the same ops run one by one as strict mode rounds
    assert warm["losses"] == pytest.approx(cold["losses"], rel=1e-5)
    assert warm["losses"] == pytest.approx(strict["losses"], rel=1e-5)


STORAGE_HELPERS = r"""
import json, torch, torchpjrt
x = torch.arange(24.0).reshape(4, 6).to("pjrt")
x[1] = torch.arange(6, dtype=torch.int64).to("pjrt")  # a row write with a cast
x[:, 2] = 7.0  # a strided write of a broadcast number
y = x.t().contiguous()  # a strided read
c = torch.nn.functional.conv2d(torch.ones(1, 2, 5, 5).to("pjrt").to(memory_format=torch.channels_last),
                               torch.ones(3, 2, 3, 3).to("pjrt"))  # a result laid out channels_last
r = torch.arange(5.0).to("pjrt")
r.resize_(9)  # grows the storage
r[5:] = 1.0
one = torch.tensor([[2.5]]).to("pjrt")
masks = [one[one > 0].cpu().tolist(), torch.masked_select(x, x > 20).cpu().tolist(), x[x > 20].cpu().tolist(),
         torch.equal(x, y.t()), torch.equal(x, y.t() + 1)]  # coordinates of a mask, torch.equal
print(json.dumps({"values": [x.cpu().tolist(), y.cpu().tolist(), c.cpu().tolist(), r.cpu().tolist(), masks],
                  "stride": list(c.stride()), "compiles": torchpjrt.eager_stats()["xla_compiles"]}))
"""


@pytest.mark.slow  # fresh processes
def test_a_second_process_compiles_nothing_for_storage_reads_writes_casts_layouts_and_masks(tmp_path):
    # strided reads and writes, casts, broadcasts, transposes to a result's layout and growing a
    # storage are programs of their own, and so are a boolean mask's count and coordinates and
    # torch.equal's comparison: a warm process loads them with the op kernels
    env = {**os.environ, "TORCHPJRT_CACHE_DIR": str(tmp_path / "cache"),
           "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax")}
    runs = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", STORAGE_HELPERS], capture_output=True, text=True, timeout=300,
                           env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    cold, warm = runs
    assert cold["compiles"] > 0 and warm["compiles"] == 0, (cold, warm)
    assert warm["values"] == cold["values"] and warm["stride"] == cold["stride"] == [27, 1, 9, 3]
    import torch

    x = torch.arange(24.0).reshape(4, 6)
    x[1] = torch.arange(6.0)
    x[:, 2] = 7.0
    r = torch.cat([torch.arange(5.0), torch.ones(4)])
    assert cold["values"][0] == x.tolist() and cold["values"][1] == x.t().tolist() and cold["values"][3] == r.tolist()
    assert cold["values"][4] == [[2.5], x[x > 20].tolist(), x[x > 20].tolist(), True, False]


def test_a_loaded_kernel_falls_back_to_jit_for_arguments_it_was_not_built_for(tmp_path, monkeypatch):
    import jax
    import jax.numpy as jnp

    from torchpjrt import kernel_cache

    monkeypatch.setattr(kernel_cache, "_directory", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_tag", "test")
    monkeypatch.setattr(kernel_cache, "stats", kernel_cache.Counter())
    # unique to this run: JAX's persistent cache must not know the program yet
    identity = ("test::double", "default", ("float32", (4,)), str(tmp_path))
    first = kernel_cache.CachedKernel(jax.jit(lambda x: x * 2), identity)
    assert first(jnp.ones(4, jnp.float32)).tolist() == [2.0] * 4
    again = kernel_cache.CachedKernel(jax.jit(lambda x: x * 2), identity)  # a new process's kernel
    assert again(jnp.ones(4, jnp.float32)).tolist() == [2.0] * 4
    assert kernel_cache.stats["kernel_cache_misses"] == 1 and kernel_cache.stats["kernel_cache_hits"] == 1
    # arguments the executable was not compiled for: jit takes over
    assert again(jnp.arange(3, dtype=jnp.int32)).tolist() == [0, 2, 4]
    assert kernel_cache.stats["kernel_cache_fallbacks"] == 1


COMPILED = r"""
import json, torch, torchpjrt
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to("pjrt")
opt = torch.optim.SGD(m.parameters(), lr=1e-2)
x, y = torch.randn(8, 16).to("pjrt"), torch.randn(8, 4).to("pjrt")
loss_fn = torch.compile(lambda: torch.nn.functional.mse_loss(m(x), y), backend="pjrt")
losses = []
for _ in range(3):
    opt.zero_grad()
    loss = loss_fn()
    loss.backward()
    opt.step()
    losses.append(loss.item())
s = torchpjrt.compile_stats()
print(json.dumps({"losses": losses, "programs": s["xla_compiles"], "graphs_loaded": s["graph_cache_hits"],
                  "hits": s["kernel_cache_hits"], "misses": s["kernel_cache_misses"],
                  "jax_lookups": s["persistent_cache_hits"] + s["persistent_cache_misses"]}))
"""


def _run_compiled(env, mode="strict"):
    r = subprocess.run([sys.executable, "-c", COMPILED], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env, "TORCHPJRT_EAGER_MODE": mode})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # fresh processes
def test_a_second_process_loads_compiled_graphs_without_tracing_them(tmp_path):
    env = {"TORCHPJRT_CACHE_DIR": str(tmp_path / "cache"), "TORCHPJRT_KERNEL_CACHE": "on",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    cold = _run_compiled(env)
    assert cold["programs"] == 2 and cold["graphs_loaded"] == 0  # forward and backward
    warm = _run_compiled(env)
    # every program of the warm process (the two graphs, the eager SGD step's kernels) is loaded
    # as an executable: nothing goes through JAX's tracing, lowering and cache lookup
    assert warm["graphs_loaded"] == 2 and warm["programs"] == 2
    assert warm["hits"] == cold["misses"] > 2 and warm["misses"] == 0 and warm["jax_lookups"] == 0
    assert warm["losses"] == cold["losses"]
    # without the layer, JAX's cache alone: every program is traced again to find it
    off = _run_compiled({**env, "TORCHPJRT_KERNEL_CACHE": "off"})
    assert off["jax_lookups"] >= cold["misses"] and off["hits"] == 0 and off["losses"] == cold["losses"]
    # fused eager mode traces the graphs into its own programs
    assert _run_compiled(env, "fused")["losses"] == pytest.approx(cold["losses"], rel=1e-5)



def test_tag_directories_unused_for_two_weeks_are_removed(tmp_path):
    import time

    from torchpjrt import kernel_cache

    root = tmp_path / "kernels"
    for name in ("stale", "recent", "current"):
        (root / name / "ab").mkdir(parents=True)
        (root / name / "ab" / "entry").write_bytes(b"x")
    long_ago = time.time() - kernel_cache.STALE_AFTER_S - 60
    os.utime(root / "stale", (long_ago, long_ago))
    os.utime(root / "current", (long_ago, long_ago))  # stale too, but this process uses it
    kernel_cache._prune(str(root), "current")
    assert sorted(os.listdir(root)) == ["current", "recent"]
    assert (root / "current" / "ab" / "entry").exists()
    assert time.time() - os.stat(root / "current").st_mtime < 60  # marked as used


EDITED_KERNEL = r"""
import sys, torch, torchpjrt
SCALE = float(sys.argv[1])

@torchpjrt.kernel
def scale(x):
    return x * SCALE

x = torch.ones(3, device="pjrt")
print(scale(x).tolist()[0], torch.compile(lambda t: scale(t) + 1, backend="pjrt")(x).tolist()[0])
"""


@pytest.mark.slow  # fresh processes
def test_an_edited_custom_kernel_is_not_loaded_stale(tmp_path):
    """A custom kernel's body is user code the cache's environment tag does not hash: a process
    whose kernel computes something else must not load the earlier process's executable."""
    env = {**os.environ, "TORCHPJRT_KERNEL_CACHE": "on", "TORCHPJRT_CACHE_DIR": str(tmp_path / "cache")}
    for scale in ("2", "3", "2"):
        r = subprocess.run([sys.executable, "-c", EDITED_KERNEL, scale], capture_output=True, text=True,
                           timeout=300, env=env)
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stdout.split() == [f"{float(scale)}", f"{float(scale) + 1}"]


def test_prepare_all_compiles_new_kernels_side_by_side_from_abstract_arguments(tmp_path, monkeypatch):
    import threading

    import jax
    import jax.numpy as jnp

    from torchpjrt import kernel_cache
    from torchpjrt.device import jax_device

    monkeypatch.setattr(kernel_cache, "_directory", str(tmp_path))
    monkeypatch.setattr(kernel_cache, "_tag", "test")
    monkeypatch.setattr(kernel_cache, "stats", kernel_cache.Counter())
    monkeypatch.setattr(kernel_cache, "PREPARE_THREADS", 2)
    threads = []
    first_call = kernel_cache.CachedKernel._first_call
    monkeypatch.setattr(kernel_cache.CachedKernel, "_first_call",
                        lambda self, args: threads.append(threading.current_thread().name) or first_call(self, args))
    sharding = jax.sharding.SingleDeviceSharding(jax_device(0))

    def kernel(name, fn):  # unique to this run: JAX's persistent cache must not know the programs yet
        return kernel_cache.CachedKernel(jax.jit(fn), (f"test::{name}", str(tmp_path)))

    scale = kernel("scale", lambda x, a: x * a)
    matmul = kernel("matmul", lambda x, y: jnp.tanh(x @ y))
    cast = kernel("cast", lambda x: x.astype(jnp.int32) + 1)
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    abstract = jax.ShapeDtypeStruct((4, 5), jnp.float32, sharding=sharding)  # a value not computed yet
    calls = [(scale, (x, 2.5)), (matmul, (x, abstract)), (cast, (x,)), (scale, (x, 2.5))]
    assert kernel_cache.prepare_all(calls) == 3  # each kernel once
    assert len(threads) == 3 and all(t.startswith("torchpjrt-prepare") for t in threads)
    assert kernel_cache.stats["kernel_cache_misses"] == 3 and kernel_cache.stats["kernels_prepared"] == 3
    assert kernel_cache.prepare_all(calls) == 0  # prepared already
    # the first calls run what was prepared: no compile, no fallback to jit, the same numbers as jit
    y = jnp.ones((4, 5), jnp.float32)
    assert scale(x, 3.0).tolist() == (x * 3.0).tolist()  # a Python number: traced, any value
    assert matmul(x, y).tolist() == jax.jit(lambda x, y: jnp.tanh(x @ y))(x, y).tolist()
    assert cast(x).tolist() == (x.astype(jnp.int32) + 1).tolist()
    assert len(threads) == 3 and kernel_cache.stats["kernel_cache_fallbacks"] == 0
    assert scale._prepared is None and scale._call is not scale.traceable
    # the entries kept for a later process describe the calls as a concrete first call would
    again = kernel_cache.CachedKernel(jax.jit(lambda x, y: jnp.tanh(x @ y)), ("test::matmul", str(tmp_path)))
    treedef, signature, _, results = again.stored_shapes()
    assert treedef == jax.tree_util.tree_structure((x, y))
    assert signature == (((3, 4), jnp.dtype(jnp.float32), False), ((4, 5), jnp.dtype(jnp.float32), False))
    assert results == [((3, 5), jnp.dtype(jnp.float32), False)]
    assert again(x, y).tolist() == matmul(x, y).tolist() and kernel_cache.stats["kernel_cache_hits"] == 1


def test_fused_mode_prepares_a_first_sightings_kernels_side_by_side(empty_kernel_cache, monkeypatch):
    import torch

    import torchpjrt
    from torchpjrt import kernel_cache

    if kernel_cache.directory() is None:
        pytest.skip("the kernel cache is off")
    monkeypatch.setattr(kernel_cache, "PREPARE_THREADS", 2)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(13, 29), torch.nn.GELU(), torch.nn.LayerNorm(29), torch.nn.Linear(29, 3))
    x = torch.randn(11, 13)
    expected = m(x).softmax(-1).sum(0)
    m.to("pjrt")
    before = dict(kernel_cache.stats)
    with torchpjrt.eager_mode("fused"):  # a first sighting runs op by op, each op its own kernel
        got = m(x.to("pjrt")).softmax(-1).sum(0).cpu()
    prepared = kernel_cache.stats["kernels_prepared"] - before.get("kernels_prepared", 0)
    compiled = kernel_cache.stats["kernel_cache_misses"] - before.get("kernel_cache_misses", 0)
    assert prepared >= 5 and compiled >= prepared
    assert kernel_cache.stats["kernel_cache_fallbacks"] == before.get("kernel_cache_fallbacks", 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_small_zero_fills_and_exact_constant_fills_run_no_program(empty_kernel_cache):
    import torch

    from torchpjrt import kernel_cache, live_programs

    def programs():
        return (live_programs.stats["xla_compiles"], kernel_cache.stats["kernel_cache_hits"],
                kernel_cache.stats["kernel_cache_misses"])

    before = programs()
    made = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int8, torch.bool):
        shape = (37, 53)  # a shape nothing else in the suite fills
        made.append((torch.zeros(shape, dtype=dtype, device="pjrt"), torch.zeros(shape, dtype=dtype)))
        made.append((torch.ones(shape, dtype=dtype, device="pjrt"), torch.ones(shape, dtype=dtype)))
        made.append((torch.empty(shape, dtype=dtype, device="pjrt").zero_(), torch.zeros(shape, dtype=dtype)))
        if dtype.is_floating_point:  # a mask's fill, and a signed zero
            for value in (float("-inf"), -0.0, 0.5):
                made.append((torch.full(shape, value, dtype=dtype, device="pjrt"), torch.full(shape, value, dtype=dtype)))
    assert programs() == before  # copied from the host: nothing compiled or loaded
    for got, expected in made:
        assert got.dtype == expected.dtype and torch.equal(got.cpu(), expected)
        assert torch.equal(got.cpu().float().signbit(), expected.float().signbit())
    # a number the dtype does not hold exactly (0.1 in float32) is converted by the program, as before
    inexact = torch.full((37, 53), 0.1, device="pjrt")
    assert programs() != before
    assert torch.equal(inexact.cpu(), torch.full((37, 53), 0.1))


def test_views_of_small_storages_reach_the_cpu_without_a_program(empty_kernel_cache):
    import torch

    from torchpjrt import live_programs

    torch.manual_seed(0)
    cpu = torch.randn(29, 31)  # shapes nothing else in the suite reads
    x = cpu.to("pjrt")
    compiles = live_programs.stats["xla_compiles"]
    views = [lambda t: t[3], lambda t: t.t(), lambda t: t[:, 5], lambda t: t.diagonal(), lambda t: t[2:9, ::3],
             lambda t: t.unsqueeze(0).expand(2, 29, 31), lambda t: t.view(-1)[7:40], lambda t: t[1:3].T,
             lambda t: t[4, 6], lambda t: t[:1, :1].squeeze(), lambda t: t[2].unbind()[3]]  # 0-d views too
    for view in views:
        got = view(x).cpu()
        assert got.shape == view(cpu).shape and torch.equal(got, view(cpu))
    assert "device='pjrt:0'" in str(x[4])  # print of a row
    assert live_programs.stats["xla_compiles"] == compiles  # copied whole to the host, viewed there
    # a row of a large storage is read on the device: the host would copy 4 MiB for 4 KiB
    big = torch.randn(1024, 1031).to("pjrt")
    compiles = live_programs.stats["xla_compiles"]
    assert torch.equal(big[5].cpu(), big.cpu()[5])
    assert live_programs.stats["xla_compiles"] > compiles
