// shmserve C++ client: the protocol's enums as enum classes, generated from the
// X-macro lists of shmserve.h (X(C name, short name, value)); nothing here types a
// value or a name by hand. Data-type helpers use the header's shms_dtype_size/name.
#pragma once

#include <cstdint>
#include <string_view>

#include "shmserve.h"

namespace shmserve {

#define SHMSERVE_ENUM_MEMBER_(cname, name, value) name = cname,
#define SHMSERVE_ENUM_CASE_(cname, name, value) \
  case cname:                                   \
    return #name;
/// enum class Type : Int with the members of LIST, and name_of(Type): the short name
/// ("UNKNOWN" for a value outside the list).
#define SHMSERVE_ENUM_(Type, Int, LIST)                                   \
  enum class Type : Int { LIST(SHMSERVE_ENUM_MEMBER_) };                  \
  inline const char *name_of(Type v) {                                    \
    switch (static_cast<int64_t>(v)) { LIST(SHMSERVE_ENUM_CASE_) }        \
    return "UNKNOWN";                                                     \
  }

SHMSERVE_ENUM_(Status, int32_t, SHMS_STATUS_LIST)             // shms_slot.status, reply "code"
SHMSERVE_ENUM_(DType, uint32_t, SHMS_DTYPE_LIST)              // Triton's DataType numbers
SHMSERVE_ENUM_(SlotState, uint32_t, SHMS_SLOT_STATE_LIST)     // shms_slot.state
SHMSERVE_ENUM_(Timestamp, uint32_t, SHMS_TIMESTAMP_LIST)      // index of Result::timestamps_ns()
SHMSERVE_ENUM_(ServerState, uint32_t, SHMS_SERVER_STATE_LIST) // shms_control.server_state
SHMSERVE_ENUM_(MemoryKind, uint32_t, SHMS_MEMORY_KIND_LIST)   // shms_tensor_ref.memory_kind
#undef SHMSERVE_ENUM_
#undef SHMSERVE_ENUM_CASE_
#undef SHMSERVE_ENUM_MEMBER_

inline const char *status_name(Status s) { return name_of(s); }

// ------------------------------------------------------------------ data types

/// Element bytes; 0 for BYTES (variable) and INVALID.
inline uint32_t dtype_size(DType t) { return shms_dtype_size(static_cast<uint32_t>(t)); }
inline const char *dtype_name(DType t) { return shms_dtype_name(static_cast<uint32_t>(t)); }
/// The DType of a name ("FP32"); INVALID for an unknown name.
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

}  // namespace shmserve
