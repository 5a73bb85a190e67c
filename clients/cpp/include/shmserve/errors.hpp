// shmserve C++ client: typed errors.
//
// Every error carries the protocol status (docs/protocol.md section 9) and the
// server's message. Catch shmserve::Error for all of them, or a subclass.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>

namespace shmserve {

enum class Status : int32_t {
  OK = 0,
  INVALID_ARG = 1,
  NOT_FOUND = 2,
  UNAVAILABLE = 3,
  OUTPUT_TOO_SMALL = 4,
  INTERNAL = 5,
  BUSY = 6,
  BAD_DESCRIPTOR = 7,
};

inline const char *status_name(Status s) {
  switch (s) {
    case Status::OK: return "OK";
    case Status::INVALID_ARG: return "INVALID_ARG";
    case Status::NOT_FOUND: return "NOT_FOUND";
    case Status::UNAVAILABLE: return "UNAVAILABLE";
    case Status::OUTPUT_TOO_SMALL: return "OUTPUT_TOO_SMALL";
    case Status::INTERNAL: return "INTERNAL";
    case Status::BUSY: return "BUSY";
    case Status::BAD_DESCRIPTOR: return "BAD_DESCRIPTOR";
  }
  return "UNKNOWN";
}

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

#define SHMSERVE_ERROR_CLASS(Name, Base, Code)                                   \
  class Name : public Base {                                                     \
   public:                                                                       \
    explicit Name(std::string m) : Base(Status::Code, std::move(m)) {}        \
    Name(Status s, std::string m) : Base(s, std::move(m)) {}                  \
  };

SHMSERVE_ERROR_CLASS(InvalidArgumentError, Error, INVALID_ARG)  // bad name, dtype, shape...
SHMSERVE_ERROR_CLASS(ModelNotFoundError, Error, NOT_FOUND)      // unknown model or version
SHMSERVE_ERROR_CLASS(UnavailableError, Error, UNAVAILABLE)      // model not loaded, worker died
SHMSERVE_ERROR_CLASS(OutputTooSmallError, Error, OUTPUT_TOO_SMALL)
SHMSERVE_ERROR_CLASS(InternalError, Error, INTERNAL)            // the model raised
SHMSERVE_ERROR_CLASS(BusyError, Error, BUSY)                    // ring full, arena full, no client id
SHMSERVE_ERROR_CLASS(BadDescriptorError, Error, BAD_DESCRIPTOR)
/// The server stopped or died, or the lease ended: no pending request will be answered.
SHMSERVE_ERROR_CLASS(ServerDeadError, UnavailableError, UNAVAILABLE)
/// The caller's timeout expired before the answer came.
SHMSERVE_ERROR_CLASS(TimeoutError, UnavailableError, UNAVAILABLE)
/// The server broke the protocol (bad magic, malformed reply, answer outside buffers).
SHMSERVE_ERROR_CLASS(ProtocolError, Error, INTERNAL)
#undef SHMSERVE_ERROR_CLASS

/// Throws the error class of a status read from a slot or a control-socket reply.
[[noreturn]] inline void throw_status(int32_t code, const std::string &msg) {
  switch (static_cast<Status>(code)) {
    case Status::INVALID_ARG: throw InvalidArgumentError(msg);
    case Status::NOT_FOUND: throw ModelNotFoundError(msg);
    case Status::UNAVAILABLE: throw UnavailableError(msg);
    case Status::OUTPUT_TOO_SMALL: throw OutputTooSmallError(msg);
    case Status::INTERNAL: throw InternalError(msg);
    case Status::BUSY: throw BusyError(msg);
    case Status::BAD_DESCRIPTOR: throw BadDescriptorError(msg);
    default: throw Error(Status::INTERNAL, "status " + std::to_string(code) + ": " + msg);
  }
}

}  // namespace shmserve
