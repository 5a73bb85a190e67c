// shmserve C++ client: tensors in the arena, inputs, outputs, results (and Options,
// with the engine).
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <variant>

#include <msgpack.hpp>

#include "shmserve/detail/engine.hpp"

namespace shmserve {

namespace detail {
struct Front;
}


/// A buffer of the caller's shared arena: fill it, pass it as an Input (zero-copy).
class Tensor {
 public:
  Tensor() = default;
  DType dtype() const { return dtype_; }
  const std::vector<int64_t> &shape() const { return shape_; }
  uint64_t nbytes() const { return nbytes_; }
  void *data() const { return block_ ? block_->engine->arena_at(block_->offset) : nullptr; }
  template <class T> T *data() const { return static_cast<T *>(data()); }
  uint64_t arena_offset() const { return block_ ? block_->offset : 0; }
  explicit operator bool() const { return static_cast<bool>(block_); }

 private:
  friend class Client;
  friend struct Input;
  std::shared_ptr<detail::Block> block_;
  DType dtype_ = DType::INVALID;
  std::vector<int64_t> shape_;
  uint64_t nbytes_ = 0;
};

// ------------------------------------------------------------------ device memory
// Tensors in the caller's GPU memory travel by CUDA IPC (docs/protocol.md 4.7, 7a):
// the server maps the caller's allocation and computes on it in place. This client
// does not link CUDA: the caller exports the allocation and hands over the record's
// fields. Only models whose instances all read device memory take them (KIND_GPU
// pytorch models); any other refuses them, INVALID_ARG naming the tensor.

/// Where a tensor lives in device memory, as its CUDA IPC record names it.
struct DeviceMemory {
  IpcHandle mem_handle{};    // cudaIpcGetMemHandle / cuIpcGetMemHandle of the allocation's base
  uint64_t offset = 0;       // the tensor's first byte, from that base (cuMemGetAddressRange)
  DeviceUuid device_uuid{};  // cudaDeviceProp::uuid / cuDeviceGetUuid of its GPU
  uint16_t device = 0;       // the caller's ordinal of that GPU (the server's messages name it)
};

/// An input in device memory: contiguous, C order, a fixed-size type. event: the
/// handle of an interprocess event (cudaEventInterprocess | cudaEventDisableTiming)
/// recorded after the caller's last write of the tensor; the server's stream waits
/// for it. Without one the caller's writes must be complete when it submits. The
/// caller keeps the tensor allocated and unchanged, and does not record the event
/// again, until the request's answer.
struct DeviceTensor : DeviceMemory {
  DType dtype = DType::INVALID;
  std::vector<int64_t> shape;
  std::optional<IpcHandle> event;
  /// Bytes of the tensor: product(shape) x element bytes (BYTES: InvalidArgumentError).
  uint64_t nbytes(const std::string &what) const {
    if (dtype_size(dtype) == 0)
      throw InvalidArgumentError(what + ": a device tensor holds a fixed-size type, not " + dtype_name(dtype));
    return element_count(shape) * dtype_size(dtype);
  }
};

/// A device buffer an output is written into (RequestOptions::device_outputs), up to
/// capacity bytes from `offset`. The server waits for no event before writing it: the
/// caller's work that still uses the buffer must be complete when it submits, or be
/// ordered before an input's event. It is written once the answer is in.
struct DeviceBuffer : DeviceMemory {
  uint64_t capacity = 0;
};

/// A request parameter's value (Triton's request parameters: bool, int, double, string).
using Parameter = std::variant<bool, int64_t, double, std::string>;

/// Per-request options, as Triton's: priority (1 = highest; 0 = the model's
/// default_priority_level), timeout_us (queue timeout, honoured where the model's queue
/// policy has allow_timeout_override; 0 = the model's), parameters (given to the model:
/// pb_utils request.parameters()); for a model with sequence_batching, the correlation
/// id (sequence_id, or sequence_id_str for a string id: set one of them) and
/// sequence_start / sequence_end (tritonclient's names).
struct RequestOptions {
  uint32_t priority = 0;
  uint64_t timeout_us = 0;
  std::map<std::string, Parameter> parameters;
  uint64_t sequence_id = 0;
  std::string sequence_id_str;
  bool sequence_start = false, sequence_end = false;
  /// Outputs, by name, that the server writes into the caller's device buffers instead
  /// of this client's arena (each must be among the outputs asked for). A buffer that
  /// is too small fails the request, OUTPUT_TOO_SMALL (a device buffer cannot grow).
  std::map<std::string, DeviceBuffer> device_outputs;
};

/// The msgpack map the protocol carries (docs/protocol.md, 4.5); empty for none.
inline std::string encode_parameters(const std::map<std::string, Parameter> &params) {
  if (params.empty()) return {};
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(static_cast<uint32_t>(params.size()));
  for (const auto &[key, value] : params) {
    if (key.empty()) throw InvalidArgumentError("request parameter names must not be empty");
    pk.pack(key);
    std::visit([&](const auto &v) { pk.pack(v); }, value);
  }
  if (buf.size() > SHMS_MAX_PARAMETER_BYTES)
    throw InvalidArgumentError("request parameters take " + std::to_string(buf.size()) +
                               " bytes packed (limit " + std::to_string(SHMS_MAX_PARAMETER_BYTES) + ")");
  return std::string(buf.data(), buf.size());
}

/// One input by name: a Tensor of the arena (zero-copy), caller memory, copied into
/// the arena at submit (the caller may reuse it once submit returns), or a tensor in
/// the caller's device memory (DeviceTensor: sent by CUDA IPC, never copied).
struct Input {
  std::string name;
  DType dtype = DType::INVALID;
  std::vector<int64_t> shape;
  const void *data = nullptr;
  uint64_t nbytes = 0;
  std::shared_ptr<detail::Block> block;  // set: zero-copy
  std::optional<DeviceTensor> device;    // set: in device memory

  Input(std::string n, DeviceTensor t)
      : name(std::move(n)), dtype(t.dtype), shape(t.shape), nbytes(t.nbytes("input '" + name + "'")),
        device(std::move(t)) {}

  Input(std::string n, const Tensor &t)
      : name(std::move(n)), dtype(t.dtype_), shape(t.shape_), nbytes(t.nbytes_), block(t.block_) {}
  Input(std::string n, DType t, std::vector<int64_t> s, const void *d, uint64_t bytes)
      : name(std::move(n)), dtype(t), shape(std::move(s)), data(d), nbytes(bytes) {}
  template <class T>
  Input(std::string n, std::vector<int64_t> s, const std::vector<T> &v)
      : name(std::move(n)), dtype(dtype_of<T>()), shape(std::move(s)), data(v.data()),
        nbytes(v.size() * sizeof(T)) {}
};

/// One output: a read-only view of shared memory, valid while its Result lives; or,
/// for an output written into the caller's device buffer (on_device()), its dtype,
/// shape and the bytes written there (data is null: the bytes are in that buffer).
struct Output {
  std::string name;
  uint32_t index = 0;
  DType dtype = DType::INVALID;
  std::vector<int64_t> shape;
  const void *data = nullptr;
  uint64_t nbytes = 0;
  MemoryKind memory_kind = MemoryKind::HOST_ARENA;
  uint16_t device_id = 0;  // on_device(): the caller's GPU ordinal it gave for the buffer
  bool on_device() const { return memory_kind != MemoryKind::HOST_ARENA; }
  template <class T> const T *as() const { return static_cast<const T *>(host()); }
  std::string_view bytes() const { return {static_cast<const char *>(host()), nbytes}; }
  std::vector<std::string> strings() const {  // BYTES outputs
    return decode_bytes(host(), nbytes, element_count(shape));
  }

 private:
  const void *host() const {
    if (on_device())
      throw InvalidArgumentError("output '" + name + "' was written into the caller's device buffer; "
                                 "it has no view in the arena");
    return data;
  }
};

class Result {
 public:
  Result() = default;
  const std::vector<Output> &outputs() const { return outputs_; }
  const Output &operator[](std::string_view name) const {
    for (const auto &o : outputs_) if (o.name == name) return o;
    throw InvalidArgumentError("result has no output '" + std::string(name) + "'");
  }
  size_t size() const { return outputs_.size(); }
  const std::string &model_name() const { return model_; }
  int64_t model_version() const { return version_; }
  /// CLOCK_MONOTONIC stamps, indexed by Timestamp (CLIENT_WAKE set by this client).
  const std::array<uint64_t, SHMS_T_COUNT> &timestamps_ns() const { return t_ns_; }
  uint64_t timestamp_ns(Timestamp t) const { return t_ns_.at(static_cast<size_t>(t)); }
  /// Returns the output memory to the arena now (if no copy of this Result holds it).
  void release() {
    outputs_.clear();
    block_.reset();
  }

 private:
  friend struct detail::Front;
  std::vector<Output> outputs_;
  std::shared_ptr<detail::Block> block_;
  std::string model_;
  int64_t version_ = 0;
  std::array<uint64_t, SHMS_T_COUNT> t_ns_{};
};

/// One response of Client::infer_stream. result's outputs are valid until the callback
/// returns; status != OK: an error response the model sent (error says why).
struct StreamResponse {
  uint32_t index = 0;  // 0, 1, ... in the order sent
  bool final = false;  // the model sent it with the final flag
  Status status = Status::OK;
  std::string error;
  Result result;
};

}  // namespace shmserve
