// shmserve C++ client: tensors in the arena, inputs, outputs, results (and Options,
// with the engine).
#pragma once

#include <functional>
#include <map>
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

/// One input by name: either a Tensor of the arena (zero-copy) or caller memory,
/// copied into the arena at submit (the caller may reuse it once submit returns).
struct Input {
  std::string name;
  DType dtype = DType::INVALID;
  std::vector<int64_t> shape;
  const void *data = nullptr;
  uint64_t nbytes = 0;
  std::shared_ptr<detail::Block> block;  // set: zero-copy

  Input(std::string n, const Tensor &t)
      : name(std::move(n)), dtype(t.dtype_), shape(t.shape_), nbytes(t.nbytes_), block(t.block_) {}
  Input(std::string n, DType t, std::vector<int64_t> s, const void *d, uint64_t bytes)
      : name(std::move(n)), dtype(t), shape(std::move(s)), data(d), nbytes(bytes) {}
  template <class T>
  Input(std::string n, std::vector<int64_t> s, const std::vector<T> &v)
      : name(std::move(n)), dtype(dtype_of<T>()), shape(std::move(s)), data(v.data()),
        nbytes(v.size() * sizeof(T)) {}
};

/// One output: a read-only view of shared memory, valid while its Result lives.
struct Output {
  std::string name;
  uint32_t index = 0;
  DType dtype = DType::INVALID;
  std::vector<int64_t> shape;
  const void *data = nullptr;
  uint64_t nbytes = 0;
  template <class T> const T *as() const { return static_cast<const T *>(data); }
  std::string_view bytes() const { return {static_cast<const char *>(data), nbytes}; }
  std::vector<std::string> strings() const {  // BYTES outputs
    return decode_bytes(data, nbytes, element_count(shape));
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
