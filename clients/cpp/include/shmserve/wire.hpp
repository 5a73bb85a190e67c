// shmserve C++ client: data types, the control socket (framing + msgpack), model
// metadata and the descriptor encoders. Layouts come from shmserve.h only.
#pragma once

#ifndef MSGPACK_NO_BOOST
#define MSGPACK_NO_BOOST 1
#endif

#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <msgpack.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "shmserve.h"
#include "shmserve/errors.hpp"

namespace shmserve {

// ------------------------------------------------------------------ data types

/// Triton's DataType numbers (docs/protocol.md section 7).
enum class DType : uint32_t {
  INVALID = SHMS_TYPE_INVALID, BOOL = SHMS_TYPE_BOOL, UINT8 = SHMS_TYPE_UINT8,
  UINT16 = SHMS_TYPE_UINT16, UINT32 = SHMS_TYPE_UINT32, UINT64 = SHMS_TYPE_UINT64,
  INT8 = SHMS_TYPE_INT8, INT16 = SHMS_TYPE_INT16, INT32 = SHMS_TYPE_INT32,
  INT64 = SHMS_TYPE_INT64, FP16 = SHMS_TYPE_FP16, FP32 = SHMS_TYPE_FP32,
  FP64 = SHMS_TYPE_FP64, BYTES = SHMS_TYPE_BYTES, BF16 = SHMS_TYPE_BF16,
};

/// Element bytes; 0 for BYTES (variable) and INVALID.
inline uint32_t dtype_size(DType t) { return shms_dtype_size(static_cast<uint32_t>(t)); }
inline const char *dtype_name(DType t) { return shms_dtype_name(static_cast<uint32_t>(t)); }
inline DType dtype_from_name(std::string_view name) {
  for (uint32_t c = 1; c < SHMS_TYPE_COUNT; c++)
    if (name == shms_dtype_name(c)) return static_cast<DType>(c);
  return DType::INVALID;
}

/// The DType of a C++ element type (FP16/BF16 have none: pass DType explicitly).
template <class T> constexpr DType dtype_of();
template <> constexpr DType dtype_of<bool>() { return DType::BOOL; }
template <> constexpr DType dtype_of<uint8_t>() { return DType::UINT8; }
template <> constexpr DType dtype_of<uint16_t>() { return DType::UINT16; }
template <> constexpr DType dtype_of<uint32_t>() { return DType::UINT32; }
template <> constexpr DType dtype_of<uint64_t>() { return DType::UINT64; }
template <> constexpr DType dtype_of<int8_t>() { return DType::INT8; }
template <> constexpr DType dtype_of<int16_t>() { return DType::INT16; }
template <> constexpr DType dtype_of<int32_t>() { return DType::INT32; }
template <> constexpr DType dtype_of<int64_t>() { return DType::INT64; }
template <> constexpr DType dtype_of<float>() { return DType::FP32; }
template <> constexpr DType dtype_of<double>() { return DType::FP64; }

/// product(shape) (1 for a scalar); throws InvalidArgumentError on a negative dim or
/// overflow.
inline uint64_t element_count(const std::vector<int64_t> &shape) {
  uint64_t n = 1;
  for (int64_t d : shape) {
    if (d < 0) throw InvalidArgumentError("negative dimension " + std::to_string(d));
    if (d != 0 && n > UINT64_MAX / 16 / static_cast<uint64_t>(d))
      throw InvalidArgumentError("shape overflows");
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

/// BYTES tensors: each element is a u32 little-endian length, then its bytes.
inline std::string encode_bytes(const std::vector<std::string> &items) {
  std::string out;
  for (const auto &s : items) {
    uint32_t n = static_cast<uint32_t>(s.size());
    char len[4] = {char(n & 0xff), char((n >> 8) & 0xff), char((n >> 16) & 0xff), char(n >> 24)};
    out.append(len, 4);
    out += s;
  }
  return out;
}

inline std::vector<std::string> decode_bytes(const void *data, uint64_t nbytes, uint64_t count) {
  const auto *p = static_cast<const unsigned char *>(data);
  std::vector<std::string> out;
  uint64_t pos = 0;
  for (uint64_t i = 0; i < count; i++) {
    if (nbytes - pos < 4) throw ProtocolError("BYTES tensor truncated at element " + std::to_string(i));
    uint32_t n = uint32_t(p[pos]) | uint32_t(p[pos + 1]) << 8 | uint32_t(p[pos + 2]) << 16 |
                 uint32_t(p[pos + 3]) << 24;
    pos += 4;
    if (n > nbytes - pos) throw ProtocolError("BYTES element " + std::to_string(i) + " runs past the tensor");
    out.emplace_back(reinterpret_cast<const char *>(p + pos), n);
    pos += n;
  }
  if (pos != nbytes) throw ProtocolError("BYTES tensor has bytes after its last element");
  return out;
}

// ------------------------------------------------------------------ descriptors

/// A shms_tensor_ref, every byte defined (unused dims 0).
inline shms_tensor_ref make_tensor_ref(uint32_t index, DType dtype, uint64_t offset, uint64_t nbytes,
                                       const std::vector<int64_t> &shape) {
  shms_tensor_ref t;
  std::memset(&t, 0, sizeof t);
  if (shape.size() > SHMS_MAX_DIMS)
    throw InvalidArgumentError("tensor has " + std::to_string(shape.size()) + " dimensions (limit 8)");
  t.index = index;
  t.dtype = static_cast<uint32_t>(dtype);
  t.ndim = static_cast<uint32_t>(shape.size());
  t.offset = offset;
  t.nbytes = nbytes;
  for (size_t d = 0; d < shape.size(); d++) t.shape[d] = shape[d];
  return t;
}

/// Fills the request part of a slot (the caller owns the slot: it is FREE). Entries
/// past n_inputs / n_outputs are left as they are (the server never reads them).
inline void encode_request(shms_request &r, uint32_t model_id, const std::vector<shms_tensor_ref> &inputs,
                           const std::vector<shms_tensor_ref> &outputs, uint64_t client_tag = 0) {
  if (inputs.size() > SHMS_MAX_TENSORS || outputs.size() > SHMS_MAX_TENSORS)
    throw InvalidArgumentError("more than 16 inputs or outputs in one request");
  r.model_id = model_id;
  r.n_inputs = static_cast<uint32_t>(inputs.size());
  r.n_outputs = static_cast<uint32_t>(outputs.size());
  r.flags = 0;
  r.client_tag = client_tag;
  r.reserved = 0;
  if (!inputs.empty()) std::memcpy(r.inputs, inputs.data(), inputs.size() * sizeof(shms_tensor_ref));
  if (!outputs.empty()) std::memcpy(r.outputs, outputs.data(), outputs.size() * sizeof(shms_tensor_ref));
}

// ------------------------------------------------------------------ discovery

/// <runtime dir>/<name>.sock: $SHMSERVE_RUNTIME_DIR, $XDG_RUNTIME_DIR/shmserve or
/// /tmp/shmserve-<uid> (docs/protocol.md section 2).
inline std::string socket_path(const std::string &name) {
  const char *rt = std::getenv("SHMSERVE_RUNTIME_DIR");
  const char *xdg = std::getenv("XDG_RUNTIME_DIR");
  std::string dir;
  if (rt && *rt) dir = rt;
  else if (xdg && *xdg) dir = std::string(xdg) + "/shmserve";
  else dir = "/tmp/shmserve-" + std::to_string(getuid());
  return dir + "/" + name + ".sock";
}

// ------------------------------------------------------------------ msgpack frames

constexpr uint32_t kMaxFrameBytes = 16u << 20;

/// One frame: a big-endian u32 length, then the msgpack body.
inline std::string frame(const msgpack::sbuffer &body) {
  uint32_t n = htonl(static_cast<uint32_t>(body.size()));
  std::string out(reinterpret_cast<const char *>(&n), 4);
  out.append(body.data(), body.size());
  return out;
}

/// The hello request frame: {"op": "hello", "version": 1, "pid": pid, "arena_bytes": n}.
inline std::string hello_frame(int64_t pid, uint64_t arena_bytes) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(4);
  pk.pack(std::string("op")); pk.pack(std::string("hello"));
  pk.pack(std::string("version")); pk.pack(static_cast<uint32_t>(SHMS_PROTOCOL_VERSION));
  pk.pack(std::string("pid")); pk.pack(pid);
  pk.pack(std::string("arena_bytes")); pk.pack(arena_bytes);
  return frame(buf);
}

/// {"op": op} plus "model" (and "version" as nil, or the number) when model is not empty.
inline std::string op_frame(const std::string &op, const std::string &model = {}, int64_t version = 0) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_map(model.empty() ? 1 : 3);
  pk.pack(std::string("op")); pk.pack(op);
  if (!model.empty()) {
    pk.pack(std::string("model")); pk.pack(model);
    pk.pack(std::string("version"));
    if (version > 0) pk.pack(version); else pk.pack_nil();
  }
  return frame(buf);
}

/// A decoded reply body (a msgpack map) with checked accessors.
class Reply {
 public:
  explicit Reply(const char *body, size_t n) {
    try {
      oh_ = msgpack::unpack(body, n);
    } catch (const std::exception &e) {
      throw ProtocolError(std::string("malformed control reply: ") + e.what());
    }
    if (oh_.get().type != msgpack::type::MAP) throw ProtocolError("control reply is not a map");
  }
  const msgpack::object &root() const { return oh_.get(); }

  static const msgpack::object *find(const msgpack::object &map, std::string_view key) {
    if (map.type != msgpack::type::MAP) return nullptr;
    for (uint32_t i = 0; i < map.via.map.size; i++) {
      const auto &kv = map.via.map.ptr[i];
      if (kv.key.type == msgpack::type::STR &&
          std::string_view(kv.key.via.str.ptr, kv.key.via.str.size) == key)
        return &kv.val;
    }
    return nullptr;
  }
  static const msgpack::object &get(const msgpack::object &map, std::string_view key) {
    const msgpack::object *o = find(map, key);
    if (!o) throw ProtocolError("control reply lacks '" + std::string(key) + "'");
    return *o;
  }
  static int64_t as_int(const msgpack::object &o) {
    if (o.type == msgpack::type::POSITIVE_INTEGER) {
      if (o.via.u64 > static_cast<uint64_t>(INT64_MAX)) throw ProtocolError("integer out of range");
      return static_cast<int64_t>(o.via.u64);
    }
    if (o.type == msgpack::type::NEGATIVE_INTEGER) return o.via.i64;
    throw ProtocolError("control reply: expected an integer");
  }
  static std::string as_str(const msgpack::object &o) {
    if (o.type != msgpack::type::STR) throw ProtocolError("control reply: expected a string");
    return std::string(o.via.str.ptr, o.via.str.size);
  }
  int64_t i(std::string_view key) const { return as_int(get(root(), key)); }
  std::string s(std::string_view key) const { return as_str(get(root(), key)); }
  bool ok() const {
    const msgpack::object &o = get(root(), "ok");
    if (o.type != msgpack::type::BOOLEAN) throw ProtocolError("control reply: 'ok' is not a bool");
    return o.via.boolean;
  }
  /// Throws the typed error of a failed reply ({"ok": false, "code", "error"}).
  void raise_if_failed() const {
    if (ok()) return;
    const msgpack::object *code = find(root(), "code");
    const msgpack::object *err = find(root(), "error");
    throw_status(code ? static_cast<int32_t>(as_int(*code)) : SHMS_ERR_INTERNAL,
                 err ? as_str(*err) : std::string("server refused the request"));
  }

 private:
  msgpack::object_handle oh_;
};

/// Splits one frame (length + body) and decodes it; for tests and vectors.
inline Reply decode_frame(const std::string &bytes) {
  if (bytes.size() < 4) throw ProtocolError("frame shorter than its header");
  uint32_t n;
  std::memcpy(&n, bytes.data(), 4);
  n = ntohl(n);
  if (n != bytes.size() - 4) throw ProtocolError("frame length does not match");
  return Reply(bytes.data() + 4, n);
}

// ------------------------------------------------------------------ model metadata

struct TensorSpec {
  std::string name;
  DType dtype = DType::INVALID;
  std::vector<int64_t> shape;  // -1: any size; batch dimension first when batched
};

struct ModelInfo {
  uint32_t id = 0;  // goes into shms_request.model_id
  std::string name;
  int64_t version = 0;
  std::string platform;
  uint32_t max_batch_size = 0;
  std::vector<TensorSpec> inputs, outputs;  // position = tensor index
  std::string state;                        // READY, UNAVAILABLE: ..., LOADING
  bool batched() const { return max_batch_size > 0; }
  bool ready() const { return state == "READY"; }
  int input_index(std::string_view n) const {
    for (size_t i = 0; i < inputs.size(); i++) if (inputs[i].name == n) return static_cast<int>(i);
    return -1;
  }
  int output_index(std::string_view n) const {
    for (size_t i = 0; i < outputs.size(); i++) if (outputs[i].name == n) return static_cast<int>(i);
    return -1;
  }
};

inline std::vector<TensorSpec> parse_specs(const msgpack::object &arr) {
  if (arr.type != msgpack::type::ARRAY) throw ProtocolError("metadata: tensors are not an array");
  std::vector<TensorSpec> out;
  for (uint32_t i = 0; i < arr.via.array.size; i++) {
    const auto &t = arr.via.array.ptr[i];
    TensorSpec s;
    s.name = Reply::as_str(Reply::get(t, "name"));
    s.dtype = dtype_from_name(Reply::as_str(Reply::get(t, "datatype")));
    const auto &shape = Reply::get(t, "shape");
    if (shape.type != msgpack::type::ARRAY) throw ProtocolError("metadata: shape is not an array");
    for (uint32_t d = 0; d < shape.via.array.size; d++) s.shape.push_back(Reply::as_int(shape.via.array.ptr[d]));
    out.push_back(std::move(s));
  }
  return out;
}

inline ModelInfo parse_model(const msgpack::object &m) {
  ModelInfo info;
  info.id = static_cast<uint32_t>(Reply::as_int(Reply::get(m, "id")));
  info.name = Reply::as_str(Reply::get(m, "name"));
  info.version = Reply::as_int(Reply::get(m, "version"));
  info.platform = Reply::as_str(Reply::get(m, "platform"));
  info.max_batch_size = static_cast<uint32_t>(Reply::as_int(Reply::get(m, "max_batch_size")));
  info.inputs = parse_specs(Reply::get(m, "inputs"));
  info.outputs = parse_specs(Reply::get(m, "outputs"));
  if (const auto *st = Reply::find(m, "state")) info.state = Reply::as_str(*st);
  if (info.inputs.size() > SHMS_MAX_TENSORS || info.outputs.size() > SHMS_MAX_TENSORS)
    throw ProtocolError("model '" + info.name + "' has more than 16 inputs or outputs");
  return info;
}

inline std::vector<ModelInfo> parse_models(const msgpack::object &arr) {
  if (arr.type != msgpack::type::ARRAY) throw ProtocolError("'models' is not an array");
  std::vector<ModelInfo> out;
  for (uint32_t i = 0; i < arr.via.array.size; i++) out.push_back(parse_model(arr.via.array.ptr[i]));
  return out;
}

// ------------------------------------------------------------------ the socket

/// The control connection; its lifetime is the lease. Not thread-safe (the client
/// serialises calls).
class ControlSocket {
 public:
  explicit ControlSocket(const std::string &path) {
    fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd_ < 0) throw ServerDeadError(std::string("socket(): ") + std::strerror(errno));
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    if (path.size() >= sizeof addr.sun_path) {
      ::close(fd_);
      throw InvalidArgumentError("control socket path too long: " + path);
    }
    std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
    if (::connect(fd_, reinterpret_cast<sockaddr *>(&addr), sizeof addr) != 0) {
      int e = errno;
      ::close(fd_);
      throw ServerDeadError("no shmserve server is running at " + path + " (" + std::strerror(e) +
                            "); start one with `shmserve serve`");
    }
  }
  ~ControlSocket() { close(); }
  ControlSocket(const ControlSocket &) = delete;
  ControlSocket &operator=(const ControlSocket &) = delete;

  void close() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }
  bool is_open() const { return fd_ >= 0; }

  /// Sends one request frame and returns the reply (typed error on `ok: false`).
  /// With received_fds, descriptors sent along with the reply (SCM_RIGHTS: the hello
  /// reply carries the arena's and the control segment's memfds) are appended there;
  /// the caller owns them, also when this throws.
  Reply call(const std::string &request, std::vector<int> *received_fds = nullptr) {
    if (fd_ < 0) throw ServerDeadError("the client is closed");
    const char *p = request.data();
    size_t left = request.size();
    while (left) {
      ssize_t n = ::send(fd_, p, left, MSG_NOSIGNAL);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) throw ServerDeadError(std::string("control socket: ") + std::strerror(errno));
      p += n;
      left -= static_cast<size_t>(n);
    }
    char header[4];
    if (received_fds) {
      size_t got = 0;
      while (got < 4) got += recv_with_fds(header + got, 4 - got, received_fds);
    } else {
      read_exact(header, 4);
    }
    uint32_t len;
    std::memcpy(&len, header, 4);
    len = ntohl(len);
    if (len > kMaxFrameBytes) throw ProtocolError("control reply of " + std::to_string(len) + " bytes");
    std::string body(len, '\0');
    read_exact(body.data(), len);
    Reply r(body.data(), body.size());
    r.raise_if_failed();
    return r;
  }

  /// Non-blocking: true when the server closed the connection (the lease is over).
  bool at_eof() const {
    if (fd_ < 0) return true;
    char c;
    ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n == 0) return true;
    if (n < 0) return !(errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
    return false;
  }

 private:
  /// One recvmsg of up to n bytes; the descriptors that come with it go to fds.
  size_t recv_with_fds(char *p, size_t n, std::vector<int> *fds) {
    for (;;) {
      iovec iov{p, n};
      alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof control;
      ssize_t r = ::recvmsg(fd_, &msg, MSG_CMSG_CLOEXEC);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) throw ServerDeadError("control socket closed by the server");
      for (cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t k = 0; k < count; k++) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(c) + k * sizeof(int), sizeof fd);
          fds->push_back(fd);
        }
      }
      return static_cast<size_t>(r);
    }
  }

  void read_exact(char *p, size_t n) {
    while (n) {
      ssize_t r = ::recv(fd_, p, n, 0);
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) throw ServerDeadError("control socket closed by the server");
      p += r;
      n -= static_cast<size_t>(r);
    }
  }
  int fd_ = -1;
};

}  // namespace shmserve
