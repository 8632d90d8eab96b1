#include "mfsdp/train/pipeline_runner.h"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/autograd.h>

#include <chrono>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

namespace mfsdp {
namespace {

// What a forward keeps for its backward.
struct InFlight {
  at::Tensor input;   // the received hidden states (a leaf whose gradient goes back); undefined first
  at::Tensor output;  // the chunk's output, or its loss on the last chunk
};

void check_activation(const at::Tensor& output, const PipelineLayout& layout, int chunk, int64_t micro_batch) {
  const bool shape_agreed = layout.variable_shapes ? output.dim() == static_cast<int64_t>(layout.activation_shape.size())
                                                   : output.sizes().vec() == layout.activation_shape;
  if (shape_agreed && output.scalar_type() == layout.activation_options.dtype()) return;
  throw std::logic_error("pipeline stage " + std::to_string(layout.stage) + ", chunk " + std::to_string(chunk) +
                         ", micro-batch " + std::to_string(micro_batch) + ": the output is " +
                         c10::str(output.sizes(), " ", output.scalar_type()) + " but the next stage expects " +
                         c10::str(at::IntArrayRef(layout.activation_shape), " ",
                                  c10::typeMetaToScalarType(layout.activation_options.dtype())));
}

}  // namespace

at::Tensor run_pipeline(const PipelineLayout& layout, const std::vector<PipelineAction>& schedule,
                        const BeforeBackward& before_backward, const ChunkForward& forward, PipelineTimes* times) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  double waiting = 0;
  const int stages = layout.stages, stage = layout.stage;
  const int chunks = stages * layout.virtual_stages;
  const int previous = (stage + stages - 1) % stages, next = (stage + 1) % stages;
  std::map<int, size_t> last_backward;  // per chunk: the index of its last backward
  size_t step_last_backward = schedule.size();
  for (size_t i = 0; i < schedule.size(); ++i)
    if (schedule[i].step == PipelineStep::kBackward) last_backward[schedule[i].chunk] = step_last_backward = i;
  // Forwards only: nothing is kept for a backward.
  const bool training = step_last_backward < schedule.size();
  std::optional<at::NoGradGuard> no_grad;
  if (!training) no_grad.emplace();

  at::Tensor loss = at::zeros({}, layout.activation_options.dtype(at::kDouble).requires_grad(false));
  std::map<std::pair<int, int64_t>, InFlight> in_flight;  // by (chunk, micro-batch)
  // Sends are not waited for until the step's end (the next stage receives when it needs them);
  // their tensors stay alive here meanwhile.
  std::vector<std::pair<WorkHandle, std::vector<at::Tensor>>> sends;
  const auto send = [&](Communicator& comm, std::vector<at::Tensor> tensors, int peer) {
    std::vector<P2POp> ops;
    for (const at::Tensor& t : tensors) ops.push_back(P2POp{P2POp::Kind::kSend, t, peer});
    sends.emplace_back(comm.send_recv_async(ops), std::move(tensors));
  };
  // With variable shapes an activation's shape goes ahead of it, in a send of its own as the
  // receiver's receives are (NCCL matches a group of sends only with a group of receives alike;
  // Megatron's _communicate_shapes does the same).
  const auto send_activation = [&](const at::Tensor& t) {
    if (layout.variable_shapes) send(*layout.forward, {at::tensor(t.sizes().vec(), at::kLong).to(t.device())}, next);
    send(*layout.forward, {t}, next);
  };
  const auto receive = [&](Communicator& comm, int peer, at::IntArrayRef shape, const at::TensorOptions& options) {
    at::Tensor t = at::empty(shape, options);
    const auto before = Clock::now();
    comm.recv(t, peer);
    waiting += std::chrono::duration<double>(Clock::now() - before).count();
    return t;
  };
  const auto receive_activation = [&]() {
    if (!layout.variable_shapes)
      return receive(*layout.forward, previous, layout.activation_shape, layout.activation_options);
    const auto rank = static_cast<int64_t>(layout.activation_shape.size());
    const at::Tensor shape =
        receive(*layout.forward, previous, {rank}, layout.activation_options.dtype(at::kLong)).cpu();
    const int64_t* dims = shape.data_ptr<int64_t>();
    return receive(*layout.forward, previous, std::vector<int64_t>(dims, dims + rank), layout.activation_options);
  };

  for (size_t i = 0; i < schedule.size(); ++i) {
    const PipelineAction& a = schedule[i];
    const int model_chunk = a.chunk * stages + stage;
    const bool first = model_chunk == 0, last = model_chunk == chunks - 1;
    const auto key = std::make_pair(a.chunk, a.micro_batch);
    if (a.step == PipelineStep::kForward) {
      RECORD_USER_SCOPE("mfsdp::pipeline_forward");
      InFlight f;
      if (!first) f.input = receive_activation().requires_grad_(training);
      ChunkOutput out = forward(a.chunk, a.micro_batch, f.input);
      if (last) {
        loss.add_(out.reported.detach().to(loss.device(), at::kDouble));
        f.output = out.loss;
      } else {
        check_activation(out.output, layout, a.chunk, a.micro_batch);
        send_activation(out.output.detach().contiguous());
        f.output = out.output;
      }
      if (training) in_flight.emplace(key, std::move(f));
    } else {
      RECORD_USER_SCOPE("mfsdp::pipeline_backward");
      auto it = in_flight.find(key);
      if (it == in_flight.end())
        throw std::logic_error("run_pipeline: backward of micro-batch " + std::to_string(a.micro_batch) + ", chunk " +
                               std::to_string(a.chunk) + " before its forward");
      InFlight f = std::move(it->second);
      in_flight.erase(it);
      before_backward(a.chunk, last_backward[a.chunk] == i, step_last_backward == i);
      if (last) {
        f.output.backward();
      } else {
        // The gradient of what this chunk sent: its output's shape.
        at::Tensor grad = receive(*layout.backward, next, f.output.sizes(), layout.activation_options);
        torch::autograd::backward({f.output}, {grad});
      }
      if (!first) {
        at::Tensor input_grad = f.input.grad();  // undefined only if the output ignored the input
        send(*layout.backward, {input_grad.defined() ? input_grad : at::zeros_like(f.input)}, previous);
      }
    }
  }
  if (!in_flight.empty())
    throw std::logic_error("run_pipeline: " + std::to_string(in_flight.size()) +
                           " forwards of the schedule had no backward");
  for (auto& [work, tensor] : sends) work->wait();
  if (times != nullptr) *times = {std::chrono::duration<double>(Clock::now() - start).count(), waiting};
  return loss;
}

at::Tensor run_forward_pipeline(const PipelineLayout& layout, int64_t micro_batches, const ChunkForward& forward) {
  std::vector<PipelineAction> forwards;
  for (const PipelineAction& a : pipeline_schedule(layout, micro_batches))
    if (a.step == PipelineStep::kForward) forwards.push_back(a);
  return run_pipeline(layout, forwards, [](int, bool, bool) {}, forward);
}

std::vector<PipelineAction> pipeline_schedule(const PipelineLayout& layout, int64_t micro_batches) {
  if (layout.virtual_stages > 1)
    return interleaved_one_f_one_b(layout.stages, layout.stage, layout.virtual_stages, micro_batches);
  return one_f_one_b(layout.stages, layout.stage, micro_batches);
}

}  // namespace mfsdp
