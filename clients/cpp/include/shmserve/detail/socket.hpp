// shmserve C++ client, internal: finding the server and its control socket (the
// lease's lifetime). docs/protocol.md section 2.
#pragma once

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "shmserve/wire.hpp"

namespace shmserve {

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

namespace detail {

/// The control connection; its lifetime is the lease. Not thread-safe (the engine
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

  /// Sends one request and returns its typed reply (the typed error of an error
  /// reply). With received_fds, descriptors sent along with the reply (SCM_RIGHTS: the
  /// hello reply carries the memfds of the arena, the control segment and the bell) are
  /// appended there; the caller owns them, also when this throws.
  template <class Req> typename Req::Reply call(const Req &request, std::vector<int> *received_fds = nullptr) {
    msgpack::object_handle body = exchange(control::encode(request), received_fds);
    return control::decode_reply<Req>(body.get());
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
  msgpack::object_handle exchange(const std::string &frame, std::vector<int> *received_fds) {
    if (fd_ < 0) throw ServerDeadError("the client is closed");
    const char *p = frame.data();
    size_t left = frame.size();
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
    if (len > control::kMaxFrameBytes) throw ProtocolError("control reply of " + std::to_string(len) + " bytes");
    std::string body(len, '\0');
    read_exact(body.data(), len);
    return control::parse_body(body.data(), body.size());
  }

  /// One recvmsg of up to n bytes; the descriptors that come with it go to fds. A
  /// short read is normal (the caller reads on); the descriptors come with the read
  /// that returns the frame's first byte. MSG_CTRUNC (the kernel dropped descriptors:
  /// at the open-file limit, or too small a buffer): every descriptor received is
  /// closed and ProtocolError says so.
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
      if (msg.msg_flags & MSG_CTRUNC) {
        size_t got = fds->size();
        for (int fd : *fds) ::close(fd);
        fds->clear();
        throw ProtocolError("the descriptors sent with the reply were cut off (MSG_CTRUNC; " +
                            std::to_string(got) +
                            " received): this process is probably at its open-file limit (ulimit -n)");
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

}  // namespace detail
}  // namespace shmserve
