// The Python module of the emulated accelerator: what devicectx.testing.emulated calls.
#include "runtime.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <torch/csrc/Generator.h>

#include <vector>

namespace emu = devicectx_emu;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "devicectx's emulated accelerator (a torch PrivateUse1 backend)";
  m.def("register_backend", [](int devices) {
    emu::set_device_count(devices);
    emu::register_hooks();
    emu::register_autocast();
  });
  m.def("device_count", &emu::device_count);
  m.def("current_device", &emu::current_device);
  m.def("set_device", &emu::set_current_device);
  m.def("synchronize", [](int index) {
    pybind11::gil_scoped_release release;
    emu::synchronize_device(index);
  });
  m.def("initialized_devices", [] {
    std::vector<int> found;
    for (int index = 0; index < emu::device_count(); ++index) {
      if (emu::is_initialized(index)) {
        found.push_back(index);
      }
    }
    return found;
  });
  m.def("delay_ms", &emu::delay_ms);
  m.def("set_delay_ms", &emu::set_delay_ms);
  m.def("pinned_enabled", &emu::pinned_enabled);
  m.def("set_pinned_enabled", &emu::set_pinned_enabled);
  m.def("events_enabled", &emu::events_enabled);
  m.def("set_events_enabled", &emu::set_events_enabled);
  m.def("poison_enabled", &emu::poison_enabled);
  m.def("set_poison_enabled", &emu::set_poison_enabled);
  m.def("float64_enabled", &emu::float64_enabled);
  m.def("set_float64_enabled", &emu::set_float64_enabled);
  m.def("record_stream_enabled", &emu::record_stream_enabled);
  m.def("set_record_stream_enabled", &emu::set_record_stream_enabled);
  m.def("memory_limit", &emu::memory_limit);
  m.def("set_memory_limit", &emu::set_memory_limit);
  m.def("generators_enabled", &emu::generators_enabled);
  m.def("set_generators_enabled", &emu::set_generators_enabled);
  m.def("default_generator", [](int index) {
    // The Python object torch keeps for the generator, made at the first call.
    return pybind11::reinterpret_steal<pybind11::object>(
        THPGenerator_Wrap(emu::default_generator(index)));
  });
  m.def("set_float64_for_printing", &emu::set_float64_for_printing);
  m.def("set_paused", &emu::set_paused);
  m.def("is_paused", &emu::is_paused);
  m.def("memory_allocated", &emu::memory_allocated);
  m.def("quarantined_bytes", &emu::quarantined_bytes);
  m.def("release_quarantine", &emu::release_quarantine);
}
