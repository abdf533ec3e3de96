"""One process per chip under torchrun: the environment each rank gets (torchpjrt/distributed/chips.py),
and a real torchrun launch of 4 ranks on the CPU platform."""

import os
import subprocess
import sys
import textwrap

import pytest

from torchpjrt.distributed import chips


def torchrun_env(local_rank, local_world, **extra):
    env = {"LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": str(local_world), "WORLD_SIZE": str(local_world),
           "RANK": str(local_rank), "GROUP_RANK": "0", "TORCHPJRT_PLATFORM": "tpu"}
    env.update(extra)
    return env


@pytest.mark.parametrize("chips_on_host,bounds", [(4, "2,2,1"), (8, "2,4,1")])
def test_each_rank_of_a_tpu_host_owns_its_chip(chips_on_host, bounds):
    seen = []
    for rank in range(chips_on_host):
        env = chips.tpu_environment(torchrun_env(rank, chips_on_host))
        assert env["TPU_VISIBLE_CHIPS"] == str(rank)
        assert env["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert env["TPU_PROCESS_BOUNDS"] == bounds
        assert env["CLOUD_TPU_TASK_ID"] == str(rank)
        addresses = env["TPU_PROCESS_ADDRESSES"].split(",")
        assert len(addresses) == chips_on_host and addresses[rank] == f"localhost:{env['TPU_PROCESS_PORT']}"
        seen.append(env)
    # every rank agrees on the host's layout and has a port of its own
    assert len({e["TPU_PROCESS_ADDRESSES"] for e in seen}) == 1
    assert len({e["TPU_PROCESS_PORT"] for e in seen}) == chips_on_host


def test_prepare_sets_the_variables_before_the_client_and_leaves_the_users_own():
    environ = torchrun_env(2, 4)
    assert chips.prepare(environ)["TPU_VISIBLE_CHIPS"] == "2"
    assert environ["TPU_VISIBLE_CHIPS"] == "2" and environ["TPU_PROCESS_BOUNDS"] == "2,2,1"
    own = torchrun_env(1, 4, TPU_VISIBLE_CHIPS="3", TPU_PROCESS_BOUNDS="1,4,1")
    assert chips.prepare(own) == {}  # the escape hatch: any TPU variable set by the user
    assert own["TPU_VISIBLE_CHIPS"] == "3" and "TPU_CHIPS_PER_PROCESS_BOUNDS" not in own
    off = torchrun_env(1, 4, TORCHPJRT_PER_PROCESS_CHIPS="0")
    assert chips.prepare(off) == {} and "TPU_VISIBLE_CHIPS" not in off


def test_nothing_is_set_outside_torchrun_or_for_one_process():
    assert chips.tpu_environment({"TORCHPJRT_PLATFORM": "tpu"}) == {}
    assert chips.tpu_environment(torchrun_env(0, 1)) == {}
    assert chips.prepare(torchrun_env(0, 4, TORCHPJRT_PLATFORM="cpu")) == {}  # not a TPU process


def test_splits_it_cannot_derive_are_clear_errors():
    with pytest.raises(RuntimeError, match="3 processes on one TPU host.*TPU_PROCESS_BOUNDS"):
        chips.tpu_environment(torchrun_env(0, 3))
    with pytest.raises(RuntimeError, match="several hosts.*nproc_per_node=1"):
        chips.tpu_environment(torchrun_env(0, 4, WORLD_SIZE="8", GROUP_RANK="1"))


def test_gpu_ranks_get_their_local_device():
    env = torchrun_env(3, 8, TORCHPJRT_PLATFORM="gpu")
    assert chips.gpu_local_device_ids(env) == [3]
    assert chips.tpu_environment(dict(env, TORCHPJRT_PLATFORM="gpu")) != {}  # TPU variables are only applied on TPU
    assert chips.prepare(env) == {} and "TPU_VISIBLE_CHIPS" not in env
    assert chips.gpu_local_device_ids(dict(env, TORCHPJRT_PLATFORM="cpu")) is None
    assert chips.gpu_local_device_ids({"TORCHPJRT_PLATFORM": "gpu"}) is None
    assert chips.gpu_local_device_ids(dict(env, TORCHPJRT_PER_PROCESS_CHIPS="0")) is None


def test_accelerator_kind_is_known_without_a_backend():
    assert chips.accelerator({"TORCHPJRT_PLATFORM": "cuda"}) == "gpu"
    assert chips.accelerator({"JAX_PLATFORMS": "tpu,cpu"}) == "tpu"
    assert chips.accelerator({"TORCHPJRT_PLATFORM": "cpu"}) == ""


RANK_SCRIPT = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    import torch.nn as nn
    dist.init_process_group("pjrt")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == 4 and rank == int(os.environ["LOCAL_RANK"])
    assert torch.pjrt.device_count() == 1  # this process's own device only
    x = torch.full((3,), float(rank + 1), device="pjrt")
    dist.all_reduce(x)
    assert x.cpu().tolist() == [10.0, 10.0, 10.0], x
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2).to("pjrt"))
    torch.manual_seed(rank)
    inp = torch.randn(8, 4)
    model(inp.to("pjrt")).square().mean().backward()
    grads = [p.grad.cpu() for p in model.parameters()]
    # DDP's gradient is the mean over ranks: compare with every rank's CPU gradient
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    total = [torch.zeros_like(p) for p in ref.parameters()]
    for r in range(world):
        torch.manual_seed(r)
        ref.zero_grad()
        ref(torch.randn(8, 4)).square().mean().backward()
        total = [t + p.grad / world for t, p in zip(total, ref.parameters())]
    for g, t in zip(grads, total):
        torch.testing.assert_close(g, t, rtol=1e-5, atol=1e-6)
    dist.destroy_process_group()
    os.write(1, f"rank {rank} ok\\n".encode())  # one write: the ranks share stdout, maybe unbuffered
""")


@pytest.mark.slow  # four JAX processes
def test_torchrun_with_four_ranks_on_the_cpu_platform(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    env = dict(os.environ, TORCHPJRT_PLATFORM="cpu", OMP_NUM_THREADS="1")
    env.pop("XLA_FLAGS", None)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)],
        env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    assert sorted(line for line in out.stdout.splitlines() if line.startswith("rank")) == [f"rank {r} ok" for r in range(4)]
