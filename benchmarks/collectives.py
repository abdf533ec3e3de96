"""torch.distributed on pjrt vs gloo: all_reduce bus bandwidth, and DDP step time 1 vs 2 processes.

    python benchmarks/collectives.py [--world 2] [--max-mb 64] [--repeats 10]

Launches the ranks itself (env:// on loopback). In the same processes it times all_reduce on
pjrt tensors (the "pjrt" process group: XLA collectives) and on CPU tensors through a gloo
group, alternating per size so both see the same machine load. Bus bandwidth follows
nccl-tests: bytes * 2(n-1)/n / time. Then it times a DDP training step on pjrt with 1 and
with `--world` processes (same per-rank batch). Not a test: it prints a table.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode, world, args):
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.setdefault("TORCHPJRT_PLATFORM", "cpu")
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", mode] + args, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            sys.exit(f"rank {rank} of {mode} failed:\n{out[-4000:]}")
    for line in outs[0].splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    sys.exit(f"{mode}: no result:\n{outs[0][-4000:]}")


def _timed(fn, repeats):
    fn()  # compile / connect
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def worker_allreduce(opts):
    import torch
    import torch.distributed as dist

    import torchpjrt  # noqa: F401

    dist.init_process_group("pjrt")
    world = dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    rows = []
    size = 1024
    while size <= opts.max_mb * 2 ** 20:
        n = size // 4
        on_pjrt = torch.ones(n, device="pjrt")
        on_cpu = torch.ones(n)

        def pjrt_step():
            dist.all_reduce(on_pjrt)  # waits: a blocking all_reduce returns once the data is there

        def gloo_step():
            dist.all_reduce(on_cpu, group=gloo)

        repeats = opts.repeats if size <= 2 ** 20 else max(3, opts.repeats // 2)
        t_pjrt, t_gloo = [], []
        for _ in range(2):  # alternate, so load spikes hit both
            t_pjrt.append(_timed(pjrt_step, repeats))
            t_gloo.append(_timed(gloo_step, repeats))
        bus = 2 * (world - 1) / world
        rows.append({"bytes": size, "pjrt_s": min(t_pjrt), "gloo_s": min(t_gloo),
                     "pjrt_busbw": size * bus / min(t_pjrt), "gloo_busbw": size * bus / min(t_gloo)})
        size *= 4
    torch.pjrt.synchronize()
    dist.barrier()
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows), flush=True)


def worker_ddp(opts):
    import torch
    import torch.distributed as dist

    import torchpjrt  # noqa: F401

    dist.init_process_group("pjrt")
    torch.manual_seed(0)
    width = opts.ddp_width
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(4)],
                                torch.nn.Linear(width, 10)).to("pjrt")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    x = torch.randn(opts.ddp_batch, width, device="pjrt")
    y = torch.randint(0, 10, (opts.ddp_batch,), device="pjrt")

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        torch.pjrt.synchronize()

    for _ in range(3):
        step()
    times = []
    for _ in range(opts.repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    dist.barrier()
    if dist.get_rank() == 0:
        params = sum(p.numel() for p in model.parameters())
        print("RESULT " + json.dumps({"step_s": sorted(times)[len(times) // 2], "params": params}), flush=True)


def _fmt_bytes(n):
    return f"{n // 2 ** 20} MB" if n >= 2 ** 20 else f"{n // 1024} KB"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--max-mb", type=int, default=64)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--ddp-width", type=int, default=1024)
    p.add_argument("--ddp-batch", type=int, default=64)
    p.add_argument("--skip-ddp", action="store_true")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    opts, _ = p.parse_known_args()
    if opts.worker:
        {"allreduce": worker_allreduce, "ddp": worker_ddp}[opts.worker](opts)
        return
    args = [f"--max-mb={opts.max_mb}", f"--repeats={opts.repeats}", f"--ddp-width={opts.ddp_width}",
            f"--ddp-batch={opts.ddp_batch}"]
    rows = launch("allreduce", opts.world, args)
    print(f"all_reduce, float32, {opts.world} processes, CPU platform (bus bandwidth, GB/s; best of repeats)")
    print(f"{'size':>8} {'pjrt GB/s':>10} {'gloo GB/s':>10} {'pjrt/gloo':>10} {'pjrt ms':>9} {'gloo ms':>9}")
    for r in rows:
        print(f"{_fmt_bytes(r['bytes']):>8} {r['pjrt_busbw'] / 1e9:>10.3f} {r['gloo_busbw'] / 1e9:>10.3f} "
              f"{r['pjrt_busbw'] / r['gloo_busbw']:>10.2f} {r['pjrt_s'] * 1e3:>9.3f} {r['gloo_s'] * 1e3:>9.3f}")
    if opts.skip_ddp:
        return
    one = launch("ddp", 1, args)
    many = launch("ddp", opts.world, args)
    print(f"\nDDP training step on pjrt, MLP {one['params'] / 1e6:.1f}M params, batch {opts.ddp_batch} per process")
    print(f"{'processes':>10} {'step ms':>9} {'vs 1 process':>13}")
    print(f"{1:>10} {one['step_s'] * 1e3:>9.1f} {1.0:>13.2f}")
    print(f"{opts.world:>10} {many['step_s'] * 1e3:>9.1f} {many['step_s'] / one['step_s']:>13.2f}")


if __name__ == "__main__":
    main()
