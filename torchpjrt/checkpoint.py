"""Safetensors checkpoints written from and read into pjrt device memory, without pickle.

Saving copies each tensor's elements from the device to a host numpy buffer and hands the
buffers to safetensors' own serializer (`safetensors.serialize_file`). Loading reads tensors
with safetensors' numpy reader and puts them on the device with `jax.device_put`; no torch
CPU tensor is made on the way (except a zero-copy view of the mapped file for float8, which
numpy lacks).

Layout on disk follows the Hugging Face convention: a checkpoint named `X.safetensors` is
either that single file, or shards `X-00001-of-0000N.safetensors` plus an index
`X.safetensors.index.json` (`{"metadata": {"total_size": ...}, "weight_map": {key: file}}`).
A directory holds the checkpoint named `model.safetensors`.
"""

import errno
import functools
import json
import os
import re
import secrets
from collections import defaultdict
from collections.abc import Mapping

import jax
import numpy as np
import safetensors
import torch

from . import dtypes, fusion, storage

WEIGHTS_NAME = "model.safetensors"
INDEX_SUFFIX = ".index.json"

# The reader this module uses, never the wrapper `install()` puts in its place.
_safe_open = getattr(safetensors.safe_open, "__wrapped__", safetensors.safe_open)

_TORCH_FRAMEWORKS = ("pt", "torch", "pytorch")


class CheckpointError(safetensors.SafetensorError, ValueError):
    """A checkpoint that cannot be read; the message names the file and what is wrong."""


# ---- saving ------------------------------------------------------------------------------


def save_safetensors(state_dict, path, metadata=None, max_shard_size=None) -> None:
    """Write `state_dict` (pjrt and CPU tensors) as a safetensors checkpoint at `path`.

    `path` is a file name, or a directory (which then holds `model.safetensors`). With
    `max_shard_size` (bytes as an int, or a string such as "5GB", "200MB", "1GiB") tensors are
    split over shards `<name>-00001-of-0000N.safetensors` with an index
    `<name>.safetensors.index.json`, following the Hugging Face convention (a checkpoint that
    fits in one shard is written as the single file, without an index).

    Views are saved as their logical values. Keys whose tensors overlap in memory (tied
    weights) raise a RuntimeError naming them, as `safetensors.torch.save_file` does.
    Every file is written to a temporary file in the same directory, flushed, fsynced and
    renamed over the target, so an interrupted save leaves the previous checkpoint intact.
    `metadata` (str -> str) is stored in every file, with `"format": "pt"` unless given.
    """
    tensors = _checked_tensors(state_dict)
    if metadata is not None and not (
        isinstance(metadata, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())
    ):
        raise TypeError(f"metadata must map str to str, got {metadata!r}")
    directory, weights_name = _save_target(path)
    metadata = {"format": "pt", **(metadata or {})}
    previous = _previous_files(directory, weights_name)
    if max_shard_size is None:
        shards = [list(tensors)]
    else:
        if not weights_name.endswith(".safetensors"):
            raise ValueError(
                f"a sharded checkpoint's name must end with '.safetensors', got {weights_name!r} (for the "
                "Hugging Face layout in a directory, create the directory or end the path with a separator)"
            )
        sizes = {k: _nbytes(t) for k, t in tensors.items()}
        shards = shard_keys(sizes, parse_size(max_shard_size))
    if len(shards) <= 1:
        target = os.path.join(directory, weights_name)
        _commit(directory, [(target, lambda tmp: _write_shard(tensors, tmp, metadata))])
        _remove_stale(directory, previous, keep={weights_name})
        return
    stem = weights_name[: -len(".safetensors")]
    n = len(shards)
    names = [f"{stem}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {key: name for name, keys in zip(names, shards) for key in keys}
    index = {"metadata": {"total_size": sum(_nbytes(t) for t in tensors.values())}, "weight_map": weight_map}
    writes = [
        (os.path.join(directory, name), functools.partial(_write_shard, {k: tensors[k] for k in keys}, metadata=metadata))
        for name, keys in zip(names, shards)
    ]
    # The index goes last: until it is renamed, the previous index still describes the checkpoint.
    writes.append((os.path.join(directory, weights_name + INDEX_SUFFIX), functools.partial(_write_json, index)))
    _commit(directory, writes)
    _remove_stale(directory, previous, keep=set(names) | {weights_name + INDEX_SUFFIX})


def save_model(model: torch.nn.Module, path, metadata=None, max_shard_size=None) -> None:
    """Save `model.state_dict()` like `safetensors.torch.save_model`: of keys naming the same
    whole tensor (tied weights, GPT-2's `lm_head.weight` and `transformer.wte.weight`) the
    first is kept; `load_model` restores the others through the tie. Partial overlaps still
    raise, as in `save_safetensors`."""
    state = model.state_dict()
    tied = _tied_duplicates(state)
    save_safetensors({k: v for k, v in state.items() if k not in tied}, path, metadata, max_shard_size)


def load_model(model: torch.nn.Module, path, strict: bool = True, device=None):
    """Load a checkpoint written by `save_model` (or any safetensors checkpoint) into `model`,
    onto the device of its parameters unless `device` is given. Keys left out because their
    tensor is tied to a saved one are not missing. With `strict`, other missing or unexpected
    keys raise a RuntimeError naming them; returns (missing, unexpected) as lists."""
    if device is None:
        first = next(iter(model.state_dict().values()), None)
        device = first.device if first is not None else "cpu"
    state = load_safetensors(path, device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = _tied_duplicates(model.state_dict())
    missing = [k for k in missing if k not in tied]
    if strict and (missing or unexpected):
        raise RuntimeError(f"error loading {os.fspath(path)} into {type(model).__name__}: missing keys {missing}, "
                           f"unexpected keys {list(unexpected)}")
    return missing, list(unexpected)


def _tied_duplicates(state) -> set:
    """Keys naming the same whole tensor as an earlier key of `state`."""
    tensors = {k: t for k, t in state.items() if isinstance(t, torch.Tensor) and t.layout == torch.strided}
    dropped = set()
    for group in _shared_groups(tensors):
        keys = [k for k in state if k in group]
        first = tensors[keys[0]]
        for k in keys[1:]:
            t = tensors[k]
            if (t.shape, t.stride(), t.storage_offset(), t.dtype) == (first.shape, first.stride(), first.storage_offset(), first.dtype):
                dropped.add(k)
    return dropped


def parse_size(size) -> int:
    """Bytes from an int or a string like "5GB" (10**9), "200MB", "1GiB" (2**30), "4096"."""
    if isinstance(size, bool):
        raise TypeError(f"max_shard_size must be an int or a size string, got {size!r}")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", size)
        unit = _SIZE_UNITS.get(m.group(2).upper()) if m else None
        if unit is None:
            raise ValueError(f"cannot read {size!r} as a size: use bytes or a unit among {', '.join(_UNIT_NAMES)}")
        value = int(float(m.group(1)) * unit)
    else:
        raise TypeError(f"max_shard_size must be an int or a size string, got {type(size).__name__}")
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


_UNIT_NAMES = ("B", "KB", "MB", "GB", "TB", "KiB", "MiB", "GiB", "TiB")
_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_keys(sizes: dict, max_shard_size: int) -> list:
    """Group keys (in order) into shards of at most `max_shard_size` bytes, as
    huggingface_hub's `split_state_dict_into_shards_factory` does: a tensor larger than the
    limit gets a shard of its own; otherwise a shard closes when the next tensor would not fit."""
    shards, current, current_size = [], [], 0
    for key, size in sizes.items():
        if size > max_shard_size:
            shards.append([key])
            continue
        if current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(key)
        current_size += size
    if current:
        shards.append(current)
    return shards


def _save_target(path):
    path = os.fspath(path)
    if os.path.isdir(path) or path.endswith(os.sep):
        os.makedirs(path, exist_ok=True)
        return path, WEIGHTS_NAME
    directory, name = os.path.split(os.path.abspath(path))
    return directory, name


def _checked_tensors(state_dict) -> dict:
    if not isinstance(state_dict, Mapping):
        raise ValueError(f"expected a dict of str -> torch.Tensor, got {type(state_dict).__name__}")
    tensors = {}
    for key, t in state_dict.items():
        if not isinstance(key, str):
            raise TypeError(f"safetensors keys must be str, got {key!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Key `{key}` is invalid, expected torch.Tensor but received {type(t)}")
        if t.layout != torch.strided:
            raise ValueError(f"`{key}` is a {t.layout} tensor; safetensors stores dense tensors only (use .to_dense())")
        if t.device.type == "meta":
            raise ValueError(f"`{key}` is on the meta device and has no data to save")
        if _safetensors_code(t.dtype) is None:
            raise ValueError(f"cannot save `{key}`: safetensors has no {t.dtype} type")
        tensors[key] = t
    shared = [sorted(group) for group in _shared_groups(tensors) if len(group) > 1]
    if shared:
        raise RuntimeError(
            "Some tensors share memory, this will lead to duplicate memory on disk and potential "
            f"differences when loading them again: {sorted(shared)}. Keep one key per shared tensor "
            "(tied module weights are tied again by the model: load with strict=False or call its "
            "tie_weights()), or .clone() the others if they must be independent."
        )
    return tensors


def _shared_groups(tensors) -> list:
    """Sets of keys whose elements overlap in memory, found like safetensors' own check
    (same storage, overlapping byte ranges); pjrt storages are told apart by identity since
    their `data_ptr()` is 0."""
    by_storage = defaultdict(list)
    for key, t in tensors.items():
        if t.numel() == 0:
            continue
        if t.device.type == "pjrt":
            storage_id = ("pjrt", id(storage.storage_of(t)))
        else:
            ptr = t.untyped_storage().data_ptr()
            if ptr == 0:
                continue
            storage_id = (t.device, ptr)
        last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        by_storage[storage_id].append((t.storage_offset() * t.element_size(), (last + 1) * t.element_size(), key))
    groups = []
    for areas in by_storage.values():
        areas.sort()
        group, group_stop = {areas[0][2]}, areas[0][1]
        for start, stop, key in areas[1:]:
            if start >= group_stop:
                groups.append(group)
                group = set()
            group.add(key)
            group_stop = max(group_stop, stop)
        groups.append(group)
    return groups


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _write_shard(tensors: dict, filename: str, metadata: dict) -> None:
    specs, keep_alive = {}, []
    for key, buffer in zip(tensors, _host_buffers(tensors.values())):
        t = tensors[key]
        keep_alive.append(buffer)
        if isinstance(buffer, np.ndarray):
            ptr, length = buffer.ctypes.data, buffer.nbytes
        else:
            ptr, length = buffer.data_ptr(), _nbytes(buffer)
        dtype_name = str(t.dtype).removeprefix("torch.")
        specs[key] = safetensors.TensorSpec(dtype=dtype_name, shape=list(t.shape), data_ptr=ptr, data_len=length)
    safetensors.serialize_file(specs, filename, metadata=metadata)


def _host_buffers(tensors):
    """Each tensor's logical elements in contiguous host memory: numpy arrays copied from the
    device for pjrt tensors (all copies started before the first is waited on), contiguous CPU
    tensors otherwise (their data pointer is handed to the serializer as safetensors.torch does)."""
    device_values = {}
    for i, t in enumerate(tensors):
        if t.device.type == "pjrt":
            a = fusion.concrete(storage.value_of(t))
            a.copy_to_host_async()
            device_values[i] = a
    buffers = []
    for i, t in enumerate(tensors):
        if i in device_values:
            buffers.append(np.ascontiguousarray(np.asarray(device_values.pop(i))))
        else:
            t = t.detach()
            if t.device.type != "cpu":
                t = t.cpu()
            buffers.append(t.resolve_conj().resolve_neg().contiguous())
    return buffers


def _write_json(obj, filename: str) -> None:
    with open(filename, "w") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _commit(directory, writes) -> None:
    """Write each (target, write_fn) to a temporary file next to its target and fsync it; once
    all are written, rename them over their targets in order and fsync the directory."""
    done = []
    try:
        for target, write in writes:
            tmp = os.path.join(directory, f".{os.path.basename(target)}.{secrets.token_hex(6)}.tmp")
            done.append((tmp, target))
            write(tmp)
            fd = os.open(tmp, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        for tmp, target in done:
            os.replace(tmp, target)
    except BaseException:
        for tmp, _ in done:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise
    _fsync_directory(directory)


def _fsync_directory(directory) -> None:
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0)
    try:
        fd = os.open(directory, flags)
    except OSError:  # platforms where a directory cannot be opened (Windows)
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _previous_files(directory, weights_name) -> set:
    """The files of the checkpoint now saved under this name: the single file, or the index
    and the shards it lists."""
    files = {weights_name}
    try:
        with open(os.path.join(directory, weights_name + INDEX_SUFFIX)) as f:
            shards = json.load(f).get("weight_map", {}).values()
        files |= {weights_name + INDEX_SUFFIX}
        files |= {name for name in shards if os.path.basename(name) == name and name.endswith(".safetensors")}
    except (OSError, ValueError, AttributeError):
        pass
    return files


def _remove_stale(directory, previous, keep) -> None:
    """Remove the previous checkpoint's files that the new one does not use."""
    removed = False
    for name in sorted(previous - keep):
        try:
            os.unlink(os.path.join(directory, name))
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        _fsync_directory(directory)


# ---- loading -----------------------------------------------------------------------------


def load_safetensors(path, device="pjrt", keys=None) -> dict:
    """Read a safetensors checkpoint into tensors on `device` ("pjrt", "pjrt:N", a
    torch.device, or "cpu").

    `path` is a `.safetensors` file, a `*.index.json` of a sharded checkpoint, a file name
    whose index exists (`X.safetensors` saved sharded), or a directory holding
    `model.safetensors` or `model.safetensors.index.json` (the single file wins when both
    exist, as in transformers). `keys` selects tensors; an unknown key raises KeyError.
    """
    source, files = _resolve(os.fspath(path))
    wanted = None if keys is None else ([keys] if isinstance(keys, str) else list(keys))
    if wanted is not None and source is not None:
        indexed = {k for file_keys in files.values() for k in file_keys}
        unknown = [k for k in wanted if k not in indexed]
        if unknown:
            raise KeyError(f"{unknown[0]!r} is not a tensor of {source}")
    result = {}
    for file, file_keys in files.items():
        if file_keys is not None and wanted is not None:
            assigned = set(file_keys)
            file_keys = [k for k in wanted if k in assigned]
            if not file_keys:
                continue
        with _open_for(file, device) as f:
            present = set(f.keys())
            if file_keys is None:  # a single file: it is its own source
                file_keys = list(f.keys()) if wanted is None else wanted
                unknown = [k for k in file_keys if k not in present]
                if unknown:
                    raise KeyError(f"{unknown[0]!r} is not a tensor of {file}")
            for key in file_keys:
                if key not in present:
                    raise CheckpointError(f"{source} maps {key!r} to {file}, which does not contain it")
                result[key] = f.get_tensor(key)
    return result if wanted is None else {k: result[k] for k in wanted}


def _resolve(path):
    """(index file or None, {file: keys the index assigns it, or None for a single file})."""
    if os.path.isdir(path):
        single = os.path.join(path, WEIGHTS_NAME)
        if os.path.isfile(single):
            return None, {single: None}
        index = single + INDEX_SUFFIX
        if os.path.isfile(index):
            return index, _read_index(index)
        raise FileNotFoundError(errno.ENOENT, f"no {WEIGHTS_NAME} or {WEIGHTS_NAME + INDEX_SUFFIX} in the directory", path)
    if path.endswith(INDEX_SUFFIX):
        return path, _read_index(path)
    if not os.path.exists(path) and os.path.isfile(path + INDEX_SUFFIX):
        return path + INDEX_SUFFIX, _read_index(path + INDEX_SUFFIX)
    return None, {path: None}


def _read_index(index_path) -> dict:
    try:
        with open(index_path) as f:
            index = json.load(f)
    except ValueError as e:
        raise CheckpointError(f"{index_path} is not a valid checkpoint index (invalid JSON: {e})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(
            f"{index_path} is not a valid checkpoint index: no \"weight_map\" object mapping tensor names to file names"
        )
    directory = os.path.dirname(index_path)
    files = defaultdict(list)
    for key, name in weight_map.items():
        files[os.path.join(directory, name)].append(key)
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
        raise FileNotFoundError(
            errno.ENOENT, f"{len(missing)} shard file(s) listed in {index_path} missing: {', '.join(missing)}", missing[0]
        )
    return dict(files)


def _open_for(file, device):
    d = torch.device(device) if not isinstance(device, int) else torch.device("pjrt", device)
    if d.type == "pjrt":
        return DeviceSafeOpen(file, d)
    return _open_checked(file, "pt", str(d))


def _open_checked(file, framework, device=None, **kwargs):
    """safetensors' reader; an invalid file raises CheckpointError naming it."""
    file = os.fspath(file)
    if os.path.isdir(file):
        raise IsADirectoryError(errno.EISDIR, "expected a safetensors file, got a directory", file)
    args = (file, framework) if device is None else (file, framework, device)
    try:
        return _safe_open(*args, **kwargs)
    except safetensors.SafetensorError as e:
        raise CheckpointError(
            f"{file} is not a valid safetensors file ({os.path.getsize(file)} bytes; truncated or corrupted?): {e}"
        ) from None


def _jax_device_of(device):
    from . import device as pjrt_device

    from . import placement

    index = device.index if device.index is not None else pjrt_device.current_device()
    placement.require(index)  # a clear error when the device does not exist
    return pjrt_device.jax_device(index)


@functools.lru_cache(maxsize=None)
def _safetensors_code(dtype: torch.dtype):
    """safetensors' code for a torch dtype ("BF16", "F8_E4M3", ...), None where the format has
    none (complex128): safetensors' own table, read through TensorSpec's validation."""
    try:
        return safetensors.TensorSpec(dtype=str(dtype).removeprefix("torch."), shape=[0], data_ptr=0, data_len=0).dtype
    except Exception:  # noqa: BLE001 - the exception type of an unknown dtype is not part of its API
        return None


# The dtypes a pjrt tensor can hold, by safetensors code.
_CODE_TO_TORCH = {_safetensors_code(d): d for d in dtypes.TORCH_TO_JAX if _safetensors_code(d) is not None}
# numpy has no float8 types, and safetensors' numpy reader looks dtypes up on numpy: these are
# read through its torch reader instead (a zero-copy view of the mapped file).
_NOT_IN_NUMPY_READER = {torch.float8_e4m3fn, torch.float8_e5m2}


class DeviceSafeOpen:
    """`safe_open(file, framework="pt", device="pjrt")`: the same methods, returning pjrt
    tensors read by safetensors' numpy reader and put on the device with `jax.device_put`."""

    def __init__(self, filename, device="pjrt", *, backend="mmap"):
        self._file = os.fspath(filename)
        self._device = _jax_device_of(torch.device(device))
        self._backend = backend
        self._numpy = _open_checked(self._file, "numpy", backend=backend)
        self._torch = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for handle in (self._numpy, self._torch):
            if handle is not None:
                handle.__exit__(None, None, None)
        return False

    def keys(self):
        return self._numpy.keys()

    def offset_keys(self):
        return self._numpy.offset_keys()

    def metadata(self):
        return self._numpy.metadata()

    def get_tensor(self, name):
        return self._to_device(name, lambda handle: handle.get_tensor(name))

    def get_tensors(self):
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def get_slice(self, name):
        return _DeviceSlice(self, name)

    def _torch_dtype(self, name):
        code = self._numpy.get_slice(name).get_dtype()
        torch_dtype = _CODE_TO_TORCH.get(code)
        if torch_dtype is None:
            raise TypeError(f"{self._file}: tensor {name!r} has dtype {code}, which pjrt tensors cannot hold")
        return torch_dtype

    def _to_device(self, name, read):
        torch_dtype = self._torch_dtype(name)
        if torch_dtype in _NOT_IN_NUMPY_READER:
            if self._torch is None:
                self._torch = _open_checked(self._file, "pt", "cpu", backend=self._backend)
            host = dtypes.numpy_from_cpu_tensor(read(self._torch))
        else:
            host = read(self._numpy)
        return storage.wrap(jax.device_put(host, self._device), torch_dtype)


class _DeviceSlice:
    """`get_slice(name)` of a DeviceSafeOpen: indexing reads only the selected elements."""

    def __init__(self, handle, name):
        self._handle, self._name = handle, name

    def get_dtype(self):
        return self._handle._numpy.get_slice(self._name).get_dtype()

    def get_shape(self):
        return self._handle._numpy.get_slice(self._name).get_shape()

    def __getitem__(self, index):
        return self._handle._to_device(self._name, lambda handle: handle.get_slice(self._name)[index])


# ---- safetensors.torch with device="pjrt" --------------------------------------------------

_DEFAULT = object()


@functools.wraps(_safe_open, updated=())
def safe_open(filename, framework, device=_DEFAULT, **kwargs):
    # safetensors' Rust reader parses the device itself and knows only its own list of device
    # types ("device pjrt is invalid"). This wrapper takes over the one case it rejects
    # (framework "pt" with a pjrt device) and passes every other call through unchanged.
    if device is not _DEFAULT and framework in _TORCH_FRAMEWORKS and _is_pjrt(device):
        return DeviceSafeOpen(filename, device, **kwargs)
    args = (filename, framework) if device is _DEFAULT else (filename, framework, device)
    return _safe_open(*args, **kwargs)


def _is_pjrt(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == "pjrt"
    if isinstance(device, str):
        try:
            return torch.device(device).type == "pjrt"
        except RuntimeError:
            return False
    return False


def install() -> None:
    """Make `safetensors.safe_open` and `safetensors.torch.load_file(..., device="pjrt")`
    accept pjrt devices. safetensors.torch binds `safe_open` from the package when it is
    imported, so the package attribute is replaced, and the module's too if already imported."""
    import sys

    safetensors.safe_open = safe_open
    torch_module = sys.modules.get("safetensors.torch")
    if torch_module is not None:
        torch_module.safe_open = safe_open
