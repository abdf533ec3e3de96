"""The c10d process group "pjrt": torch.distributed collectives on pjrt tensors as XLA collectives.

`ProcessGroupPJRT` is a Python `torch.distributed.ProcessGroup` (the way PyTorch lets a
Python backend serve both `torch.distributed.*` and C++ callers such as DDP's reducer and
the functional collectives used by DTensor/FSDP2). Each collective reads the tensors' JAX
arrays, runs the cached XLA program from `collectives.py`, and stores the results in the
output tensors' storages; nothing goes through the host. CPU tensors given to the group
are served by a gloo process group built on the same store, so one group does both.

Agreement check (on by default; TORCHPJRT_DIST_CHECK=0 turns it off): before each
collective, every rank posts (sequence number, op, shapes, dtypes, arguments) to the c10d
store and reads its peers'. A mismatch raises on every rank naming each rank's call; a rank
that never arrives is reported as dead (its store heartbeat stopped, see runtime.py) or as
late (the group timeout passed). The check costs two store round trips per collective
(~0.1-0.3 ms on loopback) and nothing per byte.
"""

import os
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Work
from torch.futures import Future

from .. import fusion, storage
from . import collectives, runtime

BACKEND_NAME = "pjrt"
_SIGNATURE_SLOTS = 3

_REDUCE_OP_NAMES = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg", dist.ReduceOp.PRODUCT: "product",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max", dist.ReduceOp.BAND: "band",
    dist.ReduceOp.BOR: "bor", dist.ReduceOp.BXOR: "bxor",
}


def _reduce_op_name(op) -> str:
    kind = getattr(op, "op", op)  # options hold a ReduceOp wrapping the enum
    if kind == dist.ReduceOp.PREMUL_SUM:
        return "sum"  # the inputs are multiplied first (_reduced_input)
    name = _REDUCE_OP_NAMES.get(kind)
    if name is None:
        raise ValueError(f"torchpjrt.distributed: reduce op {op} is not supported")
    return name


def _reduced_input(t: torch.Tensor, op):
    """The array a reduction of `t` by `op` sums: ReduceOp.PREMUL_SUM(factor) (FSDP2's gradient
    divide factor) multiplies each rank's input by the factor first, in the input's dtype, as NCCL
    does; every other op reduces `t` itself."""
    if getattr(op, "op", op) != dist.ReduceOp.PREMUL_SUM:
        return _array(t)
    factor = op.factor
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError(f"torchpjrt.distributed: PREMUL_SUM needs a one-element factor, got shape {list(factor.shape)}")
        factor = factor.item()
    with torch.no_grad():
        return _array(t * factor)


def _check_enabled() -> bool:
    return os.environ.get("TORCHPJRT_DIST_CHECK", "1") != "0"


def _array(t: torch.Tensor):
    a = storage.read(t)
    if type(a) is fusion.Pending:  # fused eager mode: run the pending graph first
        a = a.concrete("collective")
    return a


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


class PjrtWork(Work):
    """A launched collective. JAX orders device work, so later ops on the outputs are
    already correct without waiting; wait() blocks the host until the results exist and
    turns a failed collective (a peer died mid-transfer) into a clear error."""

    def __init__(self, arrays, result, description):
        super().__init__()
        self._arrays = arrays
        self._result = result
        self._description = description
        self._error = None

    def wait(self, timeout=None):
        if self._error is None:
            for a in self._arrays:
                try:
                    a.block_until_ready()
                except Exception as e:  # noqa: BLE001 - XLA reports transport failures as ValueError/RuntimeError
                    self._error = RuntimeError(
                        f"torchpjrt.distributed: {self._description} failed in XLA (a peer rank "
                        f"probably died or left the collective): {e}"
                    )
                    runtime.mark_peer_failure(str(self._error))
                    break
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self):
        return all(a.is_ready() for a in self._arrays)

    def is_success(self):
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        return self._result

    def synchronize(self):
        pass  # one in-order device queue: consumers already run after the collective

    def get_future(self):
        # Results are JAX arrays in flight; anything reading them waits for them. The value
        # is what c10d's futures carry: the output tensors.
        fut = Future()
        fut.set_result(self._result)
        return fut


class ProcessGroupPJRT(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout, global_ranks):
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._global_ranks = list(global_ranks)
        self._devices = tuple(runtime.process_device(r) for r in self._global_ranks)
        self._monitor = runtime.LivenessMonitor(store, self._global_ranks)
        self._seq = 0
        self._p2p_counts = {}
        self._gloo = None
        self._group_name = self._group_desc = ""

    def getBackendName(self):
        return BACKEND_NAME

    def name(self):
        return BACKEND_NAME

    # A Python process group has no C++ backends to keep its name and description in.
    def _set_group_name(self, name):
        self._group_name = name

    @property
    def group_name(self):
        return self._group_name

    def _set_group_desc(self, desc):
        self._group_desc = desc

    @property
    def group_desc(self):
        return self._group_desc

    def __repr__(self):
        return f"ProcessGroupPJRT(rank={self.rank()}, size={self.size()}, ranks={self._global_ranks})"

    # init_process_group(..., device_id=...) (Lightning and TorchTitan pass one) asks the group for
    # its backend on that device and whether it can split: this group serves pjrt and CPU tensors
    # itself and makes sub-groups with new_group
    supports_splitting = False

    def _get_backend(self, device):
        if torch.device(device).type not in (BACKEND_NAME, "cpu"):
            raise RuntimeError(f"torchpjrt.distributed: the pjrt process group has no backend for {device}")
        return self

    # ---- helpers ---------------------------------------------------------------------

    def _cpu_group(self):
        """A gloo group on the same store for collectives on CPU tensors."""
        if self._gloo is None:
            self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("cpu_gloo/", self._store), self.rank(), self.size(), self._timeout)
        return self._gloo

    def _placement(self, tensors, op):
        kinds = {t.device.type for t in tensors}
        if kinds == {"pjrt"}:
            other = next((t.device for t in tensors if t.get_device() != 0), None)
            if other is not None:
                raise ValueError(
                    f"torchpjrt.distributed: {op} got a tensor on {other}; each process of a pjrt process group "
                    "takes part with its pjrt:0 (one device per process: torchrun's LOCAL_RANK picks it)")
            return "pjrt"
        if kinds == {"cpu"}:
            return "cpu"
        raise ValueError(
            f"torchpjrt.distributed: {op} got tensors on {sorted(kinds)}; the pjrt process group "
            "takes pjrt tensors (or CPU tensors, served by gloo), all on one device type"
        )

    def _agree(self, signature: str) -> str:
        """Check that every rank calls the same collective; returns its description.

        Each rank posts "seq|signature" into slot seq % _SIGNATURE_SLOTS and reads its peers'
        slots until they hold `seq`: two store round trips when nobody is late. Slots are
        reused without deleting: a rank reaching check seq+1 has seen every rank post seq,
        so no rank is ever two checks ahead of another and 3 slots never collide."""
        seq = self._seq
        self._seq += 1
        description = f"collective #{seq} ({signature}) of {self!r}"
        if not _check_enabled() or self.size() == 1:
            return description
        rank, store = self.rank(), self._store
        slot = f"torchpjrt/sig/{seq % _SIGNATURE_SLOTS}/"
        pending = {r: slot + str(r) for r in range(self.size()) if r != rank}
        calls = {rank: signature}

        def missing():
            keys = list(pending.values())
            # until every slot has been written once, multi_get would block on absent keys
            if seq < _SIGNATURE_SLOTS and not store.check(keys):
                return list(pending)
            for r, value in zip(list(pending), store.multi_get(keys)):
                posted_seq, _, theirs = value.decode().partition("|")
                if int(posted_seq) == seq:
                    calls[r] = theirs
                    del pending[r]
            return list(pending)

        try:
            store.set(slot + str(rank), f"{seq}|{signature}")
            self._wait(missing, description)
        except dist.DistError as e:
            error = RuntimeError(f"torchpjrt.distributed: the c10d store failed during {description} "
                                 f"(rank 0, which hosts it, has probably died): {e}")
            runtime.mark_peer_failure(str(error))
            raise error from None
        if len(set(calls.values())) > 1:
            listing = "; ".join(f"rank {r}: {calls[r]}" for r in sorted(calls))
            raise RuntimeError(
                f"torchpjrt.distributed: collective #{seq} of {self!r} does not match across ranks "
                f"(each rank must call the same collective with the same shapes and dtypes): {listing}"
            )
        return description

    def _wait(self, missing, description):
        """Poll `missing()` (the group ranks not arrived yet) until it is empty, telling a dead
        peer (no heartbeat) from a late one (past the group timeout) meanwhile. Polls with a
        growing sleep rather than store.wait with a timeout, which logs a warning each time.
        Either failure is recorded for this process's exit (runtime.mark_peer_failure)."""
        try:
            self._wait_for(missing, description)
        except RuntimeError as e:
            runtime.mark_peer_failure(str(e))
            raise

    def _wait_for(self, missing, description):
        start = time.monotonic()
        deadline = start + self._timeout.total_seconds()
        pause, next_liveness_check = 0.0, start + runtime.HEARTBEAT_PERIOD_S
        while True:
            late = missing()
            if not late:
                return
            now = time.monotonic()
            if now >= next_liveness_check:
                next_liveness_check = now + runtime.HEARTBEAT_PERIOD_S
                dead = self._monitor.dead_ranks([self._global_ranks[r] for r in late])
                if dead:
                    raise RuntimeError(
                        f"torchpjrt.distributed: rank(s) {dead} (global) stopped responding (no heartbeat "
                        f"for {runtime.dead_after_s():.0f}s: the process died or hangs) while this rank "
                        f"waited in {description}"
                    )
                if now > deadline:
                    raise RuntimeError(
                        f"torchpjrt.distributed: group rank(s) {late} did not reach {description} within "
                        f"the process group timeout ({self._timeout}); they are alive, so they are running "
                        "other code or a different sequence of collectives"
                    )
            time.sleep(pause)
            pause = min(max(pause * 2, 1e-4), 0.02)

    # ---- collectives -----------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        if isinstance(opts, dist.ReduceOp) or opts is None:
            op = opts if opts is not None else dist.ReduceOp.SUM
        else:
            op = opts.reduceOp
        if self._placement(tensors, "all_reduce") == "cpu":
            o = dist.AllreduceOptions()
            o.reduceOp = op
            return self._cpu_group().allreduce(tensors, o)
        name = _reduce_op_name(op)
        description = self._agree(f"all_reduce {name} " + ",".join(_describe(t) for t in tensors))
        outs = []
        for t in tensors:
            local = _reduced_input(t, op)
            if collectives.reduces_on_host(self._devices, name, local.dtype):
                out = collectives.host_all_reduce(local, t.dtype, self._cpu_group(), name, self._devices[self.rank()])
            else:
                out = collectives.all_reduce(local, self._devices, name)
            storage.write(t, out)
            outs.append(out)
        return PjrtWork(outs, list(tensors), description)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        if self._placement(tensors, "broadcast") == "cpu":
            return self._cpu_group().broadcast(tensors, opts)
        description = self._agree(f"broadcast root={root} " + ",".join(_describe(t) for t in tensors))
        outs = []
        for t in tensors:
            out = collectives.broadcast(_array(t), self._devices, root)
            if self.rank() != root:
                storage.write(t, out)
            outs.append(out)
        return PjrtWork(outs, list(tensors), description)

    def allgather(self, output_lists, input_tensors, opts=None):
        if self._placement(list(input_tensors) + [t for ts in output_lists for t in ts], "all_gather") == "cpu":
            return self._cpu_group().allgather(output_lists, input_tensors, opts or dist.AllgatherOptions())
        description = self._agree("all_gather " + ",".join(_describe(t) for t in input_tensors))
        outs = []
        for outputs, t in zip(output_lists, input_tensors):
            self._check_list(outputs, t, "all_gather")
            pieces = collectives.all_gather_list(_array(t), self._devices)
            for o, piece in zip(outputs, pieces):
                storage.write(o, piece)
            outs.extend(pieces)
        return PjrtWork(outs, [o for outputs in output_lists for o in outputs], description)

    def allgather_coalesced(self, output_lists, input_tensors, opts=None):
        return self.allgather(output_lists, input_tensors, opts)

    def all_gather_single(self, output, input, opts=None):  # all_gather_into_tensor
        if self._placement([output, input], "all_gather_into_tensor") == "cpu":
            return self._cpu_group()._allgather_base(output, input, opts or dist.AllgatherOptions())
        if output.numel() != input.numel() * self.size():
            raise ValueError(
                f"torchpjrt.distributed: all_gather_into_tensor output {_describe(output)} must hold "
                f"{self.size()} x input {_describe(input)}"
            )
        description = self._agree(f"all_gather_into_tensor {_describe(input)}->{_describe(output)}")
        out = collectives.all_gather(_array(input), self._devices, tuple(output.shape))
        storage.write(output, out)
        return PjrtWork([out], [output], description)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._merge(works, outputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        tensors = list(outputs) + [t for ts in input_lists for t in ts]
        if self._placement(tensors, "reduce_scatter") == "cpu":
            return self._cpu_group().reduce_scatter(outputs, input_lists, opts)
        works = []
        for out, inputs in zip(outputs, input_lists):
            self._check_list(inputs, out, "reduce_scatter")
            stacked = torch.cat([i.reshape(-1) for i in inputs]) if out.numel() else out.new_empty((0,))
            works.append(self._reduce_scatter_into(out, stacked, op, "reduce_scatter"))
        return self._merge(works, outputs)

    def reduce_scatter_single(self, output, input, opts=None):  # reduce_scatter_tensor
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if self._placement([output, input], "reduce_scatter_tensor") == "cpu":
            return self._cpu_group()._reduce_scatter_base(output, input, opts or dist.ReduceScatterOptions())
        if input.numel() != output.numel() * self.size():
            raise ValueError(
                f"torchpjrt.distributed: reduce_scatter_tensor input {_describe(input)} must hold "
                f"{self.size()} x output {_describe(output)}"
            )
        return self._reduce_scatter_into(output, input, op, "reduce_scatter_tensor")

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        works = [self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)]
        return self._merge(works, outputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_into(self, output, input, op, what):
        name = _reduce_op_name(op)
        description = self._agree(f"{what} {name} {_describe(input)}->{_describe(output)}")
        a = _reduced_input(input, op)
        n = self.size()
        if a.ndim == 0 or a.shape[0] % n:
            a = a.reshape(-1)  # a (world, ...) stacked or odd-shaped input: split the flat elements
        out = collectives.reduce_scatter(a, self._devices, name, tuple(output.shape))
        storage.write(output, out)
        return PjrtWork([out], [output], description)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if self._placement([output, input], "all_to_all_single") == "cpu":
            return self._cpu_group().alltoall_base(output, input, output_split_sizes, input_split_sizes,
                                                   opts or dist.AllToAllOptions())
        n = self.size()
        in_splits = self._splits(input, input_split_sizes, "input")
        out_splits = self._splits(output, output_split_sizes, "output")
        if input.shape[1:] != output.shape[1:]:
            raise ValueError(f"torchpjrt.distributed: all_to_all_single output {_describe(output)} and input "
                             f"{_describe(input)} differ beyond dim 0")
        if len(set(in_splits + out_splits)) == 1:
            description = self._agree(f"all_to_all_single {_describe(input)}")
            out = collectives.all_to_all(_array(input), self._devices)
            storage.write(output, out)
            return PjrtWork([out], [output], description)
        # Uneven splits: XLA's all_to_all moves equal blocks, so pad every block to the
        # largest split of any rank (agreed by a small all-reduce), exchange, and unpad.
        with torch.no_grad():
            largest = torch.tensor([max(in_splits + out_splits)], device=input.device)
            self.allreduce([largest], dist.ReduceOp.MAX).wait()
            block = int(largest.item())
            rest = tuple(input.shape[1:])
            padded = torch.cat([torch.cat([piece, piece.new_zeros((block - len(piece),) + rest)])
                                for piece in input.split(in_splits)])
            received = torch.empty_like(padded)
            work = self.all_to_all_single(received, padded, None, None)
            output.copy_(torch.cat([received[j * block: j * block + size] for j, size in enumerate(out_splits)]))
        return self._merge([work], [output])

    alltoall_base = all_to_all_single

    def _splits(self, t, splits, which):
        n = self.size()
        if t.dim() == 0:
            raise ValueError(f"torchpjrt.distributed: all_to_all {which} must have a dim 0 to split, got {_describe(t)}")
        if not splits:
            if t.shape[0] % n:
                raise ValueError(f"torchpjrt.distributed: all_to_all_single {which} {_describe(t)} does not "
                                 f"split into {n} equal blocks along dim 0; pass split sizes")
            return [t.shape[0] // n] * n
        splits = [int(x) for x in splits]
        if len(splits) != n or sum(splits) != t.shape[0] or min(splits) < 0:
            raise ValueError(f"torchpjrt.distributed: all_to_all_single {which} splits {splits} do not split "
                             f"{_describe(t)} into {n} parts")
        return splits

    def alltoall(self, outputs, inputs, opts=None):
        if self._placement(list(outputs) + list(inputs), "all_to_all") == "cpu":
            return self._cpu_group().alltoall(outputs, inputs, opts or dist.AllToAllOptions())
        tails = {tuple(t.shape[1:]) for t in list(outputs) + list(inputs)}
        if len(tails) > 1 or len(outputs) != self.size() or len(inputs) != self.size() or any(t.dim() == 0 for t in inputs):
            raise NotImplementedError(
                "torchpjrt.distributed: all_to_all on pjrt needs one tensor per rank, all alike beyond dim 0 "
                f"(got inputs {[_describe(t) for t in inputs]}, outputs {[_describe(t) for t in outputs]})"
            )
        with torch.no_grad():
            received = outputs[0].new_empty((sum(o.shape[0] for o in outputs),) + tuple(outputs[0].shape[1:]))
            work = self.all_to_all_single(received, torch.cat(list(inputs)), [o.shape[0] for o in outputs],
                                          [t.shape[0] for t in inputs])
            for o, piece in zip(outputs, received.split([o.shape[0] for o in outputs])):
                o.copy_(piece)
        return self._merge([work], list(outputs))

    def reduce(self, tensors, opts=None):
        op, root = (opts.reduceOp, opts.rootRank) if opts is not None else (dist.ReduceOp.SUM, 0)
        if self._placement(tensors, "reduce") == "cpu":
            return self._cpu_group().reduce(tensors, opts)
        name = _reduce_op_name(op)
        description = self._agree(f"reduce {name} root={root} " + ",".join(_describe(t) for t in tensors))
        outs = []
        for t in tensors:
            out = collectives.all_reduce(_reduced_input(t, op), self._devices, name)
            if self.rank() == root:  # an all-reduce whose result only the root keeps
                storage.write(t, out)
            outs.append(out)
        return PjrtWork(outs, list(tensors), description)

    def gather(self, output_lists, input_tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        if self._placement(list(input_tensors) + [t for ts in output_lists for t in ts], "gather") == "cpu":
            return self._cpu_group().gather(output_lists, input_tensors, opts)
        description = self._agree(f"gather root={root} " + ",".join(_describe(t) for t in input_tensors))
        outs = []
        for i, t in enumerate(input_tensors):
            pieces = collectives.all_gather_list(_array(t), self._devices)
            if self.rank() == root:
                self._check_list(output_lists[i], t, "gather")
                for o, piece in zip(output_lists[i], pieces):
                    storage.write(o, piece)
            outs.extend(pieces)
        return PjrtWork(outs, [o for ts in output_lists for o in ts], description)

    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank if opts is not None else 0
        if self._placement(list(outputs) + [t for ts in input_lists for t in ts], "scatter") == "cpu":
            return self._cpu_group().scatter(outputs, input_lists, opts)
        description = self._agree(f"scatter root={root} " + ",".join(_describe(t) for t in outputs))
        outs = []
        for i, out in enumerate(outputs):
            if self.rank() == root:
                self._check_list(input_lists[i], out, "scatter")
                stacked = torch.cat([t.reshape(-1) for t in input_lists[i]])
            else:  # non-roots contribute zeros: only the root's blocks are kept
                stacked = torch.zeros(out.numel() * self.size(), dtype=out.dtype, device=out.device)
            piece = collectives.scatter(_array(stacked), self._devices, root)
            storage.write(out, piece.reshape(tuple(out.shape)))
            outs.append(piece)
        return PjrtWork(outs, list(outputs), description)

    def barrier(self, opts=None):
        description = self._agree("barrier")
        token = storage.wrap(collectives.all_reduce(_array(torch.zeros((), device="pjrt")), self._devices, "sum"))
        work = PjrtWork([_array(token)], [], description)
        work.wait()  # a barrier is host-level: return once every rank has arrived
        return work

    def monitored_barrier(self, opts=None, wait_all_ranks=False):
        return self.barrier(opts)

    # ---- point to point ----------------------------------------------------------------

    def send(self, tensors, dst, tag=0):
        return self._p2p(tensors, self.rank(), dst, "send")

    def recv(self, tensors, src, tag=0):
        return self._p2p(tensors, src, self.rank(), "recv")

    def recv_anysource(self, tensors, tag=0):
        raise NotImplementedError(
            "torchpjrt.distributed: recv without a source rank is not supported on pjrt: XLA's "
            "point-to-point transfer (ppermute) is a program both ranks compile, so the receiver "
            "must name the sender"
        )

    def _p2p(self, tensors, src, dst, what):
        """Send/recv as a two-device ppermute program that the pair runs together. The
        sender posts the transfer's signature to the store; the receiver checks it."""
        if self._placement(tensors, what) == "cpu":
            group = self._cpu_group()
            return group.send(tensors, dst, 0) if what == "send" else group.recv(tensors, src, 0)
        if src == dst:
            raise ValueError(f"torchpjrt.distributed: {what} to/from this rank itself ({src})")
        if not 0 <= (dst if what == "send" else src) < self.size():
            raise ValueError(f"torchpjrt.distributed: {what} peer rank out of range for a group of {self.size()}")
        count = self._p2p_counts.get((src, dst), 0)
        self._p2p_counts[(src, dst)] = count + 1
        signature = ",".join(_describe(t) for t in tensors)
        key = f"torchpjrt/p2p/{src}->{dst}/{count}"
        description = f"{what} #{count} {src}->{dst} ({signature}) of {self!r}"
        if _check_enabled():
            if what == "send":
                self._store.set(key, signature)
            else:
                self._wait(lambda: [] if self._store.check([key]) else [src], description)
                theirs = self._store.get(key).decode()
                self._store.delete_key(key)
                if theirs != signature:
                    raise RuntimeError(
                        f"torchpjrt.distributed: recv of {signature} from rank {src} does not match "
                        f"the tensors it sent ({theirs})"
                    )
        pair = (self._devices[src], self._devices[dst])
        outs = []
        for t in tensors:
            out = collectives.send_recv(_array(t), *pair)
            if what == "recv":
                storage.write(t, out)
            outs.append(out)
        return PjrtWork(outs, list(tensors), description)

    # ---- small utilities ---------------------------------------------------------------

    def _check_list(self, tensors, like, what):
        if len(tensors) != self.size():
            raise ValueError(f"torchpjrt.distributed: {what} needs a list of {self.size()} tensors, got {len(tensors)}")
        for t in tensors:
            if t.shape != like.shape or t.dtype != like.dtype:
                raise ValueError(
                    f"torchpjrt.distributed: {what} list tensor {_describe(t)} differs from {_describe(like)}"
                )

    def _merge(self, works, result):
        arrays = [a for w in works if isinstance(w, PjrtWork) for a in w._arrays]
        description = "; ".join(w._description for w in works if isinstance(w, PjrtWork))
        return PjrtWork(arrays, list(result), description)


def _create(dist_backend_opts, backend_options=None):
    store = dist_backend_opts.store
    rank, size = dist_backend_opts.group_rank, dist_backend_opts.group_size
    timeout = dist_backend_opts.timeout
    global_ranks = list(dist_backend_opts.global_ranks_in_group) or list(range(size))
    if not runtime.is_initialized():
        if global_ranks != list(range(size)):
            raise RuntimeError("torchpjrt.distributed: create the default process group with "
                               "init_process_group('pjrt') before sub-groups")
        runtime.initialize(store, rank, size, timeout)
    return ProcessGroupPJRT(store, rank, size, timeout, global_ranks)


_registered = False


def register() -> None:
    """Make "pjrt" a torch.distributed backend (for pjrt tensors, and CPU tensors via gloo)."""
    global _registered
    if _registered or not dist.is_available():
        return
    _registered = True
    if BACKEND_NAME in dist.Backend.backend_list:
        return  # registered at `import torch` (torchpjrt_autoload), whose creator calls _create
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["pjrt", "cpu"])
