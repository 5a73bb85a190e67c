// shmserve C++ client, internal: the lease (control socket, mapped segments, slot
// table, request path, completion and liveness). docs/protocol.md sections 2-8.
#pragma once

#include <signal.h>

#include <atomic>

#include "shmserve/types.hpp"

namespace shmserve {

namespace detail {

class Impl : public std::enable_shared_from_this<Impl> {
 public:
  // -- connection -------------------------------------------------------------------
  void connect(const Options &o) {
    opts = o;
    spin_base_ns = std::max<int64_t>(0, o.spin_us) * 1000;
    spin_max_ns = spin_base_ns ? std::max(spin_base_ns, o.max_spin_us * 1000) : 0;
    typical_ns = spin_base_ns;
    sock = std::make_unique<ControlSocket>(o.socket_path.empty() ? socket_path(o.name) : o.socket_path);
    // The arena's and the control segment's sealed memfds come with the reply; they
    // are closed here whatever happens (a mapping keeps the memory).
    std::vector<int> fds;
    struct CloseAll {
      std::vector<int> &v;
      ~CloseAll() { for (int fd : v) ::close(fd); }
    } close_all{fds};
    Reply h = sock->call(hello_frame(getpid(), o.arena_bytes), &fds);
    if (fds.size() != 2) throw ProtocolError("hello reply did not carry the arena and control descriptors");
    uint64_t arena_bytes = static_cast<uint64_t>(h.i("arena_bytes"));
    arena_map.map_fd(fds[0], arena_bytes);
    ctl_map.map_fd(fds[1], static_cast<uint64_t>(h.i("control_bytes")));
    client_id = static_cast<uint32_t>(h.i("client_id"));
    server_pid = static_cast<pid_t>(h.i("server_pid"));
    ctl = static_cast<shms_control *>(ctl_map.base);
    arena = static_cast<char *>(arena_map.base);
    hdr = reinterpret_cast<shms_arena_header *>(arena);
    n_slots = static_cast<uint32_t>(h.i("n_slots"));
    uint64_t slots_offset = static_cast<uint64_t>(h.i("slots_offset"));
    uint64_t data_offset = static_cast<uint64_t>(h.i("data_offset"));
    // docs/protocol.md section 12: refuse a segment that is not what the protocol says.
    // The ring's capacity and place are fixed here, once: the header is client-writable.
    if (shms_ring_attach(&ring, ctl_map.base, ctl_map.size) != 0 || ctl->header_bytes != sizeof(shms_control))
      throw ProtocolError("control segment: bad magic, version or ring");
    if (hdr->magic != SHMS_MAGIC_ARENA || hdr->version != SHMS_PROTOCOL_VERSION ||
        hdr->client_id != client_id || hdr->n_slots != n_slots || hdr->slots_offset != slots_offset ||
        hdr->data_offset != data_offset || slots_offset % 64 || n_slots == 0 ||
        data_offset < slots_offset + uint64_t(n_slots) * sizeof(shms_slot) || data_offset > arena_bytes)
      throw ProtocolError("arena segment: bad magic, version or layout");
    slots = reinterpret_cast<shms_slot *>(arena + slots_offset);
    alloc.reset(data_offset, arena_bytes);
    gens.assign(n_slots, 0);
    inflight.assign(n_slots, nullptr);
    for (uint32_t s = n_slots; s-- > 0;) free_slots.push_back(s);
    remember(parse_models(Reply::get(h.root(), "models")));
  }

  Reply control(const std::string &frame_bytes) {
    std::lock_guard<std::mutex> g(sock_mu);
    if (closed.load()) throw ServerDeadError("the client is closed");
    return sock->call(frame_bytes);
  }

  void close() {
    if (closed.exchange(true)) return;
    {
      std::lock_guard<std::mutex> g(sock_mu);
      sock->close();  // ends the lease: the server closes its arena descriptor; our mapping stays valid
    }
    // Calls still in flight will never be answered; dropping them frees their buffers
    // (and breaks the Impl -> Call -> Block -> Impl cycle). Their Futures fail.
    std::vector<std::shared_ptr<Call>> dropped;
    std::lock_guard<std::mutex> g(mu);
    for (auto &c : inflight) if (c) c->orphaned = true, dropped.push_back(std::move(c));
    n_inflight = 0;
  }

  void remember(const std::vector<ModelInfo> &list) {
    std::lock_guard<std::mutex> g(models_mu);
    for (const auto &m : list) {
      auto p = std::make_shared<const ModelInfo>(m);
      by_version[{m.name, m.version}] = p;
      auto &latest = latest_version[m.name];
      if (!latest || latest->version < m.version) latest = p;
    }
  }

  std::shared_ptr<const ModelInfo> model(const std::string &name, int64_t version) {
    {
      std::lock_guard<std::mutex> g(models_mu);
      if (version > 0) {
        auto it = by_version.find({name, version});
        if (it != by_version.end()) return it->second;
      } else {
        auto it = latest_version.find(name);
        if (it != latest_version.end()) return it->second;
      }
    }
    Reply r = control(op_frame("metadata", name, version));  // the server words the error
    remember({parse_model(r.root())});
    std::lock_guard<std::mutex> g(models_mu);
    return version > 0 ? by_version.at({name, version}) : latest_version.at(name);
  }

  // -- liveness -------------------------------------------------------------------------
  /// Throws ServerDeadError if the server stopped or died, or the lease ended.
  void check_server() {
    // control.server_state is only a hint (any client can write it): the pid and the
    // lease socket decide.
    if (closed.load()) throw ServerDeadError("the client is closed");
    bool stopped = shms_load(&ctl->server_state, memory_order_acquire) == SHMS_SERVER_STOPPED;
    if (::kill(server_pid, 0) != 0 && errno == ESRCH)
      throw ServerDeadError("server '" + opts.name +
                            (stopped ? "' has stopped" : "' (pid " + std::to_string(server_pid) + ") died"));
    std::unique_lock<std::mutex> g(sock_mu, std::try_to_lock);
    if (g.owns_lock() && sock->at_eof())
      throw ServerDeadError("server '" + opts.name + (stopped ? "' has stopped" : "' closed this client's lease"));
  }

  // -- memory ---------------------------------------------------------------------------
  std::shared_ptr<Block> allocate(uint64_t n, const std::string &what) {
    if (align64(n) > alloc.capacity())
      throw InvalidArgumentError(what + " needs " + std::to_string(n) + " bytes but this client's arena holds " +
                                 std::to_string(alloc.capacity()) + " (Options::arena_bytes)");
    for (;;) {
      uint64_t off;
      if (alloc.alloc(n, &off)) return std::make_shared<Block>(shared_from_this(), off, n);
      uint32_t seen = shms_load(&hdr->completions, memory_order_acquire);
      {
        std::lock_guard<std::mutex> g(mu);
        if (collect_locked()) continue;
        if (n_inflight == 0)
          throw BusyError(what + " needs " + std::to_string(n) + " bytes and the arena is full (" +
                          std::to_string(alloc.used()) + " bytes held by results and tensors still alive)");
      }
      if (!shms_doorbell_wait(&hdr->completions, &hdr->waiters, seen, spin_base_ns, kWaitSliceNs))
        check_server();
    }
  }

  // -- requests -------------------------------------------------------------------------
  std::shared_ptr<Call> submit(const std::string &model_name, const std::vector<Input> &inputs,
                               const std::vector<std::string> &outputs, int64_t version) {
    if (closed.load()) throw ServerDeadError("the client is closed");
    if (shms_load(&ctl->server_state, memory_order_acquire) == SHMS_SERVER_STOPPED) check_server();
    auto call = std::make_shared<Call>();
    call->model = model(model_name, version);
    const ModelInfo &m = *call->model;
    // Where each input goes: zero-copy tensors stay, the rest is copied into one block.
    uint64_t copy_bytes = 0;
    std::vector<int> index(inputs.size());
    for (size_t i = 0; i < inputs.size(); i++) {
      const Input &in = inputs[i];
      index[i] = m.input_index(in.name);
      if (index[i] < 0) {
        std::string names;
        for (const auto &t : m.inputs) names += (names.empty() ? "" : ", ") + t.name;
        throw InvalidArgumentError("model '" + m.name + "' has no input '" + in.name + "' (inputs: " + names + ")");
      }
      if (in.shape.size() > SHMS_MAX_DIMS)
        throw InvalidArgumentError("model '" + m.name + "' input '" + in.name + "' has more than 8 dimensions");
      if (!(in.block && in.block->impl.get() == this)) {
        if (!in.data && in.nbytes) throw InvalidArgumentError("input '" + in.name + "' has no data");
        copy_bytes += align64(in.nbytes);
      }
      call->in_bytes += in.nbytes;
    }
    if (inputs.size() > SHMS_MAX_TENSORS) throw InvalidArgumentError("more than 16 inputs");
    if (m.batched() && !inputs.empty() && !inputs[0].shape.empty() && inputs[0].shape[0] > 0)
      call->rows = static_cast<uint64_t>(inputs[0].shape[0]);
    std::vector<uint32_t> want;
    if (outputs.empty()) {
      for (uint32_t k = 0; k < m.outputs.size(); k++) want.push_back(k);
    } else {
      for (const auto &name : outputs) {
        int k = m.output_index(name);
        if (k < 0) throw InvalidArgumentError("model '" + m.name + "' has no output '" + name + "'");
        want.push_back(static_cast<uint32_t>(k));
      }
    }
    std::vector<uint64_t> caps;
    uint64_t out_bytes = 0;
    for (uint32_t k : want) caps.push_back(capacity(*call, k, 0)), out_bytes += align64(caps.back());
    auto block = allocate(copy_bytes + out_bytes, "request to model '" + m.name + "'");
    uint64_t at = block->offset;
    for (size_t i = 0; i < inputs.size(); i++) {
      const Input &in = inputs[i];
      uint64_t off;
      if (in.block && in.block->impl.get() == this) {
        off = in.block->offset;
        call->keep.push_back(in.block);
      } else {
        off = at;
        if (in.nbytes) std::memcpy(arena + off, in.data, in.nbytes);  // the one copy in
        at += align64(in.nbytes);
      }
      call->in_refs.push_back(make_tensor_ref(static_cast<uint32_t>(index[i]), in.dtype, off, in.nbytes, in.shape));
    }
    for (size_t k = 0; k < want.size(); k++) {
      call->out_refs.push_back(make_tensor_ref(want[k], DType::INVALID, at, caps[k], {}));
      at += align64(caps[k]);
    }
    call->keep.push_back(block);
    call->out_block = block;
    send(call, acquire_slot());
    return call;
  }

  /// Output buffer size: exact when the config fixes the shape, else a guess; `needed`
  /// (from OUTPUT_TOO_SMALL) wins.
  static uint64_t capacity(const Call &c, uint32_t k, uint64_t needed) {
    if (needed) return needed;
    const TensorSpec &s = c.model->outputs[k];
    size_t first = c.model->batched() ? 1 : 0;
    bool fixed = s.dtype != DType::BYTES && dtype_size(s.dtype) > 0;
    uint64_t n = c.rows * dtype_size(s.dtype);
    for (size_t d = first; d < s.shape.size() && fixed; d++) {
      if (s.shape[d] < 0) fixed = false;
      else n *= static_cast<uint64_t>(s.shape[d]);
    }
    return fixed ? n : std::max<uint64_t>(c.in_bytes, 4096);
  }

  uint32_t acquire_slot() {
    for (;;) {
      uint32_t seen = shms_load(&hdr->completions, memory_order_acquire);
      {
        std::lock_guard<std::mutex> g(mu);
        if (free_slots.empty()) collect_locked();
        if (!free_slots.empty()) {
          uint32_t s = free_slots.back();
          free_slots.pop_back();
          return s;
        }
      }
      if (!shms_doorbell_wait(&hdr->completions, &hdr->waiters, seen, spin_base_ns, kWaitSliceNs))
        check_server();
    }
  }

  /// Writes the request into its slot (owned by this thread), publishes it and rings
  /// the batcher. On failure the slot goes back to the free list.
  void send(const std::shared_ptr<Call> &c, uint32_t s) {
    {
      std::lock_guard<std::mutex> g(mu);
      inflight[s] = c;
      n_inflight++;
    }
    int rc = write_and_push(*c, s);
    if (rc != SHMS_RING_OK) {
      std::lock_guard<std::mutex> g(mu);
      inflight[s] = nullptr;
      n_inflight--;
      free_slots.push_back(s);
      if (rc == SHMS_RING_FULL) throw BusyError("server '" + opts.name + "' request ring is full; retry later");
      check_server();  // a lease that ended is why its pushes were skipped
      throw BusyError("server '" + opts.name + "': " + kSkipped);
    }
  }

  int write_and_push(Call &c, uint32_t s) {
    shms_slot &slot = slots[s];
    uint64_t t0 = shms_now_ns();
    c.slot = s;
    c.generation = gens[s] = gens[s] + 1;  // the slot is ours: no lock needed for gens[s]
    encode_request(slot.request, c.model->id, c.in_refs, c.out_refs);
    slot.generation = c.generation;
    slot.status = -1;
    slot.n_results = 0;
    slot.error[0] = 0;
    std::memset(slot.t_ns, 0, sizeof slot.t_ns);
    slot.t_ns[SHMS_T_CLIENT_WRITE] = t0;
    slot.t_ns[SHMS_T_ENQUEUE] = shms_now_ns();
    // SYNC POINT: release pairs with the batcher's CAS SUBMITTED -> QUEUED.
    shms_store(&slot.state, static_cast<uint32_t>(SHMS_SLOT_SUBMITTED), memory_order_release);
    int rc = push(s, c.generation);
    // Back to FREE only if the batcher has not taken the request meanwhile (its sweep
    // takes SUBMITTED requests the ring lost): then it is in flight after all.
    uint32_t submitted = SHMS_SLOT_SUBMITTED;
    if (rc != SHMS_RING_OK && !shms_cas(&slot.state, &submitted, static_cast<uint32_t>(SHMS_SLOT_FREE)))
      rc = SHMS_RING_OK;
    return rc;
  }

  /// Pushes the ring entry and rings the batcher. RECLAIMED (our claim was skipped:
  /// held past the batcher's grace, or our lease ended) is retried up to 100 times;
  /// FULL, which an honest ring never is (it holds every slot of every client), for up
  /// to 100 ms while the batcher repairs the ring.
  int push(uint32_t s, uint32_t generation) {
    uint64_t full_since = 0;
    for (int attempt = 0;; attempt++) {
      int rc = shms_ring_push(&ring, client_id, s, generation);
      // SYNC POINT: wakes the batcher sleeping in shms_doorbell_wait on control.doorbell.
      shms_doorbell_ring(&ctl->doorbell, &ctl->batcher_sleeping, 1);
      if (rc == SHMS_RING_OK || (rc == SHMS_RING_RECLAIMED && attempt >= 99)) return rc;
      if (rc == SHMS_RING_FULL) {
        uint64_t now = shms_now_ns();
        if (!full_since) full_since = now;
        if (now - full_since >= 100000000ull) return rc;
        struct timespec ms = {0, 1000000};
        nanosleep(&ms, nullptr);
      }
    }
  }

  /// Reads every DONE slot into its Call and frees the slot. Returns how many.
  size_t collect_locked() {
    size_t n = 0;
    for (uint32_t s = 0; s < n_slots && n_inflight; s++) {
      std::shared_ptr<Call> &c = inflight[s];
      if (!c) continue;
      shms_slot &slot = slots[s];
      // SYNC POINT: acquire pairs with the server's release store of DONE.
      if (shms_load(&slot.state, memory_order_acquire) != SHMS_SLOT_DONE) continue;
      c->status = slot.status;
      char err[SHMS_ERROR_BYTES];
      shms_copy_name(err, sizeof err, slot.error, sizeof slot.error);
      c->error = err;
      uint32_t nr = std::min<uint32_t>(slot.n_results, static_cast<uint32_t>(c->out_refs.size()));
      c->results.assign(slot.results, slot.results + nr);
      std::memcpy(c->t_ns.data(), slot.t_ns, sizeof slot.t_ns);
      c->t_ns[SHMS_T_CLIENT_WAKE] = shms_now_ns();
      if (c->status == SHMS_ERR_OUTPUT_TOO_SMALL && !c->retried && !c->orphaned && resend_locked(*c)) continue;
      shms_store(&slot.state, static_cast<uint32_t>(SHMS_SLOT_FREE), memory_order_release);
      c->done = true;
      c->keep.clear();  // the server no longer reads the inputs
      if (c->status != SHMS_OK) c->out_block.reset();
      c = nullptr;
      n_inflight--;
      free_slots.push_back(s);
      n++;
    }
    return n;
  }

  /// OUTPUT_TOO_SMALL: the same request again, in the same slot, with buffers of the
  /// size the server asked for. False if that cannot be done (the caller gets the error).
  bool resend_locked(Call &c) {
    if (c.results.size() != c.out_refs.size()) return false;
    uint64_t total = 0;
    std::vector<uint64_t> caps;
    for (size_t k = 0; k < c.out_refs.size(); k++) {
      caps.push_back(std::max(c.results[k].nbytes, c.out_refs[k].nbytes));
      total += align64(caps.back());
    }
    uint64_t off;
    if (align64(total) > alloc.capacity() || !alloc.alloc(total, &off)) return false;
    auto block = std::make_shared<Block>(shared_from_this(), off, total);
    for (size_t k = 0; k < c.out_refs.size(); k++) {
      c.out_refs[k].offset = off;
      c.out_refs[k].nbytes = caps[k];
      off += align64(caps[k]);
    }
    c.out_block = block;
    c.retried = true;
    c.status = -1;
    c.results.clear();
    // DONE -> FREE -> SUBMITTED, as section 6 has it; the slot never leaves this client.
    shms_store(&slots[c.slot].state, static_cast<uint32_t>(SHMS_SLOT_FREE), memory_order_release);
    int rc = write_and_push(c, c.slot);
    if (rc == SHMS_RING_OK) return true;
    c.status = SHMS_ERR_BUSY;  // slot set back FREE
    c.error = rc == SHMS_RING_FULL ? "request ring is full; retry later" : kSkipped;
    return false;
  }

  void record_wait(int64_t ns) {
    int64_t t = typical_ns.load(std::memory_order_relaxed);
    typical_ns.store(t + ((ns - t) >> 3), std::memory_order_relaxed);
  }
  int64_t spin_budget() const {
    int64_t t = typical_ns.load(std::memory_order_relaxed);
    if (spin_base_ns == 0 || t > spin_max_ns) return spin_base_ns;
    return std::min(spin_max_ns, std::max(spin_base_ns, t * 3 / 2));
  }

  bool poll(Call &c) {
    std::lock_guard<std::mutex> g(mu);
    if (!c.done) collect_locked();
    return c.done;
  }

  /// Waits for a call (timeout_s < 0: no limit), then returns its result or throws.
  Result wait(const std::shared_ptr<Call> &c, double timeout_s) {
    const uint64_t start = shms_now_ns();
    const int64_t limit = timeout_s < 0 ? -1 : static_cast<int64_t>(timeout_s * 1e9);
    const int64_t spin = spin_budget();
    for (;;) {
      uint32_t seen = shms_load(&hdr->completions, memory_order_acquire);  // FIRST
      if (poll(*c)) break;
      int64_t slice = kWaitSliceNs;
      if (limit >= 0) {
        int64_t left = limit - static_cast<int64_t>(shms_now_ns() - start);
        if (left <= 0) {
          abandon(*c);
          throw TimeoutError("model '" + c->model->name + "': no answer within " + std::to_string(timeout_s) + " s");
        }
        slice = std::min(slice, left);
      }
      // SYNC POINT: woken by the server's shms_doorbell_ring on arena.completions.
      if (!shms_doorbell_wait(&hdr->completions, &hdr->waiters, seen, spin, slice)) {
        try {
          check_server();
        } catch (...) {
          abandon(*c);
          throw;
        }
      }
    }
    record_wait(static_cast<int64_t>(shms_now_ns() - start));
    return finish(*c);
  }

  void abandon(Call &c) {
    std::lock_guard<std::mutex> g(mu);
    if (!c.done) c.orphaned = true;  // slot and buffers stay reserved until DONE
  }

  Result finish(Call &c) {
    if (c.status != SHMS_OK) throw_status(c.status, c.error);
    Result r;
    r.model_ = c.model->name;
    r.version_ = c.model->version;
    r.t_ns_ = c.t_ns;
    const uint64_t begin = c.out_block->offset, end = begin + align64(c.out_block->nbytes);
    for (size_t k = 0; k < c.results.size(); k++) {
      const shms_tensor_ref &t = c.results[k];
      const shms_tensor_ref &want = c.out_refs[k];
      if (t.index != want.index || t.offset != want.offset || t.nbytes > want.nbytes || t.offset < begin ||
          t.offset + t.nbytes > end || t.ndim > SHMS_MAX_DIMS || t.dtype == 0 || t.dtype >= SHMS_TYPE_COUNT)
        throw ProtocolError("model '" + c.model->name + "': server answered with an output outside the buffers it was given");
      Output o;
      o.index = t.index;
      o.name = c.model->outputs.at(t.index).name;
      o.dtype = static_cast<DType>(t.dtype);
      o.shape.assign(t.shape, t.shape + t.ndim);
      o.data = arena + t.offset;
      o.nbytes = t.nbytes;
      r.outputs_.push_back(std::move(o));
    }
    r.block_ = c.out_block;
    return r;
  }

  // -- state ------------------------------------------------------------------------------
  Options opts;
  std::mutex sock_mu;
  std::unique_ptr<ControlSocket> sock;
  std::atomic<bool> closed{false};
  detail::Mapping ctl_map, arena_map;
  shms_control *ctl = nullptr;
  shms_ring ring{};
  static constexpr const char *kSkipped =
      "the batcher skipped this client's ring entry 100 times (another client is damaging the ring); "
      "retry later";
  char *arena = nullptr;
  shms_arena_header *hdr = nullptr;
  shms_slot *slots = nullptr;
  uint32_t n_slots = 0, client_id = 0;
  pid_t server_pid = 0;
  Allocator alloc;
  std::mutex mu;  // guards the slot table and every Call's answer fields
  std::vector<uint32_t> free_slots, gens;
  std::vector<std::shared_ptr<Call>> inflight;
  size_t n_inflight = 0;
  std::mutex models_mu;
  std::map<std::pair<std::string, int64_t>, std::shared_ptr<const ModelInfo>> by_version;
  std::map<std::string, std::shared_ptr<const ModelInfo>> latest_version;
  int64_t spin_base_ns = 0, spin_max_ns = 0;
  std::atomic<int64_t> typical_ns{0};
};

inline Block::~Block() { impl->alloc.free(offset, nbytes); }

}  // namespace detail

inline void *Tensor::data() const { return block_ ? block_->impl->arena + block_->offset : nullptr; }

}  // namespace shmserve
