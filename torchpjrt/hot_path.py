"""Strict mode's hot path: the compiled helper's kernel (csrc/hot_ops.cpp) for functional ops
that return tensors, and their in-place forms, registered in place of their Python kernels.

The C++ kernel keys each call by its arguments (pjrt tensors: dtype and sizes, and for a view its
strides, offset and storage shape; numbers; static arguments) and, for a key the Python kernel
has already served, calls the same compiled program and wraps its array as storage.wrap does;
while fused mode records, it records that program into the pending graph as the Python kernel
does (fusion.record_keyed). A call it cannot key (host tensors, a storage not computed yet, a
view as an in-place target, a padded storage's tensor for an op without a keyed padding rule; a
number that does not fit the type CPU converts it to), a new key, and every call while debug mode
or a second device is in use, runs the Python kernel. A padded storage's tensor (the first n
positions of a storage of B along one dimension: padding.py) is keyed by B, without n, for an op
whose rule the key decides (padding.keyed: pointwise ops, matmuls, sums, casts, softmax, index,
index_select, index_add, accumulating index_put, cat of tensors padded alike); its results are
marked with the arguments' n as the rule marks them, and the arguments the rule read masked get
n as the program's argument beside them, as the Python kernel passed it. The Python kernel tells
it which program a call used
(`stash.last_call`, read by `take_entry`); it is taken only for plain calls: new dense results
of a functional kernel (row-major, or in the order CPU gives an op on a transposed or permuted
input, which the C++ kernel makes with the strides the Python kernel gave), a whole-storage
write of an in-place form. An op whose lowering checks its data on the device hands its
program's check vector to device_checks, as the Python kernel does; its key says whether the
checks are on.

Factories and constant fills have C++ kernels of their own (FACTORIES): torch.empty and
empty_strided of a dense row-major tensor on pjrt:0 make the same storage object storage.empty
makes; zero_() and fill_(number) of a whole small storage give it the shared array the Python
kernel gave the same shape, dtype and number (learned through `stash.last_fill`); empty_like runs
PyTorch's composite kernel (so the C++ empty) unless its tensor's storage is padded. Ops without tensor
arguments (arange, eye, tril_indices: shares_result) wrap the result the Python kernel keeps for the
same arguments (learned through `stash.last_shared`).

It is registered when torchpjrt registers its kernels and the helper is already built (the
first process on a machine builds it in the background and runs the Python kernels);
TORCHPJRT_NATIVE_OPS=off keeps the Python kernels.
"""

import ctypes
import functools
import os
import threading

import numpy as np
import torch
from jax._src.array import ArrayImpl

from . import device_checks, eager, fusion, native, padding, placement, storage

# per thread (a kernel call releases the GIL while JAX runs it: another thread's call may come in
# between), `last_call`: the latest call of a functional kernel (LoweredKernel, key), or of an
# in-place form (LoweredKernel, key, the program's results, the written tensors); dispatch sets it
stash = threading.local()

# schema argument types the C++ kernel can key or hand back to Python
_TYPES = {"Tensor", "Optional[Tensor]", "number", "Optional[number]", "int", "Optional[int]", "List[int]",
          "Optional[List[int]]", "float", "Optional[float]", "bool", "Optional[bool]", "List[bool]", "str",
          "Optional[str]", "Optional[ScalarType]", "ScalarType", "List[Tensor]", "List[number]",
          "List[Optional[Tensor]]"}

_library = None  # the helper, opened so that its calls keep the GIL (ctypes.PyDLL)


def take_entry(qualname, views):
    """For the call of aten::`qualname` that just ran, when it was plain: (its compiled program,
    per view argument in `views` whether the program took it with its offset as an argument,
    the function recording the program in fused mode, the (position, element) of each argument
    its padding rule read masked, which the program takes with its n); None otherwise (also
    when the call recorded was another op's)."""
    from .dispatch import _qualname, takes_offset

    call = getattr(stash, "last_call", None)
    stash.last_call = None
    if call is None or _qualname(call[0].op) != qualname:
        return None
    if len(call) == 4:
        # an in-place form, or an op that also writes arguments: plain when each target's storage
        # now holds the program's own result (whole-storage writes that needed no cast, broadcast
        # or placement); a target left out (None) has no result
        kernel, key, results, targets = call
        if len(results) < len(targets):
            return None
        for result, target in zip(results, targets):
            if target is None:
                if result is not None:
                    return None
                continue
            st = getattr(target.untyped_storage(), "_pjrt", None)
            if st is None or st.array is not result:
                return None
    else:
        kernel, key = call  # its results: new dense tensors, row-major or laid out as CPU lays them out
    program = kernel.cache.get(key)
    if program is None:
        return None
    # a padded view read masked takes its n as an argument (dispatch._key_beyond)
    masked = kernel.masked_of.get(key, ())
    if not masked and any(type(w) is tuple and w[:1] == ("beyond",) for w in key):
        return None
    # as LoweredKernel.compute_keyed passes a view (a padded one as its rule widened it)
    forms = tuple(takes_offset(v, v.untyped_storage()._pjrt) for v in views)
    return program, forms, functools.partial(fusion.record_keyed, kernel.fused_avals, key, program), masked


def wanted() -> bool:
    return os.environ.get("TORCHPJRT_NATIVE_OPS", "on").strip().lower() not in ("0", "off", "false")


def start():
    """The helper, configured for hot kernels, when it is built already and has them; else None."""
    global _library
    if _library is not None:
        return _library
    if not wanted() or not storage.storage_words_known():
        return None
    lib = native.start()
    path = native.loaded_path()
    if lib is None or path is None or not hasattr(lib, "torchpjrt_hot_register"):
        return None
    py = ctypes.PyDLL(path)
    py.torchpjrt_hot_configure.argtypes = [ctypes.py_object] * 14
    py.torchpjrt_hot_configure.restype = ctypes.c_int
    py.torchpjrt_hot_register.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.py_object, ctypes.c_int, ctypes.c_int,
                                          ctypes.py_object]
    py.torchpjrt_hot_register.restype = ctypes.c_int
    py.torchpjrt_hot_register_factory.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.py_object, ctypes.py_object]
    py.torchpjrt_hot_register_factory.restype = ctypes.c_int
    py.torchpjrt_hot_calls.argtypes = []
    py.torchpjrt_hot_calls.restype = ctypes.c_longlong
    from .dispatch import device_number, pack_numbers

    off_when = [(eager, "debug_enabled"), (placement, "multi"), (storage, "mesh_placements")]
    model = storage._create_empty((0,), torch.float32)
    py.torchpjrt_hot_configure(storage.Storage, ArrayImpl, stash, take_entry, off_when, model, np.int64,
                               fusion.Pending, (fusion, "records_ops"), (padding, "enabled"), padding.mark_storage,
                               np.ndarray, pack_numbers, device_number)
    from .dispatch import outside_dynamo
    from .kernel_cache import CachedKernel

    # what the helper calls back into (beside the Python kernels, which dispatch marks)
    outside_dynamo(storage.Storage.__init__, storage.Storage.replace, take_entry, padding.mark_storage, pack_numbers,
                   device_number, fusion._add_node, fusion.record_keyed, fusion.flush, CachedKernel.__call__,
                   device_checks.record)
    py.torchpjrt_hot_budget.argtypes = [ctypes.c_longlong]
    py.torchpjrt_hot_budget.restype = None
    _library = py
    fusion.hot_calls = calls
    fusion.hot_budget = py.torchpjrt_hot_budget
    return py


# ops whose indices are integer tensors or None (code 'x'): a mask's data-dependent shape, a uint8
# mask's deprecation warning (CPU's at every call) and host indices go to the Python kernel
_INDEXING = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
             torch.ops.aten._index_put_impl_.default}


def writes_first_alone(op, lowering) -> bool:
    """Whether `op`'s lowering writes its first argument and nothing else, the op returning that
    argument (_index_put_impl_, embedding_renorm_): the C++ kernel serves it as an in-place form."""
    first = op._schema.arguments[0]
    return (tuple(lowering.mutates) == (first.name,) and first.alias_info is not None and first.alias_info.is_write
            and str(first.type) == "Tensor")


def codes(op, lowering, sig, kinds, has_call_check, inplace=False) -> str | None:
    """The C++ kernel's per-argument codes for `op` (with `inplace`: an in-place form of the
    op `lowering` computes, or an op that writes its first argument alone), or None when it does
    not serve it: 't' tensor ('p': one that may be padded, its op's padding rule keyed), 'l' list of
    tensors ('a': cat's, whose appends to a grown sequence go to the Python kernel; 'x': indices,
    integer or None),
    'n' traced number ('c', 'o': one CPU converts with overflow checks to the result's
    type, or to the type it computes in), 'N' number the lowering wants static, 'f' traced list
    of numbers ('C', 'O' checked alike), 's' static argument, 'w' a tensor the op also writes
    (whole: its new value follows the results)."""
    from .dispatch import CONSTANT_FILLS, SCALAR, SCALAR_LIST, STATIC, TENSOR, TENSOR_LIST, checked_numbers

    schema = op._schema
    returns = [str(r.type) for r in schema.returns]
    # cat is a producer of padded storages only as an append to a growing sequence: the C++ kernel
    # leaves an append to a storage with a history of appends to the Python kernel, and marks a
    # first append's result as padding.py does (code 'a'); index.Tensor only with masks (bool or uint8
    # indices: a data-dependent shape, CPU's deprecation warning at every call), which it leaves
    # to the Python kernel too (code 'x'): integer indices fix the result's shape, and the Python
    # kernel's argument check (indices broadcast together) depends on nothing the key does not fix
    indexing = op in _INDEXING
    if (lowering.random or (lowering.dynamic_shape and not indexing) or (has_call_check and not indexing)
            or "device" in sig.names or (op in padding.PRODUCERS and op != torch.ops.aten.cat.default and not indexing)
            or op in CONSTANT_FILLS):
        return None
    written = set(lowering.mutates)
    if written and inplace and writes_first_alone(op, lowering):
        pass  # its program's result is the first argument's new value, as an in-place form's
    elif written and (inplace or lowering.check is not None or any(
            a.name in written and str(a.type) not in ("Tensor", "Optional[Tensor]") for a in schema.arguments)):
        # an op that also writes arguments: served for tensors it writes whole (batch norm's
        # running statistics, which native_batch_norm's schema does not even mark as written)
        return None
    if lowering.check is not None and returns == ["List[Tensor]"]:
        return None  # a checked op's vector comes after its results, one list here
    if inplace:
        first = schema.arguments[0].alias_info
        ret = schema.returns[0].alias_info if returns else None
        if first is None or not first.is_write or schema.arguments[0].kwarg_only \
                or any(a.alias_info is not None for a in schema.arguments[1:]) \
                or not (returns == [] or (len(returns) == 1 and ret is not None and ret.is_write)):
            return None
    elif not returns or any(r.alias_info is not None for r in schema.returns) or \
            not (all(r == "Tensor" for r in returns) or returns == ["List[Tensor]"]):
        return None
    checked = dict(checked_numbers(op, sig, kinds) or ())
    # a padding rule whose decision the key fixes with B for n (padding.keyed): 'p' keys padded
    # arguments by their storages' sizes, and 'x' index lists take padded indices too
    tensor = "p" if getattr(padding.rule_for(op, lowering), "keyed", False) else "t"
    out = []
    for i, (arg, kind) in enumerate(zip(schema.arguments, kinds)):
        if str(arg.type) not in _TYPES and kind != SCALAR:
            return None
        if kind == TENSOR:
            out.append("w" if arg.name in written and not inplace else tensor)
        elif kind == TENSOR_LIST:
            out.append("x" if indexing else "a" if op == torch.ops.aten.cat.default else "l")
        elif kind == SCALAR:
            out.append("N" if sig.names[i] in lowering.static else "n" if i not in checked else "o" if checked[i] else "c")
        elif kind == SCALAR_LIST:
            out.append("s" if lowering.static else "f" if i not in checked else "O" if checked[i] else "C")
        elif kind == STATIC:
            out.append("s")
        else:
            return None
    return "".join(out)


def register(op, qualname, code, python_kernel, inplace=False, check=None) -> None:
    """Register the C++ kernel for `op`; `check`: its lowering's device check (indices in range),
    whose vector the kernel hands to device_checks as the Python kernel does."""
    returns = [str(r.type) for r in op._schema.returns]
    n_returns = -1 if returns == ["List[Tensor]"] else len(returns)
    checked = None if check is None else (
        functools.partial(device_checks.record, check=check, op_name=op), (device_checks, "enabled"))
    if _library.torchpjrt_hot_register(qualname.encode(), code.encode(), python_kernel, int(inplace), n_returns,
                                       checked) != 0:
        raise RuntimeError(f"torchpjrt: registering the hot kernel of {qualname} failed")


# the C++ factory kernels (csrc/hot_ops.cpp's FactoryKernel) and what each is told to watch
FACTORIES = {"empty.memory_format": (0, (storage, "_capacity")), "empty_strided": (1, (storage, "_capacity")),
             "empty_like": (2, (padding, "live")), "fill_.Scalar": (3, None), "zero_": (4, None)}


# FactoryKernel's kind for an op that shares its result (shares_result), with no flag to watch
SHARED_RESULT = (5, None)


def register_factory(qualname, python_kernel, kind_and_flag=None) -> None:
    """Register the C++ kernel of a factory or constant fill (FACTORIES; or of `kind_and_flag`,
    SHARED_RESULT), with `python_kernel` for the calls it does not serve."""
    kind, flag = kind_and_flag or FACTORIES[qualname]
    if _library.torchpjrt_hot_register_factory(qualname.encode(), kind, python_kernel, flag) != 0:
        raise RuntimeError(f"torchpjrt: registering the hot kernel of {qualname} failed")


def shares_result(op, lowering, sig) -> bool:
    """Whether `op` makes one tensor without tensor arguments (arange, eye, linspace): its Python
    kernel keeps the result of a small call whose arguments are all static (not linspace's traced
    numbers) and hands it to every call with the same arguments (storage.shared_result), which the
    C++ kernel then does."""
    from .dispatch import TENSOR, TENSOR_LIST

    returns = [str(r.type) for r in op._schema.returns]
    return (not lowering.random and not lowering.dynamic_shape and "device" in sig.names and returns == ["Tensor"]
            and not any(kind in (TENSOR, TENSOR_LIST) for kind in sig.kinds))


def calls() -> int:
    """Calls the C++ kernels served (each also counts as an op dispatched)."""
    return _library.torchpjrt_hot_calls() if _library is not None else 0
