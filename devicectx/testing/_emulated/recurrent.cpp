// The fused recurrent cells, which torch calls for a backend registered out of tree as for
// CUDA (aten/src/ATen/native/RNN.cpp: nn.LSTM, nn.GRU, nn.LSTMCell, nn.GRUCell), and which
// have no CPU kernel for the fallback to run: a real backend writes its own, and so does
// the emulated one, from the device's own operators (each of which runs on the CPU through
// the fallback, after the streams drain).
//
// Each computes what CUDA's kernels compute (aten/src/ATen/native/cuda/RNN.cu) and keeps
// the same workspace, so that torch's derivatives (derivatives.yaml, which pass the
// workspace to the backward operators) hold: an LSTM's is its four gates after their
// activations, a GRU's its reset, update and new gates, the previous hidden state and the
// hidden state's share of the new gate.
#include "runtime.h"

#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

namespace devicectx_emu {
namespace {

bool given(const std::optional<at::Tensor>& tensor) {
  return tensor.has_value() && tensor->defined();
}

at::Tensor with_bias(const at::Tensor& gates, const std::optional<at::Tensor>& bias) {
  return given(bias) ? gates + *bias : gates;
}

// The shapes CUDA's kernels check (checkSizes): 2-D gates of `gates` times the state's
// width, a state of the gates' rows, biases of the gates' width.
void check_sizes(
    const char* op,
    const at::Tensor& input_gates,
    const at::Tensor& hidden_gates,
    const at::Tensor& state,
    const std::optional<at::Tensor>& input_bias,
    const std::optional<at::Tensor>& hidden_bias,
    int64_t gates) {
  TORCH_CHECK(
      input_gates.dim() == 2 && state.dim() == 2 && input_gates.sizes() == hidden_gates.sizes() &&
          input_gates.size(0) == state.size(0) && input_gates.size(1) == gates * state.size(1),
      op,
      ": expected gates of shape [batch, ",
      gates,
      " * hidden] and a state of shape [batch, hidden], got ",
      input_gates.sizes(),
      ", ",
      hidden_gates.sizes(),
      " and ",
      state.sizes());
  TORCH_CHECK(given(input_bias) == given(hidden_bias), op, ": expected both biases or neither");
  for (const auto& bias : {input_bias, hidden_bias}) {
    TORCH_CHECK(
        !given(bias) || (bias->dim() == 1 && bias->size(0) == input_gates.size(1)),
        op,
        ": expected a bias of shape [",
        input_gates.size(1),
        "], got ",
        bias->sizes());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell(
    const at::Tensor& input_gates,
    const at::Tensor& hidden_gates,
    const at::Tensor& cx,
    const std::optional<at::Tensor>& input_bias,
    const std::optional<at::Tensor>& hidden_bias) {
  check_sizes("_thnn_fused_lstm_cell", input_gates, hidden_gates, cx, input_bias, hidden_bias, 4);
  at::Tensor sums = with_bias(with_bias(input_gates + hidden_gates, input_bias), hidden_bias);
  std::vector<at::Tensor> gates = sums.chunk(4, 1);
  at::Tensor in = gates[0].sigmoid();
  at::Tensor forget = gates[1].sigmoid();
  at::Tensor cell = gates[2].tanh();
  at::Tensor out = gates[3].sigmoid();
  at::Tensor cy = forget * cx + in * cell;
  at::Tensor hy = out * cy.tanh();
  return std::make_tuple(hy, cy, at::cat({in, forget, cell, out}, 1));
}

// The gradients of the gates (as one tensor, each gate's before its activation), of cx and
// of the bias (the gates' gradient summed over the batch). Either state's gradient may be
// missing (a loss that reads one state only); with neither, nothing flows.
std::tuple<at::Tensor, at::Tensor, at::Tensor> fused_lstm_cell_backward(
    const std::optional<at::Tensor>& grad_hy,
    const std::optional<at::Tensor>& grad_cy,
    const at::Tensor& cx,
    const at::Tensor& cy,
    const at::Tensor& workspace,
    bool has_bias) {
  if (!given(grad_hy) && !given(grad_cy)) {
    return std::make_tuple(at::Tensor(), at::Tensor(), at::Tensor());
  }
  std::vector<at::Tensor> gates = workspace.chunk(4, 1);
  const at::Tensor& in = gates[0];
  const at::Tensor& forget = gates[1];
  const at::Tensor& cell = gates[2];
  const at::Tensor& out = gates[3];
  at::Tensor tanh_cy = cy.tanh();
  at::Tensor grad_c = given(grad_cy) ? *grad_cy : at::zeros_like(cx);
  at::Tensor grad_out = at::zeros_like(cx);
  if (given(grad_hy)) {
    grad_c = grad_c + *grad_hy * out * (1 - tanh_cy * tanh_cy);
    grad_out = *grad_hy * tanh_cy;
  }
  at::Tensor grad_gates = at::cat(
      {grad_c * cell * in * (1 - in),
       grad_c * cx * forget * (1 - forget),
       grad_c * in * (1 - cell * cell),
       grad_out * out * (1 - out)},
      1);
  at::Tensor grad_bias = has_bias ? grad_gates.sum(0) : at::Tensor();
  return std::make_tuple(grad_gates, grad_c * forget, grad_bias);
}

std::tuple<at::Tensor, at::Tensor> fused_gru_cell(
    const at::Tensor& input_gates,
    const at::Tensor& hidden_gates,
    const at::Tensor& hx,
    const std::optional<at::Tensor>& input_bias,
    const std::optional<at::Tensor>& hidden_bias) {
  check_sizes("_thnn_fused_gru_cell", input_gates, hidden_gates, hx, input_bias, hidden_bias, 3);
  std::vector<at::Tensor> in = with_bias(input_gates, input_bias).chunk(3, 1);
  std::vector<at::Tensor> hidden = with_bias(hidden_gates, hidden_bias).chunk(3, 1);
  at::Tensor reset = (in[0] + hidden[0]).sigmoid();
  at::Tensor update = (in[1] + hidden[1]).sigmoid();
  at::Tensor fresh = (in[2] + reset * hidden[2]).tanh();
  at::Tensor hy = fresh + update * (hx - fresh);
  return std::make_tuple(hy, at::cat({reset, update, fresh, hx, hidden[2]}, 1));
}

// The gradients of the input's gates, of the hidden state's gates (each gate's before its
// activation), of hx and of the two biases.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_gru_cell_backward(
    const at::Tensor& grad_hy, const at::Tensor& workspace, bool has_bias) {
  std::vector<at::Tensor> saved = workspace.chunk(5, 1);
  const at::Tensor& reset = saved[0];
  const at::Tensor& update = saved[1];
  const at::Tensor& fresh = saved[2];
  const at::Tensor& hx = saved[3];
  const at::Tensor& hidden_fresh = saved[4];
  at::Tensor grad_update = grad_hy * (hx - fresh) * (1 - update) * update;
  at::Tensor grad_fresh = grad_hy * (1 - update) * (1 - fresh * fresh);
  at::Tensor grad_reset = grad_fresh * hidden_fresh * (1 - reset) * reset;
  at::Tensor grad_input = at::cat({grad_reset, grad_update, grad_fresh}, 1);
  at::Tensor grad_hidden = at::cat({grad_reset, grad_update, grad_fresh * reset}, 1);
  at::Tensor grad_input_bias = has_bias ? grad_input.sum(0) : at::Tensor();
  at::Tensor grad_hidden_bias = has_bias ? grad_hidden.sum(0) : at::Tensor();
  return std::make_tuple(
      grad_input, grad_hidden, grad_hy * update, grad_input_bias, grad_hidden_bias);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("_thnn_fused_lstm_cell", fused_lstm_cell);
  m.impl("_thnn_fused_lstm_cell_backward_impl", fused_lstm_cell_backward);
  m.impl("_thnn_fused_gru_cell", fused_gru_cell);
  m.impl("_thnn_fused_gru_cell_backward", fused_gru_cell_backward);
}

}  // namespace devicectx_emu
