"""SPMD checks on 8 virtual CPU devices, run in a subprocess by tests/test_spmd.py
(`python tests/spmd_worker.py`; `--process RANK PORT` runs one of two processes of the
multi-process check).

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before JAX starts, which a
pytest process that already imported torchpjrt cannot do. Each check prints one line
`SPMD_RESULT {"check": ..., "error": null or the failure}`; the test reads them.
"""

import copy
import json
import os
import sys
import traceback

# 8 devices in one process, or 4 in each of two (`--process RANK PORT`)
_DEVICES = "4" if "--process" in sys.argv else "8"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={_DEVICES}")

import jax  # noqa: E402
import torch  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import torchpjrt  # noqa: E402,F401
from torchpjrt.distributed import spmd  # noqa: E402

RTOL = 1e-5


def report(check, fn):
    try:
        fn()
        error = None
    except Exception:  # noqa: BLE001 - every failure is reported to the test, with its traceback
        error = traceback.format_exc()
    print("SPMD_RESULT " + json.dumps({"check": check, "error": error}), flush=True)


def assert_close(got, want, what, rtol=RTOL):
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=rtol, atol=1e-6, msg=lambda m: f"{what}: {m}")


def assert_spec(t, spec, what):
    got = spmd.partition_spec(t)
    spec = P(*spec[:max([i + 1 for i, e in enumerate(spec) if e is not None], default=0)])
    assert got == spec, f"{what}: expected {spec}, got {got} ({spmd.sharding_of(t)})"


# ---- training the same model sharded and unsharded ----------------------------------------


def train(model, x, y, steps=5, opt="adamw"):
    """Compiled forward and backward, eager optimizer: the losses and the optimizer."""
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-2) if opt == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    loss_fn = torch.compile(lambda x, y: torch.nn.functional.mse_loss(model(x), y), backend="pjrt")
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = loss_fn(x, y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, optimizer


def train_cpu(model, x, y, steps=5, opt="adamw"):
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-2) if opt == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


class Reference:
    """One model's unsharded runs (pjrt compiled, and CPU eager) for a given optimizer."""

    def __init__(self, model, x, y, opt):
        self.model, self.x, self.y, self.opt = model, x, y, opt
        self.cpu_losses = train_cpu(copy.deepcopy(model), x, y, opt=opt)
        self.pjrt_model = copy.deepcopy(model).to("pjrt")
        self.losses, _ = train(self.pjrt_model, x.to("pjrt"), y.to("pjrt"), opt=opt)
        assert_close(self.losses, self.cpu_losses, "unsharded pjrt vs CPU losses")

    def check(self, mesh, plan, input_axis, param_specs, grads_follow=True):
        model = spmd.parallelize(copy.deepcopy(self.model).to("pjrt"), mesh, plan)
        for name, p in model.named_parameters():
            assert_spec(p, param_specs[name], f"parameter {name}")
        x, y = spmd.shard_input((self.x, self.y), mesh, input_axis)
        batch_spec = P(input_axis)
        assert_spec(x, batch_spec, "input x")
        assert_spec(y, batch_spec, "input y")
        losses, optimizer = train(model, x, y, opt=self.opt)
        assert_close(losses, self.losses, "sharded vs unsharded losses")
        assert losses[-1] < losses[0], f"the loss did not go down: {losses}"
        for (name, p), ref in zip(model.named_parameters(), self.pjrt_model.parameters()):
            # parameters keep their placement through the optimizer's in-place updates
            assert_spec(p, param_specs[name], f"parameter {name} after training")
            assert_close(p.detach().cpu(), ref.detach().cpu(), f"trained {name}", rtol=1e-4)
            if grads_follow:
                assert_spec(p.grad, param_specs[name], f"gradient of {name}")
                for key, state in optimizer.state[p].items():
                    if isinstance(state, torch.Tensor) and state.dim():
                        assert_spec(state, param_specs[name], f"optimizer state {key} of {name}")


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


class Block(torch.nn.Module):
    """A transformer MLP block: up projection (column-wise), GELU, down projection (row-wise)."""

    def __init__(self, d=16):
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


# ---- the checks ---------------------------------------------------------------------------


def check_devices():
    assert len(jax.devices()) == 8, jax.devices()
    assert torch.pjrt.device_count() == 8


def check_data_and_fsdp(ref_adamw, ref_sgd):
    def data():
        mesh = spmd.mesh((8,), ("data",))
        replicated = {n: P() for n, _ in ref_adamw.model.named_parameters()}
        ref_adamw.check(mesh, "data", "data", replicated)

    def fsdp():
        mesh = spmd.mesh((8,), ("fsdp",))
        dim0 = {n: P("fsdp") for n, _ in ref_adamw.model.named_parameters()}
        ref_adamw.check(mesh, "fsdp", "fsdp", dim0)
        ref_sgd.check(mesh, spmd.FullyShard(), "fsdp", dim0)

    report("data_parallel", data)
    report("fsdp", fsdp)


def check_tensor_parallel():
    torch.manual_seed(1)
    block = Block()
    x, y = torch.randn(8, 4, 16), torch.randn(8, 4, 16)
    ref = Reference(block, x, y, "adamw")
    mesh = spmd.mesh((2, 4), ("data", "model"))
    specs = {"norm.weight": P(), "norm.bias": P(), "up.weight": P("model", None), "up.bias": P("model"),
             "down.weight": P(None, "model"), "down.bias": P()}
    ref.check(mesh, {"up": spmd.ColwiseParallel(), "down": spmd.RowwiseParallel()}, "data", specs)


def check_eager_ops():
    mesh = spmd.mesh((2, 4), ("data", "model"))
    a_cpu, w_cpu = torch.randn(16, 8), torch.randn(8, 12)
    a = spmd.shard(a_cpu.to("pjrt"), mesh, ("data", None))
    w = spmd.shard(w_cpu.to("pjrt"), mesh, (None, "model"))
    assert_spec(a, P("data", None), "shard()")
    for what, got, want in [
        ("matmul", a @ w, a_cpu @ w_cpu),
        ("elementwise", torch.tanh(a) * 2 + 1, torch.tanh(a_cpu) * 2 + 1),
        ("sum", a.sum(0), a_cpu.sum(0)),
        ("softmax", torch.softmax(a, -1), torch.softmax(a_cpu, -1)),
        ("slice view", a[3:11, 2:], a_cpu[3:11, 2:]),
        ("transpose", a.t().contiguous(), a_cpu.t().contiguous()),
        ("cat with an unsharded tensor", torch.cat([a, torch.ones(2, 8, device="pjrt")]),
         torch.cat([a_cpu, torch.ones(2, 8)])),
        ("with a host tensor", a + torch.arange(8.0).to("pjrt"), a_cpu + torch.arange(8.0)),
        ("index_select", a.index_select(0, torch.tensor([5, 0, 9]).to("pjrt")),
         a_cpu.index_select(0, torch.tensor([5, 0, 9]))),
    ]:
        assert_close(got.cpu(), want, what)
    assert abs(a.sum().item() - a_cpu.sum().item()) < 1e-4
    assert "each device holds (8, 8)" in spmd.sharding_of(a), spmd.sharding_of(a)
    assert spmd.partition_spec(torch.tanh(a)) is not None, "an elementwise result left the mesh"

    # in-place writes, whole and through a view, keep the tensor's placement
    b, b_cpu = a.clone(), a_cpu.clone()
    b.mul_(3)
    b[2:4] = 7.0
    b.t()[1] += 1
    b_cpu.mul_(3)
    b_cpu[2:4] = 7.0
    b_cpu.t()[1] += 1
    assert_close(b.cpu(), b_cpu, "in-place writes")
    with torch.no_grad():
        a.copy_(torch.zeros(16, 8))  # a host copy into a sharded tensor
    assert_spec(a, P("data", None), "after copy_ from the host")
    assert a.abs().sum().item() == 0

    # fused eager mode records ops on sharded tensors like any others
    with torchpjrt.eager_mode("fused"):
        c = torch.relu(b) @ w
        c_sum = c.sum().item()
    assert abs(c_sum - (torch.relu(b_cpu) @ w_cpu).sum().item()) < 1e-3 * max(1.0, abs(c_sum))


def check_errors():
    mesh = spmd.mesh((2, 4), ("data", "model"))

    def raises(fn, *needles):
        try:
            fn()
        except (ValueError, TypeError) as e:
            for needle in needles:
                assert needle in str(e), f"{needle!r} not in the error: {e}"
            return str(e)
        raise AssertionError(f"expected an error mentioning {needles}")

    uneven = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.Linear(30, 8)).to("pjrt")
    before = spmd.sharding_of(uneven[1].weight)
    raises(lambda: spmd.parallelize(uneven, mesh, {"0": spmd.ColwiseParallel(), "1": spmd.RowwiseParallel()}),
           "does not divide evenly", "0.weight", "30")
    assert spmd.sharding_of(uneven[1].weight) == before, "a failed plan moved parameters"
    raises(lambda: spmd.parallelize(mlp().to("pjrt"), mesh, {"decoder.*": spmd.ColwiseParallel()}),
           "'decoder.*' matches no module")
    raises(lambda: spmd.parallelize(Block().to("pjrt"), mesh, {"norm": spmd.ColwiseParallel()}),
           "ColwiseParallel applies to nn.Linear")
    raises(lambda: spmd.parallelize(mlp().to("pjrt"), mesh, "pipeline"), "unknown plan 'pipeline'")
    raises(lambda: spmd.parallelize(mlp().to("pjrt"), mesh, "fsdp"), "pass axis=")
    raises(lambda: spmd.parallelize(mlp(), mesh, "data"), "must be a pjrt tensor")
    raises(lambda: spmd.shard_input(torch.randn(12, 4), mesh, ("data", "model")), "does not divide evenly")
    raises(lambda: spmd.shard(torch.randn(8, 8, device="pjrt"), mesh, ("tensor",)), "no axis 'tensor'")
    raises(lambda: spmd.shard(torch.randn(8, 8, device="pjrt")[2:6], mesh, ("data",)), "view")
    raises(lambda: spmd.mesh((3, 2), ("a", "b")), "needs 6 devices")


def check_multiprocess(rank, world):
    """FSDP over every process's devices: each process feeds its own part of the batch, and
    .cpu() of a parameter split across processes gathers it."""
    assert jax.process_count() == world and len(jax.devices()) == 8, (jax.process_count(), jax.devices())
    torch.manual_seed(0)
    model, x, y = mlp(), torch.randn(32, 16), torch.randn(32, 8)
    cpu_losses = train_cpu(copy.deepcopy(model), x, y)
    mesh = spmd.mesh((8,), ("fsdp",))
    sharded = spmd.parallelize(copy.deepcopy(model).to("pjrt"), mesh, "fsdp")
    part = len(x) // world
    local = slice(rank * part, (rank + 1) * part)
    xs, ys = spmd.shard_input((x[local], y[local]), mesh, "fsdp")
    assert tuple(xs.shape) == (32, 16), xs.shape
    losses, _ = train(sharded, xs, ys)
    assert_close(losses, cpu_losses, "multi-process FSDP vs CPU losses")
    reference = copy.deepcopy(model)
    train_cpu(reference, x, y)
    assert_close(sharded[0].weight.detach().cpu(), reference[0].weight.detach(), "trained weight", rtol=1e-4)


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--process":
        # one of several processes: JAX's multi-process runtime, 8 devices in all
        rank, world, port = int(sys.argv[2]), 2, int(sys.argv[3])
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=world, process_id=rank)
        report("multiprocess_fsdp", lambda: check_multiprocess(rank, world))
        return
    report("devices", check_devices)
    torch.manual_seed(0)
    model, x, y = mlp(), torch.randn(32, 16), torch.randn(32, 8)
    refs = {}

    def references():
        refs["adamw"] = Reference(model, x, y, "adamw")
        refs["sgd"] = Reference(model, x, y, "sgd")

    report("unsharded_reference", references)
    if len(refs) == 2:
        check_data_and_fsdp(refs["adamw"], refs["sgd"])
    report("tensor_parallel", check_tensor_parallel)
    report("eager_ops", check_eager_ops)
    report("errors", check_errors)


if __name__ == "__main__":
    sys.exit(main())
