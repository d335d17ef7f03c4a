// One matmul plan's call in one native call: check that x (and bias) are laid out as the
// plan was built for, allocate the output (and the K split's workspace), launch the compiled
// Triton kernel with cuLaunchKernel on the current stream of x's device, return the output.
// Why and how: native_launch.py. Built at first use by torch.utils.cpp_extension.load.

#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <c10/core/Stream.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/autograd/python_variable.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <unordered_map>
#include <vector>

namespace {

// cuLaunchKernel's signature (cuda.h), resolved from the driver library torch already loaded.
using LaunchKernelFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                               void**, void**);
LaunchKernelFn launch_kernel = nullptr;

struct Layout {
  bool present = false;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
  c10::DeviceIndex device = -1;
  std::vector<int64_t> sizes, strides;
  uintptr_t alignment = 0;  // data pointer modulo 16: what Triton specializes a pointer on

  void record(const at::Tensor& t) {
    present = true;
    dtype = t.scalar_type();
    device = t.device().index();
    sizes.assign(t.sizes().begin(), t.sizes().end());
    strides.assign(t.strides().begin(), t.strides().end());
    alignment = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16;
  }

  bool matches(const at::Tensor& t) const {
    return t.scalar_type() == dtype && t.is_cuda() && t.device().index() == device && t.sizes().equals(sizes) &&
           t.strides().equals(strides) && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == alignment;
  }
};

struct Plan {
  void* function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned block = 32, shared = 0;
  std::vector<uint64_t> slots;  // one 8-byte slot per kernel parameter, little-endian values
  std::vector<void*> params;    // &slots[i]
  int x_slot = -1, bias_slot = -1, out_slot = -1, work_slot = -1, counter_slot = -1;
  uint64_t bias_absent = 0;  // the pointer passed for bias when the plan has none
  Layout x, bias;
  std::vector<int64_t> out_shape;
  int64_t work_numel = 0, counter_numel = 0;
  std::unordered_map<void*, at::Tensor> counters;  // per stream: zeroed, and left zeroed by the kernel
};

struct LaunchObject {
  PyObject_HEAD Plan* plan;
  PyObject* keep;  // the tensors the slots point into
};

void launch_dealloc(PyObject* self) {
  auto* obj = reinterpret_cast<LaunchObject*>(self);
  delete obj->plan;
  Py_XDECREF(obj->keep);
  Py_TYPE(self)->tp_free(self);
}

// launch(x, bias) -> out, or None when x or bias is not laid out as the plan's, or autograd
// would record the call (the caller then takes its validated route).
PyObject* launch_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject *x_obj, *bias_obj;
  if (kwargs != nullptr || !PyArg_UnpackTuple(args, "launch", 2, 2, &x_obj, &bias_obj)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "launch(x, bias) takes two positional arguments");
    return nullptr;
  }
  Plan& p = *reinterpret_cast<LaunchObject*>(self)->plan;
  if (!THPVariable_Check(x_obj)) Py_RETURN_NONE;
  const at::Tensor& x = THPVariable_Unpack(x_obj);
  if (!p.x.matches(x)) Py_RETURN_NONE;
  bool grad = c10::GradMode::is_enabled() && x.requires_grad();
  const at::Tensor* bias = nullptr;
  if (bias_obj == Py_None) {
    if (p.bias.present) Py_RETURN_NONE;
  } else {
    if (!p.bias.present || !THPVariable_Check(bias_obj)) Py_RETURN_NONE;
    bias = &THPVariable_Unpack(bias_obj);
    if (!p.bias.matches(*bias)) Py_RETURN_NONE;
    grad = grad || (c10::GradMode::is_enabled() && bias->requires_grad());
  }
  if (grad) Py_RETURN_NONE;
  try {
    // c10's device-generic interface to CUDA (no CUDA headers needed to build this file).
    const c10::impl::DeviceGuardImplInterface* cuda = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
    c10::Device device(c10::DeviceType::CUDA, p.x.device);
    std::optional<c10::DeviceGuard> guard;
    if (cuda->getDevice() != device) guard.emplace(device);
    at::Tensor out = at::empty(p.out_shape, x.options());
    void* stream = cuda->getStream(device).native_handle();
    p.slots[p.x_slot] = reinterpret_cast<uint64_t>(x.data_ptr());
    p.slots[p.out_slot] = reinterpret_cast<uint64_t>(out.data_ptr());
    if (p.bias_slot >= 0) p.slots[p.bias_slot] = bias ? reinterpret_cast<uint64_t>(bias->data_ptr()) : p.bias_absent;
    at::Tensor work;
    if (p.work_slot >= 0) {
      work = at::empty({p.work_numel}, x.options().dtype(at::kFloat));
      p.slots[p.work_slot] = reinterpret_cast<uint64_t>(work.data_ptr());
    }
    if (p.counter_slot >= 0) {
      auto found = p.counters.find(stream);
      if (found == p.counters.end()) {
        found = p.counters.emplace(stream, at::zeros({p.counter_numel}, x.options().dtype(at::kInt))).first;
      }
      p.slots[p.counter_slot] = reinterpret_cast<uint64_t>(found->second.data_ptr());
    }
    int status = launch_kernel(p.function, p.grid[0], p.grid[1], p.grid[2], p.block, 1, 1, p.shared, stream,
                               p.params.data(), nullptr);
    if (status != 0) {
      PyErr_Format(PyExc_RuntimeError, "qconform_triton_nf4 native launch: cuLaunchKernel returned CUresult %d",
                   status);
      return nullptr;
    }
    return THPVariable_Wrap(std::move(out));
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
}

PyTypeObject LaunchType = {PyVarObject_HEAD_INIT(nullptr, 0)};

bool int_list(PyObject* seq, std::vector<int64_t>& into) {
  PyObject* fast = PySequence_Fast(seq, "expected a sequence of ints");
  if (fast == nullptr) return false;
  Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
  for (Py_ssize_t i = 0; i < n; ++i) {
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
    if (v == -1 && PyErr_Occurred()) {
      Py_DECREF(fast);
      return false;
    }
    into.push_back(v);
  }
  Py_DECREF(fast);
  return true;
}

// make(function, grid, block, shared, slots, indices, x, bias, out_shape, work_numel,
//      counter_numel, bias_absent, keep): a launch for calls laid out as x and bias.
// indices: (x, bias, out, work, counters) slot numbers, -1 where the kernel has none.
PyObject* make(PyObject*, PyObject* args) {
  unsigned long long function, bias_absent;
  PyObject *grid, *indices, *x_obj, *bias_obj, *out_shape, *keep;
  unsigned block, shared;
  Py_buffer slots;
  long long work_numel, counter_numel;
  if (!PyArg_ParseTuple(args, "KOIIy*OOOOLLKO", &function, &grid, &block, &shared, &slots, &indices, &x_obj,
                        &bias_obj, &out_shape, &work_numel, &counter_numel, &bias_absent, &keep)) {
    return nullptr;
  }
  auto plan = std::make_unique<Plan>();
  std::vector<int64_t> grid_values, index_values;
  bool ok = int_list(grid, grid_values) && int_list(indices, index_values) && int_list(out_shape, plan->out_shape);
  size_t count = slots.len / 8;
  if (ok && (grid_values.size() != 3 || index_values.size() != 5 || slots.len % 8 != 0 ||
             !THPVariable_Check(x_obj) || (bias_obj != Py_None && !THPVariable_Check(bias_obj)))) {
    PyErr_SetString(PyExc_ValueError, "make: bad grid, slot indices, slots or sample tensors");
    ok = false;
  }
  for (int64_t index : index_values) {
    if (ok && index >= static_cast<int64_t>(count)) {
      PyErr_SetString(PyExc_ValueError, "make: a slot index past the parameters");
      ok = false;
    }
  }
  if (ok) {
    plan->slots.resize(count);
    std::memcpy(plan->slots.data(), slots.buf, slots.len);
  }
  PyBuffer_Release(&slots);
  if (!ok) return nullptr;
  if (launch_kernel == nullptr) {
    void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (driver == nullptr) driver = dlopen("libcuda.so.1", RTLD_NOW);
    if (driver != nullptr) launch_kernel = reinterpret_cast<LaunchKernelFn>(dlsym(driver, "cuLaunchKernel"));
    if (launch_kernel == nullptr) {
      PyErr_SetString(PyExc_RuntimeError, "make: cuLaunchKernel not found in libcuda.so.1");
      return nullptr;
    }
  }
  plan->function = reinterpret_cast<void*>(function);
  for (int i = 0; i < 3; ++i) plan->grid[i] = static_cast<unsigned>(grid_values[i]);
  plan->block = block;
  plan->shared = shared;
  plan->x_slot = static_cast<int>(index_values[0]);
  plan->bias_slot = static_cast<int>(index_values[1]);
  plan->out_slot = static_cast<int>(index_values[2]);
  plan->work_slot = static_cast<int>(index_values[3]);
  plan->counter_slot = static_cast<int>(index_values[4]);
  plan->work_numel = work_numel;
  plan->counter_numel = counter_numel;
  plan->bias_absent = bias_absent;
  plan->x.record(THPVariable_Unpack(x_obj));
  if (bias_obj != Py_None) plan->bias.record(THPVariable_Unpack(bias_obj));
  plan->params.resize(count);
  for (size_t i = 0; i < count; ++i) plan->params[i] = &plan->slots[i];
  auto* obj = PyObject_New(LaunchObject, &LaunchType);
  if (obj == nullptr) return nullptr;
  obj->plan = plan.release();
  Py_INCREF(keep);
  obj->keep = keep;
  return reinterpret_cast<PyObject*>(obj);
}

PyMethodDef methods[] = {
    {"make", make, METH_VARARGS, "make(...) -> a launch: native_launch.py says what each argument is"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "qconform_nf4_launch", nullptr, -1, methods};

}  // namespace

#define QCONFORM_CONCAT(a, b) a##b
#define QCONFORM_INIT(name) QCONFORM_CONCAT(PyInit_, name)

PyMODINIT_FUNC QCONFORM_INIT(TORCH_EXTENSION_NAME)(void) {
  LaunchType.tp_name = "qconform_nf4_launch.Launch";
  LaunchType.tp_basicsize = sizeof(LaunchObject);
  LaunchType.tp_flags = Py_TPFLAGS_DEFAULT;
  LaunchType.tp_dealloc = launch_dealloc;
  LaunchType.tp_call = launch_call;
  LaunchType.tp_doc = "launch(x, bias) -> out, or None where x or bias is not laid out as the plan's";
  if (PyType_Ready(&LaunchType) < 0) return nullptr;
  module_def.m_name = "qconform_nf4_launch";
  return PyModule_Create(&module_def);
}
