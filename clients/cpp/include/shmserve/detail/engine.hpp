// shmserve C++ client, internal: the engine. One lease on a server: the control
// socket, the mapped segments, the slot table, the arena's allocator, and the life of
// one request (submit, wait, finish). It knows models by ModelInfo and tensors by
// shms_tensor_ref only; the facades (client.hpp's Client and Future; a network front
// could be another) turn their callers' inputs into a Call and its answer into
// results. Every step on shared memory is a procedure of shmserve.h (shms_slot.h:
// begin/submit, push with retries, withdraw, read the answer, release; shms_wait.h:
// doorbells and the spin policy); docs/protocol.md sections 2-8.
#pragma once

#include <signal.h>

#include <atomic>

#include "shmserve/detail/memory.hpp"

namespace shmserve {

struct Options {
  std::string name = "default";  // the server's --name
  std::string socket_path;       // explicit control socket path (default: from name)
  uint64_t arena_bytes = 0;      // tensor data region wanted; 0 = server default (32 MiB)
  int64_t spin_us = 100;         // a waiter spins at least this long before it sleeps
  int64_t max_spin_us = 1000;    // ... and up to this long when answers usually take that long
};

namespace detail {

constexpr int64_t kWaitSliceNs = 50'000'000;  // between liveness checks of the server

/// An output a request asks for (model output index): into this client's arena, or
/// (device) into the caller's device buffer of device_capacity bytes.
struct OutputWant {
  uint32_t index = 0;
  bool device = false;
  uint64_t device_capacity = 0;
  uint16_t device_id = 0;
};

/// One request from submit to answer. A front sets model, rows, in_bytes, then (after
/// Engine::reserve) in_refs and keep; the engine the rest. Once sent, the fields from
/// `retried` on (and out_refs, out_block, keep) are guarded by Engine::mu.
struct Call {
  std::shared_ptr<const ModelInfo> model;
  uint64_t in_bytes = 0, rows = 1;           // for the output buffers' sizes
  std::vector<shms_tensor_ref> in_refs, out_refs;
  // Request options (shms_request); parameters_bytes at parameters_offset in the block,
  // a string correlation id's sequence_id_bytes at sequence_id_offset.
  uint32_t flags = 0, priority = 0, parameters_bytes = 0, sequence_id_bytes = 0;
  uint64_t timeout_us = 0, parameters_offset = 0, sequence_id = 0, sequence_id_offset = 0;
  std::vector<std::shared_ptr<Block>> keep;  // memory the inputs are in
  std::shared_ptr<Block> out_block;          // output buffers (after the staging area)
  uint64_t staging = 0;                      // arena offset of the staging area for inputs
  uint32_t slot = 0, generation = 0;
  bool retried = false, done = false, orphaned = false;
  int32_t status = -1;
  uint32_t response_index = 0, response_flags = 0;  // a STREAM call's final response
  std::string error;
  std::vector<shms_tensor_ref> results;  // valid once finish() returned
  std::array<uint64_t, SHMS_T_COUNT> t_ns{};
};

class Engine : public std::enable_shared_from_this<Engine> {
 public:
  // -- the lease --------------------------------------------------------------------
  void connect(const Options &o) {
    opts = o;
    spin_ = shms_spin_make(std::max<int64_t>(0, o.spin_us) * 1000, o.max_spin_us * 1000);
    sock = std::make_unique<ControlSocket>(o.socket_path.empty() ? socket_path(o.name) : o.socket_path);
    // The sealed memfds of the arena, the control segment (O_RDONLY) and the bell come
    // with the reply; they are closed here whatever happens (a mapping keeps the memory).
    std::vector<int> fds;
    struct CloseAll {
      std::vector<int> &v;
      ~CloseAll() { for (int fd : v) ::close(fd); }
    } close_all{fds};
    control::Hello hello;
    hello.pid = getpid();
    hello.arena_bytes = o.arena_bytes;
    control::HelloReply h = sock->call(hello, &fds);
    if (fds.size() != 3)
      throw ProtocolError("hello reply did not carry the arena, control and bell descriptors");
    if (h.bell_bytes < sizeof(shms_bell)) throw ProtocolError("hello reply: bell segment too small");
    arena_map.map_fd(fds[0], h.arena_bytes);
    ctl_map.map_fd(fds[1], h.control_bytes, false);  // the server's words only: read-only
    bell_map.map_fd(fds[2], h.bell_bytes);
    check_header(ctl_map, SHMS_MAGIC_CONTROL, "control segment");
    check_header(arena_map, SHMS_MAGIC_ARENA, "arena segment");
    // The submission ring's capacity and place are fixed here, once: the arena header
    // is this client's to write (a stray write must not move the ring later).
    if (shms_ring_attach(&sub.ring, arena_map.base, arena_map.size) != 0)
      throw ProtocolError("arena segment: its submission ring is malformed");
    shms_submitter_bells(&sub, ctl_map.base, bell_map.base, arena_map.base);
    ctl = static_cast<const shms_control *>(ctl_map.base);
    // The server's "no CPU to spin on" hint; shms_spin only loads it (the page is read-only).
    spin_.crowded = &static_cast<shms_control *>(ctl_map.base)->crowded;
    client_id = h.client_id;
    server_pid = static_cast<pid_t>(h.server_pid);
    n_slots = h.n_slots;
    arena = static_cast<char *>(arena_map.base);
    hdr = reinterpret_cast<shms_arena_header *>(arena);
    // docs/protocol.md section 12: the arena is where the hello reply and the shared
    // geometry (shms_arena_layout) say its submission ring, slots and data are.
    const shms_arena_geometry g = shms_arena_layout(n_slots, h.arena_bytes - std::min(h.arena_bytes, h.data_offset));
    if (n_slots == 0 || h.data_offset > h.arena_bytes || hdr->client_id != client_id || hdr->n_slots != n_slots ||
        hdr->slots_offset != h.slots_offset || hdr->data_offset != h.data_offset ||
        g.slots_offset != h.slots_offset || g.data_offset != h.data_offset || sub.ring.capacity != g.ring_capacity ||
        reinterpret_cast<char *>(sub.ring.cells) != arena + g.ring_offset)
      throw ProtocolError("arena segment: its layout is not the one the hello reply announced");
    slots = reinterpret_cast<shms_slot *>(arena + h.slots_offset);
    alloc.reset(h.data_offset, h.arena_bytes);
    gens.assign(n_slots, 0);
    inflight.assign(n_slots, nullptr);
    for (uint32_t s = n_slots; s-- > 0;) free_slots.push_back(s);
    remember(h.models);
  }

  /// One control request on the lease's socket; its typed reply.
  template <class Req> typename Req::Reply ask(const Req &request) {
    std::lock_guard<std::mutex> g(sock_mu);
    if (closed.load()) throw ServerDeadError("the client is closed");
    return sock->call(request);
  }

  void close() {
    if (closed.exchange(true)) return;
    {
      std::lock_guard<std::mutex> g(sock_mu);
      sock->close();  // ends the lease: the server closes its arena descriptor; our mapping stays valid
    }
    // Calls still in flight will never be answered; dropping them frees their buffers
    // (and breaks the Engine -> Call -> Block -> Engine cycle). Their waiters fail.
    std::vector<std::shared_ptr<Call>> dropped;
    std::lock_guard<std::mutex> g(mu);
    for (auto &c : inflight) if (c) c->orphaned = true, dropped.push_back(std::move(c));
    n_inflight = n_orphaned = 0;
  }

  // -- models ---------------------------------------------------------------------------
  void remember(const std::vector<ModelInfo> &list) {
    std::lock_guard<std::mutex> g(models_mu);
    for (const auto &m : list) {
      auto p = std::make_shared<const ModelInfo>(m);
      by_version[{m.name, m.version}] = p;
      auto &latest = latest_version[m.name];
      if (!latest || latest->version < m.version) latest = p;
    }
  }

  /// Drops what this client knows of a model (loaded, unloaded or reloaded): its
  /// next request asks the server again.
  void forget(const std::string &name) {
    std::lock_guard<std::mutex> g(models_mu);
    latest_version.erase(name);
    for (auto it = by_version.begin(); it != by_version.end();)
      it = it->first.first == name ? by_version.erase(it) : std::next(it);
  }

  /// A model by name and version (0: the highest), asking the server if it is new.
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
    // The server words the error (unknown model or version).
    remember({ask(control::GetMetadata{name, control::version_or_latest(version)})});
    std::lock_guard<std::mutex> g(models_mu);
    return version > 0 ? by_version.at({name, version}) : latest_version.at(name);
  }

  // -- liveness -------------------------------------------------------------------------
  /// False, with why, if the server stopped or died, or the lease ended.
  bool server_alive(std::string *why) {
    if (closed.load()) {
      *why = "the client is closed";
      return false;
    }
    // The pid and the lease socket decide; control.server_state (the server's word:
    // clients map the block read-only) only words the message.
    const bool stopped = server_stopped();
    const std::string server = "server '" + opts.name + "'";
    if (::kill(server_pid, 0) != 0 && errno == ESRCH) {
      *why = server + (stopped ? " has stopped" : " (pid " + std::to_string(server_pid) + ") died");
      return false;
    }
    std::unique_lock<std::mutex> g(sock_mu, std::try_to_lock);
    if (g.owns_lock() && sock->at_eof()) {
      *why = server + (stopped ? " has stopped" : " closed this client's lease");
      return false;
    }
    return true;
  }

  /// Throws ServerDeadError if the server stopped or died, or the lease ended.
  void check_server() {
    std::string why;
    if (!server_alive(&why)) throw ServerDeadError(why);
  }

  // -- memory ---------------------------------------------------------------------------
  /// n bytes of the arena; waits for answers to free some while requests are in flight.
  /// what() names the allocation in an error (called only then).
  template <class What>
  std::shared_ptr<Block> allocate(uint64_t n, What what) {
    if (align64(n) > alloc.capacity())
      throw InvalidArgumentError(what() + " needs " + std::to_string(n) + " bytes but this client's arena holds " +
                                 std::to_string(alloc.capacity()) + " (Options::arena_bytes)");
    for (;;) {
      uint64_t off;
      if (alloc.alloc(n, &off)) return std::make_shared<Block>(shared_from_this(), off, n);
      uint32_t seen = shms_load(&hdr->completions, memory_order_acquire);
      {
        std::lock_guard<std::mutex> g(mu);
        if (collect_locked()) continue;
        if (n_inflight == 0)
          throw BusyError(what() + " needs " + std::to_string(n) + " bytes and the arena is full (" +
                          std::to_string(alloc.used()) + " bytes held by results and tensors still alive)");
      }
      if (!shms_doorbell_wait(&hdr->completions, &hdr->waiters, seen, spin_.base_ns, kWaitSliceNs))
        check_server();
    }
  }

  // -- a request ------------------------------------------------------------------------
  /// Output buffer size: exact when the config fixes the shape, else a guess; the
  /// server's answer OUTPUT_TOO_SMALL brings the size needed (resend_locked).
  static uint64_t capacity(const Call &c, uint32_t k) {
    const TensorSpec &s = c.model->outputs[k];
    if (dtype_size(s.dtype) <= 0 || s.shape.size() > SHMS_MAX_DIMS) return std::max<uint64_t>(c.in_bytes, 4096);
    int64_t shape[SHMS_MAX_DIMS];  // on the stack: this runs for every output of every request
    std::copy(s.shape.begin(), s.shape.end(), shape);
    if (c.model->batched() && !s.shape.empty()) shape[0] = static_cast<int64_t>(c.rows);
    bool fixed = std::all_of(shape, shape + s.shape.size(), [](int64_t d) { return d >= 0; });
    uint64_t n = fixed ? shms_tensor_bytes(static_cast<uint32_t>(s.dtype), static_cast<uint32_t>(s.shape.size()), shape)
                       : UINT64_MAX;
    return n != UINT64_MAX ? n : std::max<uint64_t>(c.in_bytes, 4096);
  }

  /// Allocates one block: staging_bytes for inputs the front copies in (at c.staging),
  /// then a buffer for each wanted output, or for an output into the caller's device
  /// memory the place of its shms_cuda_ipc record, which the front writes. The front
  /// then sets c.in_refs (and c.keep for memory of its own) and calls send().
  void reserve(Call &c, const std::vector<OutputWant> &outputs, uint64_t staging_bytes) {
    std::vector<uint64_t> caps;
    caps.reserve(outputs.size());
    c.out_refs.reserve(outputs.size());
    uint64_t out_bytes = 0;
    for (const OutputWant &w : outputs) {
      caps.push_back(w.device ? w.device_capacity : capacity(c, w.index));
      out_bytes += align64(w.device ? sizeof(shms_cuda_ipc) : caps.back());
    }
    auto block = allocate(staging_bytes + out_bytes, [&] { return "request to model '" + c.model->name + "'"; });
    c.staging = block->offset;
    uint64_t at = block->offset + staging_bytes;
    for (size_t k = 0; k < outputs.size(); k++) {
      const OutputWant &w = outputs[k];
      c.out_refs.push_back(make_tensor_ref(w.index, DType::INVALID, at, caps[k], {},
                                           w.device ? MemoryKind::CUDA_IPC : MemoryKind::HOST_ARENA, w.device_id));
      at += align64(w.device ? sizeof(shms_cuda_ipc) : caps[k]);
    }
    c.keep.push_back(block);
    c.out_block = std::move(block);
  }

  /// Sends a reserved call: takes a slot (waiting for one if all are in flight),
  /// publishes the request and pushes its ring entry. On failure the slot is free again.
  void send(const std::shared_ptr<Call> &c) {
    if (closed.load()) throw ServerDeadError("the client is closed");
    if (server_stopped()) check_server();
    uint32_t s = acquire_slot();
    {
      std::lock_guard<std::mutex> g(mu);
      inflight[s] = c;
      n_inflight++;
    }
    int rc = publish(*c, s);  // the slot is this thread's until it is published
    if (rc == SHMS_RING_OK) return;
    {
      std::lock_guard<std::mutex> g(mu);
      inflight[s] = nullptr;
      n_inflight--;
      free_slots.push_back(s);
    }
    check_server();  // a server or lease that ended is why its pushes failed
    throw_status(rc < 0 ? SHMS_ERR_SERVER_DEAD : SHMS_ERR_BUSY, "server '" + opts.name + "': " + push_failure(rc));
  }

  /// True once the call's answer is in (no wait).
  bool poll(Call &c) {
    std::lock_guard<std::mutex> g(mu);
    if (c.done) return true;
    if (!shms_slot_is_done(&slots[c.slot])) return false;
    collect_locked();
    return c.done;
  }

  /// Waits for a call (timeout_s < 0: no limit), then finish()es it.
  void wait(const std::shared_ptr<Call> &c, double timeout_s) {
    const uint64_t start = shms_now_ns();
    const int64_t limit = timeout_s < 0 ? -1 : static_cast<int64_t>(timeout_s * 1e9);
    const int64_t spin = spin_budget();
    Waiting waiting(*this);
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
      if (!shms_doorbell_wait(&hdr->completions, &hdr->waiters, seen, pipelined() ? 0 : spin, slice)) {
        try {
          check_server();
        } catch (...) {
          abandon(*c);
          throw;
        }
      }
    }
    spin_record(static_cast<int64_t>(shms_now_ns() - start));
    finish(*c);
  }

  /// A call that is done: throws its error, or checks that every result lies in the
  /// buffer it was given (c.results are then safe to read).
  void finish(Call &c) {
    if (c.status != SHMS_OK) {
      // The model's handle went stale (unloaded or reloaded, docs/protocol.md "Model
      // handles"): the next request resolves the name again.
      if (c.status == SHMS_ERR_UNAVAILABLE && c.error.find("stale model id") != std::string::npos)
        forget(c.model->name);
      throw_status(c.status, c.error + too_small(c));
    }
    check_results(c, c.results);
  }

  /// A STREAM call (flags SHMS_REQUEST_STREAM, docs/protocol.md section 6a): calls
  /// on(results, status, error, index, final) for each response, in order: each
  /// RESPONSE the server publishes (handed back once on returns), then the final one
  /// (DONE) unless the final flag came alone. on returning false (or throwing)
  /// cancels the request: the model is asked to stop, slot and buffers come back with
  /// its final flag. A failed request throws, as wait() does; so does a timeout
  /// (timeout_s: the longest wait for each response, < 0 none), which cancels.
  template <class F> void stream(const std::shared_ptr<Call> &c, double timeout_s, F &&on) {
    shms_slot *slot = &slots[c->slot];
    const int64_t limit = timeout_s < 0 ? -1 : static_cast<int64_t>(timeout_s * 1e9);
    uint64_t start = shms_now_ns();
    Waiting waiting(*this);  // a stream's call has its waiter: infer()s elsewhere still spin
    for (;;) {
      uint32_t seen = shms_load(&hdr->completions, memory_order_acquire);  // FIRST
      shms_answer a;
      if (shms_slot_read_response(slot, &a)) {
        std::vector<shms_tensor_ref> results(a.results, a.results + std::min<size_t>(a.n_results, c->out_refs.size()));
        bool go = false;
        try {
          if (a.status == SHMS_OK) check_results(*c, results);
          go = on(results, a.status, std::string(a.error), a.response_index, false);
        } catch (...) {
          cancel(*c);
          throw;
        }
        if (!go) return cancel(*c);
        shms_slot_hand_back(slot);  // the next response may be written
        start = shms_now_ns();
        continue;
      }
      if (poll(*c)) {
        finish(*c);  // throws a failed request's error
        if (!(c->response_flags & SHMS_RESPONSE_EMPTY))
          on(c->results, c->status, c->error, c->response_index, true);
        return;
      }
      int64_t slice = kWaitSliceNs;
      if (limit >= 0) {
        int64_t left = limit - static_cast<int64_t>(shms_now_ns() - start);
        if (left <= 0) {
          cancel(*c);
          throw TimeoutError("model '" + c->model->name + "': no response within " + std::to_string(timeout_s) + " s");
        }
        slice = std::min(slice, left);
      }
      // SYNC POINT: woken by the worker's doorbell ring on arena.completions, rung for
      // every RESPONSE as for DONE.
      if (!shms_doorbell_wait(&hdr->completions, &hdr->waiters, seen, spin_.base_ns, slice)) {
        try {
          check_server();
        } catch (...) {
          abandon(*c);
          throw;
        }
      }
    }
  }

  /// OUTPUT_TOO_SMALL not resent (a caller's device buffer cannot grow): what each
  /// output needs, against what its buffer holds.
  static std::string too_small(const Call &c) {
    std::string out;
    if (c.status != SHMS_ERR_OUTPUT_TOO_SMALL) return out;
    for (size_t k = 0; k < c.results.size() && k < c.out_refs.size(); k++) {
      const shms_tensor_ref &got = c.results[k], &want = c.out_refs[k];
      if (got.nbytes <= want.nbytes || want.index >= c.model->outputs.size()) continue;
      out += "; output '" + c.model->outputs[want.index].name + "' needs " + std::to_string(got.nbytes) +
             " bytes, its " + (want.memory_kind ? "device buffer" : "buffer") + " holds " + std::to_string(want.nbytes);
    }
    return out;
  }

  /// Checks that every result lies in the buffer the call gave for it: in the arena,
  /// or, for an output into the caller's device memory, within that buffer's capacity
  /// (its shape's bytes included; the record stays where it was).
  void check_results(const Call &c, const std::vector<shms_tensor_ref> &results) {
    const uint64_t begin = c.out_block->offset, end = begin + align64(c.out_block->nbytes);
    for (size_t k = 0; k < results.size(); k++) {
      const shms_tensor_ref &t = results[k];
      const shms_tensor_ref &want = c.out_refs[k];
      const bool device = want.memory_kind == SHMS_MEMORY_CUDA_IPC;
      const bool placed =
          device ? t.device_id == want.device_id && t.ndim <= SHMS_MAX_DIMS &&
                       shms_tensor_bytes(t.dtype, t.ndim, t.shape) <= want.nbytes
                 : t.offset >= begin && t.offset + t.nbytes <= end;
      if (t.index != want.index || t.offset != want.offset || t.nbytes > want.nbytes || !placed ||
          t.ndim > SHMS_MAX_DIMS || t.dtype == SHMS_TYPE_INVALID || t.dtype >= SHMS_TYPE_COUNT ||
          t.memory_kind != want.memory_kind || t.index >= c.model->outputs.size())
        throw ProtocolError("model '" + c.model->name + "': server answered with an output outside the buffers it was given");
    }
  }

  char *arena_at(uint64_t offset) const { return arena + offset; }

 private:
  /// A stream the caller stops reading: the model is asked to stop (shms_slot_cancel);
  /// slot and buffers stay reserved until its final response.
  void cancel(Call &c) {
    shms_slot_cancel(&slots[c.slot]);
    abandon(c);
  }

  /// The caller gave up waiting: slot and buffers stay reserved until the answer.
  void abandon(Call &c) {
    std::lock_guard<std::mutex> g(mu);
    if (!c.done && !c.orphaned) {
      c.orphaned = true;
      n_orphaned++;
    }
  }

  /// control.server_state says the server stopped (a load: the block is read-only).
  bool server_stopped() const {
    return shms_load(&ctl->server_state, memory_order_acquire) == SHMS_SERVER_STOPPED;
  }

  static void check_header(const Mapping &m, uint64_t magic, const char *what) {
    if (const char *why = shms_check_header(m.base, m.size, magic))
      throw ProtocolError(std::string(what) + ": not a shmserve protocol " + std::to_string(SHMS_PROTOCOL_VERSION) +
                          " segment: " + why);
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
      if (!shms_doorbell_wait(&hdr->completions, &hdr->waiters, seen, spin_.base_ns, kWaitSliceNs))
        check_server();
    }
  }

  /// shms_push_request asks this while its claims keep being skipped.
  static int lease_alive(void *self) {
    std::string why;
    return static_cast<Engine *>(self)->server_alive(&why) ? 1 : 0;
  }

  /// Writes the call's request into slot s (this thread's, FREE), publishes it and
  /// pushes its ring entry. Returns SHMS_RING_OK, or why the push failed (the slot is
  /// then FREE again); a request the batcher took meanwhile (its sweep finds
  /// SUBMITTED requests the ring lost) is in flight after all: OK.
  int publish(Call &c, uint32_t s) {
    shms_slot *slot = &slots[s];
    c.slot = s;
    c.generation = gens[s] = gens[s] + 1;
    shms_request &r = *shms_slot_begin(slot);
    encode_request(r, c.model->id, c.in_refs, c.out_refs);
    r.flags = c.flags;
    r.priority = c.priority;
    r.timeout_us = c.timeout_us;
    r.parameters_offset = c.parameters_offset;
    r.parameters_bytes = c.parameters_bytes;
    r.sequence_id = c.sequence_id;
    r.sequence_id_offset = c.sequence_id_offset;
    r.sequence_id_bytes = c.sequence_id_bytes;
    shms_slot_submit(slot, c.generation);
    int rc = shms_push_request(&sub, client_id, s, c.generation, &Engine::lease_alive, this);
    return rc != SHMS_RING_OK && !shms_slot_withdraw(slot) ? SHMS_RING_OK : rc;
  }

  static std::string push_failure(int rc) {
    if (rc < 0) return "this client's lease ended";
    if (rc == SHMS_RING_FULL) return "request ring is full; retry later";
    // Only this client writes its ring: its claims stayed unpublished past the
    // batcher's grace (threads starved of CPU), or something in this process wrote there.
    return "the batcher skipped this client's ring entry " + std::to_string(SHMS_PUSH_MAX_TRIES) +
           " times (its claims stalled, or its ring is damaged); retry later";
  }

  /// Reads every DONE slot's answer into its Call and frees the slot. Returns how many.
  size_t collect_locked() {
    size_t n = 0;
    for (uint32_t s = 0; s < n_slots && n_inflight; s++) {
      std::shared_ptr<Call> &c = inflight[s];
      if (!c) continue;
      shms_answer a;
      if (!shms_slot_read_answer(&slots[s], &a)) continue;
      c->status = a.status;
      c->response_index = a.response_index;
      c->response_flags = a.response_flags;
      c->error = a.error;
      c->results.assign(a.results, a.results + std::min<size_t>(a.n_results, c->out_refs.size()));
      std::memcpy(c->t_ns.data(), a.t_ns, sizeof a.t_ns);
      if (c->status == SHMS_ERR_OUTPUT_TOO_SMALL && !c->retried && !c->orphaned && resend_locked(*c)) continue;
      shms_slot_release(&slots[s]);
      c->done = true;
      c->keep.clear();  // the server no longer reads the inputs
      if (c->status != SHMS_OK) c->out_block.reset();
      if (c->orphaned) n_orphaned--;
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
    for (const auto &ref : c.out_refs)  // a caller's device buffer cannot grow
      if (ref.memory_kind != SHMS_MEMORY_HOST_ARENA) return false;
    uint64_t total = 0;
    std::vector<uint64_t> caps;
    for (size_t k = 0; k < c.out_refs.size(); k++) {
      caps.push_back(std::max(c.results[k].nbytes, c.out_refs[k].nbytes));
      total += align64(caps.back());
    }
    uint64_t off;
    if (align64(total) > alloc.capacity() || !alloc.alloc(total, &off)) return false;
    c.out_block = std::make_shared<Block>(shared_from_this(), off, total);
    for (size_t k = 0; k < c.out_refs.size(); k++) {
      c.out_refs[k].offset = off;
      c.out_refs[k].nbytes = caps[k];
      off += align64(caps[k]);
    }
    c.retried = true;
    c.results.clear();
    // DONE -> FREE -> SUBMITTED, as section 6 has it; the slot never leaves this client.
    shms_slot_release(&slots[c.slot]);
    int rc = publish(c, c.slot);
    if (rc == SHMS_RING_OK) return true;
    c.status = rc < 0 ? SHMS_ERR_SERVER_DEAD : SHMS_ERR_BUSY;  // the slot is FREE again
    c.error = push_failure(rc);
    return false;
  }

  /// A thread in wait() or stream(), counted while it waits.
  struct Waiting {
    explicit Waiting(Engine &e) : e(e) {
      std::lock_guard<std::mutex> g(e.mu);
      e.n_waiting++;
    }
    ~Waiting() {
      std::lock_guard<std::mutex> g(e.mu);
      e.n_waiting--;
    }
    Engine &e;
  };

  /// More requests in flight than threads waiting: a caller keeps several in flight
  /// (submit() ahead of get()). Their answers come in batches that share a wake-up,
  /// and spinning for them would take the CPU the server needs, so waits do not spin
  /// then, as the Python client's futures poller does not. Callers that each wait
  /// for their own request (infer() from one or more threads) spin as usual.
  bool pipelined() {
    std::lock_guard<std::mutex> g(mu);
    return n_inflight - n_orphaned > n_waiting;  // nobody waits for an abandoned call
  }

  int64_t spin_budget() {
    std::lock_guard<std::mutex> g(spin_mu);
    return shms_spin_budget(&spin_);
  }
  void spin_record(int64_t waited_ns) {
    std::lock_guard<std::mutex> g(spin_mu);
    shms_spin_record(&spin_, waited_ns);
  }

 public:
  // -- state ------------------------------------------------------------------------------
  Options opts;
  uint32_t n_slots = 0, client_id = 0;
  Allocator alloc;

 private:
  std::mutex sock_mu;
  std::unique_ptr<ControlSocket> sock;
  std::atomic<bool> closed{false};
  Mapping ctl_map, bell_map, arena_map;
  const shms_control *ctl = nullptr;  // PROT_READ: loads only
  shms_submitter sub{};               // this client's ring, the bell, the sleep token
  char *arena = nullptr;
  shms_arena_header *hdr = nullptr;
  shms_slot *slots = nullptr;
  pid_t server_pid = 0;
  std::mutex mu;  // guards the slot table and every Call's answer fields
  std::vector<uint32_t> free_slots, gens;
  std::vector<std::shared_ptr<Call>> inflight;
  size_t n_inflight = 0;
  size_t n_waiting = 0;   // threads in wait() or stream()
  size_t n_orphaned = 0;  // calls in flight whose caller stopped waiting (abandon)
  std::mutex models_mu;
  std::map<std::pair<std::string, int64_t>, std::shared_ptr<const ModelInfo>> by_version;
  std::map<std::string, std::shared_ptr<const ModelInfo>> latest_version;
  std::mutex spin_mu;
  shms_spin spin_{};
};

inline Block::~Block() { engine->alloc.free(offset, nbytes); }

}  // namespace detail
}  // namespace shmserve
