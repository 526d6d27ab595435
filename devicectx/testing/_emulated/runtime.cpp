// The emulated accelerator's runtime: see runtime.h.
//
// Everything global is allocated once and never freed: worker threads are detached, and
// tensors may be freed during interpreter shutdown, after static destructors would have run.
#include "runtime.h"

#include <c10/util/Exception.h>
#include <torch/version.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <pthread.h>
#include <thread>

// torch >= 2.9 asks the device type's allocator for torch.accelerator's memory functions
// (empty_cache, memory_allocated, memory_stats), as a c10::DeviceAllocator.
#define DEVICECTX_DEVICE_ALLOCATOR \
  (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= 209)
#if DEVICECTX_DEVICE_ALLOCATOR
#include <c10/core/CachingDeviceAllocator.h>
#endif

namespace devicectx_emu {
namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kStallCheck = std::chrono::milliseconds(20);
constexpr size_t kAlignment = 64;
// Freed blocks are kept (poisoned) this long before the real free, so that a late reader
// reads poison instead of unmapped memory.
constexpr size_t kQuarantineBytes = size_t{64} << 20;
constexpr size_t kQuarantineBlocks = 4096;

std::atomic<double> g_delay_ms{2.0};
std::atomic<bool> g_pinned{true};
std::atomic<bool> g_events{true};
std::atomic<bool> g_poison{true};
std::atomic<bool> g_float64{true};
std::atomic<bool> g_record_stream{true};
std::atomic<int64_t> g_memory_limit{0};
std::atomic<bool> g_generators{true};
std::atomic<int> g_device_count{0};
std::atomic<uint32_t> g_initialized{0};
std::atomic<bool> g_forked_after_use{false};  // this process is a child forked after a use

thread_local int tls_device = 0;
thread_local c10::StreamId tls_stream[kMaxDevices] = {};

class Worker;
thread_local Worker* tls_worker = nullptr;

// One stream: a FIFO of tasks and the thread that runs them in order.
class Worker {
 public:
  Worker(int device, c10::StreamId id, const std::atomic<bool>* device_paused)
      : device_(device), id_(id), device_paused_(device_paused) {}

  std::string name() const {
    return "emu:" + std::to_string(device_) + " stream " + std::to_string(id_);
  }

  void submit(std::function<void()> task) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
    ++pending_;
    if (!started_) {
      started_ = true;
      std::thread([this] { run(); }).detach();
    }
    work_.notify_one();
  }

  bool idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return pending_ == 0;
  }

  bool paused() const {
    return paused_.load() || device_paused_->load();
  }

  bool own_pause() const {
    return paused_.load();
  }

  void set_paused(bool paused) {
    paused_.store(paused);
    wake();
  }

  void wake() {
    std::lock_guard<std::mutex> lock(mu_);
    work_.notify_all();
  }

  // The paused stream that keeps this one from finishing its queue, if any: this one, or
  // the stream whose event this one's running task waits for, and so on.
  Worker* stalled_on() {
    Worker* worker = this;
    for (int depth = 0; worker != nullptr && depth < 16; ++depth) {
      {
        std::lock_guard<std::mutex> lock(worker->mu_);
        if (worker->pending_ == 0) {
          return nullptr;
        }
        if (worker->paused() && !worker->queue_.empty()) {
          return worker;
        }
      }
      worker = worker->waiting_on.load();
    }
    return nullptr;
  }

  void wait_idle() {
    TORCH_CHECK(
        tls_worker != this, "emu: a task on ", name(), " waited for its own stream");
    for (;;) {
      if (Worker* stalled = stalled_on()) {
        TORCH_CHECK(
            false,
            "emu: ",
            stalled->name(),
            " is paused (devicectx.testing.emulated.paused) with work queued, so waiting for ",
            name(),
            " here would never end\nfix: resume the device or stream before an operation "
            "that waits for it (an op on the device, a blocking copy, synchronize())");
      }
      std::unique_lock<std::mutex> lock(mu_);
      if (idle_.wait_for(lock, kStallCheck, [this] { return pending_ == 0; })) {
        std::string error;
        error.swap(error_);
        TORCH_CHECK(error.empty(), "emu: an asynchronous task on ", name(), " failed: ", error);
        return;
      }
    }
  }

  std::atomic<Worker*> waiting_on{nullptr};

 private:
  void run() {
    tls_worker = this;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_.wait(lock, [this] { return !queue_.empty() && !paused(); });
      std::function<void()> task = std::move(queue_.front());
      queue_.pop_front();
      lock.unlock();
      std::string error;
      try {
        task();
      } catch (const std::exception& e) {
        error = e.what();
      } catch (...) {
        error = "an unknown C++ exception";
      }
      task = nullptr;  // what the task holds is released outside the lock
      lock.lock();
      if (!error.empty() && error_.empty()) {
        error_ = error;
      }
      if (--pending_ == 0) {
        idle_.notify_all();
      }
    }
  }

  const int device_;
  const c10::StreamId id_;
  const std::atomic<bool>* device_paused_;
  std::mutex mu_;
  std::condition_variable work_;
  std::condition_variable idle_;
  std::deque<std::function<void()>> queue_;
  int64_t pending_ = 0;  // queued and running
  bool started_ = false;
  std::atomic<bool> paused_{false};
  std::string error_;
};

struct DeviceState {
  std::mutex mu;
  std::vector<Worker*> streams;  // by stream id
  std::atomic<bool> paused{false};
  std::atomic<uint32_t> next_pool{0};
};

DeviceState* devices() {
  static DeviceState* states = new DeviceState[kMaxDevices];
  return states;
}

Worker* worker(int index, c10::StreamId id) {
  DeviceState& state = devices()[checked_index(index)];
  std::lock_guard<std::mutex> lock(state.mu);
  TORCH_CHECK(
      id >= 0 && static_cast<size_t>(id) < state.streams.size(),
      "emu:",
      index,
      " has no stream with id ",
      id);
  return state.streams[static_cast<size_t>(id)];
}

std::vector<Worker*> workers(int index) {
  DeviceState& state = devices()[checked_index(index)];
  std::lock_guard<std::mutex> lock(state.mu);
  return state.streams;
}

// ---- memory ----

struct Block {
  void* ptr;
  size_t size;
  int device;  // -1: pinned host memory
  Worker* owner;  // the stream current when it was allocated; nullptr for host memory
  std::vector<Worker*> users;  // streams recorded on it (record_stream, queued copies)
};

struct Memory {
  std::mutex mu;
  std::map<uintptr_t, Block*> live;
  std::atomic<int64_t> allocated[kMaxDevices + 1] = {};
  std::atomic<int64_t> peak[kMaxDevices + 1] = {};
  std::mutex quarantine_mu;
  std::deque<Block*> quarantine;
  size_t quarantine_bytes = 0;
};

Memory& memory() {
  static Memory* state = new Memory;
  return *state;
}

int slot(int device) {
  return device < 0 ? kMaxDevices : device;
}

// The live block holding `ptr`; call with memory().mu held.
Block* find_block(const void* ptr) {
  auto& live = memory().live;
  auto address = reinterpret_cast<uintptr_t>(ptr);
  auto it = live.upper_bound(address);
  if (it == live.begin()) {
    return nullptr;
  }
  --it;
  Block* block = it->second;
  return address < it->first + std::max<size_t>(block->size, 1) ? block : nullptr;
}

void really_free(Block* block) {
  std::free(block->ptr);
  delete block;
}

void retire(Block* block) {
  if (g_poison.load()) {
    // 0xFF bytes: NaN in every floating dtype, -1 in signed integers.
    std::memset(block->ptr, 0xFF, block->size);
  }
  Memory& state = memory();
  std::vector<Block*> evicted;
  {
    std::lock_guard<std::mutex> lock(state.quarantine_mu);
    state.quarantine.push_back(block);
    state.quarantine_bytes += block->size;
    while (state.quarantine_bytes > kQuarantineBytes ||
           state.quarantine.size() > kQuarantineBlocks) {
      Block* oldest = state.quarantine.front();
      state.quarantine.pop_front();
      state.quarantine_bytes -= oldest->size;
      evicted.push_back(oldest);
    }
  }
  for (Block* oldest : evicted) {
    really_free(oldest);
  }
}

void delete_block(void* context) {
  auto* block = static_cast<Block*>(context);
  Memory& state = memory();
  std::vector<Worker*> streams;
  {
    std::lock_guard<std::mutex> lock(state.mu);
    state.live.erase(reinterpret_cast<uintptr_t>(block->ptr));
    state.allocated[slot(block->device)] -= static_cast<int64_t>(block->size);
    streams = block->users;
  }
  if (block->owner != nullptr) {
    streams.push_back(block->owner);
  }
  std::sort(streams.begin(), streams.end());
  streams.erase(std::unique(streams.begin(), streams.end()), streams.end());
  streams.erase(
      std::remove_if(streams.begin(), streams.end(), [](Worker* w) { return w->idle(); }),
      streams.end());
  if (streams.empty()) {
    retire(block);
    return;
  }
  // As CUDA's caching allocator: the block is reused (here: poisoned) only once every
  // stream it was used on has run past this point.
  auto left = std::make_shared<std::atomic<size_t>>(streams.size());
  for (Worker* stream : streams) {
    stream->submit([block, left] {
      if (left->fetch_sub(1) == 1) {
        retire(block);
      }
    });
  }
}

// Bytes as CUDA's out-of-memory message writes them.
std::string format_bytes(int64_t bytes) {
  const char* units[] = {"bytes", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024 && unit < 4) {
    value /= 1024;
    ++unit;
  }
  char text[64];
  std::snprintf(text, sizeof(text), unit == 0 ? "%.0f %s" : "%.2f %s", value, units[unit]);
  return text;
}

c10::DataPtr allocate_block(size_t size, int device, Worker* owner) {
  c10::Device where = device < 0 ? c10::Device(c10::DeviceType::CPU)
                                 : c10::Device(c10::DeviceType::PrivateUse1, device);
  if (size == 0) {
    return c10::DataPtr(nullptr, where);
  }
  Memory& state = memory();
  auto bytes_asked = static_cast<int64_t>(size);
  int64_t limit = device < 0 ? 0 : g_memory_limit.load();
  {
    // Counted before the allocation, under the lock: two threads cannot both pass the limit.
    std::lock_guard<std::mutex> lock(state.mu);
    int64_t before = state.allocated[slot(device)].load();
    if (limit > 0 && before + bytes_asked > limit) {
      // torch.OutOfMemoryError, worded as CUDA's caching allocator words it.
      TORCH_CHECK_WITH(
          OutOfMemoryError,
          false,
          "emu out of memory. Tried to allocate ",
          format_bytes(bytes_asked),
          ". emu:",
          device,
          " has a total capacity of ",
          format_bytes(limit),
          " of which ",
          format_bytes(std::max<int64_t>(limit - before, 0)),
          " is free. Of the allocated memory ",
          format_bytes(before),
          " is allocated by PyTorch. (The limit is the emulated device's: "
          "devicectx.testing.emulated.configure(memory_limit=...).)");
    }
    int64_t now = state.allocated[slot(device)] += bytes_asked;
    if (now > state.peak[slot(device)].load()) {
      state.peak[slot(device)].store(now);  // under state.mu: no lost update
    }
  }
  size_t rounded = (size + kAlignment - 1) / kAlignment * kAlignment;
  void* ptr = nullptr;
  if (posix_memalign(&ptr, kAlignment, rounded) != 0) {
    state.allocated[slot(device)] -= bytes_asked;
    TORCH_CHECK_WITH(
        OutOfMemoryError, false, "emu: out of memory allocating ", size, " bytes on ", where);
  }
  auto* block = new Block{ptr, size, device, owner, {}};
  {
    std::lock_guard<std::mutex> lock(state.mu);
    state.live[reinterpret_cast<uintptr_t>(ptr)] = block;
  }
  return c10::DataPtr(ptr, block, &delete_block, where);
}

void add_user(Block* block, Worker* stream) {
  if (stream != block->owner &&
      std::find(block->users.begin(), block->users.end(), stream) == block->users.end()) {
    block->users.push_back(stream);
  }
}

#if DEVICECTX_DEVICE_ALLOCATOR
using AllocatorBase = c10::DeviceAllocator;
#else
using AllocatorBase = c10::Allocator;
#endif

class DeviceAllocator final : public AllocatorBase {
 public:
  explicit DeviceAllocator(int index) : index_(index) {}

#if DEVICECTX_DEVICE_ALLOCATOR
  bool initialized() override {
    return true;
  }

  // Nothing is cached; the quarantine of freed blocks stays, since a late reader would
  // otherwise read unmapped memory.
  void emptyCache(c10::MempoolId_t /*pool*/) override {}

  void recordStream(const c10::DataPtr& data, c10::Stream stream) override {
    record_data_ptr(data, stream.device_index(), stream.id());
  }

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(c10::DeviceIndex index) override {
    c10::CachingDeviceAllocator::DeviceStats stats;
    auto& all = stats.allocated_bytes[static_cast<size_t>(
        c10::CachingDeviceAllocator::StatType::AGGREGATE)];
    all.current = memory().allocated[slot(checked_index(index))].load();
    all.peak = memory().peak[slot(checked_index(index))].load();
    stats.active_bytes = stats.allocated_bytes;
    stats.reserved_bytes = stats.allocated_bytes;
    return stats;
  }

  void resetAccumulatedStats(c10::DeviceIndex /*index*/) override {}

  void resetPeakStats(c10::DeviceIndex index) override {
    int at = slot(checked_index(index));
    memory().peak[at].store(memory().allocated[at].load());
  }
#endif

  c10::DataPtr allocate(size_t size) override {
    int index = checked_index(index_);
    mark_initialized(index);
    return allocate_block(size, index, worker(index, current_stream(index)));
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

 private:
  const int index_;
};

class PinnedAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t size) override {
    TORCH_CHECK(
        g_pinned.load(),
        "emu: pinned memory is switched off (devicectx.testing.emulated.configure("
        "pinned=False)), as on a device without it");
    mark_initialized(current_device());
    return allocate_block(size, -1, nullptr);
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return nullptr;
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

// ---- events ----

struct EventState {
  explicit EventState(int index) : device(index) {}
  const int device;
  std::mutex mu;
  std::condition_variable done;
  uint64_t recorded = 0;  // the version last queued
  uint64_t completed = 0;  // the version last reached by its stream
  Worker* stream = nullptr;  // where it was last recorded
  Clock::time_point at;
};

using EventHandle = std::shared_ptr<EventState>;

EventHandle& handle(void* event) {
  TORCH_CHECK(event != nullptr, "emu: an event that was never recorded");
  return *static_cast<EventHandle*>(event);
}

}  // namespace

// ---- switches ----

double delay_ms() {
  return g_delay_ms.load();
}
void set_delay_ms(double value) {
  TORCH_CHECK(value >= 0, "emu: the delay must be >= 0 ms, got ", value);
  g_delay_ms.store(value);
}
bool pinned_enabled() {
  return g_pinned.load();
}
void set_pinned_enabled(bool value) {
  g_pinned.store(value);
}
bool events_enabled() {
  return g_events.load();
}
void set_events_enabled(bool value) {
  g_events.store(value);
}
bool poison_enabled() {
  return g_poison.load();
}
void set_poison_enabled(bool value) {
  g_poison.store(value);
}
bool float64_enabled() {
  return g_float64.load();
}
void set_float64_enabled(bool value) {
  g_float64.store(value);
}
bool record_stream_enabled() {
  return g_record_stream.load();
}
void set_record_stream_enabled(bool value) {
  g_record_stream.store(value);
}
int64_t memory_limit() {
  return g_memory_limit.load();
}
void set_memory_limit(int64_t bytes) {
  TORCH_CHECK(bytes >= 0, "emu: the memory limit must be >= 0 bytes (0: none), got ", bytes);
  g_memory_limit.store(bytes);
}
bool generators_enabled() {
  return g_generators.load();
}
void set_generators_enabled(bool value) {
  g_generators.store(value);
}

// ---- devices ----

int device_count() {
  return g_device_count.load();
}

void set_device_count(int count) {
  TORCH_CHECK(
      count >= 1 && count <= kMaxDevices, "emu: between 1 and ", kMaxDevices, " devices, got ",
      count);
  TORCH_CHECK(g_device_count.load() == 0, "emu: the device count is already set");
  for (int index = 0; index < count; ++index) {
    DeviceState& state = devices()[index];
    std::lock_guard<std::mutex> lock(state.mu);
    for (c10::StreamId id = 0; id <= kPoolStreams; ++id) {
      state.streams.push_back(new Worker(index, id, &state.paused));
    }
  }
  g_device_count.store(count);
}

int checked_index(int index) {
  int count = g_device_count.load();
  if (index < 0) {
    index = tls_device;
  }
  TORCH_CHECK_INDEX(
      index < count, "emu:", index, " does not exist: there are ", count, " emu devices");
  return index;
}

int current_device() {
  return tls_device;
}

void set_current_device(int index) {
  tls_device = checked_index(index);
}

void refuse_in_forked_child() {
  TORCH_CHECK(
      !g_forked_after_use.load(),
      "Cannot re-initialize emu in forked subprocess. To use emu with multiprocessing, you "
      "must use the 'spawn' start method (the emulated accelerator refuses a device its "
      "parent process used before the fork, as CUDA does: the child has none of the "
      "parent's stream threads)");
}

void mark_initialized(int index) {
  refuse_in_forked_child();
  static std::once_flag watching;
  std::call_once(watching, [] {
    // A child forked from here on holds copies of the parent's streams without their
    // threads, and locks another thread may have held: CUDA refuses such a child the
    // device, and so does the emulator.
    pthread_atfork(nullptr, nullptr, [] { g_forked_after_use.store(true); });
  });
  g_initialized.fetch_or(uint32_t{1} << index);
}

bool is_initialized(int index) {
  return (g_initialized.load() >> checked_index(index)) & 1U;
}

// ---- streams ----

// These two never raise: the device guard calls them from noexcept functions.
c10::StreamId current_stream(int index) {
  if (index < 0) {
    index = tls_device;
  }
  return index < kMaxDevices ? tls_stream[index] : 0;
}

c10::StreamId exchange_stream(int index, c10::StreamId id) {
  if (index < 0) {
    index = tls_device;
  }
  if (index >= kMaxDevices) {
    return 0;
  }
  c10::StreamId old = tls_stream[index];
  tls_stream[index] = id;
  return old;
}

c10::StreamId pool_stream(int index) {
  index = checked_index(index);
  mark_initialized(index);
  return 1 + static_cast<c10::StreamId>(devices()[index].next_pool.fetch_add(1) % kPoolStreams);
}

c10::StreamId new_stream(int index) {
  index = checked_index(index);
  mark_initialized(index);
  DeviceState& state = devices()[index];
  std::lock_guard<std::mutex> lock(state.mu);
  auto id = static_cast<c10::StreamId>(state.streams.size());
  state.streams.push_back(new Worker(index, id, &state.paused));
  return id;
}

bool stream_exists(int index, c10::StreamId id) {
  DeviceState& state = devices()[checked_index(index)];
  std::lock_guard<std::mutex> lock(state.mu);
  return id >= 0 && static_cast<size_t>(id) < state.streams.size();
}

void submit(int index, c10::StreamId id, std::function<void()> task) {
  refuse_in_forked_child();
  worker(index, id)->submit(std::move(task));
}

bool query_stream(int index, c10::StreamId id) {
  return worker(index, id)->idle();
}

void wait_stream(int index, c10::StreamId id) {
  worker(index, id)->wait_idle();
}

void wait_current_stream(int index) {
  refuse_in_forked_child();
  index = checked_index(index);
  worker(index, tls_stream[index])->wait_idle();
}

void synchronize_device(int index) {
  for (Worker* stream : workers(index)) {
    stream->wait_idle();
  }
}

void set_paused(int index, c10::StreamId id, bool paused) {
  if (id >= 0) {
    worker(index, id)->set_paused(paused);
    return;
  }
  devices()[checked_index(index)].paused.store(paused);
  for (Worker* stream : workers(index)) {
    stream->wake();
  }
}

bool is_paused(int index, c10::StreamId id) {
  if (id >= 0) {
    return worker(index, id)->own_pause();
  }
  return devices()[checked_index(index)].paused.load();
}

// ---- events ----

void* create_event(int index) {
  return new EventHandle(std::make_shared<EventState>(checked_index(index)));
}

void destroy_event(void* event) {
  delete static_cast<EventHandle*>(event);
}

void record_event(void* event, int index, c10::StreamId id) {
  TORCH_CHECK(
      g_events.load(),
      "emu: events are switched off (devicectx.testing.emulated.configure(events=False)), "
      "as on a device without them");
  EventHandle state = handle(event);
  TORCH_CHECK(
      state->device == index,
      "emu: an event made on emu:",
      state->device,
      " cannot be recorded on emu:",
      index);
  mark_initialized(index);
  Worker* stream = worker(index, id);
  uint64_t version = 0;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    version = ++state->recorded;
    state->stream = stream;
  }
  stream->submit([state, version] {
    std::lock_guard<std::mutex> lock(state->mu);
    if (version > state->completed) {
      state->completed = version;
      state->at = Clock::now();
    }
    state->done.notify_all();
  });
}

void block_on_event(void* event, int index, c10::StreamId id) {
  EventHandle state = handle(event);
  uint64_t version = 0;
  Worker* source = nullptr;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    if (state->completed >= state->recorded) {
      return;
    }
    version = state->recorded;
    source = state->stream;
  }
  Worker* stream = worker(index, id);
  stream->submit([state, version, source, stream] {
    stream->waiting_on.store(source);
    std::unique_lock<std::mutex> lock(state->mu);
    state->done.wait(lock, [&] { return state->completed >= version; });
    stream->waiting_on.store(nullptr);
  });
}

bool query_event(void* event) {
  if (event == nullptr) {
    return true;  // never recorded
  }
  EventHandle& state = handle(event);
  std::lock_guard<std::mutex> lock(state->mu);
  return state->completed >= state->recorded;
}

void synchronize_event(void* event) {
  if (event == nullptr) {
    return;
  }
  EventHandle state = handle(event);
  uint64_t version = 0;
  Worker* source = nullptr;
  {
    std::lock_guard<std::mutex> lock(state->mu);
    version = state->recorded;
    source = state->stream;
  }
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(state->mu);
      if (state->done.wait_for(
              lock, kStallCheck, [&] { return state->completed >= version; })) {
        return;
      }
    }
    if (source != nullptr && source->stalled_on() != nullptr) {
      source->wait_idle();  // raises, naming the paused stream
    }
  }
}

double elapsed_ms(void* start, void* end) {
  EventHandle first = handle(start);
  EventHandle second = handle(end);
  Clock::time_point from;
  Clock::time_point to;
  {
    std::lock_guard<std::mutex> lock(first->mu);
    TORCH_CHECK(
        first->recorded > 0 && first->completed >= first->recorded,
        "emu: elapsed_time needs both events recorded and completed");
    from = first->at;
  }
  {
    std::lock_guard<std::mutex> lock(second->mu);
    TORCH_CHECK(
        second->recorded > 0 && second->completed >= second->recorded,
        "emu: elapsed_time needs both events recorded and completed");
    to = second->at;
  }
  return std::chrono::duration<double, std::milli>(to - from).count();
}

// ---- memory ----

c10::Allocator* device_allocator(int index) {
  static DeviceAllocator* current = new DeviceAllocator(-1);
  static DeviceAllocator** by_index = [] {
    auto** table = new DeviceAllocator*[kMaxDevices];
    for (int i = 0; i < kMaxDevices; ++i) {
      table[i] = new DeviceAllocator(i);
    }
    return table;
  }();
  return index < 0 ? current : by_index[checked_index(index)];
}

c10::Allocator* pinned_allocator() {
  static PinnedAllocator* allocator = new PinnedAllocator;
  return allocator;
}

bool is_pinned_ptr(const void* ptr) {
  if (!g_pinned.load() || ptr == nullptr) {
    return false;
  }
  std::lock_guard<std::mutex> lock(memory().mu);
  Block* block = find_block(ptr);
  return block != nullptr && block->device < 0;
}

int device_of_ptr(const void* ptr) {
  std::lock_guard<std::mutex> lock(memory().mu);
  Block* block = find_block(ptr);
  return block == nullptr ? -1 : block->device;
}

void record_data_ptr(const c10::DataPtr& data, int index, c10::StreamId id) {
  if (data.get_deleter() != &delete_block) {
    return;  // an empty tensor, or memory that is not ours
  }
  Worker* stream = worker(index, id);
  std::lock_guard<std::mutex> lock(memory().mu);
  add_user(static_cast<Block*>(data.get_context()), stream);
}

void record_host_ptr(const void* ptr, int index, c10::StreamId id) {
  Worker* stream = worker(index, id);
  std::lock_guard<std::mutex> lock(memory().mu);
  Block* block = find_block(ptr);
  if (block != nullptr) {
    add_user(block, stream);
  }
}

int64_t memory_allocated(int index) {
  return memory().allocated[index < 0 ? kMaxDevices : checked_index(index)].load();
}

int64_t quarantined_bytes() {
  std::lock_guard<std::mutex> lock(memory().quarantine_mu);
  return static_cast<int64_t>(memory().quarantine_bytes);
}

void release_quarantine() {
  std::deque<Block*> blocks;
  {
    std::lock_guard<std::mutex> lock(memory().quarantine_mu);
    blocks.swap(memory().quarantine);
    memory().quarantine_bytes = 0;
  }
  for (Block* block : blocks) {
    really_free(block);
  }
}

}  // namespace devicectx_emu
