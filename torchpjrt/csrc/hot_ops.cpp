// Strict mode's hot path: functional ops that return tensors and their in-place forms
// (`a.add_(b)`), called again with a signature the Python kernel has already run.
//
// torchpjrt's Python kernel for such an op normalizes the arguments, builds a signature key,
// looks up the op's compiled program, calls it and wraps its arrays as new tensors. Past the
// program's own call (what raw jax.jit pays too), the trip into Python and those steps cost
// about twice the call on the CPU platform. Registered for PrivateUse1 in place of the Python
// kernel, this kernel does the same from C++ for the calls it recognizes: pjrt tensors whose
// storage holds a computed jax.Array (whole, or views keyed by their geometry), numbers and
// static arguments. It keys the call by those, and on a key the Python kernel has already
// served (and reported as plain) it calls the same compiled program with the same arguments
// and wraps the results as the Python kernel does (a storage object holding the array, an
// address of its own), or for an in-place form hands the result to the target's storage
// object (Storage.replace, as storage.write does for a whole storage). Everything else goes to
// the Python kernel: a first call, another eager mode, several devices, host
// tensors, padded storages but for ops whose padding rule the key decides (code 'p'). So
// results are the Python kernel's, call for call. Factories and constant fills
// (torch.empty, zeros, ones, full, ones_like) have a kernel of their own (FactoryKernel, below).

#include <ATen/Dispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>
#include <c10/util/safe_numerics.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/Storage.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/tensor_memoryformats.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch::jit {
py::object toPyObject(c10::IValue ivalue);  // torch_python's own conversion (pybind_utils.h)
}

namespace {

// The attributes of a __slots__ class read and written through their member descriptors, without
// an attribute lookup: fused mode's graph (fusion._Graph) and its values (fusion.Pending), at
// every op recorded here.
struct Slots {
  PyTypeObject* type = nullptr;
  std::vector<PyObject*> descriptors;
  // false (and the Slots unusable) unless every name is a slot of `cls`
  bool load(PyObject* cls, std::initializer_list<const char*> names) {
    if (cls == nullptr || !PyType_Check(cls)) return false;
    for (const char* name : names) {
      PyObject* d = PyObject_GetAttrString(cls, name);
      if (d == nullptr || Py_TYPE(d) != &PyMemberDescr_Type) {
        Py_XDECREF(d);
        PyErr_Clear();
        reset();
        return false;
      }
      descriptors.push_back(d);
    }
    Py_INCREF(cls);
    type = reinterpret_cast<PyTypeObject*>(cls);
    return true;
  }
  void reset() {  // unusable again: its references dropped
    for (PyObject* d : descriptors) Py_DECREF(d);
    descriptors.clear();
    Py_CLEAR(type);
  }
  bool loaded() const { return type != nullptr; }
  PyObject* get(PyObject* o, int i) const {  // a new reference, or nullptr with an error
    return Py_TYPE(descriptors[i])->tp_descr_get(descriptors[i], o, reinterpret_cast<PyObject*>(type));
  }
  bool set(PyObject* o, int i, PyObject* v) const {
    return Py_TYPE(descriptors[i])->tp_descr_set(descriptors[i], o, v) == 0;
  }
};

// fusion._Graph's and fusion.Pending's slots this file uses, in Slots order
enum GraphSlot { kNodes, kRunners, kInputs, kInputSlots, kInputSigs, kInputIds, kOutputs, kNSlots, kTask, kSerial,
                 kStorages };
// storage.Storage's, in Slots order
enum StorageSlot { kArray, kShape, kDtype, kVersion, kViews, kRaw, kDevice, kPadding, kAppendedAlong, kTrackedIn };
enum PendingSlot { kPendingShape, kPendingDtype, kPendingWeakType, kPendingGraph, kPendingSlot, kPendingValue };

// What the Python side tells this kernel once (torchpjrt_hot_configure).
struct Config {
  PyObject* storage_class = nullptr;  // torchpjrt.storage.Storage(array, dtype)
  PyObject* array_type = nullptr;     // jax's concrete array type: anything else is not computed yet
  PyObject* pending_type = nullptr;   // fusion.Pending: a value of the graph fused mode records
  std::pair<PyObject*, PyObject*> records{nullptr, nullptr};  // (fusion's dict, "records_ops")
  std::pair<PyObject*, PyObject*> appends{nullptr, nullptr};  // (padding's dict, "enabled"): cat's first appends marked
  PyObject* stash = nullptr;          // per thread, `last_call`: set by the Python kernel's call
  PyObject* take_entry = nullptr;     // (op name, view arguments) -> (program, offset forms) or None
  PyObject* mark_padded = nullptr;    // padding.mark_storage(storage object, n, B, stride)
  PyObject* int64_type = nullptr;     // numpy.int64: a view's offset as the Python kernel passes it
  PyObject* ndarray_type = nullptr;   // numpy.ndarray: a packed list of numbers (pack_numbers)
  PyObject* pack_numbers = nullptr;   // dispatch.pack_numbers(list): a traced list as the program takes it
  PyObject* device_number = nullptr;  // dispatch.device_number(number): a traced number as a device scalar
  std::vector<std::pair<PyObject*, PyObject*>> off_when;  // (module dict, name): true -> Python kernel
  PyObject* name_pjrt = nullptr;
  PyObject* name_array = nullptr;
  PyObject* name_padding = nullptr;
  PyObject* name_shape = nullptr;
  PyObject* name_dtype = nullptr;
  PyObject* name_last_call = nullptr;
  PyObject* name_last_fill = nullptr;
  PyObject* name_last_shared = nullptr;
  PyObject* name_appended_along = nullptr;
  PyObject* name_replace = nullptr;
  PyObject* name_value = nullptr;
  PyObject* name_call = nullptr;
  PyObject* name_add_node = nullptr;
  PyObject* name_args = nullptr;
  PyObject* name_traceable = nullptr;
  PyObject* name_graph = nullptr;
  PyObject* name_lock = nullptr;
  PyObject* name_max_ops = nullptr;
  PyObject* name_flush = nullptr;
  PyObject* name_acquire = nullptr;
  PyObject* name_release = nullptr;
  PyObject* name_aval = nullptr;
  PyObject* name_weak_type = nullptr;
  PyObject* name_unflatten = nullptr;
  PyObject* flush_reason = nullptr;  // "max_ops"
  PyObject* no_arguments = nullptr;  // ()
  Slots graph;    // fusion._Graph (not loaded: every record goes through fusion._add_node)
  Slots pending;  // fusion.Pending
  Slots storage;  // storage.Storage (not loaded: its __init__ makes each)
  PyObject* zero = nullptr;  // 0
  c10::Allocator* allocator = nullptr;  // the one PyTorch's Python backend gives its storages
};

Config* config = nullptr;
// addresses of their own for the storages made here: a range the Python side (from 2**60 up)
// will never reach, handed out the same way (256-byte aligned, never reused)
std::atomic<uint64_t> next_address{(uint64_t{1} << 60) + (uint64_t{1} << 58)};
std::atomic<int64_t> calls{0};
// calls this kernel may still serve before a Python kernel must run one (-1: no limit): a
// flush-heavy region of fused mode is counted in ops, and ends at a Python kernel's op
std::atomic<int64_t> budget{-1};
std::unique_ptr<torch::Library> registration;

constexpr int64_t kNone = -1, kBool = -2, kDynInt = -4, kDynFloat = -6, kInt = -7,
                  kFloat = -8, kIntList = -9, kString = -10, kTensor = -11, kView = -12, kList = -13,
                  kReshaped = -14, kPadded = -15;

// A view argument of one call: where its array is among the program's arguments (`element`: its
// index in the list argument there, -1 for an argument of its own), its offset.
struct View {
  int position;
  int element;
  int64_t offset;
  at::Tensor tensor;
  // a padded view's sizes with B along its padded dimension (the view its op's rule reads), or empty
  std::vector<int64_t> widened;
};

// One result of a functional op: what its new tensor is made of.
struct Result {
  c10::ScalarType dtype;
  PyObject* dtype_object;  // torch.dtype, as the storage object records it
  std::vector<int64_t> sizes;
  int64_t nbytes;
  // empty: row-major; else the strides of a result laid out in CPU's order (an op on a transposed
  // or permuted input), whose array holds its elements in memory order (storage.wrap_in_order)
  std::vector<int64_t> strides;
  // false: a result the op leaves out (a backward op's gradient its output mask does not ask
  // for), None from the program and an undefined tensor from the op, as from the Python kernel
  bool defined = true;
  // the shape of the result's storage (its array's) as the Python kernel's call left it, given
  // to the storage object so that it does not read the array's shape; nullptr: it reads it
  PyObject* shape = nullptr;
  // >= 0: a padded result (padding.py), `sizes` and `strides` its whole storage's (row-major):
  // the tensor is the first n positions (the padded arguments' n, which the key leaves out) along
  // this dimension
  int64_t padded_dim = -1;
};

struct Entry {
  PyObject* program;  // the compiled function the Python kernel called for this key
  PyObject* recorder;  // (arguments) -> the program's results recorded into fused mode's graph
  // view arguments passed as (array, offset), as the Python kernel did: (position, element)
  std::vector<std::pair<int, int>> offset_positions;
  std::vector<Result> results;  // none for an in-place form
  // `program` is a kernel_cache.CachedKernel: its loaded executable (`_call`) is called directly
  bool kept = false;
  // padded arguments the op's padding rule reads masked (padding._masked: positions from n on
  // read as a fill, in the program): passed as (argument, n), as the Python kernel passed them
  std::vector<std::pair<int, int>> masked_positions;
  // (traced function, argument treedef, result avals) from the recorder's cache once it has
  // recorded this key, when the arguments and results are flat: later records call
  // fusion._add_node with them, without record_keyed's frame (nullptr: through `recorder`)
  mutable PyObject* node = nullptr;
  mutable bool node_looked_up = false;
};

struct KeyHash {
  size_t operator()(const std::vector<int64_t>& key) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t w : key) {
      h ^= static_cast<uint64_t>(w);
      h *= 1099511628211ull;
    }
    return h;
  }
};

int64_t bits_of(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

struct GilHeld {
  PyGILState_STATE state = PyGILState_Ensure();
  ~GilHeld() { PyGILState_Release(state); }
};

// Owned references: the arguments of one program call, or an in-place op's targets.
struct Arguments {
  c10::SmallVector<PyObject*, 16> items;
  int size() const { return static_cast<int>(items.size()); }
  bool push(PyObject* o) {
    if (o == nullptr) return false;
    items.push_back(o);
    return true;
  }
  ~Arguments() {
    for (PyObject* o : items) Py_DECREF(o);
  }
};

bool is_set(PyObject* dict, PyObject* name) {
  PyObject* v = PyDict_GetItemWithError(dict, name);  // borrowed
  if (v == nullptr) {
    PyErr_Clear();
    return true;
  }
  return v != Py_False && v != Py_None && !(PyLong_CheckExact(v) && PyLong_AsLongLong(v) == 0);
}

bool python_path_wanted() {
  for (auto& [dict, name] : config->off_when)
    if (is_set(dict, name)) return true;
  return false;
}

// A pjrt tensor argument: its storage object and array (new references), when the storage holds
// a computed jax.Array of the tensor's dtype (or, while fused mode records, a value it records); `whole`: the tensor is the whole storage
// (contiguous, the storage's shape, offset 0); `reshaped`: all of it in another shape (read as a
// reshape, as dispatch._key_tensor keys it); else a view whose geometry goes into the key.
struct Held {
  PyObject* storage = nullptr;
  PyObject* array = nullptr;
  bool whole = false;
  bool reshaped = false;
  std::vector<int64_t> storage_shape;
  // a padded storage's tensor (padding.py): its first n positions along `padded_dim`, keyed with
  // B there; `whole` when it is all of the storage but for the positions from n on, else a view
  int64_t padded_dim = -1;
  int64_t padded_n = 0;
  int64_t padded_bucket = 0;
  ~Held() {
    Py_XDECREF(storage);
    Py_XDECREF(array);
  }
};

// The ints of `o`, a tuple of them (a storage's shape, its padding), in `out`; false otherwise.
bool int_tuple(PyObject* o, std::vector<int64_t>& out) {
  if (o == nullptr || !PyTuple_Check(o)) return false;
  const Py_ssize_t n = PyTuple_GET_SIZE(o);
  out.resize(n);
  for (Py_ssize_t d = 0; d < n; d++) {
    PyObject* s = PyTuple_GET_ITEM(o, d);
    if (!PyLong_CheckExact(s)) return false;
    out[d] = PyLong_AsLongLong(s);
  }
  return true;
}

// Whether `t` is the first n positions along one dimension of a padded storage of `shape` (B
// along it, `stride` its stride): padding.padded_dim's dimension (the one of size n and that
// stride, and no other such, from a multiple of B positions), in `h`; `whole` when t is
// otherwise all of the storage, row-major. Otherwise (an element, a column) padding.py's rules
// read it exactly, as any view.
bool padded_tensor(const at::Tensor& t, const std::vector<int64_t>& shape, int64_t n, int64_t B, int64_t stride,
                   Held& h) {
  int64_t found = -1;
  for (int64_t d = 0; d < t.dim(); d++) {
    if (t.size(d) == n && t.stride(d) == stride) {
      if (found >= 0) return false;  // two candidates: padding.py reads it exactly
      found = d;
    }
  }
  if (found < 0 || stride <= 0 || (t.storage_offset() / stride) % B != 0) return false;
  h.padded_dim = found;
  h.padded_n = n;
  h.padded_bucket = B;
  h.whole = false;
  h.reshaped = false;
  if (t.storage_offset() != 0 || t.dim() != static_cast<int64_t>(shape.size())) return true;
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; d >= 0; d--) {
    const int64_t size = d == found ? B : t.size(d);
    if (size != shape[d] || (size != 1 && t.stride(d) != expected)) return true;
    expected *= size;
  }
  h.whole = true;
  return true;
}

// A storage object's attribute (a new reference, or nullptr with an error): through its slot for
// a storage.Storage, else by name.
PyObject* storage_attr(PyObject* st, int slot, PyObject* name) {
  if (Py_TYPE(st) == config->storage.type) return config->storage.get(st, slot);
  return PyObject_GetAttr(st, name);
}

// The storage object (storage.Storage, `_pjrt` on its UntypedStorage) of pjrt tensor `t`: a new
// reference, or nullptr with no error set.
PyObject* storage_object(const at::Tensor& t) {
  PyObject* py_storage = THPStorage_Wrap(t.storage());
  PyObject* st = py_storage != nullptr ? PyObject_GetAttr(py_storage, config->name_pjrt) : nullptr;
  Py_XDECREF(py_storage);
  if (st == nullptr) PyErr_Clear();
  return st;
}

// Whether tensor `v`'s storage may be padded (padding.py): false only for a pjrt tensor whose
// storage object says it is not.
bool may_be_padded(const c10::IValue& v) {
  if (!v.isTensor() || v.toTensor().device().type() != c10::DeviceType::PrivateUse1) return true;
  PyObject* st = storage_object(v.toTensor());
  PyObject* padding = st != nullptr ? storage_attr(st, kPadding, config->name_padding) : nullptr;
  Py_XDECREF(st);
  const bool plain = padding == Py_None;
  Py_XDECREF(padding);
  if (padding == nullptr) PyErr_Clear();
  return !plain;
}

// `padded`: a padded storage's tensor may be held (padded_whole), for an op whose padding rule
// the key decides (code 'p': padding.keyed).
bool held(const at::Tensor& t, Held& h, bool recording, bool padded = false) {
  if (t.device().type() != c10::DeviceType::PrivateUse1) return false;
  h.storage = storage_object(t);
  if (h.storage == nullptr) return false;
  h.array = storage_attr(h.storage, kArray, config->name_array);
  PyObject* shape = storage_attr(h.storage, kShape, config->name_shape);
  PyObject* dtype = storage_attr(h.storage, kDtype, config->name_dtype);
  // a padded storage (padding.py): held only for an op whose rule widens it (`padded`)
  PyObject* padding = storage_attr(h.storage, kPadding, config->name_padding);
  bool typed = dtype == reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
  if (h.array == Py_None && typed && padding == Py_None) {
    // an uninitialized storage (torch.empty): materialized as the Python kernel's read does
    // (Storage.value: zeros, one valid content)
    Py_DECREF(h.array);
    h.array = PyObject_CallMethodNoArgs(h.storage, config->name_value);
  }
  std::vector<int64_t> pad;  // a padded storage's (n, B, stride)
  const bool padded_ok = padded && padding != Py_None && int_tuple(padding, pad) && pad.size() == 3;
  bool ok = h.array != nullptr && shape != nullptr && dtype != nullptr && (padding == Py_None || padded_ok) &&
            (reinterpret_cast<PyObject*>(Py_TYPE(h.array)) == config->array_type ||
             (recording && reinterpret_cast<PyObject*>(Py_TYPE(h.array)) == config->pending_type)) &&
            typed && int_tuple(shape, h.storage_shape);
  Py_XDECREF(shape);
  Py_XDECREF(dtype);
  Py_XDECREF(padding);
  if (!ok) {
    PyErr_Clear();
    return false;
  }
  if (padded_ok && padded_tensor(t, h.storage_shape, pad[0], pad[1], pad[2], h)) return true;
  h.whole = t.storage_offset() == 0 && t.is_contiguous() && t.sizes().equals(h.storage_shape);
  if (!h.whole && t.storage_offset() == 0 && t.is_contiguous()) {
    int64_t numel = 1;
    for (int64_t s : h.storage_shape) numel *= s;
    h.reshaped = numel == t.numel();
  }
  return true;
}

// A new pjrt tensor over a new c10 storage of `nbytes` (an address of its own, as
// storage.give_address gives) whose storage object is `st` (a reference this call takes), or an
// undefined tensor. `strides` empty: row-major.
at::Tensor new_tensor(PyObject* st, c10::ScalarType dtype, c10::IntArrayRef sizes, c10::IntArrayRef strides,
                      int64_t nbytes) {
  uint64_t address = 0;
  if (nbytes) address = next_address.fetch_add((static_cast<uint64_t>(nbytes) + 255) / 256 * 256);
  c10::Storage storage(c10::make_intrusive<c10::StorageImpl>(
      c10::StorageImpl::use_byte_size_t(), nbytes,
      c10::DataPtr(reinterpret_cast<void*>(address), c10::Device(c10::DeviceType::PrivateUse1, 0)),
      config->allocator, /*resizable=*/config->allocator != nullptr));
  at::Tensor t = at::detail::make_tensor<c10::TensorImpl>(std::move(storage),
                                                          c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                                          caffe2::TypeMeta::fromScalarType(dtype));
  if (strides.empty()) {
    t.unsafeGetTensorImpl()->set_sizes_contiguous(sizes);
  } else {
    t.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides);
  }
  PyObject* py_storage = THPStorage_Wrap(t.storage());
  bool ok = py_storage != nullptr && PyObject_SetAttr(py_storage, config->name_pjrt, st) == 0;
  Py_XDECREF(py_storage);
  Py_DECREF(st);
  if (!ok) {
    PyErr_Clear();
    return at::Tensor();
  }
  return t;
}

// fusion.track(storage, pending): a storage given a recorded value is listed once in its graph,
// which swaps the computed array in when it runs. False with an error set.
bool track(PyObject* st, PyObject* pending) {
  const Slots& G = config->graph;
  const Slots& P = config->pending;
  const Slots& S = config->storage;
  PyObject* g = P.get(pending, kPendingGraph);
  if (g == nullptr) return false;
  bool ok = Py_TYPE(g) == G.type;
  PyObject* serial = ok ? G.get(g, kSerial) : nullptr;
  PyObject* tracked_in = serial != nullptr ? S.get(st, kTrackedIn) : nullptr;
  ok = tracked_in != nullptr;
  if (ok) {
    const int same = PyObject_RichCompareBool(tracked_in, serial, Py_EQ);
    ok = same >= 0;
    if (ok && !same) {
      PyObject* storages = G.get(g, kStorages);
      PyObject* ref = storages != nullptr ? PyWeakref_NewRef(st, nullptr) : nullptr;
      ok = ref != nullptr && S.set(st, kTrackedIn, serial) && PyList_Append(storages, ref) == 0;
      Py_XDECREF(ref);
      Py_XDECREF(storages);
    }
  }
  PyObject* value = ok ? P.get(pending, kPendingValue) : nullptr;  // its graph ran already
  ok = value != nullptr && (value == Py_None || S.set(st, kArray, value));
  Py_XDECREF(value);
  Py_XDECREF(tracked_in);
  Py_XDECREF(serial);
  Py_DECREF(g);
  if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "torchpjrt: a recorded value has no graph");
  return ok;
}

// storage.Storage(array, dtype, shape) for a result (a new reference, or nullptr with an error):
// Storage.__init__'s work without its Python frame, `shape` a tuple (the array's).
PyObject* new_storage(PyObject* array, PyObject* dtype, PyObject* shape) {
  const Slots& S = config->storage;
  if (!S.loaded() || shape == nullptr || !PyTuple_CheckExact(shape)) {
    PyObject* args[3] = {array, dtype, shape};
    return PyObject_Vectorcall(config->storage_class, args, shape != nullptr ? 3 : 2, nullptr);
  }
  PyObject* st = S.type->tp_new(S.type, config->no_arguments, nullptr);
  if (st == nullptr) return nullptr;
  const bool ok = S.set(st, kArray, array) && S.set(st, kDevice, config->zero) && S.set(st, kTrackedIn, config->zero) &&
                  S.set(st, kShape, shape) && S.set(st, kDtype, dtype) && S.set(st, kVersion, config->zero) &&
                  S.set(st, kViews, Py_None) && S.set(st, kRaw, Py_False) && S.set(st, kPadding, Py_None) &&
                  S.set(st, kAppendedAlong, Py_None) &&
                  (reinterpret_cast<PyObject*>(Py_TYPE(array)) != config->pending_type || track(st, array));
  if (!ok) Py_CLEAR(st);
  return st;
}

// Storage.replace(array) without its Python frames: the storage holds `array` (a recorded value
// listed in its graph, as _hold lists it), a new version, no materialized views, and a new shape
// drops its padding. False with an error set.
bool replace_array(PyObject* st, PyObject* array) {
  const Slots& S = config->storage;
  PyObject* shape = Py_TYPE(st) == S.type ? PyObject_GetAttr(array, config->name_shape) : nullptr;
  if (shape == nullptr || !PyTuple_CheckExact(shape)) {
    Py_XDECREF(shape);
    PyErr_Clear();
    PyObject* none = PyObject_CallMethodOneArg(st, config->name_replace, array);
    Py_XDECREF(none);
    return none != nullptr;
  }
  PyObject* old_shape = S.get(st, kShape);
  PyObject* version = old_shape != nullptr ? S.get(st, kVersion) : nullptr;
  PyObject* next = version != nullptr && PyLong_CheckExact(version) ? PyLong_FromLongLong(PyLong_AsLongLong(version) + 1)
                                                                    : nullptr;
  bool ok = next != nullptr && S.set(st, kArray, array) &&
            (reinterpret_cast<PyObject*>(Py_TYPE(array)) != config->pending_type || track(st, array));
  if (ok) {
    const int same = PyObject_RichCompareBool(shape, old_shape, Py_EQ);
    ok = same >= 0 && (same || (S.set(st, kShape, shape) && S.set(st, kPadding, Py_None))) &&
         S.set(st, kVersion, next) && S.set(st, kViews, Py_None);
  }
  if (!ok && !PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "torchpjrt: a storage's version is not an int");
  Py_XDECREF(next);
  Py_XDECREF(version);
  Py_XDECREF(old_shape);
  Py_DECREF(shape);
  return ok;
}

// `array` (a recorded value while recording) as a new pjrt tensor (storage.wrap), or an
// undefined tensor; `appended_along` >= 0: its storage marked as a first append's (cat). A padded
// result (r.padded_dim) is the first `padded_n` positions of its storage, marked as padding._mark
// marks it.
at::Tensor wrap(PyObject* array, const Result& r, bool recording, int64_t appended_along = -1, int64_t padded_n = -1) {
  if (reinterpret_cast<PyObject*>(Py_TYPE(array)) != (recording ? config->pending_type : config->array_type))
    return at::Tensor();
  PyObject* st = new_storage(array, r.dtype_object, r.shape);
  if (st != nullptr && appended_along >= 0) {
    PyObject* along = PyLong_FromLongLong(appended_along);
    if (along == nullptr || PyObject_SetAttr(st, config->name_appended_along, along) != 0) Py_CLEAR(st);
    Py_XDECREF(along);
  }
  if (st == nullptr) {
    PyErr_Clear();
    return at::Tensor();
  }
  if (r.padded_dim < 0) return new_tensor(st, r.dtype, r.sizes, r.strides, r.nbytes);
  const int64_t D = r.padded_dim;
  PyObject* mark_args[4] = {st, PyLong_FromLongLong(padded_n), PyLong_FromLongLong(r.sizes[D]),
                            PyLong_FromLongLong(r.strides[D])};
  PyObject* none = padded_n >= 0 && mark_args[1] && mark_args[2] && mark_args[3]
                       ? PyObject_Vectorcall(config->mark_padded, mark_args, 4, nullptr)
                       : nullptr;
  for (int j = 1; j < 4; j++) Py_XDECREF(mark_args[j]);
  if (none == nullptr) {
    PyErr_Clear();
    Py_DECREF(st);
    return at::Tensor();
  }
  Py_DECREF(none);
  c10::SmallVector<int64_t, 6> sizes(r.sizes.begin(), r.sizes.end());
  sizes[D] = padded_n;
  return new_tensor(st, r.dtype, sizes, r.strides, r.nbytes);
}

// The `shape` of a result's storage object (a new reference), or nullptr: the same program
// gives arrays of the same shape, which for a result laid out in memory order (or with a
// size-1 dimension out of place) is not the tensor's sizes.
PyObject* storage_shape(const at::Tensor& t) {
  PyObject* st = storage_object(t);
  PyObject* shape = st != nullptr ? PyObject_GetAttr(st, config->name_shape) : nullptr;
  Py_XDECREF(st);
  if (shape == nullptr || !PyTuple_CheckExact(shape)) {
    PyErr_Clear();
    Py_XDECREF(shape);
    return nullptr;
  }
  return shape;
}

// A number argument the Python kernel treats as static when it is None, a bool or the int 1
// (dispatch.scalar_is_static; for a number wrapped as a tensor, `x + 1.0`, the float 1.0 too:
// LoweredKernel._odd_tensor_arg), traced otherwise.
bool static_value(const c10::IValue& v, std::vector<int64_t>& key);

// Traced numbers as device scalars, one per value and kind (float, int) made once: a Python
// number costs each call a host-to-device transfer of its own (`a * 2.0` took 35 us where
// `a * b` took 21 here). dispatch.device_number makes them weakly typed, as jit makes a Python
// number, so the program is the same. Not while fused mode records: a graph packs its host
// numbers into one array (fusion._make_replay), and per-step values (a learning rate) would
// make a device scalar each. Dropped all at once past kDeviceNumbersKept values.
// A view's offset and a padded argument's n, which the program also takes as arguments (an
// np.int64 and a Python int, as the Python kernel passes them), are kept alike: a view of a weight
// (`w.t()` in every linear) read through its offset cost each call a transfer too.
enum NumberKind { kFloatNumber, kIntNumber, kInt64Number };
std::unordered_map<int64_t, PyObject*> device_numbers[3];  // [NumberKind][float bits or int] -> jax.Array
constexpr size_t kDeviceNumbersKept = 1024;

// A new reference: `value` as an np.int64 (a view's offset as the Python kernel passes it), or
// nullptr with an error.
PyObject* host_int64(int64_t value) {
  PyObject* number = PyLong_FromLongLong(value);
  PyObject* typed = number != nullptr ? PyObject_CallOneArg(config->int64_type, number) : nullptr;
  Py_XDECREF(number);
  return typed;
}

// A new reference: the device scalar of a float (`word`, its bits), an int (weakly typed) or an
// np.int64 (`word`); nullptr with an error.
PyObject* device_number(NumberKind kind, int64_t word) {
  auto& kept = device_numbers[kind];
  auto found = kept.find(word);
  if (found != kept.end()) {
    Py_INCREF(found->second);
    return found->second;
  }
  PyObject* number = nullptr;
  if (kind == kFloatNumber) {
    double value = 0;
    std::memcpy(&value, &word, sizeof value);
    number = PyFloat_FromDouble(value);
  } else {
    number = kind == kInt64Number ? host_int64(word) : PyLong_FromLongLong(word);
  }
  PyObject* scalar = number != nullptr ? PyObject_CallOneArg(config->device_number, number) : nullptr;
  Py_XDECREF(number);
  if (scalar == nullptr) return nullptr;
  if (kept.size() >= kDeviceNumbersKept) {
    for (auto& [_, held] : kept) Py_DECREF(held);
    kept.clear();
  }
  Py_INCREF(scalar);
  kept.emplace(word, scalar);
  return scalar;
}

bool number(const c10::IValue& v, std::vector<int64_t>& key, Arguments& dyn, bool on_device, bool wrapped = false) {
  if (v.isInt() && v.toInt() != 1) {
    key.push_back(kDynInt);
    return dyn.push(on_device ? device_number(kIntNumber, v.toInt()) : PyLong_FromLongLong(v.toInt()));
  }
  if (v.isDouble() && !(wrapped && v.toDouble() == 1.0)) {
    key.push_back(kDynFloat);
    return dyn.push(on_device ? device_number(kFloatNumber, bits_of(v.toDouble())) : PyFloat_FromDouble(v.toDouble()));
  }
  return (v.isNone() || v.isBool() || v.isInt() || v.isDouble()) && static_value(v, key);
}

bool static_value(const c10::IValue& v, std::vector<int64_t>& key) {
  if (v.isNone()) {
    key.push_back(kNone);
  } else if (v.isBool()) {
    key.push_back(kBool);
    key.push_back(v.toBool());
  } else if (v.isInt()) {
    key.push_back(kInt);
    key.push_back(v.toInt());
  } else if (v.isDouble()) {
    key.push_back(kFloat);
    key.push_back(bits_of(v.toDouble()));
  } else if (v.isIntList()) {
    auto list = v.toIntList();
    key.push_back(kIntList);
    key.push_back(static_cast<int64_t>(list.size()));
    for (int64_t x : list) key.push_back(x);
  } else if (v.isList()) {  // numbers (Scalar[], float[])
    auto list = v.toListRef();
    key.push_back(kList);
    key.push_back(static_cast<int64_t>(list.size()));
    for (const c10::IValue& x : list)
      if (x.isList() || !static_value(x, key)) return false;
  } else if (v.isString()) {
    const std::string& s = v.toStringRef();
    key.push_back(kString);
    key.push_back(static_cast<int64_t>(s.size()));
    for (size_t i = 0; i < s.size(); i += 8) {
      int64_t w = 0;
      std::memcpy(&w, s.data() + i, std::min<size_t>(8, s.size() - i));
      key.push_back(w);
    }
  } else {
    return false;
  }
  return true;
}

PyObject* to_python(const c10::Argument& arg, const c10::IValue& v) {
  if (v.isNone()) Py_RETURN_NONE;
  c10::TypePtr type = arg.real_type();
  if (auto optional = type->castRaw<c10::OptionalType>()) type = optional->getElementType();
  if (type->kind() == c10::ScalarTypeType::Kind) {
    PyObject* o = reinterpret_cast<PyObject*>(torch::getTHPDtype(v.toScalarType()));
    Py_INCREF(o);
    return o;
  }
  if (type->kind() == c10::LayoutType::Kind) {
    PyObject* o = reinterpret_cast<PyObject*>(torch::getTHPLayout(v.toLayout()));
    Py_INCREF(o);
    return o;
  }
  if (type->kind() == c10::MemoryFormatType::Kind) {
    PyObject* o = torch::utils::getTHPMemoryFormat(v.toMemoryFormat());
    Py_INCREF(o);
    return o;
  }
  return torch::jit::toPyObject(v).release().ptr();
}

// The Python kernel, called as the dispatcher calls a Python kernel: positional arguments,
// keyword-only ones by name, numbers wrapped as tensors (`x + 2`) as Python numbers.
std::vector<at::Tensor> call_python_kernel(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args,
                                           PyObject* python_kernel, int n_returns, bool inplace) {
  const auto& schema = op.schema();
  PyObject* positional = PyList_New(0);
  PyObject* keywords = PyDict_New();
  PyObject* result = nullptr;
  bool ok = positional != nullptr && keywords != nullptr;
  try {
    for (size_t i = 0; ok && i < args.size(); i++) {
      const c10::Argument& arg = schema.arguments()[i];
      PyObject* o = to_python(arg, args[i]);
      if (o == nullptr) {
        ok = false;
      } else if (arg.kwarg_only()) {
        ok = PyDict_SetItemString(keywords, arg.name().c_str(), o) == 0;
        Py_DECREF(o);
      } else {
        ok = PyList_Append(positional, o) == 0;
        Py_DECREF(o);
      }
    }
  } catch (py::error_already_set& e) {
    e.restore();
    ok = false;
  }
  if (ok) {
    PyObject* tuple = PyList_AsTuple(positional);
    if (tuple != nullptr) {
      result = PyObject_Call(python_kernel, tuple, keywords);
      Py_DECREF(tuple);
    }
  }
  Py_XDECREF(positional);
  Py_XDECREF(keywords);
  if (result == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "torchpjrt: converting an op's arguments failed");
    python_error err;
    err.persist();
    throw err;
  }
  // one tensor, a tuple of them (None for a result left out, as an output mask asks), a list
  // of them, or nothing (an in-place form: the written argument itself, not checked)
  std::vector<at::Tensor> out;
  bool single = n_returns == 1;
  Py_ssize_t n = single ? 1
                 : n_returns == 0 ? (result == Py_None ? 0 : -1)
                 : n_returns < 0 ? (PyList_Check(result) || PyTuple_Check(result) ? PySequence_Size(result) : -1)
                                  : (PyTuple_Check(result) ? PyTuple_GET_SIZE(result) : -1);
  ok = n >= 0 && (n_returns < 0 || n == static_cast<Py_ssize_t>(n_returns));
  if (inplace) {  // the written argument itself, as the op returns it: nothing to check
    Py_DECREF(result);
    return out;
  }
  for (Py_ssize_t i = 0; ok && i < n; i++) {
    PyObject* item = single ? result : PySequence_Fast_GET_ITEM(result, i);
    if (item == Py_None && !single) {
      out.emplace_back();
    } else if (THPVariable_Check(item)) {
      out.push_back(THPVariable_Unpack(item));
    } else {
      ok = false;
    }
  }
  Py_DECREF(result);
  if (!ok) {
    PyErr_Format(PyExc_TypeError, "torchpjrt: the kernel of %s did not return its %d tensors",
                 schema.name().c_str(), static_cast<int>(n_returns));
    python_error err;
    err.persist();
    throw err;
  }
  return out;
}

class HotKernel final : public c10::OperatorKernel {
 public:
  // codes: per schema argument, 't' tensor ('p' one that may be padded: padding.py's rule for
  // the op is keyed, so its storage's sizes key it, a result is marked with its n and an
  // argument the rule reads masked gets n beside it), 'l'
  // list of tensors ('a' cat's: an append to a
  // storage with a history of appends goes to the Python kernel, a first append's result is
  // marked as padding.py marks it, tensors padded alike keyed as 'p'; 'x' index's indices:
  // integer tensors, padded ones keyed as 'p', or None; a mask goes to the Python kernel),
  // 'n' number (traced unless
  // None/bool/1), 'c' and 'o' such a number that CPU converts with overflow checks to the
  // result's type ('c') or to the type it computes in ('o': float32 for float16 and bfloat16),
  // 'N' number the lowering wants static, 'f' list of numbers (traced; 'C', 'O' checked alike),
  // 's' static argument, 'w' a tensor a functional op also writes (batch norm's running
  // statistics): a whole storage or None, its new value after the results.
  // inplace: the op writes its first argument (a tensor, or each tensor of a list), the results
  // replacing those storages' arrays, and returns it (n_returns 1) or nothing (0).
  // n_returns: the tensors a functional op returns; -1: one list of tensors.
  // check_recorder: for an op whose lowering checks its data on the device (indices in range):
  // (vector) -> None, device_checks.record for this op; its program's last output is the
  // check's vector while `checks_on` (device_checks.enabled) is set. Else nullptr.
  HotKernel(const char* name, std::string codes, PyObject* python_kernel, bool inplace, int n_returns,
            PyObject* check_recorder, std::pair<PyObject*, PyObject*> checks_on)
      : name_(PyUnicode_FromString(name)), codes_(std::move(codes)), python_kernel_(python_kernel), inplace_(inplace),
        n_returns_(n_returns), check_recorder_(check_recorder), checks_on_(checks_on),
        checks_numbers_(codes_.find_first_of("coCO") != std::string::npos) {
    Py_INCREF(python_kernel_);
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    GilHeld gil;
    const size_t n = codes_.size();
    auto args = torch::jit::last(*stack, n);
    std::vector<int64_t> key;
    key.reserve(24);
    Arguments dyn;
    Arguments targets;  // an in-place op's storage objects of the tensors it writes
    std::vector<View> views;
    bool recording = is_set(config->records.first, config->records.second);
    // a checked op's program differs with the checks on or off (the Python kernel keys it so)
    bool checked = check_recorder_ != nullptr && is_set(checks_on_.first, checks_on_.second);
    if (check_recorder_ != nullptr) key.push_back(checked);
    int64_t append_mark = -1;
    int64_t padded_n = -1;
    bool masks_needed = false;
    bool keyed = budget.load(std::memory_order_relaxed) != 0 && !python_path_wanted() &&
                 make_key(args, key, dyn, targets, views, recording, append_mark, padded_n, masks_needed);
    if (keyed) {
      auto it = table_.find(key);
      if (it != table_.end() && numbers_fit(args, it->second) && with_offsets(it->second, dyn, views, !recording) &&
          with_masks(it->second, dyn, padded_n, !recording)) {
        std::vector<at::Tensor> results;
        bool done = inplace_ ? run_inplace(it->second, dyn, targets, recording, checked)
                             : run(it->second, dyn, targets, results, recording, checked, append_mark, padded_n);
        if (done) {
          calls.fetch_add(1, std::memory_order_relaxed);
          if (budget.load(std::memory_order_relaxed) > 0) budget.fetch_sub(1, std::memory_order_relaxed);
          push_results(stack, std::move(results));
          return;
        }
      }
    }
    if (keyed && PyObject_SetAttr(config->stash, config->name_last_call, Py_None) != 0) PyErr_Clear();
    std::vector<at::Tensor> out = call_python(op, args);
    if (keyed) learn(std::move(key), out, views, padded_n, masks_needed);
    push_results(stack, std::move(out));
  }

 private:
  // Whether the numbers CPU converts with overflow checks fit their types (c10's own check, as
  // CPU runs it); when one does not, the Python kernel raises CPU's error.
  bool numbers_fit(c10::ArrayRef<c10::IValue> args, const Entry& e) const {
    if (!checks_numbers_) return true;
    // the types the numbers go to: each result's (a foreach op's may differ), or each target's
    c10::SmallVector<c10::ScalarType, 4> types;
    auto add = [&types](c10::ScalarType t) {
      if (std::find(types.begin(), types.end(), t) == types.end()) types.push_back(t);
    };
    for (const Result& r : e.results)
      if (r.defined) add(r.dtype);
    if (e.results.empty()) {
      if (args[0].isTensor()) {
        add(args[0].toTensor().scalar_type());
      } else if (args[0].isTensorList()) {
        for (const at::Tensor& t : args[0].toTensorList().vec()) add(t.scalar_type());
      }
    }
    if (types.empty()) return false;
    for (size_t i = 0; i < codes_.size(); i++) {
      const char code = codes_[i];
      if (code != 'c' && code != 'o' && code != 'C' && code != 'O') continue;
      const bool computing = code == 'o' || code == 'O';
      c10::SmallVector<c10::Scalar, 8> numbers;
      if (args[i].isList()) {
        for (const c10::IValue& x : args[i].toListRef())
          if (x.isInt() || x.isDouble()) numbers.push_back(x.toScalar());
      } else if (args[i].isInt() || args[i].isDouble()) {  // None and bools fit
        numbers.push_back(args[i].toScalar());
      }
      for (c10::ScalarType type : types) {
        if (computing && (type == c10::ScalarType::Half || type == c10::ScalarType::BFloat16))
          type = c10::ScalarType::Float;
        for (const c10::Scalar& number : numbers) {
          try {
            AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(c10::ScalarType::Half, c10::ScalarType::BFloat16,
                                                   c10::ScalarType::Bool, type, "numbers_fit",
                                                   [&] { (void)number.to<scalar_t>(); });
          } catch (const c10::Error&) {
            return false;
          }
        }
      }
    }
    return true;
  }

  // The op's arguments replaced by its results on the stack: for an in-place form its first
  // argument (or nothing), for a functional op its tensors (or one list of them).
  void push_results(torch::jit::Stack* stack, std::vector<at::Tensor> results) {
    const size_t n = codes_.size();
    c10::IValue self = inplace_ && n_returns_ == 1 ? (*stack)[stack->size() - n] : c10::IValue();
    torch::jit::drop(*stack, n);
    if (inplace_) {
      if (n_returns_ == 1) stack->emplace_back(std::move(self));
    } else if (n_returns_ < 0) {
      stack->emplace_back(c10::List<at::Tensor>(results));
    } else {
      for (auto& t : results) stack->emplace_back(std::move(t));
    }
  }

  // A tensor argument's key words; false when the call cannot be keyed. With `padded_n` (code
  // 'p'), a padded storage's tensor is keyed by its storage's sizes and its padded dimension:
  // the op's rule runs the program of the whole storages whatever n, which must be the same for
  // every padded argument (`padded_n`: -1 until one is met).
  static bool tensor_key(const at::Tensor& t, Held& h, std::vector<int64_t>& key, bool recording,
                         int64_t* padded_n = nullptr) {
    if (!held(t, h, recording, padded_n != nullptr)) return false;
    key.push_back(kTensor);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(t.dim());
    if (h.padded_dim < 0) {
      for (int64_t s : t.sizes()) key.push_back(s);
      return true;
    }
    if (*padded_n >= 0 && *padded_n != h.padded_n) return false;  // padded apart: the Python kernel
    *padded_n = h.padded_n;
    for (int64_t d = 0; d < t.dim(); d++) key.push_back(d == h.padded_dim ? h.padded_bucket : t.size(d));
    key.push_back(kPadded);
    key.push_back(h.padded_dim);
    return true;
  }

  // A keyed tensor that is not its whole storage: all of it in another shape (the storage's shape
  // in the key), or a view, whose geometry over its storage (strides, offset, the storage's shape)
  // fixes the strided read compiled into the program; a view is listed in `views` with where its
  // array is among the program's arguments (`position`, and `element` of a list there, or -1).
  static void geometry_key(const at::Tensor& t, const Held& h, std::vector<int64_t>& key, std::vector<View>& views,
                           int position, int element) {
    if (h.whole) return;
    if (h.reshaped) {
      key.push_back(kReshaped);
      key.push_back(static_cast<int64_t>(h.storage_shape.size()));
      for (int64_t s : h.storage_shape) key.push_back(s);
      return;
    }
    key.push_back(kView);
    for (int64_t s : t.strides()) key.push_back(s);
    key.push_back(t.storage_offset());
    key.push_back(static_cast<int64_t>(h.storage_shape.size()));
    for (int64_t s : h.storage_shape) key.push_back(s);
    views.push_back(View{position, element, t.storage_offset(), t});
    if (h.padded_dim >= 0) {
      views.back().widened = t.sizes().vec();
      views.back().widened[h.padded_dim] = h.padded_bucket;
    }
  }

  // A list argument of `n` items: its length in the key, and a new list (borrowed: the last of
  // `dyn`) for their values; nullptr when it cannot be made.
  static PyObject* list_argument(size_t n, std::vector<int64_t>& key, Arguments& dyn) {
    key.push_back(kList);
    key.push_back(static_cast<int64_t>(n));
    PyObject* list = PyList_New(static_cast<Py_ssize_t>(n));
    if (!dyn.push(list)) {
      PyErr_Clear();
      return nullptr;
    }
    return list;
  }

  // Element j of a list argument (the last of `dyn`, a list): keyed as a tensor argument is, its
  // array put in the list; false when it cannot be keyed.
  static bool list_element(const at::Tensor& t, size_t j, Held& h, std::vector<int64_t>& key, Arguments& dyn,
                           std::vector<View>& views, bool recording, int64_t* padded_n = nullptr) {
    if (!tensor_key(t, h, key, recording, padded_n)) return false;
    geometry_key(t, h, key, views, dyn.size() - 1, static_cast<int>(j));
    Py_INCREF(h.array);
    PyList_SET_ITEM(dyn.items[dyn.size() - 1], static_cast<Py_ssize_t>(j), h.array);
    return true;
  }

  // Whether cat([x, y], dim) is one padding.py may turn into an append to a growing sequence
  // (padding._appended: every dimension of x before dim of size 1), which the Python kernel
  // decides: the same key can append or not, with the storage's history.
  static bool cat_may_append(const at::Tensor& x, const c10::IValue& dim_value) {
    const int64_t dim = cat_dim(x, dim_value);
    if (dim < 0) return true;
    for (int64_t k = 0; k < dim; k++)
      if (x.size(k) != 1) return false;
    return true;
  }

  // cat's dim over x, from 0; -1 when x or dim is not one cat accepts
  static int64_t cat_dim(const at::Tensor& x, const c10::IValue& dim_value) {
    if (!x.defined() || x.dim() == 0 || !dim_value.isInt()) return -1;
    int64_t dim = dim_value.toInt();
    if (dim < 0) dim += x.dim();
    return dim >= 0 && dim < x.dim() ? dim : -1;
  }

  // For such a cat of tensors the C++ kernel can key, with padding on: false when x's storage has
  // a history of appends (padding._appended may append to it: the Python kernel); else in
  // `mark` the dimension padding._appended would record on the exact result as a first append
  // (y of x's dtype and rank, not empty along it, every other size x's), or -1.
  static bool first_append(const at::Tensor& x, const at::Tensor& y, const c10::IValue& dim_value, PyObject* x_storage,
                           int64_t& mark) {
    PyObject* along = PyObject_GetAttr(x_storage, config->name_appended_along);
    if (along == nullptr) {
      PyErr_Clear();
      return false;
    }
    Py_DECREF(along);
    if (along != Py_None) return false;
    const int64_t d = cat_dim(x, dim_value);
    bool marks = y.scalar_type() == x.scalar_type() && y.dim() == x.dim() && y.size(d) != 0;
    for (int64_t k = 0; marks && k < x.dim(); k++) marks = k == d || x.size(k) == y.size(k);
    mark = marks ? d : -1;
    return true;
  }

  // `append_mark`: for a cat padding.py would record as a first append, the dimension its result
  // is marked with (Storage.appended_along); else left -1.
  // `padded_n`: the n of the padded storages among the arguments (code 'p'), or left -1.
  // `masks_needed`: an in-place form with padded arguments and an exact target, learned only
  // where its padding rule read them masked.
  bool make_key(c10::ArrayRef<c10::IValue> args, std::vector<int64_t>& key, Arguments& dyn, Arguments& targets,
                std::vector<View>& views, bool recording, int64_t& append_mark, int64_t& padded_n,
                bool& masks_needed) {
    bool target_padded = false;
    for (size_t i = 0; i < codes_.size(); i++) {
      const c10::IValue& v = args[i];
      switch (codes_[i]) {
        case 'w': {  // a tensor the op also writes: whole, its new value after the results
          if (v.isNone() || (v.isTensor() && !v.toTensor().defined())) {
            key.push_back(kNone);
            Py_INCREF(Py_None);
            if (!targets.push(Py_None)) return false;
            continue;
          }
          if (!v.isTensor()) return false;
          const at::Tensor& t = v.toTensor();
          Held h;
          if (!tensor_key(t, h, key, recording) || !h.whole) return false;
          Py_INCREF(h.storage);
          if (!targets.push(h.storage)) return false;
          Py_INCREF(h.array);
          if (!dyn.push(h.array)) return false;
          break;
        }
        case 't':
        case 'p': {  // 'p': a tensor that may be padded (its op's padding rule is keyed)
          if (v.isNone()) {
            key.push_back(kNone);
            continue;
          }
          if (!v.isTensor()) return false;
          const at::Tensor& t = v.toTensor();
          if (!t.defined()) {  // an optional tensor left out, as some callers pass it
            key.push_back(kNone);
            continue;
          }
          if (t.unsafeGetTensorImpl()->is_wrapped_number()) {
            // `x + 2`: the Python kernel sees a Python number; static when a bool or 1
            if (!number(c10::IValue(t.item()), key, dyn, !recording, /*wrapped=*/true)) return false;
            continue;
          }
          Held h;
          if (!tensor_key(t, h, key, recording, codes_[i] == 'p' ? &padded_n : nullptr)) return false;
          if (inplace_ && i == 0) {
            target_padded = h.padded_dim >= 0;
            // a view target: the Python kernel scatters into its storage; all of it in another
            // shape is written whole (storage.write: the storage takes the tensor's shape)
            if (!h.whole && !h.reshaped) return false;
            Py_INCREF(h.storage);
            if (!targets.push(h.storage)) return false;
          }
          Py_INCREF(h.array);
          if (!dyn.push(h.array)) return false;
          geometry_key(t, h, key, views, dyn.size() - 1, -1);
          break;
        }
        case 'l':
        case 'a': {  // views keyed by their geometry as arguments of their own are; 'a': cat's list
          if (!v.isTensorList()) return false;
          auto list = v.toTensorList();
          // with padding on, a cat that may append: keyed unless x has a history of appends (the
          // Python kernel), its result marked as padding._appended marks a first append
          const bool may_append = codes_[i] == 'a' && list.size() == 2 && cat_may_append(list.get(0), args[i + 1]);
          if (may_append && (config->appends.first == nullptr || cat_dim(list.get(0), args[i + 1]) < 0)) return false;
          const bool padding_on = may_append && is_set(config->appends.first, config->appends.second);
          if (list_argument(list.size(), key, dyn) == nullptr) return false;  // list_element fills it
          for (size_t j = 0; j < list.size(); j++) {
            at::Tensor t = list[j];
            Held h;  // a view: rotate_half's halves; cat's tensors padded alike (padding._cat)
            if (!t.defined() ||
                !list_element(t, j, h, key, dyn, views, recording, codes_[i] == 'a' ? &padded_n : nullptr))
              return false;
            // (a padded x is never a first append's: padding._appended leaves it unmarked)
            if (padding_on && j == 0 && h.padded_dim < 0 &&
                !first_append(t, list.get(1), args[i + 1], h.storage, append_mark))
              return false;
            if (inplace_ && i == 0) {
              if (!h.whole && !h.reshaped) return false;  // a view target: the Python kernel writes it
              // a tensor written twice: CPU applies the op to it twice, in turn (the Python kernel)
              for (PyObject* seen : targets.items)
                if (seen == h.storage) return false;
              Py_INCREF(h.storage);
              if (!targets.push(h.storage)) return false;
            }
          }
          break;
        }
        case 'x': {  // index's indices: integer tensors (views keyed as above) or None; a mask goes to Python
          if (!v.isList()) return false;
          auto list = v.toListRef();
          PyObject* arrays = list_argument(list.size(), key, dyn);
          if (arrays == nullptr) return false;
          for (size_t j = 0; j < list.size(); j++) {
            const c10::IValue& item = list[j];
            if (item.isNone() || (item.isTensor() && !item.toTensor().defined())) {
              key.push_back(kNone);
              Py_INCREF(Py_None);
              PyList_SET_ITEM(arrays, static_cast<Py_ssize_t>(j), Py_None);
              continue;
            }
            if (!item.isTensor()) return false;
            const at::Tensor& t = item.toTensor();
            if (t.scalar_type() == c10::ScalarType::Bool || t.scalar_type() == c10::ScalarType::Byte) return false;
            Held h;
            // padded indices (a routing's positions): keyed by B, as 'p' tensors are
            if (!list_element(t, j, h, key, dyn, views, recording, &padded_n)) return false;
          }
          break;
        }
        case 'f':
        case 'C':
        case 'O': {  // numbers, traced: their types in the key (as the Python kernel keys them)
          if (!v.isList()) return false;
          auto list = v.toListRef();
          PyObject* values = list_argument(list.size(), key, dyn);
          if (values == nullptr) return false;
          for (size_t j = 0; j < list.size(); j++) {
            const c10::IValue& x = list[j];
            PyObject* value = x.isDouble() ? PyFloat_FromDouble(x.toDouble())
                              : x.isBool() ? PyBool_FromLong(x.toBool())
                              : x.isInt()  ? PyLong_FromLongLong(x.toInt())
                                           : nullptr;
            if (value == nullptr) {
              PyErr_Clear();
              return false;
            }
            key.push_back(x.isDouble() ? kDynFloat : x.isBool() ? kBool : kDynInt);
            PyList_SET_ITEM(values, static_cast<Py_ssize_t>(j), value);
          }
          // as the Python kernel passes it: floats packed into one array (one transfer)
          PyObject* packed = PyObject_CallOneArg(config->pack_numbers, values);
          if (packed == nullptr) {
            PyErr_Clear();
            return false;
          }
          Py_DECREF(dyn.items.back());
          dyn.items.back() = packed;
          break;
        }
        case 'n':
        case 'c':
        case 'o':
          if (!number(v, key, dyn, !recording)) return false;
          break;
        case 'N':
        case 's':
          if (!static_value(v, key)) return false;
          break;
        default:
          return false;
      }
    }
    // padded arguments with an exact target: served only where the op's padding rule read them
    // masked (index_add_, an accumulating index_put_); otherwise CPU's broadcast of n positions,
    // which the Python kernel checks (learn)
    masks_needed = inplace_ && padded_n >= 0 && !target_padded;
    return true;
  }

  // The program called now, or recorded into fused mode's graph (fusion.record_keyed, as the
  // Python kernel records it): its results, a new reference, or nullptr.
  static PyObject* call(const Entry& e, Arguments& dyn, bool recording) {
    if (!recording) {
      // a kept program's loaded executable, without CachedKernel.__call__'s Python frames; one
      // not loaded (or released by live_programs) goes through __call__, which loads it, and an
      // argument the executable refuses makes the call fail here and the Python kernel run it
      PyObject* loaded = e.kept ? PyObject_GetAttr(e.program, config->name_call) : nullptr;
      if (loaded == nullptr) PyErr_Clear();
      PyObject* target = loaded != nullptr && loaded != Py_None ? loaded : e.program;
      PyObject* result = PyObject_Vectorcall(target, dyn.items.data(), dyn.size(), nullptr);
      Py_XDECREF(loaded);
      return result;
    }
    if (e.node != nullptr && config->graph.loaded()) {
      PyObject* pendings = record_node(e, dyn);
      if (pendings != nullptr || PyErr_Occurred()) return pendings;
    }
    PyObject* list = PyList_New(dyn.size());
    if (list == nullptr) return nullptr;
    for (int i = 0; i < dyn.size(); i++) {
      Py_INCREF(dyn.items[i]);
      PyList_SET_ITEM(list, i, dyn.items[i]);
    }
    const bool flat = e.node != nullptr && PyTuple_GET_ITEM(e.node, 3) == Py_True && PyTuple_GET_ITEM(e.node, 4) == Py_None;
    PyObject* add_node = flat ? PyDict_GetItemWithError(config->records.first, config->name_add_node)
                              : nullptr;  // borrowed
    PyObject* result = nullptr;
    if (add_node != nullptr) {
      PyObject* node_args[5] = {PyTuple_GET_ITEM(e.node, 0), e.program, PyTuple_GET_ITEM(e.node, 1), list,
                                PyTuple_GET_ITEM(e.node, 2)};
      PyObject* pendings = PyObject_Vectorcall(add_node, node_args, 5, nullptr);
      // as record_keyed returns them
      result = pendings != nullptr && PyList_CheckExact(pendings) ? PyList_AsTuple(pendings) : nullptr;
      Py_XDECREF(pendings);
    } else {
      if (PyErr_Occurred()) PyErr_Clear();
      result = PyObject_CallOneArg(e.recorder, list);
      if (result != nullptr && !e.node_looked_up) look_up_node(e);
    }
    Py_DECREF(list);
    return result;
  }

  // fusion._add_node's work, done here for a key whose node is known (e.node): the pending
  // graph gets the node, and the results' Pendings come back as a tuple (a new reference).
  // nullptr without an error set when _add_node must record it instead (the first node of an
  // autograd pass, which may flush the forward; a value of a graph that never ran; an argument of
  // a kind signature_of reads in Python), or with an error.
  static PyObject* record_node(const Entry& e, Arguments& dyn) {
    PyObject* fusion = config->records.first;
    c10::SmallVector<PyObject*, 16> leaves;  // borrowed
    PyObject* lock = PyDict_GetItemWithError(fusion, config->name_lock);  // borrowed
    PyObject* acquired = lock != nullptr ? PyObject_CallMethodNoArgs(lock, config->name_acquire) : nullptr;
    if (acquired == nullptr) return nullptr;
    Py_DECREF(acquired);
    bool full = false;
    PyObject* pendings = leaves_of(e, dyn, leaves) ? record_locked(e, leaves, full) : nullptr;
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyObject* released = PyObject_CallMethodNoArgs(lock, config->name_release);
    Py_XDECREF(released);
    if (released == nullptr) {
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(traceback);
      Py_XDECREF(pendings);
      return nullptr;
    }
    PyErr_Restore(type, value, traceback);
    if (full && pendings != nullptr) {  // as _add_node: the graph reached max_ops
      PyObject* flush = PyDict_GetItemWithError(fusion, config->name_flush);  // borrowed
      PyObject* none = flush != nullptr ? PyObject_CallOneArg(flush, config->flush_reason) : nullptr;
      if (none == nullptr) Py_CLEAR(pendings);
      Py_XDECREF(none);
    }
    PyObject* out_treedef = PyTuple_GET_ITEM(e.node, 4);
    if (pendings == nullptr || out_treedef == Py_None) return pendings;
    PyObject* structured = PyObject_CallMethodOneArg(out_treedef, config->name_unflatten, pendings);  // as record_keyed
    Py_DECREF(pendings);
    return structured;
  }

  // The call's arguments as jax.tree_util.tree_leaves sees them (borrowed, in `leaves`): the
  // program's arguments, or for a list op the items of its list arguments; false for any other
  // structure (left to record_keyed).
  static bool leaves_of(const Entry& e, Arguments& dyn, c10::SmallVector<PyObject*, 16>& leaves) {
    const bool flat = PyTuple_GET_ITEM(e.node, 3) == Py_True;
    for (PyObject* x : dyn.items) {
      if (flat) {
        leaves.push_back(x);
        continue;
      }
      if (x == Py_None || PyDict_Check(x)) return false;  // no leaves, or keyed ones
      if (!PyList_CheckExact(x) && !PyTuple_CheckExact(x)) {
        if (PyList_Check(x) || PyTuple_Check(x)) return false;  // a named tuple: a pytree of its own
        leaves.push_back(x);
        continue;
      }
      for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(x); i++) {
        PyObject* item = PySequence_Fast_GET_ITEM(x, i);
        if (item == Py_None || PyList_Check(item) || PyTuple_Check(item) || PyDict_Check(item)) return false;
        leaves.push_back(item);
      }
    }
    return true;
  }

  // signature_of(x) (a new reference) for an argument `signable` accepts: (shape, dtype,
  // weak_type) of a jax array, else the type of a number (its value is traced); nullptr for
  // another argument or with an error.
  static PyObject* signature(PyObject* x) {
    if (reinterpret_cast<PyObject*>(Py_TYPE(x)) == config->array_type) {
      PyObject* aval = PyObject_GetAttr(x, config->name_aval);
      if (aval == nullptr) return nullptr;
      PyObject* shape = PyObject_GetAttr(aval, config->name_shape);
      PyObject* dtype = PyObject_GetAttr(aval, config->name_dtype);
      PyObject* weak = PyObject_GetAttr(aval, config->name_weak_type);
      PyObject* sig = shape && dtype && weak ? PyTuple_Pack(3, shape, dtype, weak) : nullptr;
      Py_DECREF(aval);
      Py_XDECREF(shape);
      Py_XDECREF(dtype);
      Py_XDECREF(weak);
      return sig;
    }
    if (reinterpret_cast<PyObject*>(Py_TYPE(x)) == config->ndarray_type) {  // (shape, dtype, False)
      PyObject* shape = PyObject_GetAttr(x, config->name_shape);
      PyObject* dtype = PyObject_GetAttr(x, config->name_dtype);
      PyObject* sig = shape && dtype ? PyTuple_Pack(3, shape, dtype, Py_False) : nullptr;
      Py_XDECREF(shape);
      Py_XDECREF(dtype);
      return sig;
    }
    if (signable(x)) {
      Py_INCREF(Py_TYPE(x));
      return reinterpret_cast<PyObject*>(Py_TYPE(x));
    }
    return nullptr;
  }

  static bool signable(PyObject* x) {
    return reinterpret_cast<PyObject*>(Py_TYPE(x)) == config->array_type ||
           reinterpret_cast<PyObject*>(Py_TYPE(x)) == config->ndarray_type || PyFloat_CheckExact(x) ||
           PyLong_CheckExact(x) || PyBool_Check(x) || PyComplex_CheckExact(x) ||
           reinterpret_cast<PyObject*>(Py_TYPE(x)) == config->int64_type;
  }

  static PyObject* record_locked(const Entry& e, const c10::SmallVector<PyObject*, 16>& leaves, bool& full) {
    const int n_leaves = static_cast<int>(leaves.size());
    const Slots& G = config->graph;
    const Slots& P = config->pending;
    PyObject* g = PyDict_GetItemWithError(config->records.first, config->name_graph);
    PyObject* avals = PyTuple_GET_ITEM(e.node, 2);  // [(shape, dtype, weak_type)], from _output_avals
    if (g == nullptr || Py_TYPE(g) != G.type || !(PyList_CheckExact(avals) || PyTuple_CheckExact(avals))) return nullptr;
    Arguments graph_held;  // the graph, should a flush replace it meanwhile (a finalizer's read)
    Py_INCREF(g);
    graph_held.push(g);
    // the graph's own autograd pass, or _add_node (which flushes a forward a backward follows)
    PyObject* task = G.get(g, kTask);
    if (task == nullptr) return nullptr;
    const long long graph_task = PyLong_AsLongLong(task);
    Py_DECREF(task);
    if (graph_task != torch::autograd::get_current_graph_task_id()) return nullptr;
    // each argument: a value of this graph (its slot), or a computed one (the Pending's value)
    Arguments values;
    std::vector<long long> pending_slots(n_leaves, -1);
    for (int i = 0; i < n_leaves; i++) {
      PyObject* x = leaves[i];
      if (reinterpret_cast<PyObject*>(Py_TYPE(x)) == config->pending_type) {
        PyObject* value = P.get(x, kPendingValue);
        if (value == nullptr) return nullptr;
        if (value != Py_None) {
          values.push(value);
          if (!signable(value)) return nullptr;
          continue;
        }
        Py_DECREF(value);
        PyObject* graph = P.get(x, kPendingGraph);
        PyObject* slot = graph == g ? P.get(x, kPendingSlot) : nullptr;
        Py_XDECREF(graph);
        if (slot == nullptr) return nullptr;  // another graph's, never computed: _add_node says why
        pending_slots[i] = PyLong_AsLongLong(slot);
        Py_DECREF(slot);
        Py_INCREF(Py_None);
        values.push(Py_None);
        continue;
      }
      if (!signable(x)) return nullptr;  // signature_of reads it (a numpy array, another array type)
      Py_INCREF(x);
      values.push(x);
    }
    Arguments lists;  // nodes, runners, inputs, input_slots, input_sigs, input_ids, outputs
    for (int s = kNodes; s <= kOutputs; s++)
      if (!lists.push(G.get(g, s))) return nullptr;
    PyObject* input_ids = lists.items[kInputIds];
    PyObject* n_slots_object = G.get(g, kNSlots);
    if (n_slots_object == nullptr) return nullptr;
    long long n_slots = PyLong_AsLongLong(n_slots_object);
    Py_DECREF(n_slots_object);
    PyObject* refs = PyTuple_New(n_leaves);
    if (refs == nullptr) return nullptr;
    Arguments held_refs;
    held_refs.push(refs);
    for (int i = 0; i < n_leaves; i++) {
      long long slot = pending_slots[i];
      PyObject* x = values.items[i];
      if (slot < 0) {  // _Graph.input_slot: an array passed twice is one input
        const bool is_array = reinterpret_cast<PyObject*>(Py_TYPE(x)) == config->array_type;
        PyObject* id = is_array ? PyLong_FromVoidPtr(x) : nullptr;
        if (is_array && id == nullptr) return nullptr;
        PyObject* known = is_array ? PyDict_GetItemWithError(input_ids, id) : nullptr;  // borrowed
        if (known != nullptr) {
          slot = PyLong_AsLongLong(known);
        } else {
          PyObject* sig = PyErr_Occurred() ? nullptr : signature(x);
          if (sig == nullptr) {
            Py_XDECREF(id);
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "torchpjrt: no signature for a recorded input");
            return nullptr;
          }
          slot = n_slots++;
          PyObject* slot_object = PyLong_FromLongLong(slot);
          bool ok = slot_object != nullptr && PyList_Append(lists.items[kInputs], x) == 0 &&
                    PyList_Append(lists.items[kInputSlots], slot_object) == 0 &&
                    PyList_Append(lists.items[kInputSigs], sig) == 0 &&
                    (!is_array || PyDict_SetItem(input_ids, id, slot_object) == 0);
          Py_XDECREF(slot_object);
          Py_DECREF(sig);
          if (!ok) {
            Py_XDECREF(id);
            return nullptr;
          }
        }
        Py_XDECREF(id);
      }
      PyObject* slot_object = PyLong_FromLongLong(slot);
      if (slot_object == nullptr) return nullptr;
      PyTuple_SET_ITEM(refs, i, slot_object);
    }
    const Py_ssize_t n_out = PySequence_Fast_GET_SIZE(avals);
    const long long first = n_slots;
    Arguments made;  // first, the new n_slots, the node, then the Pendings
    if (!made.push(PyLong_FromLongLong(first)) || !made.push(PyLong_FromLongLong(n_slots + n_out)) ||
        !G.set(g, kNSlots, made.items[1]))
      return nullptr;
    if (!made.push(PyTuple_Pack(4, PyTuple_GET_ITEM(e.node, 0), PyTuple_GET_ITEM(e.node, 1), refs, made.items[0])) ||
        PyList_Append(lists.items[kNodes], made.items[2]) != 0 || PyList_Append(lists.items[kRunners], e.program) != 0)
      return nullptr;
    PyObject* out = PyTuple_New(n_out);
    if (out == nullptr) return nullptr;
    for (Py_ssize_t i = 0; i < n_out; i++) {
      PyObject* aval = PySequence_Fast_GET_ITEM(avals, i);  // (shape, dtype, weak_type)
      PyTypeObject* type = P.type;
      PyObject* p = type->tp_new(type, config->no_arguments, nullptr);  // Pending.__init__'s work below
      PyObject* slot = PyLong_FromLongLong(first + i);
      PyObject* ref = p != nullptr ? PyWeakref_NewRef(p, nullptr) : nullptr;
      bool ok = slot != nullptr && ref != nullptr && PyTuple_Check(aval) && PyTuple_GET_SIZE(aval) == 3 &&
                P.set(p, kPendingShape, PyTuple_GET_ITEM(aval, 0)) && P.set(p, kPendingDtype, PyTuple_GET_ITEM(aval, 1)) &&
                P.set(p, kPendingWeakType, PyTuple_GET_ITEM(aval, 2)) && P.set(p, kPendingGraph, g) &&
                P.set(p, kPendingSlot, slot) && P.set(p, kPendingValue, Py_None) &&
                PyList_Append(lists.items[kOutputs], ref) == 0;
      Py_XDECREF(slot);
      Py_XDECREF(ref);
      if (p != nullptr) PyTuple_SET_ITEM(out, i, p);
      if (!ok) {
        Py_DECREF(out);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "torchpjrt: a recorded op's result signature is malformed");
        return nullptr;
      }
    }
    PyObject* max_ops = PyDict_GetItemWithError(config->records.first, config->name_max_ops);  // borrowed
    full = max_ops != nullptr && PyList_GET_SIZE(lists.items[kNodes]) >= PyLong_AsLongLong(max_ops);
    if (PyErr_Occurred()) PyErr_Clear();
    return out;
  }

  // After a first record through `recorder` (functools.partial(record_keyed, avals_cache, key,
  // program)): its cache entry (traced, treedef, flat_in, out_treedef, avals, flat_out) for the key.
  static void look_up_node(const Entry& e) {
    e.node_looked_up = true;
    PyObject* args = PyObject_GetAttr(e.recorder, config->name_args);
    PyObject* entry = nullptr;
    if (args != nullptr && PyTuple_Check(args) && PyTuple_GET_SIZE(args) == 3 && PyDict_Check(PyTuple_GET_ITEM(args, 0)))
      entry = PyDict_GetItemWithError(PyTuple_GET_ITEM(args, 0), PyTuple_GET_ITEM(args, 1));  // borrowed
    if (entry != nullptr && PyTuple_Check(entry) && PyTuple_GET_SIZE(entry) == 6)
      e.node = PyTuple_Pack(5, PyTuple_GET_ITEM(entry, 0), PyTuple_GET_ITEM(entry, 1), PyTuple_GET_ITEM(entry, 4),
                            PyTuple_GET_ITEM(entry, 2) == Py_True ? Py_True : Py_False,
                            PyTuple_GET_ITEM(entry, 5) == Py_True ? Py_None : PyTuple_GET_ITEM(entry, 3));
    Py_XDECREF(args);
    if (PyErr_Occurred()) PyErr_Clear();
  }

  // The program's results as new pjrt tensors in `out`; false when anything is not as the
  // Python kernel left it (the Python kernel then runs the call and says why).
  bool run(const Entry& e, Arguments& dyn, Arguments& written, std::vector<at::Tensor>& out, bool recording,
           bool checked, int64_t append_mark, int64_t padded_n) {
    PyObject* result = call(e, dyn, recording);
    if (result == nullptr) {
      PyErr_Clear();
      return false;
    }
    if (checked && !record_check(result)) {
      Py_DECREF(result);
      return false;
    }
    // a list's arrays come as the program's outputs, or as one list among them
    PyObject* arrays = result;
    if (n_returns_ < 0 && PyTuple_Check(result) && PyTuple_GET_SIZE(result) >= 1 &&
        (PyList_Check(PyTuple_GET_ITEM(result, 0)) || PyTuple_Check(PyTuple_GET_ITEM(result, 0))))
      arrays = PyTuple_GET_ITEM(result, 0);
    PyObject* seq = PySequence_Fast(arrays, "results");
    bool ok = seq != nullptr && PySequence_Fast_GET_SIZE(seq) >= static_cast<Py_ssize_t>(e.results.size()) &&
              (n_returns_ >= 0 || PySequence_Fast_GET_SIZE(seq) == static_cast<Py_ssize_t>(e.results.size()));
    for (size_t i = 0; ok && i < e.results.size(); i++) {
      PyObject* item = PySequence_Fast_GET_ITEM(seq, i);
      if (!e.results[i].defined) {
        ok = item == Py_None;
        out.push_back(at::Tensor());
        continue;
      }
      at::Tensor t = wrap(item, e.results[i], recording, i == 0 ? append_mark : -1, padded_n);
      ok = t.defined();
      out.push_back(std::move(t));
    }
    // the arguments it writes ('w'): their new values follow the results, None for one left out
    ok = ok && (written.size() == 0 || PySequence_Fast_GET_SIZE(seq) ==
                                           static_cast<Py_ssize_t>(e.results.size()) + written.size());
    PyObject* expected = recording ? config->pending_type : config->array_type;
    for (int j = 0; ok && j < written.size(); j++) {
      PyObject* item = PySequence_Fast_GET_ITEM(seq, static_cast<Py_ssize_t>(e.results.size()) + j);
      ok = written.items[j] == Py_None ? item == Py_None : reinterpret_cast<PyObject*>(Py_TYPE(item)) == expected;
    }
    for (int j = 0; ok && j < written.size(); j++) {
      if (written.items[j] == Py_None) continue;
      PyObject* item = PySequence_Fast_GET_ITEM(seq, static_cast<Py_ssize_t>(e.results.size()) + j);
      ok = replace_array(written.items[j], item);
    }
    Py_XDECREF(seq);
    Py_DECREF(result);
    if (!ok) PyErr_Clear();
    return ok;
  }

  // A checked op's vector (its program's last output) handed to device_checks, as the Python
  // kernel hands it; the results before it are the op's.
  bool record_check(PyObject* result) const {
    if (!PyTuple_Check(result) || PyTuple_GET_SIZE(result) < 2) return false;
    PyObject* none = PyObject_CallOneArg(check_recorder_, PyTuple_GET_ITEM(result, PyTuple_GET_SIZE(result) - 1));
    if (none == nullptr) {
      PyErr_Clear();
      return false;
    }
    Py_DECREF(none);
    return true;
  }

  // The view arguments the program takes with their offset (storage.runtime_offset: an np.int64,
  // or its device scalar `on_device`), as tuples.
  static bool with_offsets(const Entry& e, Arguments& dyn, const std::vector<View>& views, bool on_device) {
    for (auto [position, element] : e.offset_positions) {
      const View* view = nullptr;
      for (const View& v : views)
        if (v.position == position && v.element == element) view = &v;
      if (view == nullptr) return false;
      PyObject* offset = on_device ? device_number(kInt64Number, view->offset) : host_int64(view->offset);
      if (!paired(dyn, position, element, offset)) return false;
    }
    return true;
  }

  // The padded arguments read masked as (argument, n), n the padded arguments' (a Python int, as
  // the Python kernel passes it, or its device scalar `on_device`), after with_offsets made a
  // view's argument (array, offset).
  static bool with_masks(const Entry& e, Arguments& dyn, int64_t padded_n, bool on_device) {
    if (e.masked_positions.empty()) return true;
    if (padded_n < 0) return false;
    for (auto [position, element] : e.masked_positions)
      if (!paired(dyn, position, element,
                  on_device ? device_number(kIntNumber, padded_n) : PyLong_FromLongLong(padded_n)))
        return false;
    return true;
  }

  // The program's argument at `position` (item `element` of the list there, or -1) replaced by
  // (that argument, `second`), a reference this call takes; false (no error set) when it cannot be.
  static bool paired(Arguments& dyn, int position, int element, PyObject* second) {
    PyObject* list = position < dyn.size() && element >= 0 ? dyn.items[position] : nullptr;
    const bool there = position < dyn.size() &&
                       (element < 0 || (PyList_CheckExact(list) && element < PyList_GET_SIZE(list)));
    PyObject* pair = there && second != nullptr
                         ? PyTuple_Pack(2, list != nullptr ? PyList_GET_ITEM(list, element) : dyn.items[position], second)
                         : nullptr;
    Py_XDECREF(second);
    if (pair == nullptr) {
      PyErr_Clear();
      return false;
    }
    if (list != nullptr) {
      PyList_SetItem(list, element, pair);  // takes `pair`, drops the item's reference
    } else {
      Py_DECREF(dyn.items[position]);
      dyn.items[position] = pair;
    }
    return true;
  }

  // The program's results given to `targets` (the written tensors' storage objects), one each
  // in order; false when anything is not as the Python kernel left it.
  bool run_inplace(const Entry& e, Arguments& dyn, Arguments& targets, bool recording, bool checked) {
    PyObject* result = call(e, dyn, recording);
    if (result == nullptr) {
      PyErr_Clear();
      return false;
    }
    if (checked && !(PyTuple_Check(result) && PyTuple_GET_SIZE(result) > targets.size() && record_check(result))) {
      Py_DECREF(result);
      return false;
    }
    PyObject* expected = recording ? config->pending_type : config->array_type;
    bool ok = PyTuple_Check(result) && PyTuple_GET_SIZE(result) >= targets.size();
    for (int i = 0; ok && i < targets.size(); i++)
      ok = reinterpret_cast<PyObject*>(Py_TYPE(PyTuple_GET_ITEM(result, i))) == expected;
    for (int i = 0; ok && i < targets.size(); i++) {
      ok = replace_array(targets.items[i], PyTuple_GET_ITEM(result, i));
    }
    Py_DECREF(result);
    if (!ok) PyErr_Clear();
    return ok;
  }

  // After a Python kernel call made with `key`: remember its program when it reported the call
  // as plain (new dense results of a functional kernel, row-major or laid out as CPU's; results
  // left out; whole-storage writes) and the results are as run() makes. With padded arguments
  // (`padded_n` >= 0) only when the op's padding rule ran: the program took the whole storages,
  // widened or read masked (n then its argument: take_entry's masked positions), and each result
  // is padded with that n (the rule marked it) or, where it read masked, an exact one.
  void learn(std::vector<int64_t> key, const std::vector<at::Tensor>& out, const std::vector<View>& views,
             int64_t padded_n, bool masks_needed) {
    PyObject* view_tensors = PyTuple_New(static_cast<Py_ssize_t>(views.size()));
    if (view_tensors == nullptr) {
      PyErr_Clear();
      return;
    }
    for (size_t j = 0; j < views.size(); j++) {
      const View& v = views[j];
      // a padded view as its op's rule widened it
      PyTuple_SET_ITEM(view_tensors, j,
                       THPVariable_Wrap(v.widened.empty() ? v.tensor
                                                          : v.tensor.as_strided(v.widened, v.tensor.strides(), v.offset)));
    }
    PyObject* found = name_ != nullptr ? PyObject_CallFunctionObjArgs(config->take_entry, name_, view_tensors, nullptr)
                                       : nullptr;
    Py_DECREF(view_tensors);
    if (found == nullptr) {
      PyErr_Clear();
      return;
    }
    // (program, per view: whether it was passed with its offset, recorder, the (position,
    // element) of each argument read masked), or None
    std::vector<std::pair<int, int>> offset_positions;
    std::vector<std::pair<int, int>> masked_positions;
    PyObject* program = Py_None;
    PyObject* recorder = Py_None;
    if (found != Py_None) {
      const bool shaped = PyTuple_Check(found) && PyTuple_GET_SIZE(found) == 4;
      PyObject* forms = shaped ? PyTuple_GET_ITEM(found, 1) : nullptr;
      PyObject* masked = shaped ? PyTuple_GET_ITEM(found, 3) : nullptr;
      bool ok = forms != nullptr && PyTuple_Check(forms) &&
                PyTuple_GET_SIZE(forms) == static_cast<Py_ssize_t>(views.size()) && PyTuple_Check(masked);
      for (Py_ssize_t j = 0; ok && j < PyTuple_GET_SIZE(masked); j++) {
        PyObject* at = PyTuple_GET_ITEM(masked, j);
        ok = PyTuple_Check(at) && PyTuple_GET_SIZE(at) == 2;
        if (ok)
          masked_positions.emplace_back(static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(at, 0))),
                                        static_cast<int>(PyLong_AsLong(PyTuple_GET_ITEM(at, 1))));
      }
      if (!ok || PyErr_Occurred()) {
        PyErr_Clear();
        Py_DECREF(found);
        return;
      }
      for (size_t j = 0; j < views.size(); j++)
        if (PyTuple_GET_ITEM(forms, j) == Py_True) offset_positions.emplace_back(views[j].position, views[j].element);
      program = PyTuple_GET_ITEM(found, 0);
      recorder = PyTuple_GET_ITEM(found, 2);
    }
    // masked reads take n as an argument: only with padded arguments (whose n run() passes)
    const bool masked = !masked_positions.empty();
    if ((masked && padded_n < 0) || (masks_needed && !masked)) program = Py_None;
    Py_INCREF(program);
    Py_INCREF(recorder);
    Py_DECREF(found);
    const bool kept = program != Py_None && PyObject_HasAttr(program, config->name_call) &&
                      PyObject_HasAttr(program, config->name_traceable);
    if (program != Py_None && inplace_) {  // the result is the written argument: nothing to make
      Entry e{program, recorder, std::move(offset_positions), {}, kept};
      e.masked_positions = std::move(masked_positions);
      table_.emplace(std::move(key), std::move(e));
      return;
    }
    std::vector<Result> results;
    bool plain = program != Py_None;
    for (const at::Tensor& t : out) {
      Result r;
      if (padded_n >= 0 && plain && padded_result(t, padded_n, r)) {
        results.push_back(r);
        continue;
      }
      // with padded arguments, a result that is not padded only where the rule read them
      // masked (a contraction or sum over the padded dimension, a scatter of padded values)
      if (padded_n >= 0 && !masked) plain = false;
      if (plain && !t.defined() && n_returns_ > 0) {  // a result left out (an output mask's)
        Py_INCREF(Py_None);
        results.push_back(Result{c10::ScalarType::Undefined, Py_None, {}, 0, {}, false});
        continue;
      }
      // a new dense tensor over all of a new storage: row-major, or laid out in CPU's order
      plain = plain && t.defined() && t.device().type() == c10::DeviceType::PrivateUse1 && t.device().index() <= 0 &&
              t.is_non_overlapping_and_dense() && t.storage_offset() == 0 &&
              t.storage().nbytes() == static_cast<size_t>(t.numel()) * t.element_size();
      if (!plain) break;
      PyObject* dtype_object = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
      Py_INCREF(dtype_object);
      PyObject* shape = storage_shape(t);
      results.push_back(Result{t.scalar_type(), dtype_object, t.sizes().vec(),
                               static_cast<int64_t>(t.numel()) * static_cast<int64_t>(t.element_size()),
                               t.is_contiguous() ? std::vector<int64_t>() : t.strides().vec(), true, shape});
    }
    if (!plain) {
      Py_DECREF(program);
      Py_DECREF(recorder);
      for (auto& r : results) {
        Py_DECREF(r.dtype_object);
        Py_XDECREF(r.shape);
      }
      return;
    }
    Entry e{program, recorder, std::move(offset_positions), std::move(results), kept};
    e.masked_positions = std::move(masked_positions);
    table_.emplace(std::move(key), std::move(e));
  }

  // A result of the padding rule: the first n positions of a new padded storage along one
  // dimension (as padding._mark leaves it), described in `r` as run() makes it.
  static bool padded_result(const at::Tensor& t, int64_t n, Result& r) {
    if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1 || t.device().index() > 0) return false;
    PyObject* st = storage_object(t);
    PyObject* padding = st != nullptr ? storage_attr(st, kPadding, config->name_padding) : nullptr;
    PyObject* shape = st != nullptr ? storage_attr(st, kShape, config->name_shape) : nullptr;
    Held h;
    std::vector<int64_t> pad, storage_sizes;
    bool ok = int_tuple(padding, pad) && pad.size() == 3 && shape != nullptr && PyTuple_CheckExact(shape) &&
              int_tuple(shape, storage_sizes);
    Py_XDECREF(padding);
    Py_XDECREF(st);
    if (PyErr_Occurred()) PyErr_Clear();
    // row-major over the whole storage: the strides run() gives the result (n along the padded dimension)
    std::vector<int64_t> strides(storage_sizes.size());
    int64_t numel = 1;
    for (int64_t d = static_cast<int64_t>(storage_sizes.size()) - 1; d >= 0; d--) {
      strides[d] = numel;
      numel *= storage_sizes[d];
    }
    ok = ok && pad[0] == n && padded_tensor(t, storage_sizes, pad[0], pad[1], pad[2], h) && h.whole &&
         t.storage().nbytes() == static_cast<size_t>(numel) * t.element_size();
    if (!ok) {
      Py_XDECREF(shape);
      return false;
    }
    PyObject* dtype_object = reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type()));
    Py_INCREF(dtype_object);
    r = Result{t.scalar_type(), dtype_object, storage_sizes, numel * static_cast<int64_t>(t.element_size()),
               std::move(strides), true, shape, h.padded_dim};
    return true;
  }

  std::vector<at::Tensor> call_python(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> args) {
    return call_python_kernel(op, args, python_kernel_, n_returns_, inplace_);
  }

  PyObject* name_;  // "add.Tensor": the stash must name this op
  std::string codes_;
  PyObject* check_recorder_;
  std::pair<PyObject*, PyObject*> checks_on_;
  bool checks_numbers_;  // a 'c', 'o', 'C' or 'O' among the codes
  PyObject* python_kernel_;
  bool inplace_;
  int n_returns_;  // tensors the op returns
  std::unordered_map<std::vector<int64_t>, Entry, KeyHash> table_;  // touched with the GIL held
};


// Factories and constant fills: torch.empty, and through it torch.zeros, ones, full, ones_like and
// autograd's seed gradient (each an empty tensor, then fill_ or zero_ of its whole storage), which
// would otherwise each call a Python kernel. Results are the Python kernels': a new empty tensor's
// storage object holds no array yet (storage.empty), and a fill of a whole small storage gets the
// same shared array the Python kernel gave it (storage.filled, storage.zeros: one array per shape,
// dtype and number, learned from the Python kernel's first call through `stash.last_fill`).
// empty_like goes to PyTorch's own composite kernel (so to the empty kernel here) unless its
// tensor's storage is padded: padding.empty_like pads a padded tensor's result alike. None of them runs a
// program, so they are not counted against a flush-heavy region (`calls`, `budget`).
class FactoryKernel final : public c10::OperatorKernel {
 public:
  // kShared: an op without tensor arguments whose result the Python kernel keeps and hands to
  // every call with the same arguments (storage.shared_result: arange, linspace, eye, ...)
  enum Kind { kEmpty = 0, kEmptyStrided = 1, kEmptyLike = 2, kFill = 3, kZero = 4, kShared = 5 };

  // flag: (module dict, name): for the empty kinds storage's `_capacity` (a larger tensor goes to
  // the Python kernel, which checks it against the device), for empty_like padding's `live`
  FactoryKernel(Kind kind, PyObject* python_kernel, std::pair<PyObject*, PyObject*> flag)
      : kind_(kind), python_kernel_(python_kernel), flag_(flag) {
    Py_INCREF(python_kernel_);
  }

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
    const size_t n = op.schema().arguments().size();
    if (kind_ == kEmptyLike) {
      bool python;
      {
        GilHeld gil;
        // while padded storages are alive, only a padded tensor's result is padded alike
        python = python_path_wanted() ||
                 (is_set(flag_.first, flag_.second) && may_be_padded(torch::jit::peek(*stack, 0, n)));
      }
      if (!python) {
        op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CompositeExplicitAutograd), stack);
        return;
      }
    }
    GilHeld gil;
    auto args = torch::jit::last(*stack, n);
    const bool fill = kind_ == kFill || kind_ == kZero;
    std::vector<int64_t> key;
    PyObject* st = nullptr;  // a fill's storage object
    bool keyed = false;
    if (kind_ != kEmptyLike && !python_path_wanted()) {
      if (kind_ == kShared) {
        keyed = shared_key(args, key);
        auto it = keyed ? shared_.find(key) : shared_.end();
        if (it != shared_.end()) {
          at::Tensor t = wrap(it->second.array, it->second.result, false);
          if (t.defined()) {
            torch::jit::drop(*stack, n);
            stack->emplace_back(std::move(t));
            return;
          }
        }
      } else if (fill) {
        keyed = fill_key(args, key, st);
        if (keyed) {
          auto it = fills_.find(key);
          if (it != fills_.end()) {
            PyObject* array = it->second;
            Py_INCREF(array);  // another thread may drop the table's reference while replace() runs
            const bool replaced = replace_array(st, array);
            Py_DECREF(array);
            if (replaced) {
              Py_DECREF(st);
              c10::IValue self = args[0];
              torch::jit::drop(*stack, n);
              stack->emplace_back(std::move(self));
              return;
            }
            PyErr_Clear();
          }
        }
      } else {
        at::Tensor t = empty(args);
        if (t.defined()) {
          torch::jit::drop(*stack, n);
          stack->emplace_back(std::move(t));
          return;
        }
      }
    }
    PyObject* learned_from = kind_ == kShared ? config->name_last_shared : config->name_last_fill;
    if (keyed && PyObject_SetAttr(config->stash, learned_from, Py_None) != 0) PyErr_Clear();
    std::vector<at::Tensor> out;
    try {
      out = call_python_kernel(op, args, python_kernel_, 1, fill);
    } catch (...) {
      Py_XDECREF(st);
      throw;
    }
    if (kind_ == kShared) {
      if (keyed && out.size() == 1) learn_shared(std::move(key), out[0]);
      torch::jit::drop(*stack, n);
      for (auto& t : out) stack->emplace_back(std::move(t));
      return;
    }
    if (keyed) {
      learn_fill(std::move(key));
      Py_DECREF(st);
    }
    if (fill) {
      c10::IValue self = args[0];
      torch::jit::drop(*stack, n);
      stack->emplace_back(std::move(self));
      return;
    }
    if (out.size() == 1 && out[0].defined()) {  // the Python kernel took this dtype
      int d = static_cast<int>(out[0].scalar_type());
      if (d >= 0 && d < static_cast<int>(known_dtypes_.size())) known_dtypes_[d] = true;
    }
    torch::jit::drop(*stack, n);
    for (auto& t : out) stack->emplace_back(std::move(t));
  }

 private:
  // empty.memory_format(size, dtype, layout, device, pin_memory, memory_format) or
  // empty_strided(size, stride, dtype, layout, device, pin_memory) on pjrt:0, dense and
  // row-major, of a dtype the Python kernel has made a tensor of: the new tensor; else undefined.
  at::Tensor empty(c10::ArrayRef<c10::IValue> args) {
    const size_t o = kind_ == kEmptyStrided ? 1 : 0;
    if (!args[0].isIntList()) return {};
    std::vector<int64_t> sizes = args[0].toIntVector();
    c10::ScalarType dtype = args[o + 1].isNone() ? c10::typeMetaToScalarType(c10::get_default_dtype())
                                                 : args[o + 1].toScalarType();
    const int d = static_cast<int>(dtype);
    if (d < 0 || d >= static_cast<int>(known_dtypes_.size()) || !known_dtypes_[d]) return {};
    if (!args[o + 2].isNone() && args[o + 2].toLayout() != c10::kStrided) return {};
    if (!args[o + 3].isNone()) {
      c10::Device device = args[o + 3].toDevice();
      if (device.type() != c10::DeviceType::PrivateUse1 || device.index() > 0) return {};
    }
    if (!args[o + 4].isNone() && args[o + 4].toBool()) return {};
    if (kind_ == kEmpty && !args[5].isNone()) {
      c10::MemoryFormat format = args[5].toMemoryFormat();
      if (format != c10::MemoryFormat::Contiguous && format != c10::MemoryFormat::Preserve) return {};
    }
    int64_t numel = 1;
    for (int64_t s : sizes)
      if (s < 0 || c10::mul_overflows(numel, s, &numel)) return {};
    if (kind_ == kEmptyStrided) {  // only row-major strides (storage.contiguous_strides)
      if (!args[1].isIntList()) return {};
      std::vector<int64_t> strides = args[1].toIntVector();
      if (strides.size() != sizes.size()) return {};
      int64_t expected = 1;
      for (size_t i = sizes.size(); i-- > 0;) {
        if (strides[i] != expected) return {};
        expected *= std::max<int64_t>(sizes[i], 1);
      }
    }
    int64_t nbytes = 0;
    if (c10::mul_overflows(numel, static_cast<int64_t>(c10::elementSize(dtype)), &nbytes)) return {};
    PyObject* capacity = PyDict_GetItemWithError(flag_.first, flag_.second);  // borrowed
    if (capacity == nullptr || !PyLong_CheckExact(capacity)) {
      PyErr_Clear();
      return {};
    }
    if (nbytes > PyLong_AsLongLong(capacity)) return {};
    PyObject* shape = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
    for (size_t i = 0; shape != nullptr && i < sizes.size(); i++) {
      PyObject* s = PyLong_FromLongLong(sizes[i]);
      if (s == nullptr) {
        Py_CLEAR(shape);
        break;
      }
      PyTuple_SET_ITEM(shape, static_cast<Py_ssize_t>(i), s);
    }
    if (shape == nullptr) {
      PyErr_Clear();
      return {};
    }
    PyObject* new_args[3] = {Py_None, reinterpret_cast<PyObject*>(torch::getTHPDtype(dtype)), shape};
    PyObject* st = PyObject_Vectorcall(config->storage_class, new_args, 3, nullptr);  // Storage(None, dtype, shape)
    Py_DECREF(shape);
    if (st == nullptr) {
      PyErr_Clear();
      return {};
    }
    return new_tensor(st, dtype, sizes, {}, nbytes);
  }

  // The key of zero_() or fill_(number) of a whole storage on pjrt:0 (its dtype, its sizes, the
  // number's type and bits) and the storage object (a new reference in `st`); false otherwise. A
  // padded storage's tensor that is all of it but the positions from n on (padding.py) is keyed
  // by the storage's sizes: its rule fills the whole storage, with the same shared array.
  bool fill_key(c10::ArrayRef<c10::IValue> args, std::vector<int64_t>& key, PyObject*& st) {
    if (!args[0].isTensor()) return false;
    const at::Tensor& t = args[0].toTensor();
    // a view from an offset is neither a whole storage nor all of a padded one: no storage lookups
    if (!t.defined() || t.device().type() != c10::DeviceType::PrivateUse1 || t.device().index() > 0 ||
        t.storage_offset() != 0 || (kind_ == kFill && args[1].isNone()))
      return false;
    PyObject* storage = storage_object(t);
    if (storage == nullptr) return false;
    // the whole storage of the tensor's dtype (storage.is_identity), or all of a padded one
    PyObject* shape = storage_attr(storage, kShape, config->name_shape);
    PyObject* dtype = storage_attr(storage, kDtype, config->name_dtype);
    PyObject* padding = storage_attr(storage, kPadding, config->name_padding);
    std::vector<int64_t> sizes, pad;
    bool ok = dtype != nullptr && padding != nullptr &&
              dtype == reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())) && int_tuple(shape, sizes);
    if (ok && padding == Py_None) {
      ok = t.storage_offset() == 0 && t.is_contiguous() && t.sizes().equals(sizes);
    } else if (ok) {
      Held h;
      ok = int_tuple(padding, pad) && pad.size() == 3 && padded_tensor(t, sizes, pad[0], pad[1], pad[2], h) && h.whole;
    }
    Py_XDECREF(shape);
    Py_XDECREF(dtype);
    Py_XDECREF(padding);
    key.push_back(static_cast<int64_t>(t.scalar_type()));
    key.push_back(static_cast<int64_t>(sizes.size()));
    for (int64_t s : sizes) key.push_back(s);
    // the number with its type (a bool, an int, a float's bits; complex: the Python kernel)
    if (ok && kind_ == kFill) ok = static_value(args[1], key);
    if (!ok) {
      PyErr_Clear();
      Py_DECREF(storage);
      return false;
    }
    st = storage;
    return true;
  }

  // After the Python kernel's fill: the shared array it gave the storage, for this key.
  void learn_fill(std::vector<int64_t> key) {
    PyObject* array = PyObject_GetAttr(config->stash, config->name_last_fill);
    if (array == nullptr) {
      PyErr_Clear();
      return;
    }
    if (reinterpret_cast<PyObject*>(Py_TYPE(array)) != config->array_type) {
      Py_DECREF(array);
      return;
    }
    if (fills_.size() >= kFillsKept) {  // small arrays, but not without bound
      for (auto& [k, a] : fills_) Py_DECREF(a);
      fills_.clear();
    }
    auto [it, inserted] = fills_.emplace(std::move(key), array);
    if (!inserted) Py_DECREF(array);
  }

  // A shared result's key: every argument (numbers with their types, dtype, layout, pin_memory)
  // and the default dtype (arange(5.0)'s dtype); a device other than pjrt:0 goes to the Python kernel.
  static bool shared_key(c10::ArrayRef<c10::IValue> args, std::vector<int64_t>& key) {
    key.push_back(static_cast<int64_t>(c10::typeMetaToScalarType(c10::get_default_dtype())));
    for (const c10::IValue& v : args) {
      if (v.isDevice()) {
        c10::Device device = v.toDevice();
        if (device.type() != c10::DeviceType::PrivateUse1 || device.index() > 0) return false;
        key.push_back(kNone);  // pjrt, pjrt:0
      } else if (!static_value(v, key)) {
        return false;
      }
    }
    return true;
  }

  struct Shared {
    PyObject* array;  // the kept result (storage.shared_result's)
    Result result;    // the tensor made over it, as the Python kernel's call made it
  };

  // After the Python kernel's call: the result it kept (stash.last_shared, set only when kept),
  // when `out` is a dense row-major tensor over exactly that array.
  void learn_shared(std::vector<int64_t> key, const at::Tensor& out) {
    PyObject* array = PyObject_GetAttr(config->stash, config->name_last_shared);
    if (array == nullptr) {
      PyErr_Clear();
      return;
    }
    Held h;
    bool ok = reinterpret_cast<PyObject*>(Py_TYPE(array)) == config->array_type && out.defined() &&
              held(out, h, false) && h.whole && h.array == array;
    PyObject* shape = ok ? storage_shape(out) : nullptr;
    if (shape == nullptr) {
      Py_DECREF(array);
      return;
    }
    if (shared_.size() >= kFillsKept) {  // small arrays, but not without bound
      for (auto& [k, e] : shared_) release(e);
      shared_.clear();
    }
    PyObject* dtype_object = reinterpret_cast<PyObject*>(torch::getTHPDtype(out.scalar_type()));
    Py_INCREF(dtype_object);
    Shared e{array, Result{out.scalar_type(), dtype_object, out.sizes().vec(),
                           static_cast<int64_t>(out.storage().nbytes()), {}, true, shape}};
    if (!shared_.emplace(std::move(key), e).second) release(e);
  }

  static void release(Shared& e) {
    Py_DECREF(e.array);
    Py_DECREF(e.result.dtype_object);
    Py_DECREF(e.result.shape);
  }

  static constexpr size_t kFillsKept = 256;
  Kind kind_;
  PyObject* python_kernel_;
  std::pair<PyObject*, PyObject*> flag_;
  std::array<bool, 64> known_dtypes_{};  // dtypes the Python kernel made an empty tensor of
  std::unordered_map<std::vector<int64_t>, PyObject*, KeyHash> fills_;  // touched with the GIL held
  std::unordered_map<std::vector<int64_t>, Shared, KeyHash> shared_;    // likewise
};

}  // namespace

extern "C" {

// storage_class, array_type, stash, take_entry: see Config; off_when: a list of
// (module, attribute name) pairs, any of them true sends every call to the Python kernel;
// model: a pjrt tensor as the Python backend makes them (its storage's allocator is taken);
// int64_type, pending_type: see Config; records: (module, attribute name), true while fused
// mode records ops (served by recording them); appends: (module, attribute name), true while
// padding.py marks cat's first appends; mark_padded, ndarray_type, pack_numbers, device_number: see Config.
// Returns 0, or -1 with a Python error set.
int torchpjrt_hot_configure(PyObject* storage_class, PyObject* array_type, PyObject* stash,
                            PyObject* take_entry, PyObject* off_when, PyObject* model, PyObject* int64_type,
                            PyObject* pending_type, PyObject* records, PyObject* appends, PyObject* mark_padded,
                            PyObject* ndarray_type, PyObject* pack_numbers, PyObject* device_number) {
  if (!THPVariable_Check(model)) {
    PyErr_SetString(PyExc_TypeError, "model must be a tensor");
    return -1;
  }
  auto c = std::make_unique<Config>();
  c->allocator = THPVariable_Unpack(model).storage().allocator();
  c->storage_class = storage_class;
  c->array_type = array_type;
  c->stash = stash;
  c->take_entry = take_entry;
  c->int64_type = int64_type;
  c->pending_type = pending_type;
  Py_INCREF(int64_type);
  Py_INCREF(pending_type);
  for (auto [flag, into] : {std::pair{records, &c->records}, std::pair{appends, &c->appends}}) {
    PyObject* module = nullptr;
    PyObject* name = nullptr;
    if (!PyArg_ParseTuple(flag, "OU", &module, &name)) return -1;
    PyObject* dict = PyObject_GenericGetDict(module, nullptr);
    if (dict == nullptr) return -1;
    Py_INCREF(name);
    *into = {dict, name};
  }
  c->mark_padded = mark_padded;
  c->ndarray_type = ndarray_type;
  c->pack_numbers = pack_numbers;
  c->device_number = device_number;
  for (PyObject* o : {storage_class, array_type, stash, take_entry, mark_padded, ndarray_type, pack_numbers, device_number})
    Py_INCREF(o);
  PyObject* seq = PySequence_Fast(off_when, "off_when must be a sequence");
  if (seq == nullptr) return -1;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(seq); i++) {
    PyObject* module = nullptr;
    PyObject* name = nullptr;
    if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "OU", &module, &name)) {
      Py_DECREF(seq);
      return -1;
    }
    PyObject* dict = PyObject_GenericGetDict(module, nullptr);
    if (dict == nullptr) {
      Py_DECREF(seq);
      return -1;
    }
    Py_INCREF(name);
    c->off_when.emplace_back(dict, name);
  }
  Py_DECREF(seq);
  c->name_pjrt = PyUnicode_InternFromString("_pjrt");
  c->name_array = PyUnicode_InternFromString("array");
  c->name_padding = PyUnicode_InternFromString("padding");
  c->name_shape = PyUnicode_InternFromString("shape");
  c->name_dtype = PyUnicode_InternFromString("dtype");
  c->name_last_call = PyUnicode_InternFromString("last_call");
  c->name_last_fill = PyUnicode_InternFromString("last_fill");
  c->name_last_shared = PyUnicode_InternFromString("last_shared");
  c->name_appended_along = PyUnicode_InternFromString("appended_along");
  c->name_replace = PyUnicode_InternFromString("replace");
  c->name_value = PyUnicode_InternFromString("value");
  c->name_call = PyUnicode_InternFromString("_call");
  c->name_add_node = PyUnicode_InternFromString("_add_node");
  c->name_args = PyUnicode_InternFromString("args");
  c->name_traceable = PyUnicode_InternFromString("traceable");
  c->name_graph = PyUnicode_InternFromString("_graph");
  c->name_lock = PyUnicode_InternFromString("_lock");
  c->name_max_ops = PyUnicode_InternFromString("max_ops");
  c->name_flush = PyUnicode_InternFromString("flush");
  c->name_acquire = PyUnicode_InternFromString("acquire");
  c->name_release = PyUnicode_InternFromString("release");
  c->name_aval = PyUnicode_InternFromString("aval");
  c->name_weak_type = PyUnicode_InternFromString("weak_type");
  c->name_unflatten = PyUnicode_InternFromString("unflatten");
  c->flush_reason = PyUnicode_InternFromString("max_ops");
  c->no_arguments = PyTuple_New(0);
  PyObject* graph_class = PyDict_GetItemString(c->records.first, "_Graph");  // borrowed
  if (!(c->pending.load(pending_type, {"shape", "dtype", "weak_type", "graph", "slot", "value"}) &&
        c->graph.load(graph_class, {"nodes", "runners", "inputs", "input_slots", "input_sigs", "input_ids", "outputs",
                                    "n_slots", "task", "serial", "storages"})))
    c->graph.reset();  // records go through fusion._add_node
  if (!c->graph.loaded() || !c->storage.load(storage_class, {"array", "shape", "dtype", "version", "views", "raw", "device",
                                                             "padding", "appended_along", "tracked_in"}))
    c->storage.reset();
  c->zero = PyLong_FromLong(0);
  config = c.release();
  return 0;
}

// Register the hot kernel for aten::`name` ("add.Tensor") at PrivateUse1, with `python_kernel`
// for every call it does not serve; `inplace`: see HotKernel; n_returns: the op's tensors returned. Returns 0, or -1 with a Python
// error set.
int torchpjrt_hot_register(const char* name, const char* codes, PyObject* python_kernel, int inplace,
                           int n_returns, PyObject* check) {
  if (config == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "torchpjrt_hot_configure was not called");
    return -1;
  }
  // check: None, or (recorder, (module, flag name)) for an op its lowering checks on the device
  PyObject* check_recorder = nullptr;
  std::pair<PyObject*, PyObject*> checks_on{nullptr, nullptr};
  if (check != Py_None) {
    PyObject* module = nullptr;
    PyObject* flag = nullptr;
    if (!PyArg_ParseTuple(check, "O(OU)", &check_recorder, &module, &flag)) return -1;
    PyObject* dict = PyObject_GenericGetDict(module, nullptr);
    if (dict == nullptr) return -1;
    Py_INCREF(check_recorder);
    Py_INCREF(flag);
    checks_on = {dict, flag};
  }
  try {
    if (!registration)
      registration = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                                      __FILE__, __LINE__);
    registration->impl(name, torch::CppFunction::makeFromBoxedFunctor(
                                 std::make_unique<HotKernel>(name, codes, python_kernel, inplace != 0, n_returns,
                                                             check_recorder, checks_on)));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
  return 0;
}

// Register a FactoryKernel for aten::`name`: kind (FactoryKernel::Kind), `python_kernel` for every
// call it does not serve, `flag` None or (module, attribute name) (see FactoryKernel). Returns 0,
// or -1 with a Python error set.
int torchpjrt_hot_register_factory(const char* name, int kind, PyObject* python_kernel, PyObject* flag) {
  if (config == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "torchpjrt_hot_configure was not called");
    return -1;
  }
  std::pair<PyObject*, PyObject*> flag_entry{nullptr, nullptr};
  if (flag != Py_None) {
    PyObject* module = nullptr;
    PyObject* attribute = nullptr;
    if (!PyArg_ParseTuple(flag, "OU", &module, &attribute)) return -1;
    PyObject* dict = PyObject_GenericGetDict(module, nullptr);
    if (dict == nullptr) return -1;
    Py_INCREF(attribute);
    flag_entry = {dict, attribute};
  } else if (kind != FactoryKernel::kFill && kind != FactoryKernel::kZero && kind != FactoryKernel::kShared) {
    PyErr_SetString(PyExc_ValueError, "this factory kernel needs its flag");
    return -1;
  }
  try {
    if (!registration)
      registration = std::make_unique<torch::Library>(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1,
                                                      __FILE__, __LINE__);
    registration->impl(name, torch::CppFunction::makeFromBoxedFunctor(std::make_unique<FactoryKernel>(
                                 static_cast<FactoryKernel::Kind>(kind), python_kernel, flag_entry)));
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return -1;
  }
  return 0;
}

// See `budget`.
void torchpjrt_hot_budget(long long n) { budget.store(n); }

// Calls served here since the process started (counted with the Python kernels' dispatches).
long long torchpjrt_hot_calls() {
  return calls.load();
}

}  // extern "C"
