// shmserve C++ client, internal: the facade's side of a request. A caller's Inputs
// (names, caller memory or arena Tensors) become an engine Call; a finished Call
// becomes a Result of named Outputs. The engine (engine.hpp) does the rest.
#pragma once

#include "shmserve/types.hpp"

namespace shmserve {
namespace detail {

struct Front {
  /// Arena bytes of a device tensor's shms_cuda_ipc record (64-aligned, as tensor data).
  static uint64_t record_bytes() { return align64(sizeof(shms_cuda_ipc)); }

  /// Resolves names against the model, copies the inputs that are not in this lease's
  /// arena into it (one block with the output buffers), and sends the request.
  static std::shared_ptr<Call> submit(Engine &e, const std::string &model_name, const std::vector<Input> &inputs,
                                      const std::vector<std::string> &outputs, int64_t version,
                                      const RequestOptions &options = {}, uint32_t extra_flags = 0) {
    auto call = std::make_shared<Call>();
    const std::string params = encode_parameters(options.parameters);
    call->priority = options.priority;
    call->timeout_us = options.timeout_us;
    const std::string &sid = options.sequence_id_str;
    if (!sid.empty() && options.sequence_id)
      throw InvalidArgumentError("a request has a numeric or a string correlation id, not both");
    if (sid.size() > SHMS_MAX_SEQUENCE_ID_BYTES)
      throw InvalidArgumentError("sequence_id_str takes " + std::to_string(sid.size()) + " bytes (limit " +
                                 std::to_string(SHMS_MAX_SEQUENCE_ID_BYTES) + ")");
    call->sequence_id = options.sequence_id;
    call->flags = (options.sequence_start ? SHMS_REQUEST_SEQUENCE_START : 0u) |
                  (options.sequence_end ? SHMS_REQUEST_SEQUENCE_END : 0u) | extra_flags;
    call->model = e.model(model_name, version);
    const ModelInfo &m = *call->model;
    if (inputs.size() > SHMS_MAX_TENSORS)
      throw InvalidArgumentError("more than " + std::to_string(SHMS_MAX_TENSORS) + " inputs");
    uint64_t copy_bytes = 0;
    std::vector<uint32_t> index(inputs.size());
    for (size_t i = 0; i < inputs.size(); i++) {
      const Input &in = inputs[i];
      int k = m.input_index(in.name);
      if (k < 0) {
        std::string names;
        for (const auto &t : m.inputs) names += (names.empty() ? "" : ", ") + t.name;
        throw InvalidArgumentError("model '" + m.name + "' has no input '" + in.name + "' (inputs: " + names + ")");
      }
      index[i] = static_cast<uint32_t>(k);
      if (in.shape.size() > SHMS_MAX_DIMS)
        throw InvalidArgumentError("model '" + m.name + "' input '" + in.name + "' has more than " +
                                   std::to_string(SHMS_MAX_DIMS) + " dimensions");
      if (in.device) {
        copy_bytes += record_bytes();  // its CUDA IPC record, in place of its bytes
      } else if (!in_arena(e, in)) {
        if (!in.data && in.nbytes) throw InvalidArgumentError("input '" + in.name + "' has no data");
        copy_bytes += align64(in.nbytes);
      }
      call->in_bytes += in.nbytes;
    }
    if (m.batched() && !inputs.empty() && !inputs[0].shape.empty() && inputs[0].shape[0] > 0)
      call->rows = static_cast<uint64_t>(inputs[0].shape[0]);
    std::vector<OutputWant> want;
    want.reserve(outputs.empty() ? m.outputs.size() : outputs.size());
    call->in_refs.reserve(inputs.size());
    if (outputs.empty()) {
      for (uint32_t k = 0; k < m.outputs.size(); k++) want.push_back({k});
    } else {
      for (const auto &name : outputs) {
        int k = m.output_index(name);
        if (k < 0) throw InvalidArgumentError("model '" + m.name + "' has no output '" + name + "'");
        want.push_back({static_cast<uint32_t>(k)});
      }
    }
    for (const auto &[name, buf] : options.device_outputs) {
      auto w = std::find_if(want.begin(), want.end(), [&](const OutputWant &o) { return m.outputs[o.index].name == name; });
      if (w == want.end())
        throw InvalidArgumentError("model '" + m.name + "' output '" + name + "' has a device buffer but is " +
                                   (m.output_index(name) < 0 ? "not an output of the model" : "not asked for"));
      w->device = true;
      w->device_capacity = buf.capacity;
      w->device_id = buf.device;
    }
    // The packed parameters, then a string correlation id, go into the staging area
    // after the copied inputs.
    e.reserve(*call, want, copy_bytes + (params.empty() ? 0 : align64(params.size())) +
                               (sid.empty() ? 0 : align64(sid.size())));
    uint64_t at = call->staging;
    for (size_t i = 0; i < inputs.size(); i++) {
      const Input &in = inputs[i];
      uint64_t off = at;
      if (in.device) {  // the record (the caller's tensor stays where it is)
        const DeviceTensor &d = *in.device;
        shms_cuda_ipc record = make_cuda_ipc_record(d.mem_handle, d.offset, d.device_uuid, d.event ? &*d.event : nullptr);
        std::memcpy(e.arena_at(off), &record, sizeof record);
        call->in_refs.push_back(
            make_tensor_ref(index[i], in.dtype, off, in.nbytes, in.shape, MemoryKind::CUDA_IPC, d.device));
        at += record_bytes();
        continue;
      }
      if (in_arena(e, in)) {
        off = in.block->offset;
        call->keep.push_back(in.block);
      } else {
        if (in.nbytes) std::memcpy(e.arena_at(off), in.data, in.nbytes);  // the one copy in
        at += align64(in.nbytes);
      }
      call->in_refs.push_back(make_tensor_ref(index[i], in.dtype, off, in.nbytes, in.shape));
    }
    for (const shms_tensor_ref &ref : call->out_refs) {  // device buffers' records (no event)
      if (ref.memory_kind != SHMS_MEMORY_CUDA_IPC) continue;
      const DeviceBuffer &d = options.device_outputs.at(m.outputs[ref.index].name);
      shms_cuda_ipc record = make_cuda_ipc_record(d.mem_handle, d.offset, d.device_uuid);
      std::memcpy(e.arena_at(ref.offset), &record, sizeof record);
    }
    if (!params.empty()) {
      std::memcpy(e.arena_at(at), params.data(), params.size());
      call->parameters_offset = at;
      call->parameters_bytes = static_cast<uint32_t>(params.size());
      at += align64(params.size());
    }
    if (!sid.empty()) {
      std::memcpy(e.arena_at(at), sid.data(), sid.size());
      call->sequence_id_offset = at;
      call->sequence_id_bytes = static_cast<uint32_t>(sid.size());
    }
    e.send(call);
    return call;
  }

  /// The outputs of a finished call: views of its output block, which they keep.
  static Result result(Engine &e, const Call &c) { return result(e, c, c.results); }

  /// Outputs of one response of a stream call (the final one: c.results).
  static Result result(Engine &e, const Call &c, const std::vector<shms_tensor_ref> &results) {
    Result r;
    r.model_ = c.model->name;
    r.version_ = c.model->version;
    r.t_ns_ = c.t_ns;
    r.outputs_.reserve(results.size());
    for (const shms_tensor_ref &t : results) {
      Output o;
      o.index = t.index;
      o.name = c.model->outputs.at(t.index).name;
      o.dtype = static_cast<DType>(t.dtype);
      o.shape.assign(t.shape, t.shape + t.ndim);
      o.memory_kind = static_cast<MemoryKind>(t.memory_kind);
      o.device_id = t.device_id;
      o.data = o.on_device() ? nullptr : e.arena_at(t.offset);  // on the device: in the caller's buffer
      o.nbytes = t.nbytes;
      r.outputs_.push_back(std::move(o));
    }
    r.block_ = c.out_block;
    return r;
  }

 private:
  /// A Tensor of this lease's arena (zero-copy).
  static bool in_arena(const Engine &e, const Input &in) { return in.block && in.block->engine.get() == &e; }
};

}  // namespace detail
}  // namespace shmserve
