// swan256_router_key: the router's per-call decode key, read natively (issue 24.5).
//
// decode_key(kwargs) -> bytes | None
// lookup(kwargs, table) -> decision | (slot, key) | None
//
// The router (adapter/swan/__init__.py) keeps one decision per distinct key; a Python key costs
// ~35 torch metadata reads (~0.1-0.3 us each through torch's Python bindings). This reads the same
// metadata from the C++ tensors in one call, and lookup() finds the decision kept for it without
// building a Python key (a 64-bit FNV-style hash of the key's words picks the slot; the whole key
// is compared byte for byte, so a colliding key is a miss, never another call's decision). The
// key is exact, not a hash: equal bytes mean equal metadata of every tensor the call passes, so
// two calls with one key get one route() verdict and one plan (tests/test_swan_routing.py checks
// it against decode_key and route(describe_call(...))). It is a superset of routing.decode_key():
// every tensor contributes its dim, dtype, device type and index, contiguity, data pointer mod
// 16, sizes and strides.
//
// None (the router takes its Python path, which names the reason or keys the call in Python):
//   q or k_cache missing or None; any of the ten names bound to something that is not a tensor
//   (None aside: by its real type, not what __class__ claims, issue 30.4); head_dim_v not an
//   exact int; q 0-D, with 0 rows or more rows than a decode call has (SWAN_DECODE_MAX_TOKENS:
//   the engine's prefill path); a size or stride outside int32; a tensor torch cannot describe
//   (it throws: sparse, no storage).
//
// Host code only (no CUDA): built with the host C++ compiler against the installed torch by
// runtime/swan256/build.py, recorded in the module's manifest, verified at install like the .so.
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <limits>

#include <torch/csrc/autograd/python_variable.h>

#ifndef SWAN_DECODE_MAX_TOKENS
#error "SWAN_DECODE_MAX_TOKENS must be defined (adapter/swan/layout.py: DECODE_MAX_TOKENS)"
#endif

namespace {

// The keyword arguments deepseek_v4_backend passes to flash_mla_with_kvcache_sm120, tensors only,
// in key order (q and k_cache first: both required).
constexpr const char* kTensorNames[] = {
    "q", "k_cache", "indices", "topk_length", "attn_sink",
    "extra_k_cache", "extra_indices_in_kvcache", "extra_topk_length",
};
constexpr int kTensors = sizeof(kTensorNames) / sizeof(kTensorNames[0]);
constexpr int kMaxDim = 8;
// 1 word for head_dim_v, then per tensor 1 descriptor word + sizes + strides.
constexpr int kMaxWords = 1 + kTensors * (1 + 2 * kMaxDim);

PyObject* g_names[kTensors];
PyObject* g_head_dim_v;

// A tensor by its real type: torch.Tensor, Parameter or any subclass (the type's MRO). Not
// THPVariable_Check: its PyObject_IsInstance reads __class__, so an impostor (a
// MagicMock(spec=torch.Tensor)) would be cast to a THPVariable and crash, and a __class__ that
// raises would run Python code here. This runs none and sets no error.
bool is_tensor(PyObject* obj) {
  if (THPVariableClass == nullptr) return false;     // torch not initialised: nothing is keyed
  return PyType_IsSubtype(Py_TYPE(obj), reinterpret_cast<PyTypeObject*>(THPVariableClass)) != 0;
}

bool fits(int64_t v) {
  return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
}

// Appends one tensor's metadata; false: not keyable (the caller returns None).
bool put_tensor(const at::Tensor& t, int32_t* words, int& n) {
  const int64_t dim = t.dim();
  if (dim > kMaxDim) return false;
  const auto device = t.device();
  const auto align = static_cast<uint32_t>(reinterpret_cast<uintptr_t>(t.const_data_ptr()) & 15u);
  // present(1) | dim(4) | dtype(7) | device type(6) | device index + 1 (8) | contiguous(1) | align(4)
  const uint32_t desc = 1u | (static_cast<uint32_t>(dim) << 1) |
                        (static_cast<uint32_t>(t.scalar_type()) << 5) |
                        (static_cast<uint32_t>(device.type()) << 12) |
                        (static_cast<uint32_t>(device.index() + 1) << 18) |
                        (static_cast<uint32_t>(t.is_contiguous()) << 26) | (align << 27);
  words[n++] = static_cast<int32_t>(desc);
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  for (int64_t i = 0; i < dim; ++i) {
    if (!fits(sizes[i]) || !fits(strides[i])) return false;
    words[n++] = static_cast<int32_t>(sizes[i]);
    words[n++] = static_cast<int32_t>(strides[i]);
  }
  return true;
}

// Fills words with the call's key; returns the word count, 0 when the call is not keyable (the
// router's Python path decides), -1 with a Python error set.
int key_words(PyObject* kwargs, int32_t* words) {
  if (!PyDict_Check(kwargs)) {
    PyErr_SetString(PyExc_TypeError, "the call's keyword arguments (a dict) expected");
    return -1;
  }
  int n = 0;
  PyObject* hdv = PyDict_GetItemWithError(kwargs, g_head_dim_v);  // borrowed
  if (hdv == nullptr) return PyErr_Occurred() ? -1 : 0;
  if (!PyLong_CheckExact(hdv)) return 0;
  int overflow = 0;
  const long long head_dim_v = PyLong_AsLongLongAndOverflow(hdv, &overflow);
  if (overflow || !fits(head_dim_v)) return 0;
  words[n++] = static_cast<int32_t>(head_dim_v);
  for (int i = 0; i < kTensors; ++i) {
    PyObject* value = PyDict_GetItemWithError(kwargs, g_names[i]);  // borrowed
    if (value == nullptr && PyErr_Occurred()) return -1;
    if (value == nullptr || value == Py_None) {
      if (i < 2) return 0;                       // q, k_cache: required
      words[n++] = 0;                            // absent
      continue;
    }
    if (!is_tensor(value)) return 0;
    const at::Tensor& t = THPVariable_Unpack(value);
    if (i == 0) {                                // q: a decode call's rows
      if (t.dim() == 0) return 0;
      const int64_t rows = t.size(0);
      if (rows <= 0 || rows > SWAN_DECODE_MAX_TOKENS) return 0;
    }
    if (!put_tensor(t, words, n)) return 0;
  }
  return n;
}

// A tensor whose metadata torch cannot give (sparse, no storage) throws: not keyable, and no
// C++ exception may cross into the interpreter. A swallowed exception may have left a Python
// error set (torch's python_error keeps it pending): cleared, or the interpreter would raise it
// later as a SystemError at an unrelated line.
int key_words_safe(PyObject* kwargs, int32_t* words) {
  try {
    return key_words(kwargs, words);
  } catch (...) {
    PyErr_Clear();
    return 0;
  }
}

// Slot of a key: FNV-1a's multiply-xor over 32-bit words (not bytes: one dependent multiply per
// word), then a final mix. Only to find the slot; the whole key is compared on every hit.
uint64_t slot_of(const int32_t* words, int n) {
  uint64_t h = 1469598103934665603ull;
  for (int i = 0; i < n; ++i) {
    h ^= static_cast<uint32_t>(words[i]);
    h *= 1099511628211ull;
  }
  return h ^ (h >> 29);
}

PyObject* decode_key(PyObject*, PyObject* kwargs) {
  int32_t words[kMaxWords];
  const int n = key_words_safe(kwargs, words);
  if (n < 0) return nullptr;
  if (n == 0) Py_RETURN_NONE;
  return PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words),
                                   static_cast<Py_ssize_t>(n) * sizeof(int32_t));
}

// lookup(kwargs, table): table maps slot (int) -> (key bytes, decision). Returns the decision
// whose key equals this call's key byte for byte; on a miss (no entry, or another key in the
// slot) the tuple (slot, key bytes) for the caller to decide and store; None when the call is
// not keyable.
PyObject* lookup(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyDict_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "lookup(kwargs, table) takes the call's keyword arguments "
                                     "and the router's decision table (dicts)");
    return nullptr;
  }
  int32_t words[kMaxWords];
  const int n = key_words_safe(args[0], words);
  if (n < 0) return nullptr;
  if (n == 0) Py_RETURN_NONE;
  const Py_ssize_t size = static_cast<Py_ssize_t>(n) * sizeof(int32_t);
  PyObject* slot = PyLong_FromUnsignedLongLong(slot_of(words, n));
  if (slot == nullptr) return nullptr;
  PyObject* entry = PyDict_GetItemWithError(args[1], slot);  // borrowed
  if (entry == nullptr && PyErr_Occurred()) {
    Py_DECREF(slot);
    return nullptr;
  }
  if (entry != nullptr && PyTuple_CheckExact(entry) && PyTuple_GET_SIZE(entry) == 2) {
    PyObject* key = PyTuple_GET_ITEM(entry, 0);
    if (PyBytes_CheckExact(key) && PyBytes_GET_SIZE(key) == size &&
        std::memcmp(PyBytes_AS_STRING(key), words, static_cast<size_t>(size)) == 0) {
      Py_DECREF(slot);
      PyObject* decision = PyTuple_GET_ITEM(entry, 1);
      Py_INCREF(decision);
      return decision;
    }
  }
  PyObject* key = PyBytes_FromStringAndSize(reinterpret_cast<const char*>(words), size);
  if (key == nullptr) {
    Py_DECREF(slot);
    return nullptr;
  }
  PyObject* miss = PyTuple_Pack(2, slot, key);
  Py_DECREF(slot);
  Py_DECREF(key);
  return miss;
}

PyMethodDef kMethods[] = {
    {"decode_key", decode_key, METH_O,
     "decode_key(kwargs) -> bytes | None: the exact metadata key of a decode call (None: not a "
     "decode call this key can describe; the router's Python path decides)"},
    {"lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(lookup)), METH_FASTCALL,
     "lookup(kwargs, table) -> decision | (slot, key) | None: the decision stored for this call's "
     "exact key in table {slot: (key, decision)}; on a miss the slot and key to store it under"},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "swan256_router_key",
                       "swan's native per-call decode key (runtime/swan256/router_key.cpp)", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC PyInit_swan256_router_key() {
  for (int i = 0; i < kTensors; ++i) {
    g_names[i] = PyUnicode_InternFromString(kTensorNames[i]);
    if (g_names[i] == nullptr) return nullptr;
  }
  g_head_dim_v = PyUnicode_InternFromString("head_dim_v");
  if (g_head_dim_v == nullptr) return nullptr;
  PyObject* module = PyModule_Create(&kModule);
  if (module == nullptr) return nullptr;
  if (PyModule_AddIntConstant(module, "DECODE_MAX_TOKENS", SWAN_DECODE_MAX_TOKENS) < 0) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
