// shmserve C++ client: tensor shapes, the BYTES element encoding, and the tensor
// descriptors a request carries (shms_tensor_ref, shms_request of shmserve.h).
#pragma once

#include <array>
#include <cstring>
#include <string>
#include <vector>

#include "shmserve/errors.hpp"

namespace shmserve {

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

/// A shms_tensor_ref, every byte defined (unused dims 0). Host arena (kind 0): offset
/// and nbytes are the data's. Device memory (kind CUDA_IPC): offset is the tensor's
/// shms_cuda_ipc record in the arena, nbytes the tensor's size (an output: its device
/// buffer's capacity), device_id the caller's GPU ordinal (docs/protocol.md 4.6, 7a).
inline shms_tensor_ref make_tensor_ref(uint32_t index, DType dtype, uint64_t offset, uint64_t nbytes,
                                       const std::vector<int64_t> &shape,
                                       MemoryKind kind = MemoryKind::HOST_ARENA, uint16_t device_id = 0) {
  shms_tensor_ref t;
  std::memset(&t, 0, sizeof t);
  if (shape.size() > SHMS_MAX_DIMS)
    throw InvalidArgumentError("tensor has " + std::to_string(shape.size()) + " dimensions (limit " +
                               std::to_string(SHMS_MAX_DIMS) + ")");
  t.index = index;
  t.dtype = static_cast<uint32_t>(dtype);
  t.ndim = static_cast<uint32_t>(shape.size());
  t.memory_kind = static_cast<uint16_t>(kind);
  t.device_id = device_id;
  t.offset = offset;
  t.nbytes = nbytes;
  for (size_t d = 0; d < shape.size(); d++) t.shape[d] = shape[d];
  return t;
}

/// A CUDA IPC memory or event handle (cudaIpcMemHandle_t / CUipcMemHandle, 64 bytes).
using IpcHandle = std::array<uint8_t, sizeof(shms_cuda_ipc::mem_handle)>;
/// A GPU's UUID (cudaDeviceProp::uuid, cuDeviceGetUuid: 16 bytes).
using DeviceUuid = std::array<uint8_t, sizeof(shms_cuda_ipc::device_uuid)>;

/// The bytes of a driver or runtime handle as the protocol carries them:
/// raw_bytes<IpcHandle>(cudaIpcMemHandle_t), raw_bytes<DeviceUuid>(cudaUUID_t).
template <class Bytes, class T> Bytes raw_bytes(const T &value) {
  static_assert(sizeof(T) == std::tuple_size<Bytes>::value, "a handle of another size");
  Bytes out;
  std::memcpy(out.data(), &value, out.size());
  return out;
}

/// The shms_cuda_ipc record of a tensor in device memory (docs/protocol.md 4.7), every
/// byte defined: an input's event (flags EVENT) when `event` is given; an output's
/// record never has one (the server synchronises before DONE).
inline shms_cuda_ipc make_cuda_ipc_record(const IpcHandle &mem_handle, uint64_t offset, const DeviceUuid &device_uuid,
                                          const IpcHandle *event = nullptr) {
  shms_cuda_ipc r;
  std::memset(&r, 0, sizeof r);
  std::memcpy(r.mem_handle, mem_handle.data(), sizeof r.mem_handle);
  if (event) {
    std::memcpy(r.event_handle, event->data(), sizeof r.event_handle);
    r.flags = SHMS_CUDA_IPC_EVENT;
  }
  r.offset = offset;
  std::memcpy(r.device_uuid, device_uuid.data(), sizeof r.device_uuid);
  return r;
}

/// Fills the request that shms_slot_begin returned (the caller owns the slot);
/// shms_slot_submit then sets the reserved fields and publishes it. Entries past
/// n_inputs / n_outputs are left as they are (the server never reads them).
inline void encode_request(shms_request &r, uint32_t model_id, const std::vector<shms_tensor_ref> &inputs,
                           const std::vector<shms_tensor_ref> &outputs) {
  if (inputs.size() > SHMS_MAX_TENSORS || outputs.size() > SHMS_MAX_TENSORS)
    throw InvalidArgumentError("more than " + std::to_string(SHMS_MAX_TENSORS) +
                               " inputs or outputs in one request");
  r.model_id = model_id;
  r.n_inputs = static_cast<uint32_t>(inputs.size());
  r.n_outputs = static_cast<uint32_t>(outputs.size());
  if (!inputs.empty()) std::memcpy(r.inputs, inputs.data(), inputs.size() * sizeof(shms_tensor_ref));
  if (!outputs.empty()) std::memcpy(r.outputs, outputs.data(), outputs.size() * sizeof(shms_tensor_ref));
}

}  // namespace shmserve
