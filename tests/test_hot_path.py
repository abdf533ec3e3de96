"""Strict mode's hot path (csrc/hot_ops.cpp, hot_path.py): repeated calls of functional ops served
from C++ give what the Python kernels give, call for call; what it cannot serve goes to them."""

import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
import torch.nn.functional as F

import torchpjrt
from torchpjrt import hot_path, native, storage

DEV = "pjrt"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _active():
    return hot_path._library is not None


needs_hot_path = pytest.mark.skipif(
    not _active(), reason=f"the hot path is not loaded: {native.failure() or 'Python headers or a compiler missing'}")


def served(fn):
    """(fn's result, how many calls the hot path served while it ran)."""
    before = hot_path.calls()
    out = fn()
    return out, hot_path.calls() - before


@needs_hot_path
def test_the_suite_runs_with_the_hot_path_loaded():
    assert native.library() is not None
    a = torch.randn(5, 7, device="pjrt")
    b = torch.randn(5, 7, device="pjrt")
    a + b  # the Python kernel's call: the C++ kernel learns its program
    out, n = served(lambda: a + b)
    assert n == 1
    torch.testing.assert_close(out.cpu(), a.cpu() + b.cpu(), rtol=0, atol=0)
    before = torchpjrt.eager_stats()["ops_dispatched"]
    a + b
    assert torchpjrt.eager_stats()["ops_dispatched"] == before + 1  # counted with the Python kernels'


@needs_hot_path
def test_results_are_new_tensors_as_the_python_kernel_makes_them():
    a = torch.randn(3, 4, device="pjrt")
    a * 3.0
    c, n = served(lambda: a * 3.0)
    assert n == 1
    model = torchpjrt.storage._create_empty((1,), torch.float32)
    assert torch._C._dispatch_keys(c) == torch._C._dispatch_keys(model)
    assert c.device == torch.device("pjrt:0") and c.shape == (3, 4) and c.stride() == (4, 1)
    assert c.dtype == torch.float32 and not c.requires_grad and c.is_leaf
    s = c.untyped_storage()
    assert s.nbytes() == 48 and s.resizable()
    assert c.data_ptr() >= 2**60 and c.data_ptr() % 256 == 0
    d = a * 3.0
    assert len({c.data_ptr(), d.data_ptr(), a.data_ptr()}) == 3  # each storage its own address
    # its storage object has every attribute Storage.__init__ gives one, with the same values
    from torchpjrt.storage import Storage

    made = c.untyped_storage()._pjrt
    reference = Storage(made.array, torch.float32, (3, 4))
    assert type(made) is Storage
    assert {k: getattr(made, k) for k in Storage.__slots__ if k != "__weakref__"} == \
        {k: getattr(reference, k) for k in Storage.__slots__ if k != "__weakref__"}
    # the new tensor is an ordinary pjrt tensor: views, in-place writes, host reads
    c[0].fill_(1.0)
    c.view(12)[5] = 7.0
    expected = a.cpu() * 3.0
    expected[0] = 1.0
    expected.view(12)[5] = 7.0
    torch.testing.assert_close(c.cpu(), expected)
    assert s.data_ptr() == c.data_ptr()


@needs_hot_path
def test_numbers_keep_their_types_and_values():
    x = torch.arange(6, device="pjrt").reshape(2, 3).clone()  # its own storage: a whole tensor
    xc = x.cpu()
    calls = [lambda t: t + 1, lambda t: t + 1.0, lambda t: t + 2, lambda t: t + 2.5, lambda t: t * True,
             lambda t: t * False, lambda t: t - 7, lambda t: t / 2, lambda t: t.add(3, alpha=2),
             lambda t: t.add(3.0, alpha=1), lambda t: torch.sub(t, 1.5, alpha=3), lambda t: t.float() * -0.0,
             lambda t: t.float() + float("nan"), lambda t: t.pow(2), lambda t: t.float().pow(0.5)]
    for round in range(3):  # the first round runs the Python kernels, the later ones the hot path
        for i, f in enumerate(calls):
            got, n = served(lambda: f(x))
            want = f(xc)
            assert got.dtype == want.dtype, i
            torch.testing.assert_close(got.cpu(), want, equal_nan=True)
            if round and i in (0, 1, 2, 3, 6, 8):
                assert n == 1, i
    # a traced number: a new value reuses the program, and gives the new result
    y = torch.randn(4, device="pjrt")
    for k in range(5):
        got, n = served(lambda: y * (k + 0.25))
        torch.testing.assert_close(got.cpu(), y.cpu() * (k + 0.25))
    assert n == 1


@needs_hot_path
def test_static_arguments_are_part_of_the_key():
    t = torch.randn(4, 6, device="pjrt")
    tc = t.cpu()
    calls = [lambda m, v: F.gelu(v), lambda m, v: F.gelu(v, approximate="tanh"),
             lambda m, v: m.sum(v, 1), lambda m, v: m.sum(v, 0), lambda m, v: m.sum(v, (0, 1), keepdim=True),
             lambda m, v: m.sum(v, 1, dtype=torch.float64), lambda m, v: m.mean(v, -1),
             lambda m, v: m.softmax(v, 0), lambda m, v: m.softmax(v, 1), lambda m, v: m.clamp(v, -0.5, 0.5),
             lambda m, v: m.clamp(v, min=-0.25), lambda m, v: m.div(v, 3, rounding_mode="floor"),
             lambda m, v: m.div(v, 3, rounding_mode="trunc"), lambda m, v: m.div(v, 3)]
    for round in range(3):
        for i, f in enumerate(calls):
            got, n = served(lambda: f(torch, t))
            want = f(torch, tc)
            assert got.dtype == want.dtype and got.shape == want.shape
            torch.testing.assert_close(got.cpu(), want)
            if round and i in (0, 1, 2, 3, 4, 5):
                assert n >= 1, i


@needs_hot_path
def test_views_as_arguments_are_keyed_by_their_geometry():
    base = torch.randn(6, 8, device="pjrt")
    cpu = base.cpu()
    calls = [lambda b: b.t() + 1.5, lambda b: b[2:] * 2.0, lambda b: b[:, 1::3].exp(), lambda b: b[1] - b[4],
             lambda b: b.t() @ b, lambda b: b[:3].t().mm(b[3:]), lambda b: b[:, :1].expand(6, 5) * 3.0,
             lambda b: b.diagonal().sum(), lambda b: torch.addmm(b[0, :3], b[:2, :4], b[:4, 4:7]),
             lambda b: b.unsqueeze(0).transpose(1, 2).softmax(-1)]
    for round in range(3):
        for i, f in enumerate(calls):
            got, n = served(lambda: f(base))
            want = f(cpu)
            torch.testing.assert_close(got.cpu(), want)
            assert got.stride() == want.stride()
            if round:
                # b.t() + 1.5 is laid out as its input (strides (1, 8)), and served so
                assert n == 1, i
    # rows read one at a time (a KV cache's pattern): one program for every row, each served
    for round in range(2):
        for r in range(6):
            got, n = served(lambda: base[r] * 0.5)
            torch.testing.assert_close(got.cpu(), cpu[r] * 0.5)
            assert n == 1 or round == 0


@needs_hot_path
def test_a_whole_storage_in_another_shape_is_served_alone_and_in_lists():
    """A tensor that is all of its storage in another shape (a Linear's bias gradient: the
    storage of `sum(0, keepdim=True)`, viewed flat) is read as a reshape: served as an argument
    and inside a foreach op's list (an optimizer step's grads), not only by the Python kernel.
    As an in-place target it is written whole, the storage taking the tensor's shape."""
    flat = torch.randn(1, 8, device="pjrt").view(8)
    grid = torch.randn(4, 6, device="pjrt").view(2, 12)
    states = [torch.randn(8, device="pjrt"), torch.randn(2, 12, device="pjrt")]
    cpu_flat, cpu_grid, cpu_states = flat.cpu(), grid.cpu(), [s.cpu() for s in states]
    for round in range(3):
        got, n = served(lambda: flat * 2.0 + grid.sum())
        torch.testing.assert_close(got.cpu(), cpu_flat * 2.0 + cpu_grid.sum())
        assert n == 3 or round == 0
        _, n = served(lambda: torch._foreach_lerp_(states, [flat, grid], 0.1))
        torch._foreach_lerp_(cpu_states, [cpu_flat, cpu_grid], 0.1)
        assert n == 1 or round == 0
        _, n = served(lambda: torch._foreach_addcmul_(states, [flat, grid], [flat, grid], 0.5))
        torch._foreach_addcmul_(cpu_states, [cpu_flat, cpu_grid], [cpu_flat, cpu_grid], 0.5)
        assert n == 1 or round == 0
        for s, c in zip(states, cpu_states):
            torch.testing.assert_close(s.cpu(), c)
    for round in range(3):
        target = torch.randn(1, 8, device="pjrt").view(8)
        cpu_target = target.cpu()
        _, n = served(lambda: target.mul_(0.5))
        cpu_target.mul_(0.5)
        assert n == 1 or round == 0
        assert target.untyped_storage()._pjrt.shape == (8,)
        torch.testing.assert_close(target.cpu(), cpu_target)


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_ops_checked_on_the_device_are_served_and_still_raise(mode):
    """embedding, index_select, gather, index_add and nll_loss check their indices on the device:
    the hot path serves them and hands the check's vector on, so an index out of range raises
    CPU's error at the next synchronization, naming the caller's line; with the checks turned
    off (another program, keyed apart) nothing is checked."""
    w = torch.randn(10, 4, device="pjrt")
    x = torch.randn(5, 10, device="pjrt")
    cw, cx = w.cpu(), x.cpu()
    cases = {
        "embedding": (lambda t, i: F.embedding(i, t), [1, 2, 3], [1, 12, 3], "index out of range in self"),
        "index_select": (lambda t, i: t.index_select(0, i), [0, 9, 3], [0, 10, 3], "index out of range in self"),
        "gather": (lambda t, i: t.gather(0, i[:, None].expand(3, 4)), [0, 9, 3], [0, 10, 3], "out of bounds"),
        "index_add": (lambda t, i: t.index_add(0, i, torch.ones(3, 4, device=t.device)), [0, 9, 3], [0, 10, 3],
                      "out of bounds"),
        "nll_loss": (lambda t, i: F.cross_entropy(x if t.device.type == "pjrt" else cx, i), [1, 2, 3, 4, 5],
                     [1, 2, 3, 4, 50], "out of bounds"),
    }
    with torchpjrt.eager_mode(mode):
        for name, (fn, good, bad, message) in cases.items():
            for round in range(3):
                got, n = served(lambda: fn(w, torch.tensor(good, device="pjrt")))
                torch.testing.assert_close(got.cpu(), fn(cw, torch.tensor(good)))
                assert n >= 1 or round == 0, name
            with pytest.raises((IndexError, RuntimeError), match=message):
                fn(w, torch.tensor(bad, device="pjrt"))
                torch.pjrt.synchronize()
            torchpjrt.set_device_checks(False)
            try:
                for round in range(3):
                    _, n = served(lambda: fn(w, torch.tensor(good, device="pjrt")))
                    assert n >= 1 or round == 0, name
            finally:
                torchpjrt.set_device_checks(True)
            with pytest.raises((IndexError, RuntimeError), match=message):
                fn(w, torch.tensor(bad, device="pjrt"))
                torch.pjrt.synchronize()


@needs_hot_path
def test_casts_on_the_device_are_served():
    """`x.half()`, `x.float()` and autocast's casts (`_to_copy` with a dtype) are served like any
    op; a transposed input's cast keeps CPU's strides, and a copy to another device or to the host
    is the Python kernel's."""
    a = torch.randn(16, 8, device="pjrt")
    cpu = a.cpu()
    calls = [lambda x: x.half(), lambda x: x.to(torch.bfloat16), lambda x: x[2:5].double(), lambda x: x.to(torch.int32),
             lambda x: x.half().float()]
    for round in range(3):
        for f in calls:
            got, n = served(lambda: f(a))
            want = f(cpu)
            assert got.dtype == want.dtype and got.stride() == want.stride()
            torch.testing.assert_close(got.cpu(), want, rtol=0, atol=0)
            assert n >= 1 or round == 0
        got, n = served(lambda: a.t().half())
        assert got.stride() == cpu.t().half().stride() and (n == 1 or round == 0)
        torch.testing.assert_close(got.cpu(), cpu.t().half(), rtol=0, atol=0)
        got, n = served(lambda: a.to("cpu", torch.float16))
        assert got.device.type == "cpu" and n == 0
    with torch.autocast("pjrt", dtype=torch.bfloat16):
        lin = torch.nn.Linear(8, 4).to("pjrt")
        for round in range(3):
            out, n = served(lambda: lin(a))
            assert out.dtype == torch.bfloat16 and (n >= 2 or round == 0)  # the input's cast and addmm (weights: cached)


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_results_laid_out_as_cpu_lays_them_out_are_served(mode):
    """An op on a transposed or permuted input gives a result in its input's order on CPU (an
    attention's `q * scale`, rotary embeddings on permuted heads, channels-last images): served
    with those strides, each result a dense tensor of its own."""
    x = torch.randn(2, 3, 4, 5)
    w = torch.randn(2, 5, 4, 3)
    calls = [lambda d: d(x).permute(0, 2, 1, 3) * 0.5, lambda d: d(x).transpose(1, 3).neg(),
             lambda d: d(x).permute(0, 2, 1, 3) + d(x).permute(0, 2, 1, 3),
             lambda d: d(x).transpose(1, 3) * d(w), lambda d: d(x).contiguous(memory_format=torch.channels_last).exp(),
             lambda d: torch.sigmoid(d(x).mT), lambda d: d(x).transpose(0, 1).to(torch.bfloat16)]
    torchpjrt.set_eager_mode(mode)
    try:
        on_device = {id(x): x.to("pjrt"), id(w): w.to("pjrt")}
        for round in range(3):
            for i, f in enumerate(calls):
                got, n = served(lambda: f(lambda t: on_device[id(t)]))
                want = f(lambda t: t)
                assert got.stride() == want.stride() and got.dtype == want.dtype, i
                assert got.untyped_storage().nbytes() == want.numel() * want.element_size()
                torch.testing.assert_close(got.cpu(), want)  # (exp and sigmoid: within an ulp of CPU's)
                if round:
                    assert n >= 1, i
                got.add_(1)  # a result is a tensor of its own
                torch.testing.assert_close(got.cpu(), want + 1)
    finally:
        torchpjrt.set_eager_mode("strict")


@needs_hot_path
def test_what_it_cannot_key_goes_to_the_python_kernel():
    base = torch.randn(6, 8, device="pjrt")
    cpu = base.cpu()
    for _ in range(3):
        out, n = served(lambda: base + torch.tensor(2.0))  # a CPU scalar tensor
        assert n == 0
        torch.testing.assert_close(out.cpu(), cpu + 2.0)
        view = base[1]
        out, n = served(lambda: view.add_(1.0))  # a view as in-place target: scattered into its storage
        cpu[1].add_(1.0)
        assert n == 0 and out is view
    torch.testing.assert_close(base.cpu(), cpu)
    # a storage not written yet (empty()): materialized as the Python kernel's read does (zeros,
    # one valid content), then served once its key is learned
    for _ in range(2):
        e = torch.empty(3, 5, device="pjrt")
        out, n = served(lambda: e + 1)
        assert torch.equal(out.cpu(), torch.ones(3, 5)) and e.untyped_storage()._pjrt.array is not None
    assert n == 1


@needs_hot_path
def test_fused_recording_debug_mode_and_padded_storages():
    from torchpjrt import padding

    a = torch.randn(8, device="pjrt")
    a.exp()
    a.exp()
    with torchpjrt.eager_mode("fused"):
        # recorded into the pending graph: exp by the hot path (learned above), the product by
        # the hot path or by the Python kernel (if no earlier call learned it in strict mode)
        pending = torchpjrt.eager_stats()["ops_pending"]
        out, n = served(lambda: a.exp() * 2.0)
        assert n >= 1 and torchpjrt.eager_stats()["ops_pending"] == pending + 2
        assert type(out.untyped_storage()._pjrt.array) is torchpjrt.fusion.Pending
    torch.testing.assert_close(out.cpu(), a.cpu().exp() * 2.0)
    with torchpjrt.eager_mode("debug", log_ops=True):
        out, n = served(lambda: a.exp())
        assert n == 0
    # a padded storage (nonzero's result): exact tensors stay on the hot path meanwhile; a view
    # of it that is all of it in another shape once its rule widens it (a column of an (n, 1)
    # index) is served from its second call, padded as the Python kernel pads it
    idx = (a > 0).nonzero()
    assert padding.storage_padding_of(idx) is not None
    out, n = served(lambda: a.exp())
    assert n == 1
    column = idx[:, 0]
    column.neg()
    out, n = served(lambda: column.neg())
    assert n == 1 and padding.storage_padding_of(out) == padding.storage_padding_of(idx)
    torch.testing.assert_close(out.cpu(), -(a.cpu() > 0).nonzero()[:, 0])
    rows = idx[:, 0].float()
    rows.exp()  # a first call: the Python kernel (the pointwise rule keeps it padded)
    out, n = served(lambda: rows.exp())  # then the hot path, padded alike
    assert n == 1 and padding.storage_padding_of(out) == padding.storage_padding_of(idx)
    torch.testing.assert_close(out.cpu(), (a.cpu() > 0).nonzero()[:, 0].float().exp())


@pytest.mark.slow
@needs_hot_path
def test_autograd_inference_mode_and_threads():
    w = torch.randn(4, 4, device="pjrt", requires_grad=True)
    x = torch.randn(4, 4, device="pjrt")
    wc = w.detach().cpu().requires_grad_()
    for _ in range(3):
        w.grad = None
        (torch.tanh(x @ w) * 2.0).sum().backward()
    (torch.tanh(x.cpu() @ wc) * 2.0).sum().backward()
    torch.testing.assert_close(w.grad.cpu(), wc.grad)
    with torch.inference_mode():
        x + x
        y, n = served(lambda: x + x)
    assert n == 1 and y.is_inference() and not x.is_inference()

    errors = []

    def worker():
        try:
            for _ in range(200):
                torch.testing.assert_close((x * 0.5).cpu(), x.cpu() * 0.5)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    def first_calls(seed):
        # new keys in every thread at once: each learns the program of its own call
        try:
            for n in range(1, 9):
                u = torch.full((n + 100 * seed,), float(seed), device="pjrt")
                for _ in range(2):
                    got = (u * 2.0 + u).sum(0, keepdim=True)
                    assert got.shape == (1,) and got.item() == 3.0 * seed * (n + 100 * seed)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    threads += [threading.Thread(target=first_calls, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@needs_hot_path
def test_errors_are_the_python_kernels():
    a = torch.randn(3, device="pjrt")
    b = torch.randn(4, device="pjrt")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="size of tensor a"):
            a + b
    with pytest.raises(RuntimeError, match="result type Float can't be cast"):
        torch.add(a, a, out=torch.empty(3, dtype=torch.long, device="pjrt"))


@pytest.mark.slow  # fresh processes
def test_turned_off_or_on_the_results_are_the_same(tmp_path):
    script = tmp_path / "ops.py"
    script.write_text(textwrap.dedent("""
        import torch, torch.nn.functional as F, torchpjrt
        from torchpjrt import hot_path
        torch.manual_seed(0)
        x = torch.randn(16, 16, device="pjrt")
        outs = []
        for i in range(4):
            y = F.gelu(x @ x.t() * 0.1 + i).softmax(-1).sum(0) - 1
            outs.append(y.cpu())
        torch.save(torch.stack(outs), __import__("sys").argv[1])
        print("served", hot_path.calls())
    """))
    env = dict(os.environ, TORCHPJRT_PLATFORM="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    results = {}
    for setting in ("on", "off"):
        out = subprocess.run([sys.executable, str(script), str(tmp_path / f"{setting}.pt")],
                             env=dict(env, TORCHPJRT_NATIVE_OPS=setting), capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        results[setting] = int(out.stdout.split("served")[1])
    assert results["off"] == 0
    if _active():
        assert results["on"] > 0
    assert torch.equal(torch.load(tmp_path / "on.pt"), torch.load(tmp_path / "off.pt"))


@needs_hot_path
def test_in_place_forms_write_their_target_as_the_python_kernel_does():
    a = torch.randn(4, 5, device="pjrt")
    b = torch.randn(4, 5, device="pjrt")
    ac, bc = a.cpu(), b.cpu()
    view = a.view(20)  # reads the storage a's writes replace
    address, version = a.data_ptr(), a._version
    for round in range(3):
        out, n = served(lambda: a.add_(b, alpha=0.5))
        ac.add_(bc, alpha=0.5)
        assert out is a and (n == 1 or round == 0)
        out, n = served(lambda: a.mul_(1.5))
        ac.mul_(1.5)
        assert out is a and (n == 1 or round == 0)
    torch.testing.assert_close(a.cpu(), ac)
    torch.testing.assert_close(view.cpu(), ac.view(20))
    assert a.data_ptr() == address and a._version == version + 6
    # the target's storage object as Storage.replace leaves it (written from C++): a new array
    # and version, no materialized views (a read of the view on the device makes one)
    st = a.untyped_storage()._pjrt
    storage_version, array = st.version, st.array
    storage.read(view)
    assert st.views
    _, calls = python_frames(lambda: a.add_(b, alpha=0.5), {"replace", "_hold"})
    assert calls == [] and st.version == storage_version + 1 and st.views is None and st.array is not array
    assert st.shape == (4, 5) and st.padding is None
    ac.add_(bc, alpha=0.5)
    torch.testing.assert_close(view.cpu(), ac.view(20))
    # broadcasting into the target, a view target, a float64 other into float32: as on CPU
    row = torch.randn(5, device="pjrt")
    for _ in range(2):
        a.sub_(row)
        ac.sub_(row.cpu())
        a[1].add_(2.0)
        ac[1].add_(2.0)
        a.add_(torch.ones(4, 5, dtype=torch.float64, device="pjrt"))
        ac.add_(torch.ones(4, 5, dtype=torch.float64))
    torch.testing.assert_close(a.cpu(), ac)
    assert a.dtype == torch.float32
    ints = torch.arange(3, device="pjrt")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="can't be cast to the desired output type"):
            ints.add_(0.5)
    # autograd's checks stay in front of the kernel
    leaf = torch.randn(3, device="pjrt", requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        leaf.add_(1.0)


@needs_hot_path
def test_fused_modes_flush_heavy_regions_are_served_and_counted():
    x = torch.arange(60.0).reshape(20, 3)  # integers: exact sums (shapes no other test uses)

    def generate_like(device):
        d = x.to(device)
        return [(d[:n].neg() * 2 + 1).sum().item() for n in range(1, 21)]  # a new shape per read

    expected = generate_like("cpu")
    with torchpjrt.eager_mode("fused"):
        assert generate_like(DEV) == expected
        assert generate_like(DEV) == expected  # a flush-heavy region by now: ops run at once
        before = torchpjrt.eager_stats()
        got, n = served(lambda: generate_like(DEV))
        after = torchpjrt.eager_stats()
    assert got == expected
    assert n >= 20  # `* 2` of each round at least (`d[:n]` is a view: its neg goes to Python)
    # settled at each Python-kernel op (each neg): without the hot calls about 20 would count
    assert after["ops_passed_through"] - before["ops_passed_through"] >= n


@needs_hot_path
def test_a_flush_heavy_region_ends_after_its_count_when_every_op_is_served(monkeypatch):
    from torchpjrt import fusion

    monkeypatch.setattr(fusion, "passthrough_window", 4)
    monkeypatch.setattr(fusion, "passthrough_ops", 30)
    x = torch.arange(24.0, device="pjrt").reshape(4, 6)
    y = x * 1.0
    (y.tanh() * 0.5).tanh()  # the programs below, learned in strict mode
    with torchpjrt.eager_mode("fused"):
        for n in range(1, 6):  # host reads of new shapes: a flush-heavy region starts
            x[:n].neg().sum().item()
        before = torchpjrt.eager_stats()
        assert before["passthrough_regions"] >= 1 and fusion._passthrough_left
        for _ in range(40):
            y = y.tanh() * 0.5  # every op served by the hot path
        after = torchpjrt.eager_stats()
        assert fusion.stats["passthrough_ends"] > 0 and not fusion._passthrough_left
        assert after["ops_pending"] > 0  # recording again
    expected = torch.arange(24.0).reshape(4, 6)
    for _ in range(40):
        expected = expected.tanh() * 0.5
    torch.testing.assert_close(y.cpu(), expected)


@needs_hot_path
def test_ops_with_several_results():
    x = torch.randn(4, 6, device="pjrt")
    xc = x.cpu()
    calls = [lambda m, v: m.max(v, 1), lambda m, v: m.var_mean(v, 0), lambda m, v: m.sort(v, 1),
             lambda m, v: m.topk(v, 2), lambda m, v: m.aminmax(v, dim=0), lambda m, v: m.std_mean(v[1:], 1)]
    for round in range(3):
        for i, f in enumerate(calls):
            got, n = served(lambda: f(torch, x))
            want = f(torch, xc)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and g.shape == w.shape
                torch.testing.assert_close(g.cpu(), w)
            assert got[0].data_ptr() != got[1].data_ptr()
            if round and i in (0, 1, 2, 3):
                assert n == 1, i
    # layer norm's forward (three results) and backward (results left out by its mask: Python)
    w = torch.randn(6, device="pjrt", requires_grad=True)
    wc = w.detach().cpu().requires_grad_()
    for _ in range(3):
        w.grad = None
        F.layer_norm(x, (6,), w).sum().backward()
    F.layer_norm(xc, (6,), wc).sum().backward()
    torch.testing.assert_close(w.grad.cpu(), wc.grad)
    got, n = served(lambda: F.layer_norm(x, (6,), w.detach()))
    assert n == 1
    torch.testing.assert_close(got.cpu(), F.layer_norm(xc, (6,), wc.detach()))


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_backward_ops_with_an_output_mask(mode):
    """Layer norm's, group norm's and convolution's backward take the gradients wanted as a
    bool[3]: served, a gradient left out (a first layer's input, a convolution without bias)
    None as on CPU."""
    aten = torch.ops.aten
    torch.manual_seed(0)
    x, g4 = torch.randn(2, 4, 5, 6), torch.randn(2, 4, 5, 6)
    w6, b6, w4, b4 = torch.randn(6), torch.randn(6), torch.randn(4), torch.randn(4)
    conv_w, conv_g = torch.randn(3, 4, 3, 3), torch.randn(2, 3, 3, 3)

    def layer_norm(d, mask):
        _, mean, rstd = aten.native_layer_norm(d(x), [6], d(w6), d(b6), 1e-5)
        return aten.native_layer_norm_backward(d(g4), d(x), [6], mean, rstd, d(w6), d(b6), mask)

    def group_norm(d, mask):
        _, mean, rstd = aten.native_group_norm(d(x), d(w4), d(b4), 2, 4, 30, 2, 1e-5)
        return aten.native_group_norm_backward(d(g4), d(x), mean, rstd, d(w4), 2, 4, 30, 2, mask)

    def convolution(d, mask):
        return aten.convolution_backward(d(conv_g), d(x), d(conv_w), [3], [1, 2], [0, 1], [1, 1], False, [0, 0], 1,
                                         mask)

    torchpjrt.set_eager_mode(mode)
    try:
        for f in (layer_norm, group_norm, convolution):
            for mask in ([True, True, True], [False, True, True], [True, False, False]):
                want = f(lambda t: t, mask)
                for round in range(3):
                    pj = [t.to("pjrt") for t in (x, g4, w6, b6, w4, b4, conv_w, conv_g)]
                    on_device = dict(zip(map(id, (x, g4, w6, b6, w4, b4, conv_w, conv_g)), pj))
                    got, n = served(lambda: f(lambda t: on_device[id(t)], mask))
                    for g, w in zip(got, want):
                        assert (g is None) == (w is None), (f.__name__, mask)
                        if w is not None:
                            torch.testing.assert_close(g.cpu(), w, rtol=1e-4, atol=1e-4)
                    if round:
                        # the backward op, and the forward op of the norms (their mean and rstd)
                        assert n == (1 if f is convolution else 2), (f.__name__, mask, n)
    finally:
        torchpjrt.set_eager_mode("strict")


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_batch_norm_writes_its_running_statistics_when_served(mode):
    """native_batch_norm returns its results and writes the running mean and variance (whole
    buffers): served, each write a new value of its buffer as from the Python kernel; without
    running statistics, or in evaluation, alike."""
    aten = torch.ops.aten
    torch.manual_seed(0)
    x, w, b = torch.randn(3, 4, 5, 5), torch.randn(4), torch.randn(4)
    mean, var = torch.randn(4), torch.rand(4) + 0.5
    torchpjrt.set_eager_mode(mode)
    try:
        for training, stats in ((True, True), (False, True), (True, False)):
            cpu_stats = [mean.clone(), var.clone()] if stats else [None, None]
            pj_stats = [t.to("pjrt") for t in cpu_stats] if stats else [None, None]
            before = [t.clone() for t in pj_stats] if stats else None
            for round in range(3):
                got, n = served(lambda: aten.native_batch_norm(x.to("pjrt"), w.to("pjrt"), b.to("pjrt"), *pj_stats,
                                                                training, 0.1, 1e-5))
                want = aten.native_batch_norm(x, w, b, *cpu_stats, training, 0.1, 1e-5)
                for g, v in zip(got, want):
                    assert g.shape == v.shape
                    torch.testing.assert_close(g.cpu(), v, rtol=1e-5, atol=1e-5)
                for g, v in zip(pj_stats, cpu_stats):
                    if v is not None:
                        torch.testing.assert_close(g.cpu(), v, rtol=1e-6, atol=1e-6)
                if round:
                    assert n >= 1, (training, stats)
            if stats and training:
                assert not torch.equal(pj_stats[0].cpu(), before[0].cpu())  # three updates reached the buffer
        # a module's training steps and then evaluation, as a CNN runs them
        bn = torch.nn.BatchNorm2d(4)
        bn_pjrt = torch.nn.BatchNorm2d(4).to("pjrt")
        for step in range(4):
            y = torch.randn(2, 4, 3, 3)
            bn(y).square().sum().backward()
            bn_pjrt(y.to("pjrt")).square().sum().backward()
        for name, t in bn.state_dict().items():
            torch.testing.assert_close(bn_pjrt.state_dict()[name].cpu(), t, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn_pjrt.weight.grad.cpu(), bn.weight.grad, rtol=1e-4, atol=1e-5)
        bn.eval()
        bn_pjrt.eval()
        torch.testing.assert_close(bn_pjrt(x.to("pjrt")).cpu(), bn(x), rtol=1e-5, atol=1e-5)
    finally:
        torchpjrt.set_eager_mode("strict")


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_foreach_ops_and_an_optimizer_step(mode):
    xs = [torch.randn(3, 4, device="pjrt") for _ in range(4)] + [torch.randn(5, device="pjrt")]
    ys = [x.cpu() for x in xs]
    others = [torch.rand(x.shape, device="pjrt") + 0.5 for x in xs]
    oc = [o.cpu() for o in others]
    with torchpjrt.eager_mode(mode):
        for round in range(3):
            for f in (lambda m, a, b: m._foreach_mul_(a, 0.5), lambda m, a, b: m._foreach_add_(a, b, alpha=2.0),
                      lambda m, a, b: m._foreach_div_(a, [1.5, 2.0, 2.5, 3.0, 3.5]),
                      lambda m, a, b: m._foreach_addcdiv_(a, b, b, [0.1, 0.2, 0.3, 0.4, 0.5]),
                      lambda m, a, b: m._foreach_lerp_(a, b, 0.25)):
                served_now, n = served(lambda: f(torch, xs, others))
                f(torch, ys, oc)
                if round and mode == "strict":
                    assert n == 1
            outs, n = served(lambda: torch._foreach_sqrt(others))
            assert isinstance(outs, tuple) and len(outs) == 5 and len({o.data_ptr() for o in outs}) == 5  # as on CPU
            if round and mode == "strict":
                assert n == 1
            for o, c in zip(outs, oc):
                torch.testing.assert_close(o.cpu(), c.sqrt())
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x.cpu(), y)
        # a view in a list goes to the Python kernel
        view = xs[0][1]
        torch._foreach_add_([view, xs[1]], 1.0)
        ys[0][1] += 1.0
        ys[1] += 1.0
        for x, y in zip(xs, ys):
            torch.testing.assert_close(x.cpu(), y)
    # a model's worth of tensors in one list
    many = [torch.full((3,), float(i), device="pjrt") for i in range(100)]
    with torchpjrt.eager_mode(mode):
        for round in range(3):
            _, n = served(lambda: torch._foreach_mul_(many, 2.0))
            if round and mode == "strict":
                assert n == 1
    assert all(m.cpu().tolist() == [8.0 * i] * 3 for i, m in enumerate(many))
    # AdamW through its foreach path, against CPU
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.GELU(), torch.nn.Linear(8, 2))
    ref.load_state_dict(model.state_dict())
    model.to("pjrt")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, foreach=True)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=0.01, foreach=True)
    x = torch.randn(16, 6)
    with torchpjrt.eager_mode(mode):
        for _ in range(6):
            for m, o, inp in ((model, opt, x.to("pjrt")), (ref, opt_ref, x)):
                o.zero_grad()
                m(inp).square().mean().backward()
                o.step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


TRANSFERS_OF_NUMBERS = """
import sys, jax, torch, torchpjrt
from torchpjrt import hot_path
xs, ys, zs = ([torch.rand(3, 4, device="pjrt") + 0.5 for _ in range(21)] for _ in range(3))
cx, cy, cz = ([t.cpu() for t in ts] for ts in (xs, ys, zs))
sizes = [0.01 * (i + 1) for i in range(21)]
a = torch.rand(5, 6, device="pjrt")
h = a.half()
w = torch.rand(6, 6, device="pjrt")
rows = torch.where(torch.tensor([[1, 0, 1, 1, 0]], device="pjrt"))[1]  # as an expert loop routes
ca, ch, cw, crows = a.cpu(), h.cpu(), w.cpu(), rows.cpu()
for call in range(3):
    before = hot_path.calls()
    with jax.transfer_guard_host_to_device("log"):
        print(f"lists {call}", file=sys.stderr, flush=True)
        torch._foreach_addcdiv_(xs, ys, zs, sizes)
        torch._foreach_div_(xs, sizes)
        print(f"numbers {call}", file=sys.stderr, flush=True)
        b = a * 2.5 + 3
        c = (h - 0.125).mul(7)
        torch.pjrt.synchronize()
        print(f"views {call}", file=sys.stderr, flush=True)
        d = torch.nn.functional.linear(a[1:4], w) * a[2]  # w.t() and rows of `a`, read at their offsets
        e = a[rows].sum(0)  # a padded gather's rows, summed up to their n
        torch.pjrt.synchronize()
        print("end", file=sys.stderr, flush=True)
    print(f"served {hot_path.calls() - before}", flush=True)
    torch._foreach_addcdiv_(cx, cy, cz, sizes)
    torch._foreach_div_(cx, sizes)
for x, y in zip(xs, cx):
    torch.testing.assert_close(x.cpu(), y)
torch.testing.assert_close(b.cpu(), ca * 2.5 + 3, rtol=0, atol=0)
torch.testing.assert_close(c.cpu(), (ch - 0.125).mul(7), rtol=0, atol=0)
assert c.dtype == torch.float16
torch.testing.assert_close(d.cpu(), torch.nn.functional.linear(ca[1:4], cw) * ca[2])
torch.testing.assert_close(e.cpu(), ca[crows].sum(0))
print("values match", flush=True)
"""


@needs_hot_path
def test_numbers_reach_the_device_without_a_transfer_each(tmp_path):
    """An optimizer's per-parameter step sizes (`_foreach_addcdiv_`, `_foreach_div_` with a list
    of floats) are packed into one array, in the Python kernel and the C++ one; a number argument
    (`a * 2.5 + 3`) is a device scalar the C++ kernel keeps per value, and so are a view's offset
    (`w.t()` in a linear, a row of `a`) and a padded argument's n (the rows an expert got). Each
    separate number was a host-to-device transfer of its own. Results are CPU's, dtypes too (a
    float16 stays float16)."""
    script = tmp_path / "step_sizes.py"
    script.write_text(TRANSFERS_OF_NUMBERS)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         # JAX's warnings (the transfer log) shown whatever the environment asks
                         env=dict(os.environ, TORCHPJRT_CACHE_DIR=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="0"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "values match" in out.stdout
    assert out.stdout.count("served 10") == 2  # the second and third calls are the C++ kernel's
    # JAX logs each transfer on stderr, between the script's marks
    transfers, part = {}, None
    for line in out.stderr.splitlines():
        if line.startswith(("lists", "numbers", "views", "end")):
            part = line
        elif "host-to-device transfer" in line:
            transfers[part] = transfers.get(part, 0) + 1
    for call in range(3):
        assert transfers.get(f"lists {call}") == 2, transfers  # one per op call
    assert transfers.get("numbers 0") == 4  # the Python kernels' calls pass the numbers
    assert "numbers 2" not in transfers, transfers  # the kept device scalars
    assert "views 2" not in transfers, transfers  # views' offsets and padded sizes kept alike


def calls_while(fn, name_of):
    """(fn's result, name_of(frame) for each Python call while it ran that it names, in order)."""
    calls = []

    def profile(frame, event, arg):
        if event == "call" and (name := name_of(frame)) is not None:
            calls.append(name)

    sys.setprofile(profile)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    return out, calls


def python_frames(fn, names):
    """(fn's result, the calls of Python functions named in `names` while it ran, by name)."""
    return calls_while(fn, lambda frame: frame.f_code.co_name if frame.f_code.co_name in names else None)


@needs_hot_path
def test_fused_mode_records_the_ops_it_serves_from_cpp(monkeypatch):
    """Once a key's node is known, the hot path adds it to the pending graph itself (no
    record_keyed or _add_node frame): the graph is the one the Python recorder builds, an array
    passed twice is one input, a list op's results come back as its lists, and a graph at
    max_ops flushes."""
    from torchpjrt import fusion

    a = torch.randn(6, 5, device="pjrt")
    xs = [torch.randn(4, device="pjrt") for _ in range(3)]
    ac, xc = a.cpu(), [x.cpu() for x in xs]

    def body():
        b = (a * a + 2.5).tanh()  # `a` twice, a Python number
        c = b.sum(0) * 0.5
        ys = torch._foreach_mul(xs, 3.0)  # a list op: its node has lists in and out
        zs = torch._foreach_add(ys, xs, alpha=2.0)
        return b, c, ys, zs

    def check(out):
        b, c, ys, zs = out
        bc = (ac * ac + 2.5).tanh()
        cc = bc.sum(0) * 0.5
        torch.testing.assert_close(b.cpu(), bc)
        torch.testing.assert_close(c.cpu(), cc)
        for y, z, x in zip(ys, zs, xc):
            torch.testing.assert_close(y.cpu(), x * 3.0)
            torch.testing.assert_close(z.cpu(), x * 5.0)

    check(body())  # strict: the hot path learns the keys
    keys = []
    graph_key = fusion._GraphKey

    def key(parts):
        keys.append(graph_key(parts))
        return keys[-1]

    monkeypatch.setattr(fusion, "_GraphKey", key)
    names = {"record_keyed", "_add_node"}
    with torchpjrt.eager_mode("fused"):
        out, first = python_frames(body, names)  # recorded through record_keyed: nodes looked up
        assert "record_keyed" in first
        fusion.flush("test")
        check(out)
        for _ in range(2):
            out, later = python_frames(body, names | {"__init__", "track"})
            assert later == [], later  # Storage.__init__ and fusion.track's work done in C++ too
            assert torchpjrt.eager_stats()["ops_pending"] >= 6
            # each result's storage is listed once in the graph, which gives it the computed array
            live = [st for st in (r() for r in fusion._graph.storages) if st is not None]
            assert len(live) == len({id(st) for st in live}) >= 6
            assert all(type(st.array) is fusion.Pending for st in live)
            fusion.flush("test")
            assert all(type(st.array) is not fusion.Pending for st in live)
            check(out)
        assert keys[-1] == keys[-2] == keys[-3]  # the same graph as record_keyed's
        arrays = [sig for sig in keys[-1].parts[3] if isinstance(sig, tuple)]
        assert len(arrays) == 4  # `a` once, and the list's three
        monkeypatch.setattr(fusion, "max_ops", 3)
        flushes = torchpjrt.eager_stats()["flush_reasons"].get("max_ops", 0)
        out, later = python_frames(body, names)
        assert later == [] and torchpjrt.eager_stats()["flush_reasons"]["max_ops"] > flushes
        check(out)


def python_kernel_calls(fn):
    """(fn's result, the aten ops whose Python kernels ran while it ran, in order)."""
    return calls_while(fn, lambda frame: str(frame.f_locals["op"])
                       if frame.f_code.co_name == "registered" and "op" in frame.f_locals else None)


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_factories_and_constant_fills_are_served_as_the_python_kernels_make_them(mode):
    """torch.empty, zeros, ones, full, ones_like (empty + fill_ or zero_ of the whole storage)
    from C++ after their Python kernels' first calls: the same tensors, the same shared arrays,
    and no Python kernel."""
    torchpjrt.set_eager_mode(mode)
    try:
        model = torchpjrt.storage._create_empty((1,), torch.float32)
        x = torch.randn(3, 4, device=DEV)
        makers = {
            "empty": lambda: torch.empty(3, 4, device=DEV),
            "empty_strided": lambda: torch.empty_strided((3, 4), (4, 1), device=DEV),
            "zeros": lambda: torch.zeros(3, 4, device=DEV),
            "ones": lambda: torch.ones(3, 4, dtype=torch.int64, device=DEV),
            "full": lambda: torch.full((3, 4), -0.0, device=DEV),
            "full_nan": lambda: torch.full((3, 4), float("nan"), dtype=torch.float16, device=DEV),
            "full_bool": lambda: torch.full((3, 4), True, device=DEV),
            "full_int": lambda: torch.full((3, 4), 7, dtype=torch.int32, device=DEV),
            "ones_like": lambda: torch.ones_like(x),
            "zeros_like": lambda: torch.zeros_like(x, dtype=torch.bfloat16),
            "new_full": lambda: x.new_full((2, 3), 2.5),
        }
        for name, make in makers.items():
            make()  # the Python kernels' calls: the C++ kernels learn from them
            t, ops = python_kernel_calls(make)
            assert ops == [], (name, ops)
            expected = {"empty": None, "empty_strided": None}.get(name, ...)
            assert torch._C._dispatch_keys(t) == torch._C._dispatch_keys(model), name
            assert t.device == torch.device("pjrt:0") and t.is_contiguous() and t.storage_offset() == 0
            st = t.untyped_storage()
            assert st.nbytes() == t.numel() * t.element_size() and st.resizable()
            assert t.data_ptr() >= 2**60 and t.data_ptr() % 256 == 0
            assert st._pjrt.shape == tuple(t.shape) and st._pjrt.dtype == t.dtype and st._pjrt.padding is None
            if expected is None:
                assert st._pjrt.array is None  # not materialized, as storage.empty leaves it
            else:
                again = make()
                # the same shared array as the Python kernel's fill (storage.filled / zeros)
                assert again.untyped_storage()._pjrt.array is st._pjrt.array
                assert again.data_ptr() != t.data_ptr()
        # values, bit for bit, against CPU
        cpu_x = x.cpu()
        for name, make in makers.items():
            if name.startswith("empty"):
                continue
            on_cpu = {"ones_like": lambda: torch.ones_like(cpu_x),
                      "zeros_like": lambda: torch.zeros_like(cpu_x, dtype=torch.bfloat16),
                      "new_full": lambda: cpu_x.new_full((2, 3), 2.5)}.get(name)
            if on_cpu is None:
                code = make.__code__
                on_cpu = type(make)(code, dict(make.__globals__, DEV="cpu"))
            got, want = make().cpu(), on_cpu()
            assert got.dtype == want.dtype and torch.equal(got.view(torch.uint8), want.view(torch.uint8)) if \
                want.dtype.is_floating_point else torch.equal(got, want), name
        # an empty tensor is an ordinary pjrt tensor: written in place, read, viewed
        e = torch.empty(3, 4, device=DEV)
        e.zero_()
        e[1] = 2.0
        e.view(12)[11] = 5.0
        want = torch.zeros(3, 4)
        want[1] = 2.0
        want.view(12)[11] = 5.0
        assert torch.equal(e.cpu(), want)
        z = torch.zeros(3, 4, device=DEV)
        version = z._version
        z.fill_(3.0)
        assert z._version == version + 1 and torch.equal(z.cpu(), torch.full((3, 4), 3.0))
        # what they do not serve goes to the Python kernels, and gives what CPU gives
        for make, want_ops in [
            (lambda: torch.empty_strided((3, 4), (1, 3), device=DEV), ["aten.empty_strided.default"]),
            (lambda: torch.empty(2, 3, 4, 5, memory_format=torch.channels_last, device=DEV),
             ["aten.empty.memory_format"]),
        ]:
            make()
            t, ops = python_kernel_calls(make)
            assert want_ops[0] in ops
            cpu_twin = type(make)(make.__code__, dict(make.__globals__, DEV="cpu"))()
            assert t.stride() == cpu_twin.stride() and t.dtype == cpu_twin.dtype
        row = torch.zeros(3, 4, device=DEV)
        row[1].fill_(4.0)  # a view: scattered into its storage by the Python kernel
        t, ops = python_kernel_calls(lambda: row[2].fill_(5.0))
        assert "aten.fill_.Scalar" in ops
        assert torch.equal(row.cpu(), torch.tensor([[0.0] * 4, [4.0] * 4, [5.0] * 4]))
        # errors are the Python kernels', at every call
        for _ in range(2):
            with pytest.raises(TypeError, match="complex32 is not supported"):
                torch.empty(3, dtype=torch.complex32, device=DEV)
            with pytest.raises(RuntimeError, match="negative dimension"):
                torch.empty(-1, device=DEV)
            with pytest.raises(RuntimeError, match="overflow"):
                torch.full((2,), 300, dtype=torch.uint8, device=DEV)
        torch.full((2,), 200, dtype=torch.uint8, device=DEV)
        # the default dtype is read at each call
        torch.set_default_dtype(torch.float64)
        try:
            assert torch.empty(2, device=DEV).dtype == torch.float64
            assert torch.zeros(2, device=DEV).dtype == torch.float64
        finally:
            torch.set_default_dtype(torch.float32)
        assert torch.empty(2, device=DEV).dtype == torch.float32
        w = torch.zeros(3, device=DEV, requires_grad=True)
        assert w.is_leaf and w.requires_grad
        (w * 2.0).sum().backward()
        assert torch.equal(w.grad.cpu(), torch.full((3,), 2.0))
    finally:
        torchpjrt.set_eager_mode("strict")


def test_arange_of_an_end_or_a_start_and_end_is_one_kernel_call():
    """torch.arange(end) and arange(start, end) (position ids, masks: several a forward of a
    transformers model) run their own lowering, where ATen's composite kernels filled an empty
    tensor through arange.start_out (a decomposition, resize_ and copy_: three Python kernels);
    a repeated call is served from C++ (no Python kernel)."""
    cases = [((32,), {}), ((3, 32), {}), ((0.5, 7.2), {}), ((7.5,), {}), ((5,), {"dtype": torch.float16}),
             ((-4, 9), {"dtype": torch.int32}), ((0,), {})]
    for args, kwargs in cases:
        name = f"aten.arange.{'default' if len(args) == 1 else 'start'}"
        t, ops = python_kernel_calls(lambda: torch.arange(*args, device=DEV, **kwargs))
        want = torch.arange(*args, **kwargs)
        assert ops in ([name], []), (args, ops)  # none when an earlier call taught the hot path the key
        assert t.dtype == want.dtype and torch.equal(t.cpu(), want), args
        again, ops = python_kernel_calls(lambda: torch.arange(*args, device=DEV, **kwargs))
        assert ops == ([] if _active() else [name]), (args, ops)
        assert again.dtype == want.dtype and torch.equal(again.cpu(), want), args
    out = torch.empty(0, dtype=torch.int64, device=DEV)
    torch.arange(2, 6, out=out)
    assert torch.equal(out.cpu(), torch.arange(2, 6))


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_views_in_list_arguments_are_keyed_by_their_geometry(mode):
    """cat and stack of views (rotate_half's halves), a foreach op's views: each view keyed as a
    view argument is (its strides, offset and storage), with its offset passed as the Python
    kernel passed it; cat([x, y]) that padding.py may make an append stays with the Python kernel."""
    from torchpjrt import padding

    torchpjrt.set_eager_mode(mode)
    try:
        q = torch.randn(4, 2, 6, 16, device=DEV)
        qc = q.cpu()
        col = torch.randn(40, 3, device=DEV)  # a column view's last rows: offset compiled in
        colc = col.cpu()
        calls = [
            (lambda t: torch.cat((-t[..., 8:], t[..., :8]), dim=-1), (q, qc), 2),
            (lambda t: torch.stack([t[0], t[1], t[3]], 1), (q, qc), 1),
            (lambda t: torch.cat([t[1], t[0, :, 2:]], 1), (q, qc), 1),
            (lambda t: torch.cat([t[i:i + 2, 2] for i in (0, 10, 37, 38)]), (col, colc), 1),
        ]
        for fn, (x, xc), n_ops in calls:
            fn(x)  # the Python kernels' calls
            out, n = served(lambda: fn(x))
            assert n == n_ops, n
            assert torch.equal(out.cpu(), fn(xc))
        for i in range(5):  # the same geometry at other offsets: one program, offsets as arguments
            out = torch.cat([q[i % 4, 0], q[(i + 1) % 4, 1, :, 3:]], 1)
            assert torch.equal(out.cpu(), torch.cat([qc[i % 4, 0], qc[(i + 1) % 4, 1, :, 3:]], 1))
        a, b = torch.randn(2, 5, device=DEV), torch.randn(2, 5, device=DEV)
        grads = torch.randn(3, 5, device=DEV)
        ac, bc, gc = a.cpu(), b.cpu(), grads.cpu()
        for _ in range(3):
            torch._foreach_add_([a, b], [grads[:2], grads[1:]], alpha=0.5)
            torch._foreach_add_([ac, bc], [gc[:2], gc[1:]], alpha=0.5)
        out, n = served(lambda: torch._foreach_add_([a, b], [grads[:2], grads[1:]], alpha=0.5))
        torch._foreach_add_([ac, bc], [gc[:2], gc[1:]], alpha=0.5)
        assert n == 1
        torch._foreach_mul_([a[0], b], 2.0)  # a view target: the Python kernel writes its storage
        out, n = served(lambda: torch._foreach_mul_([a[0], b], 2.0))
        torch._foreach_mul_([ac[0], bc], 2.0)
        torch._foreach_mul_([ac[0], bc], 2.0)
        assert n == 0
        assert torch.equal(a.cpu(), ac) and torch.equal(b.cpu(), bc)
        # a sequence of one grown a token at a time: appended into a padded storage (the first
        # append exact, served once learned; the later ones by the Python kernel)
        seq = torch.zeros(1, 3, dtype=torch.long, device=DEV)
        for step in range(4):
            tok = torch.full((1, 1), step, dtype=torch.long, device=DEV)
            seq, n = served(lambda: torch.cat([seq, tok], dim=-1))
            assert n == 0 or step == 0
        assert padding.storage_padding_of(seq) is not None
        assert seq.cpu().tolist() == [[0, 0, 0, 0, 1, 2, 3]]
    finally:
        torchpjrt.set_eager_mode("strict")


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_integer_indexing_is_served_and_masks_go_to_the_python_kernel(mode):
    """x[i] with integer index tensors (a MoE's token gather): served, views and None among the
    indices keyed; masks (a data-dependent shape), uint8 masks (CPU's warning at every call),
    host index tensors and indices that do not broadcast stay with the Python kernel."""
    torchpjrt.set_eager_mode(mode)
    try:
        x = torch.randn(10, 6, 4, device=DEV)
        xc = x.cpu()
        i = torch.tensor([3, 1, 1, 9], device=DEV)
        j = torch.tensor([[0], [5]], device=DEV)
        cases = [lambda x, i, j: x[i], lambda x, i, j: x[:, j], lambda x, i, j: x[i, :, 2:3],
                 lambda x, i, j: x[j, i[:2]], lambda x, i, j: x[i[1:3]], lambda x, i, j: x[..., i[:2]]]
        for fn in cases:
            fn(x, i, j)
            out, n = served(lambda: fn(x, i, j))
            assert n == 1
            assert torch.equal(out.cpu(), fn(xc, i.cpu(), j.cpu()))
        m = xc[:, 0, 0] > 0
        for _ in range(2):
            out, n = served(lambda: x[m.to(DEV)])
            assert torch.equal(out.cpu(), xc[m])
            out, n = served(lambda: x[i.cpu()])  # a host index tensor
            assert n == 0 and torch.equal(out.cpu(), xc[i.cpu()])
            with pytest.warns(UserWarning, match="uint8 is now deprecated"):
                out = x[m.to(torch.uint8).to(DEV)]
            assert torch.equal(out.cpu(), xc[m])
            with pytest.raises(IndexError, match="shape mismatch"):
                x[i, j[:, :1].expand(2, 3)]
        out_of_range = torch.tensor([11], device=DEV)
        x[out_of_range[:0]]
        with pytest.raises(IndexError, match="out of bounds"):
            x[out_of_range].cpu()
        with pytest.raises(IndexError, match="out of bounds"):
            x[out_of_range].cpu()
    finally:
        torchpjrt.set_eager_mode("strict")


@needs_hot_path
def test_a_served_result_keeps_the_shape_of_its_array():
    """A result whose array is laid out otherwise than its sizes (a size-1 dimension out of place:
    linalg.solve's backward with a vector right-hand side) gets its storage's shape from the
    array, as the Python kernel's call made it: from the tensor's sizes, a later op read the
    array in the wrong shape (linalg.solve_ex's backward then failed in dot_general)."""
    torch.manual_seed(0)
    A0 = torch.randn(5, 5) + 5 * torch.eye(5)
    B0 = torch.randn(5)
    fns = [lambda A, B: torch.linalg.solve(A, B), lambda A, B: torch.linalg.solve_ex(A, B)[0]]
    for _ in range(2):
        for fn in fns:
            grads = []
            for dev in ("cpu", DEV):
                A = A0.clone().to(dev).requires_grad_()
                B = B0.clone().to(dev).requires_grad_()
                fn(A, B).sum().backward()
                grads.append((A.grad.cpu(), B.grad.cpu()))
            torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-4)


@needs_hot_path
def test_factories_without_tensor_arguments_hand_out_the_kept_result():
    """arange, eye, tril_indices repeated with the same arguments: served from C++ as
    new tensors over the result the Python kernel kept (storage.shared_result), each with a
    storage and an address of its own, so writing one leaves the next call's alone; dtype=None
    follows torch.set_default_dtype at each call (the kept float32 result was handed to a float64
    call before)."""
    makers = [lambda d, **k: torch.arange(6, device=d, **k), lambda d, **k: torch.arange(1.5, 4.0, 0.5, device=d, **k),
              lambda d, **k: torch.eye(3, 4, device=d, **k), lambda d, **k: torch.tril_indices(4, 3, device=d),
              lambda d, **k: torch.arange(5.0, device=d, **k)]
    linspace = lambda d, **k: torch.linspace(-1, 1, 5, device=d, **k)  # noqa: E731 (its numbers are traced: not kept)
    for make in makers:
        make(DEV)
        out, ops = python_kernel_calls(lambda: make(DEV))
        want = make("cpu")
        assert ops == [] and out.dtype == want.dtype and torch.equal(out.cpu(), want)
        other = make(DEV)
        assert other.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
        out.add_(1)
        assert torch.equal(make(DEV).cpu(), want) and torch.equal(other.cpu(), want)
    make = makers[-1]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        for maker in (make, linspace, makers[2]):
            for _ in range(2):
                out = maker(DEV)
                assert out.dtype == torch.float64 and torch.equal(out.cpu(), maker("cpu"))
    finally:
        torch.set_default_dtype(before)
    assert make(DEV).dtype == before
    with pytest.raises(RuntimeError, match="inconsistent with step sign"):
        torch.arange(-1, device=DEV)


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_index_put_is_served_and_keeps_cpus_results(mode):
    """x[i] = v, index_put_ with accumulate (the backward of an integer gather: zeros, then
    _index_put_impl_), into a whole storage (an uninitialized one too: torch.empty, which the
    C++ kernel materializes as the Python kernel's read does): served after the first call and
    equal to CPU; a view target, masks and host indices go to the Python kernel; out-of-range
    indices still raise."""
    torchpjrt.set_eager_mode(mode)
    try:
        i = torch.tensor([3, 1, 1, 4], device=DEV)
        v = torch.randn(4, 3, device=DEV)
        base = torch.randn(6, 3, device=DEV)

        def put(dev, accumulate):
            x = base.to(dev).clone()
            x.index_put_((i.to(dev),), v.to(dev), accumulate=accumulate)
            return x

        for accumulate in (True, False):
            put(DEV, accumulate)
            out, n = served(lambda: put(DEV, accumulate))
            assert n >= 2  # clone and index_put_
            want = put("cpu", accumulate)
            if accumulate:
                torch.testing.assert_close(out.cpu(), want)
            else:  # a repeated index: one of its values (CPU's order is not specified either)
                rows = [0, 2, 3, 4, 5]
                assert torch.equal(out.cpu()[rows], want[rows])
        perm = torch.tensor([2, 0, 3, 1], device=DEV)

        def inverse():
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(4, device=DEV)
            return inv

        inverse()
        out, ops = python_kernel_calls(inverse)
        assert ops == [] and torch.equal(out.cpu(), torch.argsort(perm.cpu()))
        x = torch.randn(6, 3, device=DEV, requires_grad=True)
        for _ in range(2):
            x.grad = None
            x[i].sum().backward()
            assert torch.equal(x.grad.cpu(), torch.zeros(6, 3).index_put_((i.cpu(),), torch.ones(4, 3), True))
        _, ops = python_kernel_calls(lambda: x[i].sum().backward())
        assert "aten._index_put_impl_.default" not in ops and "aten.index_put_.default" not in ops
        rows = torch.tensor([0, 5])
        for dev in (DEV, "cpu"):
            y = torch.zeros(6, 3, device=dev)
            iv, vv = i.to(dev), v.to(dev)
            for _ in range(2):
                # a view target
                _, ops = python_kernel_calls(lambda: y[:, 1].index_put_((iv,), vv[:, 0], accumulate=True))
                assert ops == (["aten.index_put_.default"] if dev == DEV else [])
                _, ops = python_kernel_calls(lambda: y.index_put_((rows,), vv[:2]))  # host indices
                assert ops == (["aten.index_put_.default"] if dev == DEV else [])
            if dev == DEV:
                got = y.cpu()
        torch.testing.assert_close(got, y)
        bad = torch.tensor([6], device=DEV)
        for _ in range(2):
            with pytest.raises(IndexError, match="out of bounds"):
                base.clone().index_put_((bad,), v[:1], accumulate=True).cpu()
    finally:
        torchpjrt.set_eager_mode("strict")


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_cat_is_served_and_marks_first_appends_as_padding_does(mode, monkeypatch):
    """cat([x, y]) along a dim whose leading dims are 1 (always so for dim 0) may start a growing
    sequence (padding._appended): served, its result marked as a first append as the Python kernel
    marks it; an append to a storage with a history of appends goes to the Python kernel, which
    pads it. With padding off nothing is marked."""
    from torchpjrt import padding

    torchpjrt.set_eager_mode(mode)
    try:
        a = torch.randn(64, 64, device=DEV)
        b = torch.randn(64, 64, device=DEV)
        torch.cat([a, b])
        out, n = served(lambda: torch.cat([a, b]))
        assert n == 1 and out.untyped_storage()._pjrt.appended_along == 0
        assert torch.equal(out.cpu(), torch.cat([a.cpu(), b.cpu()]))
        _, n = served(lambda: torch.cat([out, b]))  # a second append: the Python kernel pads it
        assert n == 0
        for sequence in range(2):
            x = torch.zeros(1, 3, dtype=torch.long, device=DEV)
            for step in range(5):
                token = torch.full((1, 1), step, dtype=torch.long, device=DEV)
                x, n = served(lambda: torch.cat([x, token], dim=1))
                st = x.untyped_storage()._pjrt
                if step == 0:
                    # the first sequence's first append teaches the key (unless an earlier test did)
                    assert st.appended_along == 1 and st.padding is None and (n == 1 or sequence == 0)
                else:
                    assert n == 0 and st.padding is not None
            assert x.cpu().tolist() == [[0, 0, 0, 0, 1, 2, 3, 4]]
        monkeypatch.setattr(padding, "enabled", False)
        out, n = served(lambda: torch.cat([a, b]))
        assert n == 1 and out.untyped_storage()._pjrt.appended_along is None
        torch.cat([out, b])
        again, n = served(lambda: torch.cat([out, b]))
        assert n == 1 and again.untyped_storage()._pjrt.padding is None
        assert torch.equal(again.cpu(), torch.cat([a.cpu(), b.cpu(), b.cpu()]))
    finally:
        torchpjrt.set_eager_mode("strict")


@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_an_inplace_op_on_a_reshaped_tensor_writes_the_whole_storage(mode):
    """x.view(...).add_(y) over all of a storage (attention's mask: a (B*H, L, L) bias viewed as
    (B, H, L, L)): the storage takes the tensor's shape (its elements in order are the same), so
    the write needs no second program and the hot path serves it; every tensor of the storage
    reads the new values, as on CPU."""
    torchpjrt.set_eager_mode(mode)
    try:
        y = torch.randn(3, 4, device=DEV)
        for _ in range(3):
            base = torch.randn(6, 3, 4, device=DEV)
            want = base.cpu()
            view = base.view(2, 3, 3, 4)
            before = hot_path.calls()
            view.add_(y)
            n = hot_path.calls() - before
            want.view(2, 3, 3, 4).add_(y.cpu())
            assert torch.equal(view.cpu(), want.view(2, 3, 3, 4)) and torch.equal(base.cpu(), want)
            assert torch.equal(base[1:3].cpu(), want[1:3]) and torch.equal(base.transpose(0, 2).cpu(), want.transpose(0, 2))
            assert tuple(base.untyped_storage()._pjrt.shape) == (2, 3, 3, 4)
        if _active():
            assert n == 1
        flat = torch.zeros(12, device=DEV)
        flat.view(3, 4).mul_(2).add_(1)
        assert torch.equal(flat.cpu(), torch.ones(12))
    finally:
        torchpjrt.set_eager_mode("strict")


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_padded_storages_are_served_for_ops_whose_rule_the_key_decides(mode):
    """Rows picked by a mask (a padded storage: n of B rows) are keyed by B: a second call with
    another n of the same bucket is served, with the results and the padding the Python kernel
    gives. Ops whose rule reads the rows masked (a sum over them, a column summed) are served
    too, n passed to their program: their results are exact."""
    from torchpjrt import padding

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 8, generator=gen), torch.randn(8, 5, generator=gen)
    xd, wd = x.to(DEV), w.to(DEV)
    ops = {  # name: (fn, whether its result is padded)
        "mul": (lambda t, w: t * 2.5, True),
        "sigmoid": (lambda t, w: t.sigmoid(), True),
        "mm": (lambda t, w: t @ w, True),
        "sum over columns": (lambda t, w: t.sum(1), True),
        "cast": (lambda t, w: t.to(torch.float64), True),
        "sub_": (lambda t, w: (t * 1.0).sub_(t), True),
        "a row (an exact view) added": (lambda t, w: t + t[:1], True),
        "halves (padded views)": (lambda t, w: t[:, :4] * t[:, 4:], True),
        "cat along columns": (lambda t, w: torch.cat([t, t * 2], 1), True),
        "sum over rows": (lambda t, w: t.sum(0), False),
        "a column summed": (lambda t, w: t[:, 0].sum(), False),
        "rows contracted (a weight's gradient)": (lambda t, w: t.t() @ (t * 0.5), False),
    }
    order = torch.randperm(64, generator=gen)
    with torchpjrt.eager_mode(mode):
        for call, k in enumerate((10, 13, 11)):  # one bucket (16 rows)
            mask = torch.zeros(64, dtype=torch.bool)
            mask[order[:k]] = True
            rows, ref_rows = xd[mask.to(DEV)], x[mask]
            assert padding.storage_padding_of(rows) == (k, 16)
            for name, (fn, padded) in ops.items():
                out, n = served(lambda: fn(rows, wd))
                ref = fn(ref_rows, w)
                if call:
                    assert n >= 1, name
                assert out.shape == ref.shape, name
                torch.testing.assert_close(out.cpu(), ref, msg=name)
                assert padding.storage_padding_of(out) == ((k, 16) if padded else None), name
                if padded:
                    torch.testing.assert_close(out.sum().cpu(), ref.sum(), msg=name)  # the padding stays unseen


@needs_hot_path
def test_fills_of_a_padded_storage_are_served_and_keep_its_padding():
    """zero_() and fill_(number) of rows picked by a mask (n of B rows): the whole storage takes
    the shared array of B rows, as the Python kernel gives it, for every n of the bucket."""
    from torchpjrt import padding

    x = torch.randn(64, 8)
    xd = x.to(DEV)
    for call, k in enumerate((10, 13, 11, 16)):  # one bucket (16 rows)
        mask = torch.zeros(64, dtype=torch.bool)
        mask[:k] = True
        for fill, value in ((lambda t: t.zero_(), 0.0), (lambda t: t.fill_(2.5), 2.5), (lambda t: t.fill_(-1), -1.0)):
            rows = xd[mask.to(DEV)] * 1.0
            out, ops = python_kernel_calls(lambda: fill(rows))
            assert out is rows
            if call:
                assert ops == [], ops
            assert padding.storage_padding_of(rows) == (k, 16)
            torch.testing.assert_close(rows.cpu(), torch.full((k, 8), value))
            torch.testing.assert_close((rows + 1).sum().cpu(), torch.tensor(k * 8 * (value + 1)))


@needs_hot_path
def test_like_factories_of_plain_tensors_are_served_while_padded_storages_live():
    """zeros_like and ones_like (empty_like, then a fill) of a plain tensor run no Python kernel
    while a padded storage is alive (autograd's gradients next to an expert loop's rows); of the
    padded rows themselves they are padded alike, by padding.empty_like."""
    from torchpjrt import padding

    x = torch.randn(64, 8, device=DEV)
    mask = torch.zeros(64, dtype=torch.bool)
    mask[:10] = True
    rows = x[mask.to(DEV)]  # 10 of 16 rows: a padded storage, alive
    assert padding.live and padding.storage_padding_of(rows) == (10, 16)
    torch.zeros_like(x), torch.ones_like(x)  # the fills' Python kernels teach the C++ ones
    for make, value in ((torch.zeros_like, 0.0), (torch.ones_like, 1.0)):
        out, ops = python_kernel_calls(lambda: make(x))
        assert ops == [], ops
        assert padding.storage_padding_of(out) is None
        torch.testing.assert_close(out.cpu(), torch.full((64, 8), value))
        like, ops = python_kernel_calls(lambda: make(rows))
        assert ops[:1] == ["aten.empty_like.default"], ops  # padded alike in Python
        assert padding.storage_padding_of(like) == (10, 16)
        torch.testing.assert_close(like.cpu(), torch.full((10, 8), value))


@needs_hot_path
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_a_routing_loop_is_served_with_n_passed_to_its_masked_reads(mode):
    """A mixture-of-experts layer's expert loop (transformers' eager experts): the tokens an
    expert got (torch.where of its mask: padded), gathered, projected, weighted and added back,
    forward and backward. Routings of other sizes in the same bucket are served by the hot path,
    the gather, index_select, index_add_ and accumulating index_put_ included, their masked
    reads given each call's n; every value and gradient equals CPU's."""
    gen = torch.Generator().manual_seed(0)
    tokens, hidden, experts = 32, 8, 3
    w_cpu = torch.randn(experts, hidden, hidden, generator=gen)

    def layer(x, w, route, weights):
        out = torch.zeros_like(x)
        for e in range(experts):
            idx, pos = torch.where(route == e)
            h = x[idx] @ w[e]
            h = h * weights[idx, pos, None]
            out.index_add_(0, idx, h)
            out = out + torch.index_select(x, 0, idx).sum() * 0.0
        return out

    from torchpjrt import dispatch

    counts = []  # per step, the calls Python kernels ran (the rest the hot path served)
    with torchpjrt.eager_mode(mode):
        for step in range(5):
            x_cpu = torch.randn(tokens, hidden, generator=gen)
            route = torch.randint(0, experts, (tokens, 2), generator=gen)
            weights = torch.rand(tokens, 2, generator=gen)
            results = []
            for dev in ("cpu", DEV):
                x = x_cpu.to(dev).detach().requires_grad_()
                w = w_cpu.to(dev).detach().requires_grad_()
                python_calls = dispatch.stats["lowered"]
                out = layer(x, w, route.to(dev), weights.to(dev))
                (out * out).sum().backward()
                python_calls = dispatch.stats["lowered"] - python_calls
                results.append((out.detach().cpu(), x.grad.cpu(), w.grad.cpu(), python_calls))
            (ref, ref_gx, ref_gw, _), (got, gx, gw, python_calls) = results
            torch.testing.assert_close(got, ref)
            torch.testing.assert_close(gx, ref_gx)
            torch.testing.assert_close(gw, ref_gw)
            counts.append(python_calls)
    # past a first routing, each expert's torch.where (nonzero: it reads the count) alone runs a
    # Python kernel; a step that meets a new bucket runs more
    assert min(counts[1:]) <= experts, counts
@needs_hot_path
def test_padded_arguments_of_an_exact_target_or_another_n_go_to_the_python_kernel():
    """CPU's broadcast of one padded row (n = 1) into an exact target depends on n, which the key
    leaves out: such calls are never served, so n = 2 meets CPU's error or its result."""
    x = torch.randn(64, 8)
    xd = x.to(DEV)

    def rows(k):
        mask = torch.zeros(64, dtype=torch.bool)
        mask[:k] = True
        return xd[mask.to(DEV)], x[mask]

    for k in (1, 1, 2, 2):
        padded, ref = rows(k)
        target = torch.ones(2, 8)
        target_d = target.to(DEV)
        out, n = served(lambda: target_d + padded)
        assert n == 0
        torch.testing.assert_close(out.cpu(), target + ref)
        _, n = served(lambda: target_d.add_(padded))
        assert n == 0
        torch.testing.assert_close(target_d.cpu(), target.add_(ref))
    with pytest.raises(RuntimeError, match="must match the size"):
        torch.ones(2, 8, device=DEV) + rows(3)[0]
    # two padded arguments with different n: the Python kernel (an exact run, CPU's error)
    with pytest.raises(RuntimeError, match="must match the size"):
        rows(3)[0] + rows(4)[0]
