// The emulated accelerator as torch sees it: the device guard, the PrivateUse1 hooks, the
// pinned host allocator, and the ATen operators registered for PrivateUse1.
//
// Operators: the factory, view and copy operators are ours (views must share device
// memory; copies are where streams and pinned memory matter); the convolutions call the
// CPU's (torch has no kernel for a backend out of tree); every other operator runs on the
// CPU through torch's boxed CPU fallback, after the current stream has drained.
//
// Random numbers: each device has a default generator, and torch.Generator(device="emu")
// makes more (EmuGenerator); a random operator on the device runs the CPU kernel with the
// CPU generator inside the emu one.
//
// Written against torch 2.6 to 2.15 (the range devicectx supports). Hooks that only some
// releases declare are written without `override`, so that they override where torch
// declares them and are plain methods elsewhere.
#include "runtime.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/core/op_registration/adaption.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_as_complex_native.h>
#include <ATen/ops/view_as_real_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <initializer_list>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#define DEVICECTX_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= (major) * 100 + (minor))

#if DEVICECTX_TORCH_AT_LEAST(2, 8)
#include <ATen/core/CachingHostAllocator.h>
#endif

// torch.Generator(device="emu"): torch 2.6 makes it with the function registered by
// REGISTER_GENERATOR_PRIVATEUSE1 (at::GetGeneratorForPrivateuse1); later releases ask the
// hooks' getNewGenerator, and deprecate the registration (a warning). The releases that ask
// the hooks are those whose hooks header includes the registration's header, for its
// backward compatibility (2.13 does; 2.6 does not); from 2.13 on, the hooks whatever a
// later release does with that header.
#if !defined(REGISTER_GENERATOR_PRIVATEUSE1) && !DEVICECTX_TORCH_AT_LEAST(2, 13)
#define DEVICECTX_REGISTER_GENERATOR 1
#include <ATen/core/GeneratorForPrivateuseone.h>
#else
#define DEVICECTX_REGISTER_GENERATOR 0
#endif

namespace devicectx_emu {
namespace {

constexpr auto kEmu = c10::DeviceType::PrivateUse1;

int index_of(const c10::Device& device) {
  TORCH_CHECK(device.type() == kEmu, "emu: expected an emu device, got ", device);
  return checked_index(device.has_index() ? device.index() : -1);
}

// ---- the device guard ----

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override {
    return kEmu;
  }

  c10::Device exchangeDevice(c10::Device device) const override {
    int old = current_device();
    set_current_device(index_of(device));
    return {kEmu, static_cast<c10::DeviceIndex>(old)};
  }

  c10::Device getDevice() const override {
    return {kEmu, static_cast<c10::DeviceIndex>(current_device())};
  }

  void setDevice(c10::Device device) const override {
    set_current_device(index_of(device));
  }

  void uncheckedSetDevice(c10::Device device) const noexcept override {
    try {
      set_current_device(index_of(device));
    } catch (...) {
    }
  }

  // noexcept: torch 2.6 declares these two noexcept, later releases do not.
  c10::Stream getStream(c10::Device device) const noexcept override {
    int index = device.has_index() ? device.index() : current_device();
    return make(index, current_stream(index));
  }

  c10::Stream exchangeStream(c10::Stream stream) const noexcept override {
    int index = stream.device_index();
    return make(index, exchange_stream(index, stream.id()));
  }

  c10::Stream getDefaultStream(c10::Device device) const override {
    return make(index_of(device), 0);
  }

  c10::Stream getStreamFromGlobalPool(c10::Device device, bool /*high*/) const override {
    int index = index_of(device);
    return make(index, pool_stream(index));
  }

  c10::Stream getNewStream(c10::Device device, int /*priority*/) const override {
    int index = index_of(device);
    return make(index, new_stream(index));
  }

  c10::DeviceIndex deviceCount() const noexcept override {
    return static_cast<c10::DeviceIndex>(device_count());
  }

  void destroyEvent(void* event, const c10::DeviceIndex /*index*/) const noexcept override {
    destroy_event(event);
  }

  void record(
      void** event,
      const c10::Stream& stream,
      const c10::DeviceIndex index,
      const c10::EventFlag /*flag*/) const override {
    TORCH_CHECK(
        index == -1 || index == stream.device_index(),
        "emu: an event of emu:",
        static_cast<int>(index),
        " recorded on a stream of emu:",
        static_cast<int>(stream.device_index()));
    if (*event == nullptr) {
      TORCH_CHECK(
          events_enabled(),
          "emu: events are switched off (devicectx.testing.emulated.configure(events=False)), "
          "as on a device without them");
      *event = create_event(stream.device_index());
    }
    record_event(*event, stream.device_index(), stream.id());
  }

  void block(void* event, const c10::Stream& stream) const override {
    if (event != nullptr) {
      block_on_event(event, stream.device_index(), stream.id());
    }
  }

  bool queryEvent(void* event) const override {
    return query_event(event);
  }

  bool queryStream(const c10::Stream& stream) const override {
    return query_stream(stream.device_index(), stream.id());
  }

  void synchronizeStream(const c10::Stream& stream) const override {
    wait_stream(stream.device_index(), stream.id());
  }

  void synchronizeEvent(void* event) const override {
    synchronize_event(event);
  }

  void synchronizeDevice(const c10::DeviceIndex index) const override {
    synchronize_device(index);
  }

  void recordDataPtrOnStream(const c10::DataPtr& data, const c10::Stream& stream)
      const override {
    record_data_ptr(data, stream.device_index(), stream.id());
  }

  double elapsedTime(void* start, void* end, const c10::DeviceIndex /*index*/)
      const override {
    return elapsed_ms(start, end);
  }

 private:
  static c10::Stream make(int index, c10::StreamId id) {
    return c10::Stream(
        c10::Stream::UNSAFE, c10::Device(kEmu, static_cast<c10::DeviceIndex>(index)), id);
  }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// ---- storage growth (resize_, UntypedStorage.resize_) ----

void resize_storage(c10::StorageImpl* storage, int index, size_t nbytes) {
  TORCH_CHECK(storage->resizable(), "emu: this tensor's storage is not resizable");
  wait_current_stream(index);
  c10::DataPtr fresh = device_allocator(index)->allocate(nbytes);
  size_t keep = std::min(nbytes, storage->nbytes());
  if (keep > 0) {
    std::memcpy(fresh.get(), storage->data_ptr().get(), keep);
  }
  storage->set_data_ptr_noswap(std::move(fresh));
  storage->set_nbytes(nbytes);
}

// ---- generators ----

// A seed's numbers on the device are not the CPU's for that seed, as on CUDA and MPS (other
// algorithms), so that code comparing a device's draws with the CPU's fails here as there:
// the CPU generator inside an emu one is seeded with the seed XOR this constant (the golden
// ratio's bits; the low 32 bits, all that torch's Mersenne Twister takes, are not 0), and
// initial_seed() gives the seed back.
constexpr uint64_t kSeedMix = 0x9E3779B97F4A7C15ULL;

// An emu generator: a CPU generator (torch's Mersenne Twister) on an emu device. A random
// operator on the device runs the CPU kernel with it (the fallback swaps it in); get_state()
// and set_state() take the CPU generator's state. The CPU kernels lock the CPU generator's
// mutex, so every method here locks it too (after the emu generator's, which torch's Python
// methods lock).
class EmuGenerator final : public c10::GeneratorImpl {
 public:
  explicit EmuGenerator(
      c10::DeviceIndex index,
      at::Generator cpu =
          at::make_generator<at::CPUGeneratorImpl>(c10::default_rng_seed_val ^ kSeedMix))
      : c10::GeneratorImpl(
            c10::Device(kEmu, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)),
        cpu_(std::move(cpu)) {}

  const at::Generator& cpu() const {
    return cpu_;
  }

  void set_current_seed(uint64_t seed) override {
    std::lock_guard<std::mutex> lock(impl()->mutex_);
    impl()->set_current_seed(seed ^ kSeedMix);
  }

  uint64_t current_seed() const override {
    std::lock_guard<std::mutex> lock(impl()->mutex_);
    return impl()->current_seed() ^ kSeedMix;
  }

  uint64_t seed() override {
    uint64_t random = c10::detail::getNonDeterministicRandom();
    set_current_seed(random);
    return random;
  }

  void set_state(const c10::TensorImpl& state) override {
    std::lock_guard<std::mutex> lock(impl()->mutex_);
    impl()->set_state(state);
  }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    std::lock_guard<std::mutex> lock(impl()->mutex_);
    return impl()->get_state();
  }

  // A Mersenne Twister has no offset (CUDA's and MPS's Philox generators do); torch's
  // pickling of a generator on a device that is not the CPU saves and restores one, so it
  // is 0 here, and setting any other offset is refused.
  uint64_t get_offset() const override {
    return 0;
  }

  void set_offset(uint64_t offset) override {
    TORCH_CHECK(
        offset == 0,
        "emu: an emulated device's generator draws as the CPU's (a Mersenne Twister), which "
        "has no offset; got set_offset(",
        offset,
        ")\nfix: save and restore its state, g.set_state(g.get_state())");
  }

 private:
  c10::GeneratorImpl* impl() const {
    return cpu_.unsafeGetGeneratorImpl();
  }

  EmuGenerator* clone_impl() const override {
    std::lock_guard<std::mutex> lock(impl()->mutex_);
    return new EmuGenerator(device().index(), cpu_.clone());
  }

  at::Generator cpu_;
};

at::Generator new_generator(c10::DeviceIndex index) {
  TORCH_CHECK_NOT_IMPLEMENTED(
      generators_enabled(),
      "emu: generators are switched off (devicectx.testing.emulated.configure("
      "generators=False)), as on a backend without a torch.Generator of its own");
  return at::make_generator<EmuGenerator>(static_cast<c10::DeviceIndex>(checked_index(index)));
}

}  // namespace

const at::Generator& default_generator(int index) {
  // One per device that can exist, seeded as torch seeds a new generator; never freed (see
  // runtime.cpp).
  static const std::vector<at::Generator>* generators = [] {
    auto* made = new std::vector<at::Generator>;
    for (int i = 0; i < kMaxDevices; ++i) {
      made->push_back(at::make_generator<EmuGenerator>(static_cast<c10::DeviceIndex>(i)));
    }
    return made;
  }();
  return (*generators)[static_cast<size_t>(checked_index(index))];
}

namespace {

// ---- the hooks ----

struct Hooks final : public at::PrivateUse1HooksInterface {
  // Declared by torch >= 2.7 (2.6 asks the device count instead).
  bool isBuilt() const {
    return true;
  }

  bool isAvailable() const {
    return device_count() > 0;
  }

  bool hasPrimaryContext(c10::DeviceIndex index) const override {
    return is_initialized(index);
  }

  void init() const override {}

  c10::DeviceIndex deviceCount() const override {
    return static_cast<c10::DeviceIndex>(device_count());
  }

  void setCurrentDevice(c10::DeviceIndex index) const override {
    set_current_device(index);
  }

  c10::DeviceIndex getCurrentDevice() const override {
    return static_cast<c10::DeviceIndex>(current_device());
  }

  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    int old = current_device();
    set_current_device(index);
    return static_cast<c10::DeviceIndex>(old);
  }

  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override {
    return exchangeDevice(index);
  }

  bool isPinnedPtr(const void* data) const override {
    return is_pinned_ptr(data);
  }

  at::Allocator* getPinnedMemoryAllocator() const override {
    return pinned_allocator();
  }

  at::Device getDeviceFromPtr(void* data) const override {
    int index = device_of_ptr(data);
    TORCH_CHECK(index >= 0, "emu: the pointer ", data, " is not emu device memory");
    return {kEmu, static_cast<c10::DeviceIndex>(index)};
  }

  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    resize_storage(storage.unsafeGetStorageImpl(), index_of(storage.device()), nbytes);
  }

  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index);
  }

  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return new_generator(index);
  }
};

#if DEVICECTX_TORCH_AT_LEAST(2, 8)
// torch >= 2.8 keeps a host allocator per device type (at::getHostAllocator), which
// torch.accelerator's host-memory functions ask; pinning itself goes through the hooks.
struct HostAllocator final : public at::HostAllocator {
  at::DataPtr allocate(size_t size) override {
    return pinned_allocator()->allocate(size);
  }
  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
  bool record_event(void* ptr, void* /*ctx*/, c10::Stream stream) override {
    record_host_ptr(ptr, stream.device_index(), stream.id());
    return true;
  }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    return {};
  }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}
};
#endif

// ---- copies ----

// The memory of an emu tensor as a CPU tensor over the same bytes: no copy.
at::Tensor host_alias(const at::Tensor& tensor) {
  if (!tensor.is_privateuseone()) {
    return tensor;
  }
  at::TensorOptions options = tensor.options().device(at::kCPU);
  if (tensor.numel() == 0) {
    return at::empty_strided(tensor.sizes(), tensor.strides(), options);
  }
  at::Tensor alias = at::from_blob(tensor.data_ptr(), tensor.sizes(), tensor.strides(), options);
  alias._set_conj(tensor.is_conj());
  alias._set_neg(tensor.is_neg());
  return alias;
}

// What a queued copy needs of a tensor: its bytes and layout, no reference (a GPU copy
// keeps none: freeing a source too early is the caller's bug, which poison then shows).
struct Layout {
  explicit Layout(const at::Tensor& tensor)
      : data(tensor.numel() == 0 ? nullptr : tensor.data_ptr()),
        sizes(tensor.sizes().vec()),
        strides(tensor.strides().vec()),
        dtype(tensor.scalar_type()),
        conj(tensor.is_conj()),
        neg(tensor.is_neg()) {}

  at::Tensor view() const {
    at::TensorOptions options = at::TensorOptions().dtype(dtype).device(at::kCPU);
    if (data == nullptr) {
      return at::empty_strided(sizes, strides, options);
    }
    at::Tensor alias = at::from_blob(data, sizes, strides, options);
    alias._set_conj(conj);
    alias._set_neg(neg);
    return alias;
  }

  void* data;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  at::ScalarType dtype;
  bool conj;
  bool neg;
};

bool is_pinned(const at::Tensor& host) {
  return host.numel() > 0 && is_pinned_ptr(host.data_ptr());
}

// A non_blocking copy to or from pinned memory: queued on the device's current stream,
// and done `delay_ms` after the stream reaches it.
void copy_later(int index, const at::Tensor& dst, const at::Tensor& src, const at::Tensor& host) {
  c10::StreamId stream = current_stream(index);
  record_host_ptr(host.data_ptr(), index, stream);
  auto delay = std::chrono::duration<double, std::milli>(delay_ms());
  submit(index, stream, [to = Layout(dst), from = Layout(src), delay] {
    std::this_thread::sleep_for(delay);
    at::Tensor target = to.view();
    target.copy_(from.view());
  });
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  TORCH_CHECK(
      self.is_privateuseone() || self.is_cpu(), "emu: cannot copy from ", self.device());
  TORCH_CHECK(dst.is_privateuseone() || dst.is_cpu(), "emu: cannot copy to ", dst.device());
  if (self.is_privateuseone() && dst.is_privateuseone()) {
    int from = index_of(self.device());
    int to = index_of(dst.device());
    wait_current_stream(from);
    if (to != from) {
      wait_current_stream(to);
    }
    host_alias(dst).copy_(host_alias(self));
    return dst;
  }
  const at::Tensor& host = dst.is_privateuseone() ? self : dst;
  int index = index_of((dst.is_privateuseone() ? dst : self).device());
  if (non_blocking && is_pinned(host)) {
    copy_later(index, dst, self, host);
    return dst;
  }
  wait_current_stream(index);
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// ---- factories, views, metadata ----

// torch's tensor printing (torch/_tensor_str.py) converts the values to float64 to size
// the columns, on every device but MPS (and XPUs without float64), where it uses float32.
// While Python prints an emu tensor (emulated.py wraps Tensor.__repr__), this thread may
// make float64 tensors, so that the device prints as MPS does; the values printed are the
// tensor's own either way.
thread_local bool tls_printing = false;

}  // namespace

bool set_float64_for_printing(bool value) {
  bool previous = tls_printing;
  tls_printing = value;
  return previous;
}

namespace {

// Playing a device without float64 and complex128 (configure(float64=False), the "mps"
// profile): every tensor of the device is made here, so refusing the dtype here refuses
// it everywhere (a factory, .to(), an op's result), with MPS's error type and words.
void check_dtype(c10::ScalarType dtype) {
  bool wide = dtype == at::kDouble || dtype == at::kComplexDouble;
  if (!wide || float64_enabled() || tls_printing) {
    return;
  }
  bool complex = dtype == at::kComplexDouble;
  TORCH_CHECK_TYPE(
      false,
      "Cannot convert a emu Tensor to ",
      complex ? "complex128" : "float64",
      " dtype as the emulated device, playing MPS, doesn't support ",
      complex ? "complex128" : "float64",
      ". Please use ",
      complex ? "complex64" : "float32",
      " instead. (devicectx.testing.emulated.configure(float64=False), or the 'mps' "
      "profile)");
}

at::Tensor empty_memory_format(
    c10::IntArrayRef size,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory,
    std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(!pin_memory.value_or(false), "emu: only CPU tensors can be pinned");
  TORCH_CHECK(
      layout.value_or(c10::kStrided) == c10::kStrided, "emu: only strided tensors are supported");
  check_dtype(c10::dtype_or_default(dtype));
  int index = device.has_value() ? index_of(*device) : checked_index(-1);
  return at::detail::empty_generic(
      size,
      device_allocator(index),
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype),
      memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout> layout,
    std::optional<c10::Device> device,
    std::optional<bool> pin_memory) {
  TORCH_CHECK(!pin_memory.value_or(false), "emu: only CPU tensors can be pinned");
  TORCH_CHECK(
      layout.value_or(c10::kStrided) == c10::kStrided, "emu: only strided tensors are supported");
  check_dtype(c10::dtype_or_default(dtype));
  int index = device.has_value() ? index_of(*device) : checked_index(-1);
  return at::detail::empty_strided_generic(
      size,
      stride,
      device_allocator(index),
      c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
      c10::dtype_or_default(dtype));
}

const at::Tensor& resize_(
    const at::Tensor& self,
    c10::IntArrayRef size,
    std::optional<c10::MemoryFormat> memory_format) {
  c10::TensorImpl* impl = self.unsafeGetTensorImpl();
  if (self.sizes() != size) {
    impl->set_sizes_contiguous(size);
  }
  if (self.numel() > 0) {
    size_t needed = at::detail::computeStorageNbytesContiguous(
        size, self.dtype().itemsize(), self.storage_offset());
    c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
    if (needed > storage->nbytes()) {
      resize_storage(storage, index_of(self.device()), needed);
    }
  }
  if (memory_format.has_value()) {
    TORCH_CHECK(
        *memory_format != c10::MemoryFormat::Preserve,
        "emu: resize_ does not take memory_format=torch.preserve_format");
    impl->empty_tensor_restride(*memory_format);
  }
  return self;
}

at::Tensor& set_empty(at::Tensor& self) {
  c10::Storage storage(
      c10::Storage::use_byte_size_t(), 0, device_allocator(index_of(self.device())), true);
  return self.set_(storage, 0, {0}, {});
}

at::Tensor as_strided(
    const at::Tensor& self,
    c10::IntArrayRef size,
    c10::IntArrayRef stride,
    std::optional<int64_t> storage_offset) {
  return at::native::as_strided_tensorimpl(self, size, stride, storage_offset);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  wait_current_stream(index_of(self.device()));
  return at::_local_scalar_dense(host_alias(self));
}

void record_stream(at::Tensor& self, c10::Stream stream) {
  // NotImplementedError, as torch raises on a backend that has no record_stream.
  TORCH_CHECK_NOT_IMPLEMENTED(
      record_stream_enabled(),
      "emu: record_stream is switched off (devicectx.testing.emulated.configure("
      "record_stream=False)), as on a backend without it");
  TORCH_CHECK(stream.device_type() == kEmu, "emu: record_stream needs an emu stream");
  record_data_ptr(self.storage().data_ptr(), stream.device_index(), stream.id());
}

// torch's device check, as CUDA's operators make it: every tensor argument on one device,
// except a 0-dim CPU tensor (a scalar, which CUDA's kernels take from the host) and the
// indices of an indexing operator (`x[cpu_index]` works on CUDA). A foreach or fused
// operator checks each position of its lists on its own: CUDA runs lists that span devices
// tensor by tensor. The error is torch's own (c10::impl::common_device_check_failure, what
// CUDA's generated wrappers raise), in the words of the torch release it was built against.
class SameDevice {
 public:
  explicit SameDevice(const c10::FunctionSchema& schema) : schema_(schema) {}

  void check(std::optional<c10::Device>& common, const at::Tensor& tensor, size_t argument) {
    if (!tensor.defined() || (tensor.is_cpu() && tensor.dim() == 0)) {
      return;
    }
    if (!common.has_value()) {
      common = tensor.device();
    } else if (*common != tensor.device()) {
      std::string name = schema_.name();
      std::string method = "wrapper_PrivateUse1_" + schema_.overload_name() + "_" +
          name.substr(name.find("::") == std::string::npos ? 0 : name.find("::") + 2);
      c10::impl::common_device_check_failure(
          *common, tensor, method.c_str(), schema_.arguments()[argument].name().c_str());
    }
  }

 private:
  const c10::FunctionSchema& schema_;
};

bool checks_per_position(const c10::FunctionSchema& schema) {
  const std::string& name = schema.name();
  return name.rfind("aten::_foreach_", 0) == 0 || name.rfind("aten::_fused_", 0) == 0;
}

// Whether an operator's argument is a generator (`Generator?` in its schema).
bool takes_generator(const c10::Argument& argument) {
  const c10::TypePtr& type = argument.type();
  if (type->kind() == c10::TypeKind::OptionalType) {
    return type->expectRef<c10::OptionalType>().getElementType()->kind() ==
        c10::TypeKind::GeneratorType;
  }
  return type->kind() == c10::TypeKind::GeneratorType;
}

// A random operator on the device with a generator of another device (a CPU
// torch.Generator): CUDA's and MPS's kernels refuse it (check_generator), in these words.
// The CPU kernel that the fallback runs would take it, hiding code that fails on a GPU.
void check_generator(
    const c10::FunctionSchema& schema, const at::Generator& generator, int index) {
  if (generator.device().type() == kEmu) {
    return;
  }
  std::string fix = generators_enabled()
      ? "fix: make the generator on the device, torch.Generator(device=\"emu:" +
          std::to_string(index) +
          "\"), or draw on the generator's device and move the numbers, "
          "torch.randn(3, generator=g).to(device)"
      : "fix: draw on the generator's device and move the numbers, "
        "torch.randn(3, generator=g).to(device), or leave generator= out (generators are "
        "switched off: devicectx.testing.emulated.configure(generators=False))";
  TORCH_CHECK(
      false,
      "Expected a 'emu' device type for generator but found '",
      c10::DeviceTypeName(generator.device().type(), /*lower_case=*/true),
      "' (",
      schema.name(),
      " on the emulated device, which refuses another device's generator as CUDA and MPS "
      "do)\n",
      fix);
}

// A random operator's generators, once its device is known: an emu generator (given, or
// the device's default one for a generator left out) becomes the CPU generator inside it,
// which the CPU kernel takes. An operator whose tensors are on the CPU (reached here only by
// an emu generator) keeps it, and the CPU kernel refuses it as it refuses a CUDA generator.
void swap_generators(
    const c10::FunctionSchema& schema,
    torch::jit::Stack* stack,
    size_t first,
    const std::vector<size_t>& positions,
    const std::optional<c10::Device>& common) {
  if (common.has_value() && common->type() != kEmu) {
    return;
  }
  int index = common.has_value() ? common->index() : current_device();
  for (size_t position : positions) {
    c10::IValue& value = (*stack)[first + position];
    at::Generator emu = value.isNone() ? default_generator(index) : value.toGenerator();
    if (emu.defined()) {
      check_generator(schema, emu, index);
      value = c10::IValue(emu.get<EmuGenerator>()->cpu());
    }
  }
}

// The dropout of torch.nn.functional.dropout on the device (torch calls native_dropout for
// backends out of tree, as for CUDA): torch's CPU kernel, which the fallback would run,
// draws its mask from the CPU's default generator, since the operator takes no generator;
// here the mask is drawn on the device (bernoulli_, from its default generator), as CUDA's
// kernel draws from CUDA's. The rest is the CPU kernel's arithmetic and a mask of bools.
std::tuple<at::Tensor, at::Tensor> native_dropout(
    const at::Tensor& input, double p, std::optional<bool> train) {
  if (input.numel() == 0) {
    return std::make_tuple(input, at::empty_like(input));
  }
  if (train.has_value() && !*train) {
    return std::make_tuple(input.clone(), at::ones_like(input, input.options().dtype(at::kBool)));
  }
  double keep = 1. - p;
  double scale = keep == 0 ? 0. : 1. / keep;
  at::Tensor mask = at::empty_like(
      input, input.options().dtype(at::kBool), at::MemoryFormat::Contiguous);
  mask.bernoulli_(keep);
  return std::make_tuple(input.mul(mask).mul_(scale), mask);
}

// Convolutions: at::_convolution picks a kernel by device, and for a backend out of tree
// calls convolution_overrideable (and convolution_backward_overrideable), whose default
// raises NotImplementedError. Here the CPU's convolution runs on the device's bytes, with
// the arguments it would have had for CPU tensors, so that nn.Conv*d computes the CPU's
// values and gradients on the device.
at::Tensor on_device(const at::Tensor& host, const c10::Device& device) {
  return host.defined() ? host.to(device) : host;
}

// The device check of CUDA's convolution kernels (tensors of two devices), in its words.
void check_one_device(
    const char* method, std::initializer_list<std::pair<const at::Tensor*, const char*>> args) {
  std::optional<c10::Device> common;
  for (const auto& [tensor, name] : args) {
    if (tensor->defined()) {
      c10::impl::check_and_update_common_device(common, *tensor, method, name);
    }
  }
}

at::Tensor convolution_overrideable(
    const at::Tensor& input,
    const at::Tensor& weight,
    const std::optional<at::Tensor>& bias,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    bool transposed,
    c10::SymIntArrayRef output_padding,
    c10::SymInt groups) {
  at::Tensor no_bias;
  const at::Tensor& given_bias = bias.has_value() ? *bias : no_bias;
  check_one_device(
      "wrapper_PrivateUse1__convolution_overrideable",
      {{&input, "input"}, {&weight, "weight"}, {&given_bias, "bias"}});
  wait_current_stream(index_of(input.device()));
  std::optional<at::Tensor> host_bias;
  if (given_bias.defined()) {
    host_bias = host_alias(given_bias);
  }
  at::Tensor output = at::convolution_symint(
      host_alias(input),
      host_alias(weight),
      host_bias,
      stride,
      padding,
      dilation,
      transposed,
      output_padding,
      std::move(groups));
  return on_device(output, input.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output,
    const at::Tensor& input,
    const at::Tensor& weight,
    c10::SymIntArrayRef stride,
    c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation,
    bool transposed,
    c10::SymIntArrayRef output_padding,
    c10::SymInt groups,
    std::array<bool, 3> output_mask) {
  check_one_device(
      "wrapper_PrivateUse1__convolution_backward_overrideable",
      {{&grad_output, "grad_output"}, {&input, "input"}, {&weight, "weight"}});
  wait_current_stream(index_of(input.device()));
  std::vector<c10::SymInt> bias_sizes{grad_output.sym_size(1)};
  auto [grad_input, grad_weight, grad_bias] = at::convolution_backward_symint(
      host_alias(grad_output),
      host_alias(input),
      host_alias(weight),
      output_mask[2] ? std::optional<c10::SymIntArrayRef>(bias_sizes) : std::nullopt,
      stride,
      padding,
      dilation,
      transposed,
      output_padding,
      std::move(groups),
      output_mask);
  const c10::Device& device = input.device();
  return std::make_tuple(
      on_device(grad_input, device), on_device(grad_weight, device), on_device(grad_bias, device));
}

// Arguments that an operator writes although its schema does not mark them written (no
// `Tensor(a!)`): torch's CPU fallback copies back only the marked ones, so it would drop
// these writes. Batch norm's running statistics, as native_batch_norm (which
// F.batch_norm, the BatchNorm and InstanceNorm modules reach) and batch_norm_update_stats
// write them; the other operators that do (cudnn_batch_norm, miopen_batch_norm,
// batch_norm_gather_stats) have no CPU kernel, and _native_batch_norm_legit and
// _batch_norm_with_update mark theirs.
bool writes_unmarked(const c10::FunctionSchema& schema, const c10::Argument& argument) {
  const std::string& name = schema.name();
  if (name != "aten::native_batch_norm" && name != "aten::batch_norm_update_stats") {
    return false;
  }
  return argument.name() == "running_mean" || argument.name() == "running_var";
}

// The CPU kernel writes such an argument in place, into the device's bytes (host_alias):
// its values, strides and the tensors that view it are then the CPU kernel's. The device
// tensors are returned, so that they live until the kernel has run.
std::vector<at::Tensor> alias_unmarked_writes(
    const c10::FunctionSchema& schema, torch::jit::Stack* stack, size_t first) {
  std::vector<at::Tensor> written;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    c10::IValue& value = (*stack)[first + i];
    if (value.isTensor() && value.toTensor().is_privateuseone() &&
        writes_unmarked(schema, schema.arguments()[i])) {
      written.push_back(value.toTensor());
      value = c10::IValue(host_alias(written.back()));
    }
  }
  return written;
}

// Every other operator: on the CPU, after the streams of the devices involved drained, once
// its tensors were found on one device (SameDevice).
void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  size_t count = schema.arguments().size();
  auto arguments = torch::jit::last(*stack, count);
  std::vector<size_t> generators;
  SameDevice same(schema);
  bool per_position = checks_per_position(schema);
  std::optional<c10::Device> common;
  std::vector<std::pair<size_t, std::vector<at::Tensor>>> lists;  // checked per position
  auto drain = [](const at::Tensor& tensor) {
    if (tensor.defined() && tensor.is_privateuseone()) {
      wait_current_stream(tensor.device().index());
    }
  };
  for (size_t i = 0; i < count; ++i) {
    const c10::IValue& value = arguments[i];
    if (value.isGenerator() || (value.isNone() && takes_generator(schema.arguments()[i]))) {
      generators.push_back(i);
    } else if (value.isTensor()) {
      drain(value.toTensor());
      same.check(common, value.toTensor(), i);
    } else if (value.isTensorList()) {
      std::vector<at::Tensor> tensors = value.toTensorList().vec();
      for (const at::Tensor& tensor : tensors) {
        drain(tensor);
        if (!per_position) {
          same.check(common, tensor, i);
        }
      }
      if (per_position) {
        lists.emplace_back(i, std::move(tensors));
      }
    } else if (value.isList()) {  // Tensor?[]: an indexing operator's indices, unchecked
      for (const c10::IValue& item : value.toListRef()) {
        if (item.isTensor()) {
          drain(item.toTensor());
        }
      }
    }
  }
  size_t positions = 0;
  for (const auto& list : lists) {
    positions = std::max(positions, list.second.size());
  }
  for (size_t position = 0; position < positions; ++position) {
    std::optional<c10::Device> here = common;
    for (const auto& list : lists) {
      if (position < list.second.size()) {
        same.check(here, list.second[position], list.first);
      }
    }
  }
  if (!generators.empty()) {
    swap_generators(schema, stack, stack->size() - count, generators, common);
  }
  std::vector<at::Tensor> written = alias_unmarked_writes(schema, stack, stack->size() - count);
  at::native::cpu_fallback(op, stack);
}

}  // namespace

void register_hooks() {
  static Hooks* hooks = new Hooks;
  at::RegisterPrivateUse1HooksInterface(hooks);
#if DEVICECTX_REGISTER_GENERATOR
  static auto* generators = new at::_GeneratorRegister(&new_generator);
  (void)generators;
#endif
#if DEVICECTX_TORCH_AT_LEAST(2, 8)
  static HostAllocator* host = new HostAllocator;
  at::setHostAllocator(kEmu, host);
#endif
  c10::SetAllocator(kEmu, device_allocator(-1));
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("view", TORCH_FN(at::native::view));
  m.impl("_reshape_alias", TORCH_FN(at::native::_reshape_alias));
  m.impl("unfold", TORCH_FN(at::native::unfold));
  m.impl("view_as_real", TORCH_FN(at::native::view_as_real));
  m.impl("view_as_complex", TORCH_FN(at::native::view_as_complex));
  m.impl("resize_", resize_);
  m.impl("set_.source_Storage", TORCH_FN(at::native::set_));
  m.impl("set_.source_Storage_storage_offset", TORCH_FN(at::native::set_storage_cpu_));
  m.impl("set_.source_Tensor", TORCH_FN(at::native::set_tensor_));
  m.impl("set_", set_empty);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("record_stream", record_stream);
  m.impl("native_dropout", native_dropout);
  m.impl("convolution_overrideable", convolution_overrideable);
  m.impl("convolution_backward_overrideable", convolution_backward_overrideable);
  // Ops with a CPU kernel and a composite one, which torch runs for a backend without a
  // kernel: layer and group norm decompose into other ops, whose rounding differs from the
  // CPU kernel's by a few ulps. The device runs the CPU kernel, through the fallback.
  m.impl("native_layer_norm", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("native_group_norm", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  // Ops whose meta function resizes the output after sizing it as the inputs: for a backend
  // without a kernel, torch's composite kernel allocates that output and calls the out=
  // variant, whose CPU kernel (through the fallback) sizes a one-element output again and
  // warns "An output with one or more elements was resized". A GPU runs the functional
  // kernel, which warns nothing: so does the emulated device, through the fallback.
  m.impl("mse_loss", torch::CppFunction::makeFromBoxedFunction<&fallback>());
  m.impl("smooth_l1_loss", torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

// A conjugate or negative view (z.conj(), autograd's backward of a complex product) reaches
// copy_from with its bit set, which host_alias keeps for the CPU's copy to resolve. Without
// these, torch's conj/neg fallback would resolve the bit first, by a clone, whose copy comes
// back here through the same fallback, for ever (a stack overflow). The in-tree devices
// copy without _copy_from; devices out of tree (XLA) get the bit too, in a process that
// enabled the emulator.
TORCH_LIBRARY_IMPL(aten, Conjugate, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

TORCH_LIBRARY_IMPL(aten, Negative, m) {
  m.impl("_copy_from", torch::CppFunction::makeFallthrough());
  m.impl("_copy_from_and_resize", torch::CppFunction::makeFallthrough());
}

}  // namespace devicectx_emu
