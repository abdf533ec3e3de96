"""safetensors checkpoints written from and read into pjrt device memory (torchpjrt.checkpoint)."""

import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import safetensors
import safetensors.torch
import torch
from safetensors import safe_open

import torchpjrt
from torchpjrt import checkpoint
from torchpjrt.checkpoint import CheckpointError, parse_size, shard_keys

# Every dtype a pjrt tensor can hold that safetensors can store (complex128 is not in the format).
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64,
          torch.bool, torch.complex64]


def raw_bytes(t):
    """A tensor's elements as bytes (compares NaN payloads, -0.0 and float8 exactly)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_equal(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got.dtype, got.shape, expected.dtype, expected.shape)
    assert torch.equal(raw_bytes(got), raw_bytes(expected))


def random_bits(dtype, shape, generator):
    """Arbitrary bit patterns of `dtype` (NaNs with payloads, infinities, subnormals, -0.0)."""
    numel = torch.Size(shape).numel()
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


def cpu_state(generator=None):
    generator = generator or torch.Generator().manual_seed(0)
    state = {f"{str(d).removeprefix('torch.')}": random_bits(d, (3, 5), generator) for d in DTYPES}
    state["scalar_bf16"] = random_bits(torch.bfloat16, (), generator)
    state["empty_f32"] = torch.empty(0, 4)
    return state


def files_in(directory):
    return sorted(p.name for p in pathlib.Path(directory).iterdir())


# ---- round trips -------------------------------------------------------------------------


def test_every_dtype_round_trips_bit_exactly(tmp_path):
    state = cpu_state()
    on_device = {k: v.to("pjrt") for k, v in state.items()}
    torchpjrt.save_safetensors(on_device, tmp_path / "ours.safetensors")

    back = torchpjrt.load_safetensors(tmp_path / "ours.safetensors")
    assert set(back) == set(state)
    for key, expected in state.items():
        assert back[key].device.type == "pjrt"
        assert_bit_equal(back[key], expected)
    # The same bytes safetensors.torch writes for the same values (the metadata saved by default).
    safetensors.torch.save_file(state, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()


def test_cpu_tensors_and_metadata(tmp_path):
    state = {"cpu": torch.randn(2, 3), "dev": torch.randn(4, device="pjrt"), "half": torch.randn(3).half()}
    torchpjrt.save_safetensors(state, tmp_path / "m.safetensors", metadata={"step": "7"})
    with safe_open(tmp_path / "m.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "pt", "step": "7"}
    back = torchpjrt.load_safetensors(tmp_path / "m.safetensors", device="cpu")
    for key, t in state.items():
        assert back[key].device.type == "cpu" and torch.equal(back[key], t.cpu())
    torchpjrt.save_safetensors(state, tmp_path / "m.safetensors", metadata={"format": "custom"})
    with safe_open(tmp_path / "m.safetensors", framework="numpy") as f:
        assert f.metadata() == {"format": "custom"}


def test_empty_state_dict(tmp_path):
    torchpjrt.save_safetensors({}, tmp_path / "e.safetensors")
    assert torchpjrt.load_safetensors(tmp_path / "e.safetensors") == {}


def test_dtype_safetensors_cannot_store_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match=r"`z`: safetensors has no torch.complex128"):
        torchpjrt.save_safetensors({"z": torch.zeros(2, dtype=torch.complex128, device="pjrt")}, tmp_path / "z.safetensors")
    assert files_in(tmp_path) == []  # no temporary file left behind


def test_dtype_pjrt_cannot_hold_loads_on_cpu_and_is_a_clear_error_on_pjrt(tmp_path):
    state = {"q": torch.randn(3).to(torch.float8_e4m3fnuz), "w": torch.ones(2)}
    torchpjrt.save_safetensors(state, tmp_path / "ours.safetensors")  # CPU tensors of any safetensors dtype
    safetensors.torch.save_file(state, tmp_path / "reference.safetensors", metadata={"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "reference.safetensors").read_bytes()
    path = tmp_path / "ours.safetensors"
    with pytest.raises(TypeError, match=f"{path}: tensor 'q' has dtype F8_E4M3FNUZ"):
        torchpjrt.load_safetensors(path)
    assert torchpjrt.load_safetensors(path, keys=["w"])["w"].device.type == "pjrt"
    assert_bit_equal(torchpjrt.load_safetensors(path, device="cpu")["q"], state["q"])


def test_metadata_must_map_str_to_str(tmp_path):
    with pytest.raises(TypeError, match="metadata must map str to str"):
        torchpjrt.save_safetensors({"w": torch.ones(2)}, tmp_path / "m.safetensors", metadata={"step": 3})
    assert files_in(tmp_path) == []


def test_views_save_their_logical_values(tmp_path):
    def base():
        return torch.arange(24, dtype=torch.float32).reshape(4, 6)

    views = {
        "transposed": lambda b: b.t(),
        "strided": lambda b: b[:, ::2],
        "tail": lambda b: b[2:],
        "expanded": lambda b: b[1].expand(3, 6),
        "diagonal": lambda b: b.diagonal(),
        "scalar": lambda b: b[1, 2],
    }
    on_device = {k: make(base().to("pjrt")) for k, make in views.items()}
    torchpjrt.save_safetensors(on_device, tmp_path / "v.safetensors")
    with safe_open(tmp_path / "v.safetensors", framework="numpy") as f:
        assert f.get_slice("tail").get_shape() == [2, 6]  # only the view's elements are stored
    back = torchpjrt.load_safetensors(tmp_path / "v.safetensors")
    for key, make in views.items():
        expected = make(base())
        assert back[key].is_contiguous()
        assert back[key].shape == expected.shape and torch.equal(back[key].cpu(), expected), key


def test_fused_mode_values_are_computed_before_saving(tmp_path):
    x = torch.randn(8, 8)
    with torchpjrt.eager_mode("fused"):
        y = x.to("pjrt") * 2 + 1  # still pending in the recorded graph
        torchpjrt.save_safetensors({"y": y}, tmp_path / "f.safetensors")
    assert torch.equal(torchpjrt.load_safetensors(tmp_path / "f.safetensors")["y"].cpu(), x * 2 + 1)


# ---- tied weights ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [lambda a: {"a": a, "b": a}, lambda a: {"a": a, "b": a[1]}, lambda a: {"a": a, "b": a.view(-1)},
     lambda a: {"a": a[:3], "b": a[2:]}],
    ids=["same", "row", "reshaped", "overlapping-slices"],
)
@pytest.mark.parametrize("device", ["pjrt", "cpu"])
def test_tensors_sharing_memory_raise_like_safetensors(tmp_path, make, device):
    cpu_case = make(torch.randn(4, 4))
    with pytest.raises(RuntimeError, match="share memory") as reference:
        safetensors.torch.save_file(cpu_case, tmp_path / "reference.safetensors")
    case = make(torch.randn(4, 4, device=device))
    with pytest.raises(RuntimeError, match="share memory") as ours:
        torchpjrt.save_safetensors(case, tmp_path / "ours.safetensors")
    assert "'a'" in str(reference.value) and "'b'" in str(reference.value)
    assert "[['a', 'b']]" in str(ours.value)
    assert not (tmp_path / "ours.safetensors").exists()


def test_disjoint_parts_of_one_storage_save_like_safetensors(tmp_path):
    a = torch.randn(4, 4)
    safetensors.torch.save_file({"top": a[:2], "bottom": a[2:]}, tmp_path / "reference.safetensors")
    p = a.to("pjrt")
    torchpjrt.save_safetensors({"top": p[:2], "bottom": p[2:]}, tmp_path / "ours.safetensors")
    assert (tmp_path / "ours.safetensors").read_bytes() == safetensors.torch.save(
        {"top": a[:2], "bottom": a[2:]}, metadata={"format": "pt"})
    back = torchpjrt.load_safetensors(tmp_path / "ours.safetensors")
    assert torch.equal(back["top"].cpu(), a[:2]) and torch.equal(back["bottom"].cpu(), a[2:])


# ---- atomic saves --------------------------------------------------------------------------

# Saves new values over an existing checkpoint and dies (os._exit) after writing half of a
# file: the single file, or the second of two shards.
_DIE_MID_SAVE = r"""
import os, sys
import safetensors, torch, torchpjrt

path, layout = sys.argv[1], sys.argv[2]
real_serialize_file = safetensors.serialize_file
written = []

def serialize_then_die(specs, filename, metadata=None):
    written.append(filename)
    real_serialize_file(specs, filename, metadata=metadata)
    if layout == "single" or len(written) == 2:
        with open(filename, "r+b") as f:
            f.truncate(os.path.getsize(filename) // 2)
        os._exit(17)

safetensors.serialize_file = serialize_then_die
new = {"w": torch.full((64, 64), 2.0, device="pjrt"), "v": torch.full((64,), 3.0, device="pjrt")}
torchpjrt.save_safetensors(new, path, max_shard_size=None if layout == "single" else 16400)
sys.exit(0)
"""


@pytest.mark.slow  # kills a child process mid-save
@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_process_killed_mid_save_leaves_previous_checkpoint(tmp_path, layout):
    old = {"w": torch.full((64, 64), 1.0), "v": torch.full((64,), 1.0)}
    target = tmp_path / "m.safetensors" if layout == "single" else tmp_path
    torchpjrt.save_safetensors({k: v.to("pjrt") for k, v in old.items()}, target,
                               max_shard_size=None if layout == "single" else 16400)
    before = {name: (tmp_path / name).read_bytes() for name in files_in(tmp_path)}
    if layout == "sharded":
        assert set(before) == {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                               "model.safetensors.index.json"}

    child = subprocess.run([sys.executable, "-c", _DIE_MID_SAVE, str(target), layout],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 17, child.stderr[-3000:]

    for name, content in before.items():
        assert (tmp_path / name).read_bytes() == content, name
    leftovers = set(files_in(tmp_path)) - set(before)
    assert leftovers and all(n.startswith(".") and n.endswith(".tmp") for n in leftovers), leftovers
    back = torchpjrt.load_safetensors(target)
    assert all(torch.equal(back[k].cpu(), v) for k, v in old.items())


def test_failed_save_removes_its_temporary_file(tmp_path, monkeypatch):
    path = tmp_path / "m.safetensors"
    torchpjrt.save_safetensors({"w": torch.ones(3, device="pjrt")}, path)
    before = path.read_bytes()
    real = safetensors.serialize_file

    def disk_full(specs, filename, metadata=None):
        real(specs, filename, metadata=metadata)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors, "serialize_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        torchpjrt.save_safetensors({"w": torch.zeros(3, device="pjrt")}, path)
    assert files_in(tmp_path) == ["m.safetensors"] and path.read_bytes() == before


# ---- sharding ------------------------------------------------------------------------------


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("200MB") == 200 * 10**6
    assert parse_size(" 2 kb ") == 2000
    assert parse_size("1GiB") == 2**30
    assert parse_size("1.5MiB") == 3 * 2**19
    assert parse_size(4096) == parse_size("4096") == 4096
    for bad in ("5 parsecs", "GB", "", "-1MB"):
        with pytest.raises(ValueError, match="size"):
            parse_size(bad)
    with pytest.raises(ValueError, match="positive"):
        parse_size(0)
    with pytest.raises(TypeError):
        parse_size(True)


def test_shards_match_huggingface_hub():
    hub = pytest.importorskip("huggingface_hub.serialization._base")
    sizes = {"a": 600, "b": 600, "c": 200, "big": 2500, "d": 600, "e": 200, "f": 200, "g": 1000}
    for limit in (1000, 1200, 2000, 10**6):
        split = hub.split_state_dict_into_shards_factory(
            sizes, get_storage_size=lambda size: size, filename_pattern="model{suffix}.safetensors", max_shard_size=limit)
        assert shard_keys(sizes, limit) == list(split.filename_to_tensors.values()), limit


def sharded_state():
    g = torch.Generator().manual_seed(1)
    return {
        "embed": torch.randn(40, 16, generator=g),  # 2560 bytes: larger than the limit, a shard of its own
        "w1": torch.randn(16, 16, generator=g),  # 1024
        "b1": torch.randn(16, generator=g),  # 64
        "w2": torch.randn(16, 16, generator=g).bfloat16(),  # 512
        "w3": torch.randn(16, 16, generator=g),  # 1024
        "step": torch.tensor(3),
    }


def test_sharded_save_follows_the_hugging_face_layout(tmp_path):
    state = sharded_state()
    torchpjrt.save_safetensors({k: v.to("pjrt") for k, v in state.items()}, tmp_path, max_shard_size="2KB")
    names = [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert files_in(tmp_path) == names + ["model.safetensors.index.json"]
    text = (tmp_path / "model.safetensors.index.json").read_text()
    index = json.loads(text)
    assert index == {
        "metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
        "weight_map": {"embed": names[0], "w1": names[1], "b1": names[1], "w2": names[1],
                       "w3": names[2], "step": names[2]},
    }
    assert text == json.dumps(index, indent=2, sort_keys=True) + "\n"  # as transformers writes it
    for name in names:
        with safe_open(tmp_path / name, framework="numpy") as f:
            assert sorted(f.keys()) == sorted(k for k, v in index["weight_map"].items() if v == name)
            assert f.metadata() == {"format": "pt"}
    for source in (tmp_path, tmp_path / "model.safetensors.index.json", tmp_path / "model.safetensors"):
        back = torchpjrt.load_safetensors(source)
        assert set(back) == set(state)
        assert all(torch.equal(back[k].cpu(), v) for k, v in state.items())
    subset = torchpjrt.load_safetensors(tmp_path, keys=["w3", "embed"])
    assert list(subset) == ["w3", "embed"] and torch.equal(subset["w3"].cpu(), state["w3"])


def test_one_shard_is_written_as_a_single_file(tmp_path):
    state = sharded_state()
    torchpjrt.save_safetensors(state, tmp_path, max_shard_size="1GB")
    assert files_in(tmp_path) == ["model.safetensors"]


def test_saving_again_replaces_the_previous_layout(tmp_path):
    state = {k: v.to("pjrt") for k, v in sharded_state().items()}
    torchpjrt.save_safetensors(state, tmp_path, max_shard_size=1000)
    assert len(files_in(tmp_path)) == 5  # four shards and the index
    torchpjrt.save_safetensors(state, tmp_path, max_shard_size=3000)
    assert files_in(tmp_path) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                  "model.safetensors.index.json"]
    torchpjrt.save_safetensors(state, tmp_path)
    assert files_in(tmp_path) == ["model.safetensors"]
    torchpjrt.save_safetensors(state, tmp_path, max_shard_size=3000)
    assert "model.safetensors" not in files_in(tmp_path)
    back = torchpjrt.load_safetensors(tmp_path)
    assert all(torch.equal(back[k].cpu(), v.cpu()) for k, v in state.items())


def test_sharded_file_name(tmp_path):
    state = sharded_state()
    torchpjrt.save_safetensors(state, tmp_path / "run.safetensors", max_shard_size=3000)
    assert files_in(tmp_path) == ["run-00001-of-00002.safetensors", "run-00002-of-00002.safetensors",
                                  "run.safetensors.index.json"]
    back = torchpjrt.load_safetensors(tmp_path / "run.safetensors")
    assert all(torch.equal(back[k].cpu(), v) for k, v in state.items())
    with pytest.raises(ValueError, match="must end with '.safetensors'"):
        torchpjrt.save_safetensors(state, tmp_path / "run.ckpt", max_shard_size=3000)


# ---- loading -------------------------------------------------------------------------------


@pytest.mark.parametrize("device", ["pjrt", "pjrt:0", torch.device("pjrt"), torch.device("pjrt", 0), "cpu"],
                         ids=str)
def test_load_onto_each_device_form(tmp_path, device):
    state = {"w": torch.randn(3, 4).bfloat16(), "n": torch.arange(4)}
    safetensors.torch.save_file(state, tmp_path / "m.safetensors")
    back = torchpjrt.load_safetensors(tmp_path / "m.safetensors", device=device)
    for key, expected in state.items():
        assert back[key].device.type == torch.device(device).type
        assert back[key].dtype == expected.dtype and torch.equal(back[key].cpu(), expected)


def test_load_onto_a_device_this_process_cannot_use(tmp_path):
    safetensors.torch.save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    with pytest.raises((RuntimeError, NotImplementedError), match="pjrt:1"):
        torchpjrt.load_safetensors(tmp_path / "m.safetensors", device="pjrt:1")


def test_keys_select_tensors(tmp_path):
    state = {"a": torch.randn(2), "b": torch.randn(3), "c": torch.randn(4)}
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(state, path)
    back = torchpjrt.load_safetensors(path, keys=["c", "a"])
    assert list(back) == ["c", "a"] and torch.equal(back["c"].cpu(), state["c"])
    assert list(torchpjrt.load_safetensors(path, keys="b")) == ["b"]
    with pytest.raises(KeyError, match=f"'missing'.*{path}"):
        torchpjrt.load_safetensors(path, keys=["a", "missing"])
    (tmp_path / "sharded").mkdir()
    torchpjrt.save_safetensors(sharded_state(), tmp_path / "sharded", max_shard_size=2000)
    with pytest.raises(KeyError, match="'missing'.*model.safetensors.index.json"):
        torchpjrt.load_safetensors(tmp_path / "sharded", keys=["w1", "missing"])


# ---- damaged checkpoints -------------------------------------------------------------------


def _offsets_shifted(data):
    header_len = int.from_bytes(data[:8], "little")
    header = data[8:8 + header_len]
    assert b'"data_offsets":[0,' in header
    return data[:8] + header.replace(b'"data_offsets":[0,', b'"data_offsets":[8,', 1) + data[8 + header_len:]


DAMAGE = {
    "truncated data": lambda data: data[:-7],
    "truncated header": lambda data: data[:5],
    "empty": lambda data: b"",
    "garbage header": lambda data: data[:8] + b"{\x00garbage" + data[18:],
    "header length beyond the file": lambda data: (len(data) * 2).to_bytes(8, "little") + data[8:],
    "data bytes appended": lambda data: data + b"\x00" * 8,
    "offsets inconsistent with the data": _offsets_shifted,
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_file_is_a_clear_error_naming_it(tmp_path, damage):
    good = tmp_path / "good.safetensors"
    torchpjrt.save_safetensors({"w": torch.randn(8, 8), "b": torch.randn(8).bfloat16()}, good)
    path = tmp_path / "damaged.safetensors"
    path.write_bytes(DAMAGE[damage](good.read_bytes()))
    for load in (lambda: torchpjrt.load_safetensors(path),
                 lambda: safetensors.torch.load_file(path, device="pjrt"),
                 lambda: torchpjrt.load_safetensors(path, device="cpu")):
        with pytest.raises(CheckpointError, match=str(path)) as error:
            load()
        assert isinstance(error.value, ValueError) and isinstance(error.value, safetensors.SafetensorError)


def test_damaged_index_and_missing_shards(tmp_path):
    torchpjrt.save_safetensors(sharded_state(), tmp_path, max_shard_size=2000)
    index = tmp_path / "model.safetensors.index.json"
    content = json.loads(index.read_text())

    (tmp_path / "model-00002-of-00003.safetensors").rename(tmp_path / "moved.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00003.safetensors") as error:
        torchpjrt.load_safetensors(tmp_path)
    assert error.value.filename == str(tmp_path / "model-00002-of-00003.safetensors")
    (tmp_path / "moved.safetensors").rename(tmp_path / "model-00002-of-00003.safetensors")

    content["weight_map"]["ghost"] = "model-00001-of-00003.safetensors"
    index.write_text(json.dumps(content))
    with pytest.raises(CheckpointError, match="'ghost' to .*model-00001-of-00003.safetensors"):
        torchpjrt.load_safetensors(tmp_path)
    index.write_text('{"metadata": {}, "weight_map": ')
    with pytest.raises(CheckpointError, match="model.safetensors.index.json is not a valid checkpoint index"):
        torchpjrt.load_safetensors(tmp_path)
    index.write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map"):
        torchpjrt.load_safetensors(tmp_path)
    index.unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        torchpjrt.load_safetensors(tmp_path)


# ---- safetensors' own API with device="pjrt" ----------------------------------------------


def test_safetensors_torch_load_file_onto_pjrt(tmp_path):
    state = {"w": torch.randn(3, 4).bfloat16(), "f8": torch.randn(5).to(torch.float8_e5m2), "n": torch.arange(6)}
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file(state, path, metadata={"k": "v"})
    for device in ("pjrt", "pjrt:0", torch.device("pjrt")):
        back = safetensors.torch.load_file(path, device=device)
        for key, expected in state.items():
            assert back[key].device.type == "pjrt"
            assert_bit_equal(back[key], expected)

    with safe_open(path, framework="pt", device="pjrt") as f:
        assert sorted(f.keys()) == ["f8", "n", "w"] and f.metadata() == {"k": "v"}
        part = f.get_slice("w")
        assert part.get_shape() == [3, 4] and part.get_dtype() == "BF16"
        assert part[1:, ::2].device.type == "pjrt" and torch.equal(part[1:, ::2].cpu(), state["w"][1:, ::2])
        assert_bit_equal(f.get_slice("f8")[1:3], state["f8"][1:3])
        assert set(f.get_tensors()) == set(state)

    model = torch.nn.Linear(4, 3)
    safetensors.torch.save_model(model, tmp_path / "linear.safetensors")
    on_device = torch.nn.Linear(4, 3).to("pjrt")
    safetensors.torch.load_model(on_device, tmp_path / "linear.safetensors", device="pjrt")
    assert torch.equal(on_device.weight.cpu(), model.weight.detach())


def test_other_devices_go_to_safetensors_unchanged(tmp_path):
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"w": torch.randn(2)}, path)
    assert safetensors.safe_open is checkpoint.safe_open and safetensors.torch.safe_open is checkpoint.safe_open
    assert safetensors.safe_open.__wrapped__ is safetensors._safetensors_rust.safe_open
    assert safetensors.torch.load_file(path)["w"].device.type == "cpu"
    with safe_open(path, framework="numpy") as f:
        assert type(f) is safetensors._safetensors_rust.safe_open
    with pytest.raises(safetensors.SafetensorError, match="device pjrtx is invalid"):
        safetensors.torch.load_file(path, device="pjrtx")
    with pytest.raises(safetensors.SafetensorError, match="framework"):
        safe_open(path, framework="nonsense", device="pjrt")


def test_install_reaches_a_safetensors_torch_imported_earlier(tmp_path, monkeypatch):
    # safetensors.torch imported before torchpjrt holds the original safe_open
    monkeypatch.setattr(safetensors, "safe_open", safetensors._safetensors_rust.safe_open)
    monkeypatch.setattr(safetensors.torch, "safe_open", safetensors._safetensors_rust.safe_open)
    checkpoint.install()
    safetensors.torch.save_file({"w": torch.ones(2)}, tmp_path / "m.safetensors")
    assert safetensors.torch.load_file(tmp_path / "m.safetensors", device="pjrt")["w"].device.type == "pjrt"


# ---- real models ---------------------------------------------------------------------------


def tiny_gpt2(seed):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.mark.slow
def test_gpt2_round_trip_gives_identical_outputs(tmp_path):
    model = tiny_gpt2(seed=0).to("pjrt")
    ids = torch.randint(0, 64, (2, 8)).to("pjrt")
    with torch.no_grad():
        expected = model(ids).logits.cpu()

    state = model.state_dict()
    with pytest.raises(RuntimeError, match=r"\[\['lm_head.weight', 'transformer.wte.weight'\]\]"):
        torchpjrt.save_safetensors(state, tmp_path / "gpt2.safetensors")  # the tied embedding
    del state["lm_head.weight"]
    torchpjrt.save_safetensors(state, tmp_path / "gpt2.safetensors")

    fresh = tiny_gpt2(seed=1).to("pjrt")
    missing, unexpected = fresh.load_state_dict(torchpjrt.load_safetensors(tmp_path / "gpt2.safetensors"), strict=False)
    assert missing == ["lm_head.weight"] and unexpected == []
    assert fresh.lm_head.weight is fresh.transformer.wte.weight  # still tied, so loaded too
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits.cpu(), expected)


def test_save_model_and_load_model_handle_tied_weights(tmp_path):
    model = tiny_gpt2(seed=0).to("pjrt")
    ids = torch.randint(0, 64, (2, 8)).to("pjrt")
    with torch.no_grad():
        expected = model(ids).logits.cpu()
    torchpjrt.save_model(model, tmp_path / "gpt2.safetensors")
    with safetensors.safe_open(tmp_path / "gpt2.safetensors", framework="np") as f:
        assert "lm_head.weight" not in f.keys() and "transformer.wte.weight" in f.keys()

    fresh = tiny_gpt2(seed=1).to("pjrt")
    assert torchpjrt.load_model(fresh, tmp_path / "gpt2.safetensors") == ([], [])
    with torch.no_grad():
        assert torch.equal(fresh(ids).logits.cpu(), expected)

    # a key really missing from the checkpoint is still an error
    state = {k: v for k, v in model.state_dict().items() if k not in ("lm_head.weight", "transformer.ln_f.bias")}
    torchpjrt.save_safetensors(state, tmp_path / "partial.safetensors")
    with pytest.raises(RuntimeError, match=r"missing keys \['transformer.ln_f.bias'\]"):
        torchpjrt.load_model(tiny_gpt2(seed=1).to("pjrt"), tmp_path / "partial.safetensors")


def test_gpt2_checkpoints_interchange_with_safetensors_on_cpu(tmp_path):
    cpu_state = {k: v for k, v in tiny_gpt2(seed=0).state_dict().items() if k != "lm_head.weight"}
    safetensors.torch.save_file(cpu_state, tmp_path / "from_cpu.safetensors")
    on_device = torchpjrt.load_safetensors(tmp_path / "from_cpu.safetensors")
    assert all(v.device.type == "pjrt" and torch.equal(v.cpu(), cpu_state[k]) for k, v in on_device.items())
    assert set(on_device) == set(cpu_state)

    torchpjrt.save_safetensors(on_device, tmp_path / "from_pjrt.safetensors")
    on_cpu = safetensors.torch.load_file(tmp_path / "from_pjrt.safetensors")
    assert set(on_cpu) == set(cpu_state) and all(torch.equal(on_cpu[k], cpu_state[k]) for k in cpu_state)


def test_transformers_from_pretrained_reads_a_sharded_pjrt_checkpoint(tmp_path):
    model = tiny_gpt2(seed=0).to("pjrt")
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
    torchpjrt.save_safetensors(state, tmp_path, max_shard_size="20KB")
    model.config.save_pretrained(tmp_path)
    assert len(json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]) == len(state)
    loaded = type(model).from_pretrained(tmp_path)
    assert all(torch.equal(loaded.state_dict()[k], v.cpu()) for k, v in state.items())


# ---- benchmark script ----------------------------------------------------------------------


def test_checkpoint_benchmark_measures_both_paths():
    script = pathlib.Path(__file__).parent.parent / "benchmarks" / "checkpoint_io.py"
    spec = importlib.util.spec_from_file_location("checkpoint_io_benchmark", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.measure(total_mb=2, repeats=1)
    assert {row["operation"] for row in rows} >= {"save", "load"}
    for row in rows:
        assert row["torchpjrt_mb_s"] > 0 and row["safetensors_cpu_mb_s"] > 0
        assert row["ratio"] == pytest.approx(row["torchpjrt_mb_s"] / row["safetensors_cpu_mb_s"])
