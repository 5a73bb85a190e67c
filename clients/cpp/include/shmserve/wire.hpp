// shmserve C++ client: the control-socket codec (docs/protocol.md section 2), protocol
// version SHMS_PROTOCOL_VERSION (5).
//
// A frame is a big-endian u32 length, then one msgpack map. Requests carry "op";
// replies carry "ok" and either the answer's fields or "code", "error" and "type".
// Every message is a typed struct here, as in shmserve/protocol/control.py (same names,
// same fields in the same order, so the bytes are Python's): each lists its fields once
// in visit(), and encode()/decode() below work from that list. Decoding ignores keys it
// does not know (a newer peer may add fields); a missing or mistyped field is a
// ProtocolError naming it. tests/vectors/protocol_vectors.json pins the bytes.
#pragma once

#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST 1
#endif

#include <arpa/inet.h>

#include <cstring>
#include <limits>
#include <map>
#include <msgpack.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "shmserve/errors.hpp"

namespace shmserve {

// ------------------------------------------------------------------ the field codec

namespace wire {

using Packer = msgpack::packer<msgpack::sbuffer>;
enum Presence { kRequired, kOptional };  // kOptional: a missing key keeps the default

[[noreturn]] inline void bad_field(std::string_view key, const char *want) {
  throw ProtocolError("control message: field '" + std::string(key) + "' must be " + want);
}

/// One value: pack(), and unpack() with the field's key for errors; `strict` (tests)
/// refuses keys no field names. The primary template is a struct with visit(): a map.
template <class T, class = void> struct Codec;

/// Decodes the fields of `o` (a map) into m.
template <class M> void unpack_fields(const msgpack::object &o, M &m, bool strict, std::string_view envelope = {}) {
  if (o.type != msgpack::type::MAP) throw ProtocolError("control message is not a map");
  auto find = [&](std::string_view key) -> const msgpack::object * {
    for (uint32_t i = 0; i < o.via.map.size; i++) {
      const auto &kv = o.via.map.ptr[i];
      if (kv.key.type == msgpack::type::STR && std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) == key)
        return &kv.val;
    }
    return nullptr;
  };
  uint32_t known = 0;
  M::visit(m, [&](std::string_view key, auto &value, Presence p = kRequired) {
    const msgpack::object *v = find(key);
    if (!v) {
      if (p == kRequired) throw ProtocolError("control message: field '" + std::string(key) + "' is missing");
      return;
    }
    known++;
    Codec<std::decay_t<decltype(value)>>::unpack(*v, value, key, strict);
  });
  if (!envelope.empty() && find(envelope)) known++;
  if (strict && known != o.via.map.size) throw ProtocolError("control message has a key no field names");
}

template <class M> void pack_fields(Packer &pk, const M &m) {
  M::visit(m, [&](std::string_view key, const auto &value, Presence = kRequired) {
    pk.pack_str(static_cast<uint32_t>(key.size()));
    pk.pack_str_body(key.data(), static_cast<uint32_t>(key.size()));
    Codec<std::decay_t<decltype(value)>>::pack(pk, value);
  });
}

template <class M> uint32_t field_count(const M &m) {
  uint32_t n = 0;
  M::visit(m, [&](std::string_view, const auto &, Presence = kRequired) { n++; });
  return n;
}

template <class T, class> struct Codec {  // a struct with visit(): a map of its fields
  static void pack(Packer &pk, const T &v) {
    pk.pack_map(field_count(v));
    pack_fields(pk, v);
  }
  static void unpack(const msgpack::object &o, T &v, std::string_view key, bool strict) {
    if (o.type != msgpack::type::MAP) bad_field(key, "a map");
    unpack_fields(o, v, strict);
  }
};

template <class T> struct Codec<T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>>> {
  static void pack(Packer &pk, T v) { pk.pack(v); }  // msgpack's smallest form, as Python's
  static void unpack(const msgpack::object &o, T &v, std::string_view key, bool) {
    if (o.type == msgpack::type::POSITIVE_INTEGER && o.via.u64 <= std::numeric_limits<T>::max())
      v = static_cast<T>(o.via.u64);
    else if (o.type == msgpack::type::NEGATIVE_INTEGER && std::is_signed_v<T> &&
             o.via.i64 >= static_cast<int64_t>(std::numeric_limits<T>::min()))
      v = static_cast<T>(o.via.i64);
    else
      bad_field(key, "an integer in range");
  }
};

template <> struct Codec<bool> {
  static void pack(Packer &pk, bool v) { pk.pack(v); }
  static void unpack(const msgpack::object &o, bool &v, std::string_view key, bool) {
    if (o.type != msgpack::type::BOOLEAN) bad_field(key, "a boolean");
    v = o.via.boolean;
  }
};

template <> struct Codec<std::string> {
  static void pack(Packer &pk, const std::string &v) { pk.pack(v); }
  static void unpack(const msgpack::object &o, std::string &v, std::string_view key, bool) {
    if (o.type != msgpack::type::STR) bad_field(key, "a string");
    v.assign(o.via.str.ptr, o.via.str.size);
  }
};

template <> struct Codec<DType> {  // by name: "FP32"
  static void pack(Packer &pk, DType v) { Codec<std::string>::pack(pk, dtype_name(v)); }
  static void unpack(const msgpack::object &o, DType &v, std::string_view key, bool strict) {
    std::string name;
    Codec<std::string>::unpack(o, name, key, strict);
    v = dtype_from_name(name);
  }
};

template <class T> struct Codec<std::optional<T>> {  // nil when absent
  static void pack(Packer &pk, const std::optional<T> &v) {
    if (v) Codec<T>::pack(pk, *v);
    else pk.pack_nil();
  }
  static void unpack(const msgpack::object &o, std::optional<T> &v, std::string_view key, bool strict) {
    if (o.type == msgpack::type::NIL) return v.reset();
    Codec<T>::unpack(o, v.emplace(), key, strict);
  }
};

template <class T> struct Codec<std::vector<T>> {
  static void pack(Packer &pk, const std::vector<T> &v) {
    pk.pack_array(static_cast<uint32_t>(v.size()));
    for (const auto &e : v) Codec<T>::pack(pk, e);
  }
  static void unpack(const msgpack::object &o, std::vector<T> &v, std::string_view key, bool strict) {
    if (o.type != msgpack::type::ARRAY) bad_field(key, "an array");
    v.assign(o.via.array.size, T{});
    for (uint32_t i = 0; i < o.via.array.size; i++) Codec<T>::unpack(o.via.array.ptr[i], v[i], key, strict);
  }
};

template <> struct Codec<std::map<uint32_t, uint64_t>> {  // a histogram: {"n": count}, n ascending
  static void pack(Packer &pk, const std::map<uint32_t, uint64_t> &v) {
    pk.pack_map(static_cast<uint32_t>(v.size()));
    for (const auto &[n, count] : v) pk.pack(std::to_string(n)), pk.pack(count);
  }
  static void unpack(const msgpack::object &o, std::map<uint32_t, uint64_t> &v, std::string_view key, bool strict) {
    if (o.type != msgpack::type::MAP) bad_field(key, "a map");
    v.clear();
    for (uint32_t i = 0; i < o.via.map.size; i++) {
      std::string n;
      Codec<std::string>::unpack(o.via.map.ptr[i].key, n, key, strict);
      if (n.empty() || n.size() > 9 || n.find_first_not_of("0123456789") != std::string::npos)
        bad_field(key, "a map with decimal keys");
      Codec<uint64_t>::unpack(o.via.map.ptr[i].val, v[static_cast<uint32_t>(std::stoul(n))], key, strict);
    }
  }
};

}  // namespace wire

// ------------------------------------------------------------------ model metadata

struct TensorSpec {
  std::string name;
  DType dtype = DType::INVALID;
  std::vector<int64_t> shape;  // -1: any size; batch dimension first when batched
  template <class S, class V> static void visit(S &s, V &&v) {
    v("name", s.name), v("datatype", s.dtype), v("shape", s.shape);
  }
};

/// A model's metadata (KServe-v2 style, plus its id); the reply to GetMetadata.
struct ModelInfo {
  uint32_t id = 0;  // goes into shms_request.model_id
  std::string name;
  int64_t version = 0;
  std::string platform;
  uint32_t max_batch_size = 0;
  std::vector<TensorSpec> inputs, outputs;  // position = tensor index
  std::string state = "LOADING";            // READY, UNAVAILABLE: ..., LOADING
  bool decoupled = false;  // answers stream requests only (Client::infer_stream)
  bool batched() const { return max_batch_size > 0; }
  bool ready() const { return state == "READY"; }
  int input_index(std::string_view n) const { return find(inputs, n); }
  int output_index(std::string_view n) const { return find(outputs, n); }
  template <class S, class V> static void visit(S &s, V &&v) {
    v("id", s.id), v("name", s.name), v("version", s.version), v("platform", s.platform);
    v("max_batch_size", s.max_batch_size), v("inputs", s.inputs), v("outputs", s.outputs);
    v("state", s.state, wire::kOptional), v("decoupled", s.decoupled, wire::kOptional);
  }

 private:
  static int find(const std::vector<TensorSpec> &list, std::string_view n) {
    for (size_t i = 0; i < list.size(); i++) if (list[i].name == n) return static_cast<int>(i);
    return -1;
  }
};

// ------------------------------------------------------------------ statistics
// Triton's statistics extension (docs/operating.md), one ModelStats per model version.

/// A duration summed over requests (or executions, in batch_stats).
struct DurationStat {
  uint64_t count = 0, ns = 0;
  template <class S, class V> static void visit(S &s, V &&v) { v("count", s.count), v("ns", s.ns); }
};

struct InferenceStats {
  DurationStat success, fail, queue, compute_input, compute_infer, compute_output, cache_hit,
      cache_miss;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("success", s.success), v("fail", s.fail), v("queue", s.queue);
    v("compute_input", s.compute_input), v("compute_infer", s.compute_infer);
    v("compute_output", s.compute_output), v("cache_hit", s.cache_hit), v("cache_miss", s.cache_miss);
  }
};

/// Executions of one batch size (rows).
struct BatchStat {
  uint64_t batch_size = 0;
  DurationStat compute_input, compute_infer, compute_output;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("batch_size", s.batch_size), v("compute_input", s.compute_input);
    v("compute_infer", s.compute_infer), v("compute_output", s.compute_output);
  }
};

struct MemoryUsage {
  std::string type;  // "CPU": an instance's resident memory
  int64_t id = 0;    // the instance
  uint64_t byte_size = 0;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("type", s.type), v("id", s.id), v("byte_size", s.byte_size);
  }
};

/// Failed requests by reason (nv_inference_request_failure's label).
struct FailureCounts {
  uint64_t rejected = 0, canceled = 0, backend = 0, other = 0;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("REJECTED", s.rejected), v("CANCELED", s.canceled), v("BACKEND", s.backend), v("OTHER", s.other);
  }
};

/// What Triton has no field for (the "shmserve" key).
struct OwnStats {
  std::string state;     // READY, LOADING, UNAVAILABLE: <reason>
  uint64_t pending = 0;  // requests queued in the batcher now
  FailureCounts failures;
  std::map<uint32_t, uint64_t> batch_requests;  // requests per execution -> executions
  template <class S, class V> static void visit(S &s, V &&v) {
    v("state", s.state), v("pending", s.pending), v("failures", s.failures);
    v("batch_requests", s.batch_requests);
  }
};

struct ModelStats {
  std::string name;
  std::string version;        // a string, as Triton's JSON has it
  uint64_t last_inference = 0;  // ms since the epoch
  uint64_t inference_count = 0, execution_count = 0;
  InferenceStats inference_stats;
  std::vector<BatchStat> batch_stats;
  std::vector<MemoryUsage> memory_usage;
  OwnStats shmserve;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("name", s.name), v("version", s.version), v("last_inference", s.last_inference);
    v("inference_count", s.inference_count), v("execution_count", s.execution_count);
    v("inference_stats", s.inference_stats), v("batch_stats", s.batch_stats);
    v("memory_usage", s.memory_usage), v("shmserve", s.shmserve);
  }
};

// ------------------------------------------------------------------ the messages

namespace control {

using ModelMetadata = ModelInfo;

// -- replies (coordinator -> client)

struct HelloReply {
  uint32_t client_id = 0, generation = 0;
  uint64_t control_bytes = 0, bell_bytes = 0, arena_bytes = 0, slots_offset = 0;
  uint32_t n_slots = 0;
  uint64_t data_offset = 0;
  int64_t server_pid = 0, spin_us = 0;
  std::vector<ModelInfo> models;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("client_id", s.client_id), v("generation", s.generation), v("control_bytes", s.control_bytes);
    v("bell_bytes", s.bell_bytes), v("arena_bytes", s.arena_bytes), v("slots_offset", s.slots_offset), v("n_slots", s.n_slots);
    v("data_offset", s.data_offset), v("server_pid", s.server_pid), v("spin_us", s.spin_us);
    v("models", s.models);
  }
};

struct ModelList {
  std::vector<ModelInfo> models;
  std::optional<bool> ready;  // the server's readiness under its --strict-readiness; none: not said
  template <class S, class V> static void visit(S &s, V &&v) {
    v("models", s.models), v("ready", s.ready, wire::kOptional);
  }
};

struct ModelConfig {
  std::string config;  // config.pbtxt as parsed (protobuf text format)
  template <class S, class V> static void visit(S &s, V &&v) { v("config", s.config); }
};

struct StatsReply {
  std::vector<ModelStats> model_stats;
  template <class S, class V> static void visit(S &s, V &&v) { v("model_stats", s.model_stats); }
};

/// The answer of a control operation that answers nothing but its success.
struct Done {
  template <class S, class V> static void visit(S &, V &&) {}
};

/// One row of Triton's repository index: version and state empty for a model of the
/// repository never loaded; reason set for UNAVAILABLE ("unloaded", or why it failed).
struct IndexEntry {
  std::string name, version, state, reason;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("name", s.name), v("version", s.version, wire::kOptional);
    v("state", s.state, wire::kOptional), v("reason", s.reason, wire::kOptional);
  }
};

struct IndexReply {
  std::vector<IndexEntry> models;
  template <class S, class V> static void visit(S &s, V &&v) { v("models", s.models); }
};

/// A failed request ("ok": false): a status, the message, and the server's exception
/// class where it is finer than the status (ConfigError, ShmSpaceError...).
struct ErrorReply {
  int32_t code = SHMS_ERR_INTERNAL;
  std::string error = "the server refused the request";
  std::optional<std::string> type;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("code", s.code, wire::kOptional), v("error", s.error, wire::kOptional);
    v("type", s.type, wire::kOptional);
  }
  [[noreturn]] void raise() const { throw_status(code, error, type ? std::string_view(*type) : std::string_view()); }
};

// -- requests (client -> coordinator); Reply is the answer's type

/// Opens the lease; the reply carries the memfds of the arena, the control segment
/// (O_RDONLY) and the bell.
struct Hello {
  static constexpr const char *op = "hello";
  using Reply = HelloReply;
  int64_t version = SHMS_PROTOCOL_VERSION;
  int64_t pid = 0;
  uint64_t arena_bytes = 0;  // 0: the server's default
  template <class S, class V> static void visit(S &s, V &&v) {
    v("version", s.version), v("pid", s.pid), v("arena_bytes", s.arena_bytes, wire::kOptional);
  }
};

struct ListModels {
  static constexpr const char *op = "models";
  using Reply = ModelList;
  template <class S, class V> static void visit(S &, V &&) {}
};

struct GetMetadata {
  static constexpr const char *op = "metadata";
  using Reply = ModelMetadata;
  std::string model;
  std::optional<int64_t> version;  // none: the highest
  template <class S, class V> static void visit(S &s, V &&v) {
    v("model", s.model), v("version", s.version, wire::kOptional);
  }
};

struct GetConfig {
  static constexpr const char *op = "config";
  using Reply = ModelConfig;
  std::string model;
  std::optional<int64_t> version;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("model", s.model), v("version", s.version, wire::kOptional);
  }
};

struct GetStats {
  static constexpr const char *op = "stats";
  using Reply = StatsReply;
  std::optional<std::string> model;  // none: every model
  std::optional<int64_t> version;    // none: every version of model
  bool histograms = false;           // Python's status view asks for them; C++ need not
  template <class S, class V> static void visit(S &s, V &&v) {
    v("model", s.model, wire::kOptional), v("version", s.version, wire::kOptional);
    v("histograms", s.histograms, wire::kOptional);
  }
};

/// Triton's repository extension (--model-control-mode explicit): loads a model, or
/// reloads it; config: the model configuration as JSON, instead of config.pbtxt.
struct LoadModel {
  static constexpr const char *op = "load";
  using Reply = Done;
  std::string model;
  std::optional<std::string> config;
  template <class S, class V> static void visit(S &s, V &&v) {
    v("model", s.model), v("config", s.config, wire::kOptional);
  }
};

/// Unloads every version of a model; its requests in flight finish first.
struct UnloadModel {
  static constexpr const char *op = "unload";
  using Reply = Done;
  std::string model;
  template <class S, class V> static void visit(S &s, V &&v) { v("model", s.model); }
};

struct RepositoryIndex {
  static constexpr const char *op = "index";
  using Reply = IndexReply;
  bool ready = false;  // only the READY versions
  template <class S, class V> static void visit(S &s, V &&v) { v("ready", s.ready, wire::kOptional); }
};

/// A model version as the messages carry it: none for the highest (0 or less).
inline std::optional<int64_t> version_or_latest(int64_t version) {
  return version > 0 ? std::optional<int64_t>(version) : std::nullopt;
}

// ------------------------------------------------------------------ frames

constexpr uint32_t kMaxFrameBytes = 16u << 20;

template <class M, class = void> struct is_request : std::false_type {};
template <class M> struct is_request<M, std::void_t<decltype(M::op)>> : std::true_type {};

/// The frame of a message: {"op": op, fields...} for a request, {"ok": ..., fields...}
/// for a reply.
template <class M> std::string encode(const M &m) {
  msgpack::sbuffer buf;
  wire::Packer pk(buf);
  pk.pack_map(wire::field_count(m) + 1);
  if constexpr (is_request<M>::value) pk.pack(std::string("op")), pk.pack(std::string(M::op));
  else pk.pack(std::string("ok")), pk.pack(!std::is_same_v<M, ErrorReply>);
  wire::pack_fields(pk, m);
  uint32_t n = htonl(static_cast<uint32_t>(buf.size()));
  std::string out(reinterpret_cast<const char *>(&n), 4);
  out.append(buf.data(), buf.size());
  return out;
}

/// A message from a decoded body (a map). strict (tests): no key beyond the fields
/// and the envelope ("op" of a request, "ok" of a reply).
template <class M> M decode(const msgpack::object &body, bool strict = false) {
  M m;
  wire::unpack_fields(body, m, strict, is_request<M>::value ? "op" : "ok");
  return m;
}

/// A frame's body, parsed.
inline msgpack::object_handle parse_body(const char *body, size_t n) {
  msgpack::object_handle oh;
  try {
    oh = msgpack::unpack(body, n);
  } catch (const std::exception &e) {
    throw ProtocolError(std::string("malformed control message: ") + e.what());
  }
  if (oh.get().type != msgpack::type::MAP) throw ProtocolError("control message is not a map");
  return oh;
}

/// Splits one whole frame (length + body) and parses the body.
inline msgpack::object_handle parse_frame(std::string_view bytes) {
  if (bytes.size() < 4) throw ProtocolError("frame shorter than its header");
  uint32_t n;
  std::memcpy(&n, bytes.data(), 4);
  if (ntohl(n) != bytes.size() - 4) throw ProtocolError("frame length does not match");
  return parse_body(bytes.data() + 4, bytes.size() - 4);
}

/// What every reply carries: "ok".
struct ReplyEnvelope {
  bool ok = false;
  template <class S, class V> static void visit(S &s, V &&v) { v("ok", s.ok); }
};

/// The reply to a request of type Req: its answer, or the typed error of an ErrorReply.
template <class Req> typename Req::Reply decode_reply(const msgpack::object &body, bool strict = false) {
  ReplyEnvelope envelope;
  wire::unpack_fields(body, envelope, false);
  if (!envelope.ok) decode<ErrorReply>(body, strict).raise();
  return decode<typename Req::Reply>(body, strict);
}

}  // namespace control

}  // namespace shmserve
