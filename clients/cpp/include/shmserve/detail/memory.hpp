// shmserve C++ client, internal: the arena allocator, blocks of the arena, mappings
// of received segments.
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <map>
#include <mutex>

#include "shmserve/detail/socket.hpp"
#include "shmserve/tensors.hpp"

namespace shmserve {
namespace detail {

/// Bytes a block of n bytes takes in the arena: tensor data offsets are multiples of
/// SHMS_DATA_ALIGN (shms_align), and an empty block still takes one unit.
inline uint64_t align64(uint64_t n) { return shms_align(std::max<uint64_t>(n, 1), SHMS_DATA_ALIGN); }

/// First-fit allocator over the arena's data region (offsets multiple of SHMS_DATA_ALIGN).
class Allocator {
 public:
  void reset(uint64_t begin, uint64_t end) {
    std::lock_guard<std::mutex> g(mu_);
    free_.clear();
    free_[begin] = end - begin;
    capacity_ = end - begin;
  }
  bool alloc(uint64_t n, uint64_t *offset) {
    n = align64(n);
    std::lock_guard<std::mutex> g(mu_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < n) continue;
      *offset = it->first;
      uint64_t rest = it->second - n;
      free_.erase(it);
      if (rest) free_[*offset + n] = rest;
      used_ += n;
      return true;
    }
    return false;
  }
  void free(uint64_t offset, uint64_t n) {
    n = align64(n);
    std::lock_guard<std::mutex> g(mu_);
    used_ -= n;
    auto it = free_.emplace(offset, n).first;
    auto next = std::next(it);
    if (next != free_.end() && it->first + it->second == next->first) {
      it->second += next->second;
      free_.erase(next);
    }
    if (it != free_.begin()) {
      auto prev = std::prev(it);
      if (prev->first + prev->second == it->first) {
        prev->second += it->second;
        free_.erase(it);
      }
    }
  }
  uint64_t used() {
    std::lock_guard<std::mutex> g(mu_);
    return used_;
  }
  uint64_t capacity() const { return capacity_; }

 private:
  std::mutex mu_;
  std::map<uint64_t, uint64_t> free_;
  uint64_t used_ = 0, capacity_ = 0;
};

class Engine;

/// One allocation in the arena; freed when the last owner drops it. Keeps the
/// mapping (the Engine) alive.
struct Block {
  std::shared_ptr<Engine> engine;
  uint64_t offset = 0, nbytes = 0;
  Block(std::shared_ptr<Engine> e, uint64_t o, uint64_t n) : engine(std::move(e)), offset(o), nbytes(n) {}
  ~Block();
};

struct Mapping {
  void *base = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (base != MAP_FAILED) munmap(base, size);
  }
  /// Maps `want` bytes of a received descriptor (a memfd: the arena, the control
  /// segment, the bell); the caller closes it. The server seals their size; a descriptor
  /// without those seals is refused (a peer could shrink it and make every access a
  /// SIGBUS). writable false: PROT_READ only (the control block's descriptor is
  /// O_RDONLY, so a shared writable mapping of it fails).
  void map_fd(int fd, uint64_t want, bool writable = true) {
    struct stat st;
    int seals = fcntl(fd, F_GET_SEALS);
    const int need = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
    if (want == 0 || fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < want || seals < 0 ||
        (seals & need) != need)
      throw ProtocolError("segment descriptor is smaller than announced or not sealed");
    size = want;
    base = mmap(nullptr, size, writable ? PROT_READ | PROT_WRITE : PROT_READ, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) throw ServerDeadError(std::string("cannot map a segment: ") + std::strerror(errno));
  }
};

}  // namespace detail

}  // namespace shmserve
