"""Asynchronous device-side checks (device_checks.py): an out-of-range index and the other errors
that need the data raise the CPU's exception type at the next synchronization point, in every
eager mode and under torch.compile, naming the op and the line that recorded it; the process
stays usable afterwards; valid inputs never raise."""

import re

import pytest
import torch
import torch.nn.functional as F

import torchpjrt
from torchpjrt import device_checks

DEV = "pjrt"

# Each case is fn(x, device) with x a float32 (2, 3) tensor on that device.
CASES = {
    "index": lambda x, d: x[torch.tensor([0, 5], device=d)],
    "index_negative": lambda x, d: x[torch.tensor([0, -3], device=d)],
    "index_second_dim": lambda x, d: x[:, torch.tensor([0, 3], device=d)],
    "index_two_tensors": lambda x, d: x[torch.tensor([0], device=d), torch.tensor([7], device=d)],
    "index_put": lambda x, d: x.index_put_((torch.tensor([5], device=d),), torch.tensor(1.0, device=d)),
    "setitem_accumulate": lambda x, d: x.index_put_((torch.tensor([2], device=d),), torch.ones(3, device=d),
                                                    accumulate=True),
    "index_select_dim0": lambda x, d: x.index_select(0, torch.tensor([0, 5], device=d)),
    "index_select_dim1": lambda x, d: x.index_select(1, torch.tensor([3], device=d)),
    "index_add": lambda x, d: x.index_add(0, torch.tensor([5], device=d), torch.ones(1, 3, device=d)),
    "index_copy": lambda x, d: x.index_copy(0, torch.tensor([-1], device=d), torch.ones(1, 3, device=d)),
    "index_fill": lambda x, d: x.index_fill(1, torch.tensor([-4], device=d), 1.0),
    "gather": lambda x, d: x.gather(0, torch.tensor([[0, 5, 1]], device=d)),
    "gather_negative": lambda x, d: x.gather(1, torch.tensor([[0, -1, 1]], device=d)),
    "scatter": lambda x, d: x.scatter(0, torch.tensor([[0, 5, 1]], device=d), 1.0),
    "scatter_add": lambda x, d: x.scatter_add(0, torch.tensor([[0, 5, 1]], device=d), torch.ones(1, 3, device=d)),
    "scatter_reduce": lambda x, d: x.scatter_reduce(1, torch.tensor([[0, 9]], device=d),
                                                    torch.ones(1, 2, device=d), "amax"),
    "take": lambda x, d: x.take(torch.tensor([7], device=d)),
    "put": lambda x, d: x.put(torch.tensor([-7], device=d), torch.tensor([1.0], device=d)),
    "embedding": lambda x, d: F.embedding(torch.tensor([[0, 2]], device=d), x),
    "embedding_bag": lambda x, d: F.embedding_bag(torch.tensor([0, 5], device=d), x, torch.tensor([0], device=d)),
    "cross_entropy": lambda x, d: F.cross_entropy(x, torch.tensor([0, 3], device=d)),
    "nll_loss_negative": lambda x, d: F.nll_loss(x, torch.tensor([0, -1], device=d)),
    "multinomial_negative": lambda x, d: torch.multinomial(torch.tensor([0.5, -0.1], device=d), 1),
    "multinomial_zero_sum": lambda x, d: torch.multinomial(torch.zeros(2, 3, device=d), 1),
    "uniform_bounds": lambda x, d: x.uniform_(2.0, 1.0),
    "floor_divide_by_zero": lambda x, d: x.long() // torch.tensor([1, 0, 2], device=d),
    "remainder_by_zero": lambda x, d: x.long() % 0,
    "remainder_of_a_number": lambda x, d: torch.remainder(3, torch.tensor([1, 0], device=d)),
    "fmod_by_zero": lambda x, d: torch.fmod(x.to(torch.uint8), torch.zeros(3, dtype=torch.uint8, device=d)),
    "div_trunc_by_zero": lambda x, d: x.int().div(torch.tensor([0, 1, 1], device=d), rounding_mode="trunc"),
    "floor_divide_in_place": lambda x, d: x.long().floor_divide_(torch.tensor([0, 1, 1], device=d)),
}
# ops PyTorch's compiler cannot put in a graph as they are (random draws, in-place on inputs)
NOT_COMPILED = {"multinomial_negative", "multinomial_zero_sum", "uniform_bounds"}


def cpu_error(case):
    try:
        case(torch.ones(2, 3), "cpu")
    except Exception as e:  # noqa: BLE001 - the CPU's exception is the reference
        return e
    raise AssertionError("the CPU accepts this case")


def assert_reported(case, run):
    """`run()` raises the CPU's exception type with the CPU's message, the op and the recording
    line; the device keeps working afterwards."""
    expected = cpu_error(case)
    witness = torch.arange(6.0, device=DEV)
    with pytest.raises(type(expected)) as info:
        run()
    message = str(info.value)
    assert str(expected).splitlines()[0] in message
    assert re.search(rf"found on the device by aten\.\w+\.\w+, called from {re.escape(__file__)}:"
                     rf"{case.__code__.co_firstlineno}", message), message
    assert device_checks.pending() == 0
    assert witness.sum().item() == 15.0  # later reads do not raise again; earlier tensors intact


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("mode", ["strict", "fused"])
def test_raised_at_the_next_synchronization_point(name, mode):
    case = CASES[name]
    with torchpjrt.eager_mode(mode):
        x = torch.ones(2, 3, device=DEV)

        def run():
            result = case(x, DEV)  # asynchronous: nothing waits for the device here
            torch.pjrt.synchronize()
            return result

        assert_reported(case, run)


@pytest.mark.parametrize("name", CASES)
def test_debug_mode_raises_at_the_op(name):
    case = CASES[name]
    with torchpjrt.eager_mode("debug"):
        assert_reported(case, lambda: case(torch.ones(2, 3, device=DEV), DEV))


@pytest.mark.parametrize("name", sorted(set(CASES) - NOT_COMPILED))
def test_compiled_graphs_check_too(name):
    case = CASES[name]
    torch._dynamo.reset()
    compiled = torch.compile(case, backend="pjrt")

    def run():
        return compiled(torch.ones(2, 3, device=DEV), DEV).cpu()

    assert_reported(case, run)


@pytest.mark.parametrize("sync", ["item", "cpu", "print", "bool", "tolist", "synchronize"])
def test_every_synchronization_point_reports(sync, capsys):
    x = torch.arange(6.0, device=DEV).reshape(2, 3)
    y = x[torch.tensor([4], device=DEV)]  # out of range: no error yet
    z = x.sum()
    reads = {"item": lambda: z.item(), "cpu": lambda: z.cpu(), "print": lambda: print(z),
             "bool": lambda: bool(z), "tolist": lambda: y.tolist(), "synchronize": torch.pjrt.synchronize}
    with pytest.raises(IndexError, match="index 4 is out of bounds for dimension 0 with size 2"):
        reads[sync]()
    assert z.item() == 15.0


def test_valid_indices_never_raise(each_eager_mode):
    x = torch.arange(12.0, device=DEV).reshape(3, 4)
    i = torch.tensor([0, 2, -1, -3], device=DEV)
    results = [x[i], x[:, i], x.index_select(1, torch.tensor([3, 0], device=DEV)), x.gather(1, torch.zeros(3, 1, dtype=torch.long, device=DEV)),
               x.take(torch.tensor([-12, 11], device=DEV)), x.index_fill(0, torch.tensor([-3], device=DEV), 0.0),
               F.embedding(torch.tensor([2, 0], device=DEV), x),
               F.cross_entropy(x, torch.tensor([3, -100, 0], device=DEV)),
               torch.multinomial(torch.tensor([0.0, 1.0], device=DEV), 1),
               x[torch.tensor([True, False, True], device=DEV)]]
    cpu = torch.arange(12.0).reshape(3, 4)
    assert results[0].cpu().tolist() == cpu[[0, 2, -1, -3]].tolist()
    assert results[4].cpu().tolist() == [0.0, 11.0]
    assert results[8].item() == 1
    torch.pjrt.synchronize()


def test_division_by_zero_raises_for_integers_only(each_eager_mode):
    """Float division, true division and an empty result give CPU's values, not an error."""
    a, b = torch.tensor([5, -5]), torch.tensor([0, 2])
    pa, pb = a.to(DEV), b.to(DEV)
    pairs = [(pa / pb, a / b), (pa.float() // pb.float(), a.float() // b.float()),
             (pa.float() % pb.float(), a.float() % b.float()), (torch.fmod(pa.double(), 0), torch.fmod(a.double(), 0)),
             (pa[:0] // pb[:1], a[:0] // b[:1]), (pa // (pb + 1), a // (b + 1))]
    for got, want in pairs:
        torch.testing.assert_close(got.cpu(), want, equal_nan=True)
    torch.pjrt.synchronize()


def test_a_training_step_reports_a_bad_label_at_loss_item(each_eager_mode):
    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Flatten(), torch.nn.Linear(16, 4)).to(DEV)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.tensor([[1, 2], [3, 4]], device=DEV)

    def step(labels):
        loss = F.cross_entropy(model(tokens), labels.to(DEV))
        loss.backward()
        opt.step()  # may report it already (debug mode at the op, the others once the device is done)
        opt.zero_grad()
        return loss.item()

    assert step(torch.tensor([0, 3])) > 0
    with pytest.raises(IndexError, match="Target 4 is out of bounds"):
        step(torch.tensor([0, 4]))
    opt.zero_grad()
    assert step(torch.tensor([1, 2])) > 0


def test_checks_do_not_pile_up_without_synchronization():
    x = torch.ones(4, device=DEV)
    i = torch.tensor([1], device=DEV)
    for _ in range(device_checks.POLL_AFTER * 4):
        x = x + x[i]
    assert device_checks.pending() <= device_checks.POLL_AFTER + 1 or x.sum().item()
    x.sum().item()
    assert device_checks.pending() == 0


NOT_PD = torch.tensor([[1.0, 2.0], [2.0, 1.0]])
SINGULAR = torch.tensor([[1.0, 2.0], [2.0, 4.0]])
GOOD = torch.tensor([[2.0, 1.0], [1.0, 2.0]])
LINALG = {  # fn, a bad input
    "cholesky": (lambda a: torch.linalg.cholesky(a), NOT_PD),
    "inv_batched": (lambda a: torch.linalg.inv(torch.stack([torch.eye(2, device=a.device), a])), SINGULAR),
    "solve": (lambda a: torch.linalg.solve(a, a[:, :1] + 1), SINGULAR),
}


@pytest.mark.parametrize("name", LINALG)
def test_compiled_linalg_errors_are_device_checks(name):
    """linalg's "not positive-definite"/"singular" check is an effect in a compiled graph: it runs
    on the device (the graph compiles whole instead of running eagerly) and raises PyTorch's
    LinAlgError with its message."""
    fn, bad = LINALG[name]
    with pytest.raises(torch.linalg.LinAlgError) as expected:
        fn(bad)
    torch._dynamo.reset()
    before = torchpjrt.compile_stats()["eager_graphs"]
    compiled = torch.compile(fn, backend="pjrt")
    with pytest.raises(torch.linalg.LinAlgError) as info:
        compiled(bad.to(DEV)).cpu()
    assert str(expected.value) in str(info.value)
    assert "found on the device by aten._linalg_check_errors" in str(info.value)
    assert torchpjrt.compile_stats()["eager_graphs"] == before
    torch.testing.assert_close(compiled(GOOD.to(DEV)).cpu(), fn(GOOD))
