"""Activation checkpointing on pjrt: the recomputed forward draws the forward's random numbers.

torch.utils.checkpoint saves the device's random state before the forward and restores it
for the recomputation, reading what it needs from the device module `torch.pjrt`. These
tests compare gradients with and without checkpointing in every eager mode, and check the
device-module attributes PyTorch's utilities read.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import torchpjrt  # noqa: F401

DEV = "pjrt"


def _grads(params):
    return [p.grad.detach().cpu().clone() for p in params]


def _assert_grads_equal(want, got):
    assert len(want) == len(got)
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-6)


# ---- a function and a model that use dropout -----------------------------------------------


def _dropout_fn(x, w):
    return F.dropout(torch.tanh(x @ w), 0.5, training=True)


def _function_grads(mode_of_checkpoint, seed=3):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(8, 16, generator=gen).to(DEV).requires_grad_()
    w = torch.randn(16, 16, generator=gen).to(DEV).requires_grad_()
    torch.manual_seed(seed)
    if mode_of_checkpoint is None:
        y = _dropout_fn(x, w)
    else:
        y = checkpoint(_dropout_fn, x, w, use_reentrant=mode_of_checkpoint == "reentrant")
    loss = (y * y).sum()
    loss.backward()
    return loss.item(), _grads([x, w]), torch.pjrt.get_rng_state()


@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("kind", ["reentrant", "non_reentrant"])
def test_checkpointed_dropout_function_has_the_same_gradients(kind):
    loss, grads, state = _function_grads(None)
    ck_loss, ck_grads, ck_state = _function_grads(kind)
    assert ck_loss == pytest.approx(loss, rel=1e-6)
    _assert_grads_equal(grads, ck_grads)
    # the recomputation ran inside fork_rng: the generator goes on as without checkpointing
    assert torch.equal(ck_state, state)


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.drop = torch.nn.Dropout(0.3)

    def forward(self, x):
        return x + self.drop(torch.relu(self.fc(x)))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(_Block(16), _Block(16), _Block(16), _Block(16)).train()


def _model_grads(model, run, seed=11):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(6, 16, generator=gen).to(DEV).requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    out = run(model, x)
    out.pow(2).mean().backward()
    return _grads([x, *model.parameters()])


def _plain(model, x):
    return model(x)


def _per_block(use_reentrant):
    def run(model, x):
        for block in model:
            x = checkpoint(block, x, use_reentrant=use_reentrant)
        return x

    return run


def _sequential(use_reentrant):
    return lambda model, x: checkpoint_sequential(model, 2, x, use_reentrant=use_reentrant)


@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("name,run", [
    ("per_block_reentrant", _per_block(True)),
    ("per_block_non_reentrant", _per_block(False)),
    ("sequential_reentrant", _sequential(True)),
    ("sequential_non_reentrant", _sequential(False)),
])
def test_checkpointed_dropout_model_has_the_same_gradients(name, run):
    model = _model().to(DEV)
    want = _model_grads(model, _plain)
    got = _model_grads(model, run)
    _assert_grads_equal(want, got)


class _FeedForward(torch.nn.Module):
    """A dropout in the middle of the checkpointed region: the backward needs its recomputation."""

    def __init__(self, d):
        super().__init__()
        self.up, self.down, self.drop = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d), torch.nn.Dropout(0.3)

    def forward(self, x):
        return x + self.down(self.drop(torch.relu(self.up(x))))


@pytest.mark.slow  # torch.compile of a model, forward and backward
def test_compiled_checkpointed_dropout_model_has_the_same_gradients():
    """Under torch.compile the checkpointed regions' random ops are saved for the backward, not
    replayed (PyTorch's replay has no pjrt implementation and raised "Backend not supported for
    pjrt"): the gradients equal the same compiled model's without checkpointing, and a second
    call (the compiled graphs cached) still does."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(_FeedForward(16), _FeedForward(16)).train().to(DEV)
    plain = torch.compile(_plain, backend="pjrt", fullgraph=True)
    checkpointed = torch.compile(_per_block(False), backend="pjrt", fullgraph=True)
    for _ in range(2):
        want = _model_grads(model, plain)
        got = _model_grads(model, checkpointed)
        _assert_grads_equal(want, got)
    assert any((g != 0).any() and (g == 0).any() for g in want[1:])  # dropout did drop


def test_gradients_would_differ_if_the_state_were_not_replayed():
    """The comparison above can fail: without replaying the state, the masks differ."""
    model = _model().to(DEV)
    want = _model_grads(model, _plain)

    def no_rng_replay(model, x):
        for block in model:
            x = checkpoint(block, x, use_reentrant=False, preserve_rng_state=False)
        return x

    got = _model_grads(model, no_rng_replay)
    assert any(not torch.allclose(w, g, atol=1e-6) for w, g in zip(want, got))


@pytest.mark.slow  # a transformers model in every mode
@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_transformers_gradient_checkpointing_with_dropout(use_reentrant):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(2))

    def grads(checkpointing):
        model = copy.deepcopy(base).to(DEV).train()
        if checkpointing:
            kwargs = {"use_reentrant": use_reentrant}
            if hasattr(model, "activation_checkpointing_enable"):  # the newer name
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        torch.manual_seed(5)
        out = model(ids.to(DEV), labels=ids.to(DEV))
        out.loss.backward()
        return out.loss.item(), _grads(list(model.parameters()))

    loss, want = grads(False)
    ck_loss, got = grads(True)
    assert ck_loss == pytest.approx(loss, rel=1e-6)
    _assert_grads_equal(want, got)


# ---- the device-module attributes PyTorch's utilities read -------------------------------


def test_checkpoint_sees_a_live_pjrt_random_state():
    assert torch.pjrt._initialized is True  # read by torch.utils.checkpoint
    x = torch.ones(3, device=DEV)
    ids, states = torch.utils.checkpoint.get_device_states(x, torch.ones(2))
    assert ids == [0]
    assert len(states) == 1 and torch.equal(states[0], torch.pjrt.get_rng_state())
    torch.utils.checkpoint.set_device_states(ids, states, device_type=DEV)


def test_get_device_states_replays_draws():
    x = torch.ones(3, device=DEV)
    ids, states = torch.utils.checkpoint.get_device_states(x)
    a = torch.rand(5, device=DEV).cpu()
    torch.utils.checkpoint.set_device_states(ids, states, device_type=DEV)
    assert torch.equal(torch.rand(5, device=DEV).cpu(), a)


@pytest.mark.usefixtures("each_eager_mode")
@pytest.mark.parametrize("devices", [None, [0]])
def test_fork_rng_restores_the_pjrt_state(devices):
    torch.manual_seed(7)
    before = torch.pjrt.get_rng_state()
    with torch.random.fork_rng(devices=devices, device_type=DEV):
        inside = torch.randn(4, device=DEV).cpu()
        assert not torch.equal(torch.pjrt.get_rng_state(), before)
    assert torch.equal(torch.pjrt.get_rng_state(), before)
    assert torch.equal(torch.randn(4, device=DEV).cpu(), inside)


@pytest.mark.usefixtures("each_eager_mode")
def test_state_set_before_lazily_recorded_draws_replays_them():
    """Fused mode records random ops and runs them later: each takes its (seed, offset) when
    it is issued, so a state saved between ops replays exactly the later ones."""
    torch.manual_seed(1)
    torch.rand(3, device=DEV)  # pending in fused mode
    state = torch.pjrt.get_rng_state()
    a = F.dropout(torch.ones(64, device=DEV), 0.5)
    b = torch.randn(8, device=DEV)
    torch.pjrt.set_rng_state(state)
    a2 = F.dropout(torch.ones(64, device=DEV), 0.5)
    b2 = torch.randn(8, device=DEV)
    assert torch.equal(a.cpu(), a2.cpu()) and torch.equal(b.cpu(), b2.cpu())


def test_rng_state_functions_take_a_device():
    state = torch.pjrt.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu" and state.numel() == 16
    for dev in (0, "pjrt", "pjrt:0", torch.device("pjrt", 0)):
        assert torch.equal(torch.pjrt.get_rng_state(dev), state)
        torch.pjrt.set_rng_state(state, dev)
    with pytest.raises(RuntimeError, match="does not exist"):
        torch.pjrt.get_rng_state(torch.pjrt.device_count())
    with pytest.raises(ValueError, match="Expected a pjrt device"):
        torch.pjrt.get_rng_state("cpu")
    with pytest.raises(TypeError, match="ByteTensor"):
        torch.pjrt.set_rng_state(state.to(torch.int64))
    states = torch.pjrt.get_rng_state_all()
    assert len(states) == torch.pjrt.device_count()
    torch.pjrt.set_rng_state_all(states)
    assert torch.equal(torch.pjrt.get_rng_state(), state)
    # a state on the device (DTensor moves it there) sets the generator too
    torch.pjrt.set_rng_state(state.to(DEV))


def test_rng_state_layout_is_seed_then_offset():
    torch.manual_seed(1234)
    torch.rand(2, device=DEV)
    state = torch.pjrt.get_rng_state()
    assert state[:8].view(torch.int64).item() == 1234 == torch.pjrt.initial_seed()
    assert state[8:].view(torch.int64).item() == 1


def test_seeding_functions():
    torch.manual_seed(-5)  # taken modulo 2**64, as torch.Generator does
    assert torch.pjrt.initial_seed() == torch.initial_seed() == 2**64 - 5
    torch.pjrt.manual_seed_all(9)
    assert torch.pjrt.initial_seed() == 9
    with pytest.raises(ValueError, match="Overflow"):
        torch.pjrt.manual_seed(2**64)
    seed = torch.random.seed()  # seeds the CPU and, through manual_seed_all, pjrt
    assert torch.pjrt.initial_seed() == seed
    torch.pjrt.seed()
    torch.pjrt.seed_all()
    assert torch.pjrt._is_in_bad_fork() is False


def test_device_context_managers():
    assert torch.pjrt.current_device() == 0
    with torch.pjrt.device(0) as d:
        assert d.index == 0 and torch.pjrt.current_device() == 0
    with torch.pjrt.device(None), torch.pjrt.device(-1), torch.pjrt.device("pjrt"):
        assert torch.pjrt.current_device() == 0
    with torch.pjrt.device_of(torch.ones(1, device=DEV)) as d:
        assert d.index == 0
    with torch.pjrt.device_of(torch.ones(1)) as d:  # not a pjrt tensor: selects nothing
        assert d.index == -1
    assert torch.pjrt._exchange_device(0) == 0
    assert torch.pjrt._maybe_exchange_device(-1) == 0
    torch.pjrt.set_device(-1)  # selects nothing, like torch.cuda
    assert torch.pjrt.current_device() == 0
    # torch._utils._to enters device_module.device(...) for a storage copy
    assert torch.ones(3).untyped_storage().pjrt().device == torch.device("pjrt:0")


def test_initialization_and_availability():
    torch.ones(1, device=DEV).cpu()
    torch.pjrt.init()
    torch.pjrt._lazy_init()
    assert torch.pjrt.is_initialized()
    assert torch.pjrt.is_available() and torch.pjrt.device_count() >= 1
    assert torch.utils.backend_registration._get_custom_mod_func("device_count")() == torch.pjrt.device_count()
    assert torch.pjrt.is_bf16_supported()
    assert torch.bfloat16 in torch.pjrt.get_amp_supported_dtype()
    props = torch.pjrt.get_device_properties(0)
    assert props.name == torch.pjrt.get_device_name(0) and props.platform == torch.pjrt.platform()
    summary = torch.pjrt.memory_summary()
    assert isinstance(summary, str) and "pjrt" in summary
    torch.pjrt.empty_cache()


@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")
def test_bad_fork_is_reported_in_a_forked_child():
    import multiprocessing

    torch.ones(1, device=DEV).cpu()  # the runtime runs in this process
    ctx = multiprocessing.get_context("fork")
    q = ctx.SimpleQueue()

    def child():
        try:
            torch.pjrt._lazy_init()
            q.put((torch.pjrt._is_in_bad_fork(), torch.pjrt.is_initialized(), None))
        except RuntimeError as e:
            q.put((torch.pjrt._is_in_bad_fork(), torch.pjrt.is_initialized(), str(e)))

    p = ctx.Process(target=child)
    p.start()
    p.join(60)
    bad, initialized, error = q.get()
    assert bad is True and initialized is False
    assert error is not None and "spawn" in error
    assert not torch.pjrt._is_in_bad_fork()


@pytest.mark.usefixtures("each_eager_mode")
def test_streams_and_events_keep_cuda_default_stream_semantics():
    s = torch.pjrt.current_stream()
    assert s == torch.pjrt.default_stream() == torch.pjrt.Stream(priority=-1)
    assert s.device == torch.device("pjrt:0")
    x = torch.randn(64, 64, device=DEV)
    with torch.pjrt.stream(torch.pjrt.Stream()):
        y = x @ x
    start, end = torch.pjrt.Event(enable_timing=True), torch.pjrt.Event(enable_timing=True)
    start.record()
    z = y @ y
    end.record()
    s.wait_event(end)
    s.wait_stream(torch.pjrt.Stream())
    end.synchronize()
    assert end.elapsed_time(start) <= 0 <= start.elapsed_time(end)
    torch.pjrt.synchronize()
    assert s.query() and end.query()  # everything issued has finished
    torch.testing.assert_close(z.cpu(), (x.cpu() @ x.cpu()) @ (x.cpu() @ x.cpu()), rtol=1e-4, atol=1e-3)


def test_fsdp_device_handle_reads_the_module():
    from torch.distributed.fsdp._common_utils import _FSDPDeviceHandle

    handle = _FSDPDeviceHandle.from_device(torch.device(DEV))
    for name in ("current_stream", "Stream", "Event", "stream", "synchronize", "is_available",
                 "device_count", "current_device", "set_device", "is_initialized",
                 "get_rng_state", "set_rng_state", "memory_summary"):
        assert callable(getattr(handle, name)), name
    assert torch.equal(handle.get_rng_state(), torch.pjrt.get_rng_state())
