"""Several pjrt devices in one process (the CPU platform split into 4 devices), checked the way a
user writes multi-GPU code: `.to("pjrt:1")`, `torch.pjrt.set_device`, a model split across two
devices by hand. Run by tests/test_multi_device.py in a fresh process per eager mode:

    python multi_device_worker.py MODE OUT.json [--runtime-first]

Results go to OUT.json as {check name: value}; the test compares them with what CUDA gives.
"""

import json
import os
import sys
import traceback

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"

import torch  # noqa: E402

MODE, OUT = sys.argv[1], sys.argv[2]
RUNTIME_FIRST = "--runtime-first" in sys.argv
results = {}


def check(fn):
    try:
        results[fn.__name__] = fn()
    except Exception:  # noqa: BLE001 - recorded for the test to show
        results[fn.__name__] = {"error": traceback.format_exc()[-3000:]}
    return fn


if RUNTIME_FIRST:
    torch.pjrt.init()  # the runtime (and its 4 devices) before any backward of the process

import torchpjrt  # noqa: E402

if MODE != "compiled":
    torchpjrt.set_eager_mode(MODE)


def array_device(t):
    """Where the tensor's data really is: the index of its JAX array's device."""
    (dev,) = torchpjrt.to_jax(t).devices()
    return torch.pjrt.jax_devices().index(dev)


def placed(t):
    return [str(t.device), array_device(t)]


class Pipe(torch.nn.Module):
    """Two stages on two devices, activations copied between them (pipeline style)."""

    def __init__(self, d0, d1):
        super().__init__()
        self.d0, self.d1 = d0, d1
        self.a = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16)).to(d0)
        self.b = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)).to(d1)
        if MODE == "compiled" and d0 != "cpu":
            # one compiled graph per stage, each on its own device
            self.a = torch.compile(self.a, backend="pjrt")
            self.b = torch.compile(self.b, backend="pjrt")

    def forward(self, x):
        return self.b(self.a(x.to(self.d0)).to(self.d1))


def train(d0, d1, steps=5):
    torch.manual_seed(0)
    model = Pipe(d0, d1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 8, generator=gen)
        y = torch.randint(0, 3, (6,), generator=gen)
        loss = torch.nn.functional.cross_entropy(model(x), y.to(d1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # by position: torch.compile renames a compiled stage's parameters (a._orig_mod.0.weight)
    params = [(n.replace("._orig_mod", ""), str(p.device), str(p.grad.device), p.detach().cpu().flatten().tolist())
              for n, p in model.named_parameters()]
    return losses, params


@check
def pipeline_training():
    if not RUNTIME_FIRST:
        cpu = train("cpu", "cpu")  # a backward before the pjrt runtime starts: the CPU oracle first
    pj = train("pjrt:0", "pjrt:1")
    if RUNTIME_FIRST:
        cpu = train("cpu", "cpu")
    diff = max(abs(a - b) for a, b in zip(cpu[0], pj[0]))
    param_diff = max(abs(x - y) for c, p in zip(cpu[1], pj[1]) for x, y in zip(c[3], p[3]))
    return {"loss_diff": diff, "param_diff": param_diff, "devices": {p[0]: [p[1], p[2]] for p in pj[1]}}


@check
def counts():
    return [torch.pjrt.device_count(), torch.accelerator.device_count()]


@check
def factories():
    out = {}
    for i in range(4):
        d = f"pjrt:{i}"
        made = {"empty": torch.empty(3, device=d), "zeros": torch.zeros(2, 2, device=d),
                "ones": torch.ones(3, dtype=torch.int64, device=d), "arange": torch.arange(5, device=d),
                "full": torch.full((2,), 7.0, device=d), "rand": torch.rand(4, device=d),
                "randn": torch.randn(4, device=d), "eye": torch.eye(3, device=d),
                "tensor": torch.tensor([1.0, 2.0], device=d), "empty_strided": torch.empty_strided((2, 3), (1, 2), device=d)}
        for name, t in made.items():
            t.cpu()  # materialized
            out[f"{name}@{i}"] = placed(t)
    return out


@check
def ops_views_inplace():
    x = torch.arange(12.0, device="pjrt:2").reshape(3, 4)
    y = x * 2 + 1
    v = y[1:, ::2]
    t = y.t()
    x.add_(1)
    x[0].mul_(10)
    out = torch.empty(0, device="pjrt:2")
    torch.mul(x, 2, out=out)
    s = y.sum(dim=1)
    m = y @ y.t()
    return {"op": placed(y), "view": placed(v), "transpose": placed(t), "inplace": placed(x),
            "out": placed(out), "reduction": placed(s), "matmul": placed(m),
            "values": [x.cpu().tolist(), v.cpu().tolist(), out.cpu().tolist()]}


@check
def device_mismatch():
    a = torch.ones(3, device="pjrt:0")
    b = torch.ones(3, device="pjrt:1")
    errors = {}
    for name, fn in {"add": lambda: a + b, "matmul": lambda: a.view(1, 3) @ b.view(3, 1),
                     "cat": lambda: torch.cat([a, b]), "inplace": lambda: a.add_(b),
                     "out": lambda: torch.add(a, a, out=b), "index": lambda: a[torch.zeros(1, dtype=torch.long, device="pjrt:1")]}.items():
        try:
            fn()
            errors[name] = None
        except RuntimeError as e:
            errors[name] = str(e)
    # a CPU scalar tensor may join any device's op, as on CUDA
    errors["cpu_scalar"] = (b + torch.tensor(2.0)).cpu().tolist()
    return errors


@check
def copies():
    src = torch.arange(6.0, device="pjrt:1")
    out = {"to": placed(src.to("pjrt:3")), "to_non_blocking": placed(src.to("pjrt:2", non_blocking=True)),
           "to_dtype": placed(src.to("pjrt:0", torch.int32))}
    dst = torch.zeros(6, device="pjrt:3")
    dst.copy_(src * 2)
    out["copy_"] = placed(dst)
    out["values"] = [dst.cpu().tolist(), src.to("pjrt:3").cpu().tolist(), src.to("pjrt:0", torch.int32).cpu().tolist()]
    cpu = torch.arange(4.0)
    out["from_cpu"] = placed(cpu.to("pjrt:2"))
    part = torch.zeros(2, 3, device="pjrt:2")
    part[1].copy_(torch.ones(3, device="pjrt:0"))
    out["into_view"] = [placed(part), part.cpu().tolist()]
    return out


@check
def current_device():
    out = {"start": torch.pjrt.current_device()}
    torch.pjrt.set_device(2)
    out["after_set"] = [torch.pjrt.current_device(), str(torch.ones(1, device="pjrt").device),
                        str(torch.arange(2, device="pjrt").device), str(torch.ones(1).to("pjrt").device)]
    with torch.pjrt.device(3):
        out["in_context"] = [torch.pjrt.current_device(), str(torch.zeros(1, device="pjrt").device)]
    out["after_context"] = torch.pjrt.current_device()
    with torch.pjrt.device_of(torch.ones(1, device="pjrt:1")):
        out["device_of"] = torch.pjrt.current_device()
    torch.pjrt.set_device(0)
    out["accelerator"] = torch.accelerator.current_device_index()
    try:
        torch.ones(1, device="pjrt:9")
        out["missing"] = None
    except RuntimeError as e:
        out["missing"] = str(e)
    return out


@check
def random_generators():
    torch.manual_seed(5)
    a0 = torch.rand(4, device="pjrt:0").cpu()
    a1 = torch.rand(4, device="pjrt:1").cpu()
    torch.manual_seed(5)
    b1 = torch.rand(4, device="pjrt:1").cpu()
    # seeding one device leaves the other's stream alone
    torch.manual_seed(5)
    torch.rand(4, device="pjrt:0")
    with torch.pjrt.device(1):
        torch.pjrt.manual_seed(99)
    c0 = torch.rand(4, device="pjrt:0").cpu()
    torch.manual_seed(5)
    torch.rand(4, device="pjrt:0")
    d0 = torch.rand(4, device="pjrt:0").cpu()
    state = torch.pjrt.get_rng_state("pjrt:1")
    e1 = torch.rand(3, device="pjrt:1").cpu()
    torch.pjrt.set_rng_state(state, "pjrt:1")
    f1 = torch.rand(3, device="pjrt:1").cpu()
    return {"same_seed_each_device": torch.equal(a1, b1), "devices_independent": torch.equal(c0, d0),
            "state_replays": torch.equal(e1, f1), "all_states": len(torch.pjrt.get_rng_state_all())}


@check
def memory_and_properties():
    return [torch.pjrt.get_device_properties(i).index for i in range(4)] + \
           [isinstance(torch.pjrt.memory_stats(i), dict) for i in range(4)]


@check
def module_moves():
    m = torch.nn.Linear(3, 2)
    w = m.weight
    m.to("pjrt:1")
    same = m.weight is w
    m.to("pjrt:2")
    state = {k: str(v.device) for k, v in m.state_dict().items()}
    return {"parameter_kept": same and m.weight is w, "state_dict": state}


@check
def compiled_on_device():
    f = torch.compile(lambda x: (x.sin() * 2).sum(0) + torch.ones(3, device=x.device), backend="pjrt")
    x = torch.randn(4, 3, device="pjrt:3")
    y = f(x)
    return {"placed": placed(y), "diff": (y.cpu() - ((x.cpu().sin() * 2).sum(0) + 1)).abs().max().item()}


@check
def fused_factory_graph():
    # a graph made only of factories on pjrt:2 (no device inputs) must run there
    t = torch.ones(3, device="pjrt:2") * 3 + torch.arange(3.0, device="pjrt:2")
    return [placed(t), t.cpu().tolist()]


@check
def save_and_load(tmp=os.path.dirname(os.path.abspath(OUT))):
    import safetensors.torch

    t = torch.arange(4.0, device="pjrt:1")
    path = os.path.join(tmp, f"md_{MODE}.pt")
    torch.save({"t": t}, path)
    loaded = torch.load(path, map_location="pjrt:2")["t"]
    st_path = os.path.join(tmp, f"md_{MODE}.safetensors")
    safetensors.torch.save_file({"t": t.cpu()}, st_path)
    st = safetensors.torch.load_file(st_path, device="pjrt:3")["t"]
    return {"torch_load": placed(loaded), "safetensors": placed(st), "values": loaded.cpu().tolist() + st.cpu().tolist()}


@check
def data_dependent_and_modes():
    """Ops whose output shape depends on the data, inference mode, autocast, activation
    checkpointing with dropout (its RNG state per device), and both Adam kernels, on pjrt:1."""
    from torch.utils.checkpoint import checkpoint

    d = "pjrt:1"
    x = torch.randn(5, 4, device=d)
    out = {"nonzero": placed(torch.nonzero(x > 0)), "mask": placed(x[x > 0]),
           "unique": placed(torch.unique(torch.tensor([3, 1, 3], device=d)))}
    with torch.inference_mode():
        out["inference"] = placed(x * 2)
    with torch.autocast("pjrt", dtype=torch.bfloat16):
        out["autocast"] = placed(x @ x.t()) + [str((x @ x.t()).dtype)]
    layer = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)).to(d)
    torch.manual_seed(0)
    checkpoint(layer, x, use_reentrant=False).sum().backward()
    checkpointed = layer[0].weight.grad.cpu().clone()
    layer.zero_grad()
    torch.manual_seed(0)
    layer(x).sum().backward()
    out["checkpoint_same_grads"] = torch.equal(checkpointed, layer[0].weight.grad.cpu())
    for fused in (False, True):
        p = torch.nn.Parameter(torch.ones(3, device=d))
        opt = torch.optim.Adam([p], lr=0.1, fused=fused or None, foreach=not fused)
        (p * 2).sum().backward()
        opt.step()
        out[f"adam_fused={fused}"] = placed(p.detach()) + [round(p[0].item(), 6)]
    return out


@check
def autograd_threads():
    """PyTorch's autograd engine's device worker threads (pt_autograd_<device>)."""
    names = [open(f"/proc/self/task/{tid}/comm").read().strip() for tid in os.listdir("/proc/self/task")]
    return sorted(n for n in names if n.startswith("pt_autograd_"))


@check
def kernel_cache_stats():
    from torchpjrt import kernel_cache

    return dict(kernel_cache.stats)


@check
def compile_stats():
    stats = torchpjrt.compile_stats()
    return {"graphs": stats["graphs"], "eager_graphs": stats["eager_graphs"]}


with open(OUT, "w") as f:
    json.dump(results, f)
