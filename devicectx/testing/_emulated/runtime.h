// The emulated accelerator's runtime: devices, streams, events and memory.
//
// Nothing here knows about ATen's operators; backend.cpp registers those, bindings.cpp
// exposes the switches to Python. Device memory is ordinary host memory that only this
// backend hands out, so a kernel "on the device" is a CPU kernel run over it.
//
// Streams: each is a FIFO of tasks run in order by its own worker thread (started at its
// first task). Only work that a GPU runs after the host call returns is queued (a
// non_blocking copy to or from pinned memory, an event record, an event wait, a deferred
// free); everything else waits for the current stream to drain and runs on the calling
// thread, which gives the same order.
#pragma once

#include <ATen/core/Generator.h>
#include <c10/core/Allocator.h>
#include <c10/core/Stream.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace devicectx_emu {

constexpr int kMaxDevices = 16;
// Stream ids: 0 is a device's default stream, 1..kPoolStreams its pool (handed out round
// robin, as CUDA's are), and every stream made after those is new.
constexpr c10::StreamId kPoolStreams = 4;

// The runtime switches (devicectx.testing.emulated.configure).
double delay_ms();
void set_delay_ms(double value);
bool pinned_enabled();
void set_pinned_enabled(bool value);
bool events_enabled();
void set_events_enabled(bool value);
bool poison_enabled();
void set_poison_enabled(bool value);
// What the device holds and does, for playing other devices (profiles): float64 and
// complex128 (MPS has neither), record_stream (some backends lack it), and how many bytes
// of memory each device has (0: as many as the host gives).
bool float64_enabled();
void set_float64_enabled(bool value);
bool record_stream_enabled();
void set_record_stream_enabled(bool value);
int64_t memory_limit();
void set_memory_limit(int64_t bytes);
// Whether torch.Generator(device="emu") can be made (false: a backend without generators
// of its own; random ops still draw from each device's default generator).
bool generators_enabled();
void set_generators_enabled(bool value);
// Float64 on the calling thread even where float64_enabled() is false, for torch's tensor
// printing (backend.cpp says why); returns the previous value.
bool set_float64_for_printing(bool value);

// Devices. The count is fixed once, before the backend is registered.
int device_count();
void set_device_count(int count);
int current_device();
void set_current_device(int index);
int checked_index(int index);  // -1 means the current device

// Contexts: a device is initialised by its first allocation, stream or event, or by
// pinned memory allocated while it is current (as a CUDA context is created).
void mark_initialized(int index);
// Raises in a child forked after this process used a device (as CUDA's lazy init does).
void refuse_in_forked_child();
bool is_initialized(int index);

// Streams.
c10::StreamId current_stream(int index);
c10::StreamId exchange_stream(int index, c10::StreamId id);
c10::StreamId pool_stream(int index);
c10::StreamId new_stream(int index);
bool stream_exists(int index, c10::StreamId id);
void submit(int index, c10::StreamId id, std::function<void()> task);
bool query_stream(int index, c10::StreamId id);
// Block the calling thread until the stream has run everything queued on it. Raises
// instead of waiting forever when the stream is paused (or waits on a paused stream),
// and re-raises the first error of a task that failed.
void wait_stream(int index, c10::StreamId id);
void wait_current_stream(int index);
void synchronize_device(int index);
void set_paused(int index, c10::StreamId id, bool paused);  // id < 0: the whole device
bool is_paused(int index, c10::StreamId id);

// Events: markers queued on a stream.
void* create_event(int index);
void destroy_event(void* event);
void record_event(void* event, int index, c10::StreamId id);
void block_on_event(void* event, int index, c10::StreamId id);
bool query_event(void* event);
void synchronize_event(void* event);
double elapsed_ms(void* start, void* end);

// Registers the hooks, the allocators and the generators with torch (backend.cpp).
void register_hooks();
// Each device's default generator, as torch.emu.default_generators holds it (backend.cpp).
const at::Generator& default_generator(int index);  // -1: the current device
// Registers torch.autocast("emu") (autocast.cpp).
void register_autocast();

// Memory.
c10::Allocator* device_allocator(int index);  // -1: the current device
c10::Allocator* pinned_allocator();
bool is_pinned_ptr(const void* ptr);
int device_of_ptr(const void* ptr);  // -1 when the pointer is no device memory of ours
// The block behind a DataPtr of ours is poisoned and freed only once `id` has run past
// the point where the block is freed (torch's record_stream).
void record_data_ptr(const c10::DataPtr& data, int index, c10::StreamId id);
// Host memory that a queued task reads or writes: its free waits for that task.
void record_host_ptr(const void* ptr, int index, c10::StreamId id);
int64_t memory_allocated(int index);  // -1: pinned host memory
int64_t quarantined_bytes();
void release_quarantine();

}  // namespace devicectx_emu
