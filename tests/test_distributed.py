"""torch.distributed on pjrt: multi-process tests on the CPU platform.

Each test launches real processes (this file run as a script, one per rank, with torchrun's
env:// variables on loopback) and checks in every rank; a rank fails by exiting non-zero with
its traceback. Process start-up and JAX initialization dominate, so each launch runs many
checks. Every launch has a subprocess timeout, every test a pytest-timeout.
"""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario, world, timeout, extra_env=None):
    """Run `scenario` on `world` ranks; returns each rank's (returncode, output, result dict)."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   TORCHPJRT_PLATFORM="cpu", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   TF_CPP_MIN_LOG_LEVEL="2", **(extra_env or {}))
        procs.append(subprocess.Popen([sys.executable, __file__, scenario], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    results = []
    try:
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                out, _ = p.communicate()
                pytest.fail(f"{scenario} on {world} ranks did not finish within {timeout}s:\n{out[-4000:]}")
            result = {}
            for line in out.splitlines():
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
            # wall clock when the launcher saw the process end (exact for rank 0, waited for first)
            result["ended_at"] = time.time()
            results.append((p.returncode, out, result))
    finally:  # pytest-timeout or any error here must not leave ranks behind
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def assert_all_ok(results):
    for rank, (code, out, _) in enumerate(results):
        assert code == 0, f"rank {rank} exited with {code}:\n{out[-6000:]}"


# ---- the tests -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(130)
@pytest.mark.parametrize("world,reductions", [(2, "gloo"), (4, "gloo"), (2, "xla")])
def test_collectives_subgroups_async_mpmd_and_mismatch(world, reductions):
    # CPU platform all_reduce goes through gloo on host copies, or XLA's own collective
    results = launch("collectives", world, timeout=120, extra_env={"TORCHPJRT_CPU_COLLECTIVES": reductions})
    assert_all_ok(results)
    for _, _, result in results:
        assert result.get("checked", 0) >= (30 if world == 2 else 15), result


@pytest.mark.slow
@pytest.mark.timeout(130)
def test_ddp_dtensor_fsdp2_match_single_process():
    results = launch("training", 2, timeout=120)
    assert_all_ok(results)
    assert results[0][2]["ddp_max_rel_err"] < 1e-5
    assert results[0][2]["fsdp_max_rel_err"] < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_dead_rank_fails_the_others_clearly():
    results = launch("dead_rank", 2, timeout=50, extra_env={"TORCHPJRT_DIST_DEAD_AFTER": "3"})
    code, out, result = results[0]
    assert "error" in result, out[-4000:]
    assert "stopped responding" in result["error"] or "failed in XLA" in result["error"], result
    assert result["seconds"] < 30, result
    assert code == 3, f"the survivor exited with {code}, not its own sys.exit(3):\n{out[-4000:]}"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_survivor_of_a_dead_peer_exits_with_its_own_code_promptly():
    # JAX's shutdown barrier used to hold the survivor until JAX's heartbeat timeout (~26 s
    # after the error here) and then abort it (SIGABRT), destroy_process_group or not.
    results = launch("dead_rank", 2, timeout=50,
                     extra_env={"TORCHPJRT_DIST_DEAD_AFTER": "3", "TEST_DESTROY_AFTER_ERROR": "1"})
    code, out, result = results[0]
    assert "error" in result, out[-4000:]
    assert code == 3, f"the survivor exited with {code}, not its own sys.exit(3):\n{out[-4000:]}"
    assert "Terminating process" not in out, out[-4000:]
    took = result["ended_at"] - result["error_at"]
    assert took < 20, f"the survivor took {took:.1f}s from the error to its exit:\n{out[-4000:]}"
    assert results[1][0] == 7  # the peer really was killed


# ---- worker side ---------------------------------------------------------------------------


_START = time.monotonic()


def _init(timeout_s=60):
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import torchpjrt  # noqa: F401

    print(f"imported at {time.monotonic() - _START:.1f}s", flush=True)
    # frameworks ask about the device before init_process_group (TorchTitan at import); with
    # TORCHPJRT_PLATFORM set that starts JAX's runtime, which the process group must still start
    assert torch.pjrt.is_available() and torch.pjrt.device_count() == 1
    assert torch.pjrt.get_device_properties(0).total_memory > 0
    dist.init_process_group("pjrt", timeout=timedelta(seconds=timeout_s))
    print(f"initialized at {time.monotonic() - _START:.1f}s", flush=True)
    return torch, dist, dist.get_rank(), dist.get_world_size()


def _close(torch, dist, result):
    torch.pjrt.synchronize()
    dist.barrier()
    result["seconds"] = round(time.monotonic() - _START, 1)
    print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def worker_collectives():
    torch, dist, rank, world = _init()
    dev = "pjrt"
    checked = 0
    every_check = world == 2  # 4 ranks on 2 cores: only what the rank count changes

    def same(got, expected):
        nonlocal checked
        torch.testing.assert_close(got.cpu(), expected, rtol=1e-6, atol=1e-6)
        checked += 1

    def per_rank(r, shape=(3, 2), dtype=torch.float32):
        return (torch.arange(6, dtype=torch.float64).reshape(3, 2)[: shape[0]] + 10 * r + 1).to(dtype)

    ranks = range(world)
    # all_reduce with every op
    stacked = torch.stack([per_rank(r) for r in ranks])
    expected = {dist.ReduceOp.SUM: stacked.sum(0), dist.ReduceOp.AVG: stacked.mean(0),
                dist.ReduceOp.MAX: stacked.max(0).values, dist.ReduceOp.MIN: stacked.min(0).values,
                dist.ReduceOp.PRODUCT: stacked.prod(0)}
    for op, want in expected.items():
        t = per_rank(rank).to(dev)
        dist.all_reduce(t, op=op)
        same(t, want)
    if every_check:
        ints = torch.tensor([rank + 1, 2 ** 40 + rank], device=dev)  # int64 stays int64
        dist.all_reduce(ints)
        same(ints, torch.tensor([sum(r + 1 for r in ranks), world * 2 ** 40 + sum(ranks)]))
        flags = torch.tensor([rank == 0, True], device=dev)
        dist.all_reduce(flags, op=dist.ReduceOp.MIN)
        same(flags, torch.tensor([world == 1, True]))
        for dtype in (torch.bfloat16, torch.float16):  # half types through gloo's host path as well
            half = per_rank(rank, dtype=dtype).to(dev)
            dist.all_reduce(half)
            assert half.dtype == dtype
            same(half.float(), stacked.sum(0).to(dtype).float())
        bits = torch.tensor([rank + 1, 6, 2 ** 30 + rank], dtype=torch.int32)
        every = torch.stack([torch.tensor([r + 1, 6, 2 ** 30 + r], dtype=torch.int32) for r in ranks])
        for op, fold in ((dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                         (dist.ReduceOp.BXOR, torch.bitwise_xor)):
            t = bits.to(dev)
            dist.all_reduce(t, op=op)
            want = every[0]
            for row in every[1:]:
                want = fold(want, row)
            same(t, want)
        scalar = torch.tensor(float(rank), device=dev)
        dist.all_reduce(scalar)
        same(scalar, torch.tensor(float(sum(ranks))))
        # in-place through a view writes into its base
        base = torch.zeros(4, 3, device=dev)
        column = base[:, 1]
        column.fill_(rank + 1.0)
        dist.all_reduce(column)
        want = torch.zeros(4, 3)
        want[:, 1] = sum(r + 1.0 for r in ranks)
        same(base, want)

        # broadcast from a non-zero root (exact bits: -0.0, nan)
        root = world - 1
        t = torch.tensor([-0.0, float("nan"), 1.5], device=dev) if rank == root else torch.zeros(3, device=dev)
        dist.broadcast(t, src=root)
        got = t.cpu()
        assert torch.signbit(got[0]) and torch.isnan(got[1]) and got[2] == 1.5, got
        checked += 1

    # all_gather (list), all_gather_into_tensor (concat and stacked outputs)
    outs = [torch.empty(3, 2, device=dev) for _ in ranks]
    dist.all_gather(outs, per_rank(rank).to(dev))
    for r in ranks:
        same(outs[r], per_rank(r))
    cat = torch.empty(3 * world, 2, device=dev)
    dist.all_gather_into_tensor(cat, per_rank(rank).to(dev))
    same(cat, torch.cat([per_rank(r) for r in ranks]))
    stack = torch.empty(world, 3, 2, device=dev)
    dist.all_gather_into_tensor(stack, per_rank(rank).to(dev))
    same(stack, torch.stack([per_rank(r) for r in ranks]))

    # reduce_scatter_tensor (sum, max), reduce_scatter (list)
    full = [torch.arange(world * 2, dtype=torch.float32).reshape(world, 2) * (r + 1) for r in ranks]
    out = torch.empty(2, device=dev)
    dist.reduce_scatter_tensor(out, full[rank].reshape(-1).to(dev))
    same(out, sum(full)[rank])
    dist.reduce_scatter_tensor(out, full[rank].reshape(-1).to(dev), op=dist.ReduceOp.MAX)
    same(out, torch.stack(full).max(0).values[rank])
    out = torch.empty(2, device=dev)
    dist.reduce_scatter(out, [row.to(dev) for row in full[rank]])
    same(out, sum(full)[rank])
    # PREMUL_SUM (FSDP2's gradient divide factor): each input times the factor, then summed
    for factor in (0.25, torch.tensor(0.5, device=dev)):
        dist.reduce_scatter_tensor(out, full[rank].reshape(-1).to(dev), op=dist.ReduceOp.PREMUL_SUM(factor))
        same(out, sum(full)[rank] * float(factor))
    t = per_rank(rank).to(dev)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.125))
    same(t, stacked.sum(0) * 0.125)

    if every_check:
        # all_to_all_single and all_to_all
        send = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
        recv = torch.empty(world * 2, device=dev)
        dist.all_to_all_single(recv, send.to(dev))
        same(recv, torch.cat([torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32) + 100 * r for r in ranks]))
        outs = [torch.empty(2, device=dev) for _ in ranks]
        dist.all_to_all(outs, [c.to(dev) for c in send.chunk(world)])
        for r in ranks:
            same(outs[r], torch.arange(rank * 2, rank * 2 + 2, dtype=torch.float32) + 100 * r)
        # uneven splits: rank r sends r + j + 1 rows to rank j
        send_splits = [rank + j + 1 for j in ranks]
        recv_splits = [r + rank + 1 for r in ranks]
        rows = torch.cat([torch.full((k, 2), 10.0 * rank + j) for j, k in enumerate(send_splits)])
        got = torch.empty(sum(recv_splits), 2, device=dev)
        dist.all_to_all_single(got, rows.to(dev), recv_splits, send_splits)
        same(got, torch.cat([torch.full((k, 2), 10.0 * r + rank) for r, k in enumerate(recv_splits)]))
        outs = [torch.empty(k, 2, device=dev) for k in recv_splits]
        dist.all_to_all(outs, [c.to(dev) for c in rows.split(send_splits)])
        same(torch.cat(outs), torch.cat([torch.full((k, 2), 10.0 * r + rank) for r, k in enumerate(recv_splits)]))

        # reduce, gather, scatter to/from a root
        t = per_rank(rank).to(dev)
        dist.reduce(t, dst=root)
        if rank == root:
            same(t, stacked.sum(0))
        gathered = [torch.empty(3, 2, device=dev) for _ in ranks] if rank == root else None
        dist.gather(per_rank(rank).to(dev), gathered, dst=root)
        if rank == root:
            for r in ranks:
                same(gathered[r], per_rank(r))
        piece = torch.empty(3, 2, device=dev)
        dist.scatter(piece, [per_rank(r).to(dev) for r in ranks] if rank == 0 else None, src=0)
        same(piece, per_rank(rank))

    # send/recv around a ring (even ranks send first so the pairs line up)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    msg = torch.full((4,), float(rank), device=dev)
    box = torch.empty(4, device=dev)
    if rank % 2 == 0:
        dist.send(msg, nxt)
        dist.recv(box, prev)
    else:
        dist.recv(box, prev)
        dist.send(msg, nxt)
    same(box, torch.full((4,), float(prev)))

    if every_check:
        # fused eager mode: pending graphs run before the collective reads its input
        import torchpjrt

        with torchpjrt.eager_mode("fused"):
            t = (torch.ones(3, device=dev) * (rank + 1)).exp().log()
            dist.all_reduce(t)
            t = t * 2
        same(t, torch.full((3,), 2.0 * sum(r + 1 for r in ranks)))

        # async handles
        a, b = per_rank(rank).to(dev), torch.ones(5, device=dev) * rank
        works = [dist.all_reduce(a, async_op=True), dist.all_reduce(b, op=dist.ReduceOp.MAX, async_op=True)]
        for w in works:
            w.wait()
            assert w.is_completed()
        same(a, stacked.sum(0))
        same(b, torch.ones(5) * (world - 1))
        fut = dist.all_reduce(torch.ones(2, device=dev), async_op=True).get_future()
        same(fut.wait()[0], torch.full((2,), float(world)))

    # sub-groups: the even ranks, and every rank's pair
    evens = [r for r in ranks if r % 2 == 0]
    even_group = dist.new_group(evens)
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    if rank in evens:
        t = torch.tensor([float(rank)], device=dev)
        dist.all_reduce(t, group=even_group)
        same(t, torch.tensor([float(sum(evens))]))
    mine = pairs[rank // 2]
    t = torch.tensor([float(rank)], device=dev)
    dist.all_reduce(t, group=mine)
    same(t, torch.tensor([float(2 * (rank // 2) * 2 + 1)]))
    outs = [torch.empty(1, device=dev) for _ in range(2)]
    dist.all_gather(outs, torch.tensor([rank * 1.0], device=dev), group=mine)
    same(torch.cat(outs), torch.tensor([2.0 * (rank // 2), 2.0 * (rank // 2) + 1]))

    if every_check:
        # CPU tensors in the same group go through gloo
        c = torch.ones(3) * rank
        dist.all_reduce(c)
        same(c, torch.ones(3) * sum(ranks))
        objects = [None] * world
        dist.all_gather_object(objects, {"rank": rank})
        assert [o["rank"] for o in objects] == list(ranks)
        checked += 1

        # MPMD: rank 0 alone logs, evaluates and saves between collectives (its own device work,
        # of different shapes); everyone meets again at the next collective with right values.
        model = torch.nn.Linear(4, 4).to(dev)
        for step in range(3):
            g = torch.full((4, 4), float(rank + step), device=dev)
            dist.all_reduce(g)
            same(g, torch.full((4, 4), float(sum(ranks) + world * step)))
            if rank == 0:
                with torch.no_grad():
                    for _ in range(5):
                        model(torch.randn(16, 4, device=dev)).sum().item()
                torch.save(model.state_dict(), os.devnull)
                print(f"rank 0 step {step} logging", flush=True)
            else:
                time.sleep(0.05 * rank)
        if rank == 1:
            extra = torch.ones(7, device=dev)
            dist.broadcast(extra, src=1, group=pairs[0])  # only the first pair joins this one
        elif rank == 0:
            extra = torch.zeros(7, device=dev)
            dist.broadcast(extra, src=1, group=pairs[0])
            same(extra, torch.ones(7))

    # mismatched shapes fail clearly on every rank, and the group stays usable afterwards
    bad = torch.ones(4 + rank, device=dev)
    try:
        dist.all_reduce(bad)
        raise AssertionError("a shape mismatch must raise")
    except RuntimeError as e:
        assert "does not match across ranks" in str(e) and "float32[4]" in str(e), e
        checked += 1
    t = torch.ones(2, device=dev)
    dist.all_reduce(t)
    same(t, torch.full((2,), float(world)))
    _close(torch, dist, {"checked": checked})


def worker_dead_rank():
    torch, dist, rank, world = _init(timeout_s=60)
    t = torch.ones(4, device="pjrt")
    dist.all_reduce(t)
    t.cpu()
    if rank == 1:
        os._exit(7)  # dies without a word
    time.sleep(0.5)
    start = time.monotonic()
    try:
        for _ in range(3):
            dist.all_reduce(t)
            t.cpu()
        result = {"no_error": True}
    except RuntimeError as e:
        result = {"error": str(e), "seconds": time.monotonic() - start, "error_at": time.time()}
    print("RESULT " + json.dumps(result), flush=True)
    if os.environ.get("TEST_DESTROY_AFTER_ERROR"):
        dist.destroy_process_group()
    sys.exit(3)  # what torchrun and the scheduler must see: this process's own exit code


def _mlp(torch, seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def _max_rel_err(torch, got, want):
    return max(((g.detach().cpu() - w.detach().cpu()).abs().max() / w.detach().cpu().abs().max().clamp_min(1e-12)).item()
               for g, w in zip(got, want))


def worker_training():
    torch, dist, rank, world = _init()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dev = "pjrt"
    result = {}
    gen = torch.Generator().manual_seed(1)
    xs = torch.randn(4, 8 * world, 8, generator=gen)  # 4 steps of a global batch of 8 per rank
    ys = torch.randn(4, 8 * world, 4, generator=gen)
    mine = slice(8 * rank, 8 * (rank + 1))

    # DDP across ranks == one process on the whole batch
    ddp = torch.nn.parallel.DistributedDataParallel(_mlp(torch, 0).to(dev))
    single = _mlp(torch, 0).to(dev)
    opt_ddp = torch.optim.SGD(ddp.parameters(), lr=0.1)
    opt_single = torch.optim.SGD(single.parameters(), lr=0.1)
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.mse_loss(ddp(x[mine].to(dev)), y[mine].to(dev))
        opt_ddp.zero_grad()
        loss.backward()
        opt_ddp.step()
        full = torch.nn.functional.mse_loss(single(x.to(dev)), y.to(dev))
        opt_single.zero_grad()
        full.backward()
        opt_single.step()
    result["t_ddp"] = round(time.monotonic() - _START, 1)
    result["ddp_max_rel_err"] = _max_rel_err(torch, list(ddp.module.parameters()), list(single.parameters()))
    assert result["ddp_max_rel_err"] < 1e-5, result

    # DTensor on a pjrt device mesh
    mesh = init_device_mesh(dev, (world,))
    full = torch.arange(4 * world * 6, dtype=torch.float32).reshape(4 * world, 6)
    rows = distribute_tensor(full.to(dev), mesh, [Shard(0)])
    assert rows.to_local().device.type == "pjrt"
    torch.testing.assert_close(rows.to_local().cpu(), full.chunk(world)[rank])
    cols = rows.redistribute(mesh, [Shard(1)])
    torch.testing.assert_close(cols.to_local().cpu(), full.chunk(world, dim=1)[rank])
    torch.testing.assert_close(cols.redistribute(mesh, [Replicate()]).to_local().cpu(), full)
    torch.testing.assert_close(rows.full_tensor().cpu(), full)
    torch.testing.assert_close((rows * 2 + 1).sum().full_tensor().cpu(), (full * 2 + 1).sum())
    weight = distribute_tensor(torch.eye(6).to(dev), mesh, [Replicate()])
    torch.testing.assert_close((rows @ weight).full_tensor().cpu(), full)

    result["t_dtensor"] = round(time.monotonic() - _START, 1)
    # FSDP2 on a small transformer-style stack == unsharded training on the whole batch
    from torch.distributed.fsdp import fully_shard

    def blocks(seed):
        torch.manual_seed(seed)
        layers = [torch.nn.Sequential(torch.nn.LayerNorm(8), torch.nn.Linear(8, 32), torch.nn.GELU(),
                                      torch.nn.Linear(32, 8)) for _ in range(3)]
        return torch.nn.Sequential(*layers, torch.nn.Linear(8, 4))

    sharded = blocks(2).to(dev)
    for layer in list(sharded)[:3]:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    reference = blocks(2).to(dev)
    opt_sharded = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
    opt_reference = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    losses = []
    for x, y in zip(xs, ys):
        loss = torch.nn.functional.mse_loss(sharded(x[mine].to(dev)), y[mine].to(dev))
        opt_sharded.zero_grad()
        loss.backward()
        opt_sharded.step()
        total = loss.detach().clone()
        dist.all_reduce(total, op=dist.ReduceOp.AVG)
        full_loss = torch.nn.functional.mse_loss(reference(x.to(dev)), y.to(dev))
        opt_reference.zero_grad()
        full_loss.backward()
        opt_reference.step()
        losses.append((total.item(), full_loss.item()))
    for got, want in losses:
        assert abs(got - want) <= 1e-5 * abs(want) + 1e-6, losses
    gathered = [p.full_tensor() for p in sharded.parameters()]
    result["fsdp_max_rel_err"] = _max_rel_err(torch, gathered, list(reference.parameters()))
    assert result["fsdp_max_rel_err"] < 1e-4, result
    _close(torch, dist, result)


WORKERS = {"collectives": worker_collectives, "dead_rank": worker_dead_rank, "training": worker_training}

if __name__ == "__main__":
    WORKERS[sys.argv[1]]()


def test_host_buffers_return_only_when_jax_lets_go():
    """CPU-platform all_reduce results live in pooled host buffers: a buffer goes back to the
    pool when the JAX array made from it is gone, never while it is alive."""
    import gc

    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from torchpjrt.distributed import collectives

    pool = collectives._HostBuffers()
    saved, collectives._host_buffers = collectives._host_buffers, pool
    try:
        src = jnp.arange(4096, dtype=jnp.float32)
        first = jax.dlpack.from_dlpack(collectives._host_copy(src, torch.float32))
        gc.collect()
        assert pool._idle == 0  # the array still reads that buffer
        second = jax.dlpack.from_dlpack(collectives._host_copy(src * 2, torch.float32))
        assert np.array_equal(np.asarray(first), np.arange(4096)) and np.array_equal(np.asarray(second), 2 * np.arange(4096))
        address = first.unsafe_buffer_pointer()
        del first
        gc.collect()
        assert pool._idle == 4096 * 4
        third = jax.dlpack.from_dlpack(collectives._host_copy(src * 3, torch.float32))
        assert third.unsafe_buffer_pointer() == address  # the same pages, used again
        assert np.array_equal(np.asarray(second), 2 * np.arange(4096)) and np.array_equal(np.asarray(third), 3 * np.arange(4096))
        assert pool._idle == 0
    finally:
        collectives._host_buffers = saved
