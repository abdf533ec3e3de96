"""`import torch` on a machine with torchpjrt installed imports neither torchpjrt nor JAX; the
first use of the device, by any of the ways a program reaches it, loads them, and the program
behaves as if it had imported torchpjrt first. Each case runs in a fresh interpreter that never
imports torchpjrt itself."""

import os
import subprocess
import sys
import textwrap

import pytest

PRELUDE = """
import sys
import torch
assert "jax" not in sys.modules and "torchpjrt" not in sys.modules, "import torch loaded torchpjrt"
assert torch.device("pjrt").type == "pjrt"
"""

LOADED = """
assert "torchpjrt" in sys.modules and "jax" in sys.modules, "the device was used but torchpjrt is not loaded"
print("OK")
"""


def _run(body: str, tmp_path=None, timeout=600):
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    code = PRELUDE + textwrap.dedent(body) + LOADED
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_import_torch_alone_does_not_import_jax():
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    code = PRELUDE + "print(type(torch.pjrt).__name__, torch.accelerator.current_accelerator())\n"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["_DeviceModule", "pjrt"]


@pytest.mark.slow  # a fresh process
def test_first_op_loads_the_device_and_matches_cpu():
    _run("""
    x = torch.arange(6.0).reshape(2, 3)
    y = (x.to("pjrt") * 2 + 1).sum(0)
    assert type(torch.pjrt).__name__ == "module" and torch.pjrt.device_count() >= 1
    assert torch.equal(y.cpu(), (x * 2 + 1).sum(0))
    z = torch.zeros(4, device="pjrt")  # a factory: no tensor argument
    assert z.device.type == "pjrt" and z.sum().item() == 0
    """)


@pytest.mark.slow  # a fresh process
def test_importing_torchpjrt_leaves_dynamo_to_torch_compile():
    # Dynamo and AOTAutograd take about a second to import: torch.compile loads them when used
    _run("""
    import torchpjrt
    assert "torch._dynamo" not in sys.modules, "import torchpjrt imported Dynamo"
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU()).to("pjrt").eval()
    with torch.no_grad():
        y = model(torch.ones(2, 4, device="pjrt")).cpu()
        assert torch.allclose(torch.compile(model, backend="pjrt")(torch.ones(2, 4, device="pjrt")).cpu(), y)
    assert torchpjrt.compile_stats()["graphs"] == 1
    """)


@pytest.mark.slow
@pytest.mark.parametrize("case", [
    "module_to", "device_module", "factory_context", "storage", "compile", "accelerator", "from_dlpack", "threads",
])
def test_each_way_in_loads_the_device(case):
    bodies = {
        # a training loop written for any device, unchanged: the model moves first
        "module_to": """
            import copy
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
            data = [(torch.randn(4, 8), torch.randn(4, 2)) for _ in range(3)]
            def train(device):
                m = copy.deepcopy(model).to(device)
                opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
                out = []
                for x, y in data:
                    opt.zero_grad()
                    loss = torch.nn.functional.mse_loss(m(x.to(device)), y.to(device))
                    loss.backward()
                    opt.step()
                    out.append(loss.item())
                return out
            dev = train("pjrt")
            cpu = train("cpu")
            assert max(abs(a - b) for a, b in zip(dev, cpu)) < 1e-5, (dev, cpu)
        """,
        "device_module": """
            assert torch.pjrt.is_available() and torch.pjrt.device_count() >= 1
            torch.pjrt.manual_seed(1)
            assert torch.randn(3, device="pjrt").shape == (3,)
        """,
        "factory_context": """
            with torch.device("pjrt"):
                layer = torch.nn.Linear(3, 2)
            assert layer.weight.device.type == "pjrt"
        """,
        "storage": """
            s = torch.UntypedStorage(16, device="pjrt")
            assert s.device.type == "pjrt" and s.nbytes() == 16
        """,
        "compile": """
            f = torch.compile(lambda a: (a * 3).sin(), backend="pjrt")
            a = torch.randn(5)
            assert torch.allclose(f(a.to("pjrt")).cpu(), (a * 3).sin(), atol=1e-6)
        """,
        "accelerator": """
            assert torch.accelerator.current_accelerator().type == "pjrt"
            assert torch.accelerator.memory_allocated() >= 0
            torch.accelerator.synchronize()
            assert torch.randn(4).pin_memory().is_pinned() in (True, False)
        """,
        "from_dlpack": """
            import jax.numpy as jnp
            t = torch.from_dlpack(jnp.arange(4.0))
            assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
        """,
        "threads": """
            import threading
            results, errors = [], []
            def work(i):
                try:
                    results.append((torch.full((3,), float(i), device="pjrt") + 1).sum().item())
                except Exception as e:
                    errors.append(e)
            threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
            [t.start() for t in threads]; [t.join() for t in threads]
            assert not errors, errors
            assert sorted(results) == [3.0, 6.0, 9.0, 12.0]
        """,
    }
    _run(bodies[case])


@pytest.mark.slow
def test_checkpoints_load_onto_the_device(tmp_path):
    # saved from pjrt by one process, loaded by fresh ones that never used the device before
    _run("""
    import safetensors.torch
    w = torch.arange(6.0).reshape(2, 3)
    p = w.to("pjrt")
    state = {"w": p, "view": p[1]}
    torch.save(state, "state.pt")
    safetensors.torch.save_file({"w": w}, "w.safetensors")
    """, tmp_path)
    for load in (
        'sd = torch.load("state.pt")',  # pjrt storages, no map_location
        'sd = torch.load("state.pt", map_location="pjrt")',
        'sd = torch.load("state.pt", map_location={"pjrt:0": "pjrt:0"})',
    ):
        _run(load + textwrap.dedent("""
            assert sd["w"].device.type == "pjrt" and sd["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
            assert sd["view"].untyped_storage().data_ptr() == sd["w"].untyped_storage().data_ptr()  # one storage
        """), tmp_path)
    _run("""
    import safetensors.torch
    sd = safetensors.torch.load_file("w.safetensors", device="pjrt")
    assert sd["w"].device.type == "pjrt" and sd["w"].tolist() == [[0, 1, 2], [3, 4, 5]]
    """, tmp_path)


@pytest.mark.slow
def test_distributed_backend_loads_the_device(tmp_path):
    _run("""
    import torch.distributed as dist
    dist.init_process_group("pjrt", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    t = torch.ones(3, device="pjrt")
    dist.all_reduce(t)
    assert t.tolist() == [1.0, 1.0, 1.0]
    dist.destroy_process_group()
    """, tmp_path)


@pytest.mark.slow
def test_lightning_knows_the_accelerator(tmp_path):
    pytest.importorskip("lightning")
    _run("""
    import lightning.pytorch as pl
    assert "jax" in sys.modules  # importing Lightning loads torchpjrt: Trainer must know "pjrt"
    trainer = pl.Trainer(accelerator="pjrt", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    assert trainer.strategy.root_device.type == "pjrt"
    """, tmp_path)


def test_the_autoload_and_torchpjrt_share_one_list_of_accelerator_routes():
    import torchpjrt_autoload
    from torchpjrt import accelerator

    assert set(torchpjrt_autoload.ACCELERATOR_FUNCTIONS) == set(accelerator._ROUTES)
