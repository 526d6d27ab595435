// torch.autocast("emu"): the op lists torch itself uses for CUDA, MPS and XPU.
//
// torch 2.6 to 2.15 register nothing for AutocastPrivateUse1, not even a fallthrough, so
// without this every op under torch.autocast("emu") fails. Registered at run time, and only
// where torch has no fallback of its own for the key (a later torch may add one).
#include "runtime.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace devicectx_emu {

void register_autocast() {
  auto& dispatcher = c10::Dispatcher::singleton();
  if (dispatcher.hasBackendFallbackForDispatchKey(c10::DispatchKey::AutocastPrivateUse1)) {
    return;
  }
  static auto* fallback = new torch::Library(
      torch::Library::IMPL, "_", c10::DispatchKey::AutocastPrivateUse1, __FILE__, __LINE__);
  fallback->fallback(torch::CppFunction::makeFallthrough());

  static auto* library = new torch::Library(
      torch::Library::IMPL, "aten", c10::DispatchKey::AutocastPrivateUse1, __FILE__, __LINE__);
  torch::Library& m = *library;  // the KERNEL macros register through `m`
  using namespace at;  // and name Tensor, Scalar, ... unqualified
#define DEVICECTX_LOWER(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define DEVICECTX_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define DEVICECTX_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define DEVICECTX_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
#define DEVICECTX_REDISPATCH(REDISPATCH_FUNC, NAME, SIGNATURE, REDISPATCH_SIGNATURE, POLICY) \
  KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE(                                        \
      REDISPATCH_FUNC, NAME, SIGNATURE, REDISPATCH_SIGNATURE, POLICY)
  AT_FORALL_LOWER_PRECISION_FP(DEVICECTX_LOWER)
  AT_FORALL_FP32(DEVICECTX_FP32)
  AT_FORALL_FP32_SET_OPT_DTYPE(DEVICECTX_FP32_SET_OPT_DTYPE)
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(DEVICECTX_REDISPATCH)
  AT_FORALL_PROMOTE(DEVICECTX_PROMOTE)
#undef DEVICECTX_LOWER
#undef DEVICECTX_FP32
#undef DEVICECTX_FP32_SET_OPT_DTYPE
#undef DEVICECTX_PROMOTE
#undef DEVICECTX_REDISPATCH
}

}  // namespace devicectx_emu
