// shmserve C++ client: typed errors.
//
// Every error carries the protocol status (docs/protocol.md section 9; the Status enum
// comes from shmserve.h's SHMS_STATUS_LIST) and the server's message. Catch
// shmserve::Error for all of them, or a subclass. The classes follow the Python
// client's (shmserve/errors.py): a control-socket error reply names its Python class
// in "type", and throw_status() throws the C++ class of that name where there is one.
#pragma once

#include <stdexcept>
#include <string>
#include <string_view>

#include "shmserve/enums.hpp"

namespace shmserve {

/// Base class: status() is the protocol status, message() the text (from the server
/// where the server answered).
class Error : public std::runtime_error {
 public:
  Error(Status status, std::string message)
      : std::runtime_error(message), status_(status), message_(std::move(message)) {}
  Status status() const noexcept { return status_; }
  const std::string &message() const noexcept { return message_; }

 private:
  Status status_;
  std::string message_;
};

// Every error class, X(class, base, status, name in a control reply's "type": the
// Python class of shmserve/errors.py, "" where Python has none).
#define SHMSERVE_ERROR_CLASSES(X)                                                        \
  X(InvalidArgumentError, Error, INVALID_ARG, "InvalidArgumentError") /* bad name, shape */ \
  X(ModelNotFoundError, Error, NOT_FOUND, "ModelNotFoundError")       /* unknown model */   \
  X(UnavailableError, Error, UNAVAILABLE, "UnavailableError") /* not loaded, worker died */ \
  X(OutputTooSmallError, Error, OUTPUT_TOO_SMALL, "OutputTooSmallError")                  \
  X(InternalError, Error, INTERNAL, "InternalError")                  /* the model raised */ \
  X(BusyError, Error, BUSY, "BusyError")               /* ring full, arena full, no lease */ \
  X(BadDescriptorError, Error, BAD_DESCRIPTOR, "BadDescriptorError")                      \
  /* The server stopped or died, or the lease ended: no pending request is answered. */  \
  X(ServerDeadError, Error, SERVER_DEAD, "ServerDeadError")                               \
  /* The caller's timeout expired before the answer came. */                              \
  X(TimeoutError, Error, TIMEOUT, "ServerTimeoutError")                                   \
  /* A model repository or config.pbtxt is wrong; the message names the file. */          \
  X(ConfigError, InvalidArgumentError, INVALID_ARG, "ConfigError")                        \
  /* Not enough shared memory for a segment (an arena, /dev/shm). */                      \
  X(ShmSpaceError, UnavailableError, UNAVAILABLE, "ShmSpaceError")                        \
  /* The server broke the protocol (bad magic, malformed reply, answer outside buffers). */ \
  X(ProtocolError, Error, INTERNAL, "")

#define SHMSERVE_ERROR_CLASS_(Name, Base, Code, type_name)                     \
  class Name : public Base {                                                   \
   public:                                                                     \
    explicit Name(std::string m) : Base(Status::Code, std::move(m)) {}        \
    Name(Status s, std::string m) : Base(s, std::move(m)) {}                  \
  };
SHMSERVE_ERROR_CLASSES(SHMSERVE_ERROR_CLASS_)
#undef SHMSERVE_ERROR_CLASS_

/// Throws the error class of a status read from a slot or of a control-socket error
/// reply; type_name (the reply's "type") picks a finer class where the C++ client has
/// that class; the status stays the one the server sent.
[[noreturn]] inline void throw_status(int32_t code, const std::string &msg, std::string_view type_name = {}) {
  const Status s = static_cast<Status>(code);
  if (!type_name.empty()) {
#define SHMSERVE_THROW_NAMED_(Name, Base, Code, py_name) \
  if (type_name == py_name) throw Name(s, msg);
    SHMSERVE_ERROR_CLASSES(SHMSERVE_THROW_NAMED_)
#undef SHMSERVE_THROW_NAMED_
  }
  switch (s) {
    case Status::INVALID_ARG: throw InvalidArgumentError(msg);
    case Status::NOT_FOUND: throw ModelNotFoundError(msg);
    case Status::UNAVAILABLE: throw UnavailableError(msg);
    case Status::OUTPUT_TOO_SMALL: throw OutputTooSmallError(msg);
    case Status::INTERNAL: throw InternalError(msg);
    case Status::BUSY: throw BusyError(msg);
    case Status::BAD_DESCRIPTOR: throw BadDescriptorError(msg);
    case Status::SERVER_DEAD: throw ServerDeadError(msg);
    case Status::TIMEOUT: throw TimeoutError(msg);
    case Status::OK: break;  // an error reply that says OK: not a status of an error
  }
  throw Error(Status::INTERNAL, std::string("status ") + name_of(s) + " (" + std::to_string(code) + "): " + msg);
}

}  // namespace shmserve
