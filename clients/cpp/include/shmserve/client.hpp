// shmserve C++ client: header-only, C++17, over docs/protocol.md and shmserve.h.
//
//   shmserve::Client client("default");                      // or Options{...}
//   std::vector<int32_t> a(16, 1), b(16, 2);
//   auto r = client.infer("simple", {shmserve::Input("INPUT0", {1, 16}, a),
//                                    shmserve::Input("INPUT1", {1, 16}, b)});
//   const int32_t *sum = r["OUTPUT0"].as<int32_t>();           // a view of shared memory
//
// Lifetimes: a Result's outputs point into this client's shared arena and stay valid
// while the Result (or a copy of it) lives, even after the Client is closed; its
// memory returns to the arena when the last copy is destroyed or release()d. A Tensor
// from Client::alloc() lives in the arena too: pass it as an Input and no input byte is
// copied. Client, Future, Result and Tensor are thread-safe to use from several threads
// (a single Future or Result object is not meant to be shared without synchronisation).
//
// Client and Future are the facade; the lease itself (socket, segments, slots, arena,
// the life of a request) is the engine, detail/engine.hpp.
#pragma once

#include "shmserve/detail/front.hpp"

namespace shmserve {

using IndexEntry = control::IndexEntry;

/// A request in flight. get() once; ready() does not block.
class Future {
 public:
  Future() = default;
  bool valid() const { return static_cast<bool>(call_); }
  bool ready() const { return call_ && engine_->poll(*call_); }
  /// Waits for the answer (timeout_s < 0: no limit; TimeoutError after it).
  Result get(double timeout_s = -1) {
    if (!call_) throw InvalidArgumentError("Future::get() on an empty future");
    auto c = std::move(call_);
    engine_->wait(c, timeout_s);
    return detail::Front::result(*engine_, *c);
  }

 private:
  friend class Client;
  Future(std::shared_ptr<detail::Engine> e, std::shared_ptr<detail::Call> c) : engine_(std::move(e)), call_(std::move(c)) {}
  std::shared_ptr<detail::Engine> engine_;
  std::shared_ptr<detail::Call> call_;
};

/// A lease on a running server. Thread-safe; one per process is enough.
class Client {
 public:
  explicit Client(const std::string &name = "default") : Client(options_for(name)) {}
  explicit Client(const Options &o) : engine_(std::make_shared<detail::Engine>()) { engine_->connect(o); }
  ~Client() { close(); }
  Client(Client &&) noexcept = default;
  Client &operator=(Client &&) noexcept = default;
  Client(const Client &) = delete;
  Client &operator=(const Client &) = delete;

  /// Runs one request and waits for it (timeout_s < 0: no limit). outputs: names
  /// wanted, empty = all. version 0 = the highest. options: priority, queue timeout,
  /// request parameters (RequestOptions).
  Result infer(const std::string &model, const std::vector<Input> &inputs,
               const std::vector<std::string> &outputs = {}, double timeout_s = -1, int64_t version = 0,
               const RequestOptions &options = {}) {
    return submit(model, inputs, outputs, version, options).get(timeout_s);
  }
  /// infer() with options and every other argument at its default.
  Result infer(const std::string &model, const std::vector<Input> &inputs, const RequestOptions &options) {
    return infer(model, inputs, {}, -1, 0, options);
  }

  /// Sends a request and returns at once. Inputs not in the arena are copied before
  /// it returns. Many may be in flight; past the lease's slots submit waits for one.
  Future submit(const std::string &model, const std::vector<Input> &inputs,
                const std::vector<std::string> &outputs = {}, int64_t version = 0,
                const RequestOptions &options = {}) {
    return Future(engine_, detail::Front::submit(*engine_, model, inputs, outputs, version, options));
  }

  /// A decoupled model's responses to one request (docs/protocol.md section 6a):
  /// on_response(const StreamResponse &) is called for each, in order, on this thread;
  /// return false to cancel the request (the model's is_cancelled() turns true).
  /// A response's outputs are views of the request's output buffers, valid until
  /// on_response returns (the next response is written there): copy what you keep.
  /// An error response the model sent has status != OK and its error; the stream goes
  /// on. A failed request throws (infer's errors); timeout_s is the longest wait for
  /// each response (TimeoutError, the request cancelled). A model that is not
  /// decoupled gives one (final) response. Returns the number of responses.
  size_t infer_stream(const std::string &model, const std::vector<Input> &inputs,
                      const std::function<bool(const StreamResponse &)> &on_response,
                      const std::vector<std::string> &outputs = {}, double timeout_s = -1,
                      int64_t version = 0, const RequestOptions &options = {}) {
    auto c = detail::Front::submit(*engine_, model, inputs, outputs, version, options, SHMS_REQUEST_STREAM);
    size_t n = 0;
    engine_->stream(c, timeout_s, [&](const std::vector<shms_tensor_ref> &results, int32_t status,
                                      const std::string &error, uint32_t index, bool final) {
      StreamResponse r;
      r.index = index;
      r.final = final;
      r.status = static_cast<Status>(status);
      r.error = error;
      if (status == SHMS_OK) r.result = detail::Front::result(*engine_, *c, results);
      n++;
      return on_response(r);
    });
    return n;
  }

  /// A zeroed tensor in this client's shared arena (zero-copy input).
  Tensor alloc(DType dtype, std::vector<int64_t> shape) {
    if (dtype_size(dtype) == 0) throw InvalidArgumentError("alloc() holds fixed-size types only");
    Tensor t;
    t.nbytes_ = element_count(shape) * dtype_size(dtype);
    t.block_ = engine_->allocate(t.nbytes_, [] { return std::string("alloc()"); });
    std::memset(t.data(), 0, t.nbytes_);
    t.dtype_ = dtype;
    t.shape_ = std::move(shape);
    return t;
  }

  std::vector<ModelInfo> models() {
    auto list = engine_->ask(control::ListModels{}).models;
    engine_->remember(list);
    return list;
  }
  ModelInfo metadata(const std::string &model, int64_t version = 0) {
    return engine_->ask(control::GetMetadata{model, control::version_or_latest(version)});
  }
  /// config.pbtxt as the server parsed it (protobuf text format).
  std::string config(const std::string &model, int64_t version = 0) {
    return engine_->ask(control::GetConfig{model, control::version_or_latest(version)}).config;
  }
  /// Triton's statistics extension: every model (model empty), every version of
  /// model (version 0), or one version; shmserve's own figures in .shmserve.
  std::vector<ModelStats> stats(const std::string &model = {}, int64_t version = 0) {
    control::GetStats request;
    if (!model.empty()) request.model = model;
    request.version = control::version_or_latest(version);
    return engine_->ask(request).model_stats;
  }

  /// Triton's repository extension (the server runs --model-control-mode explicit):
  /// loads a model of its repository, or reloads it without losing a request; config:
  /// the model configuration as JSON, used instead of config.pbtxt (empty: none).
  /// Throws InvalidArgumentError naming each version that failed to load.
  void load_model(const std::string &model, const std::string &config = {}) {
    control::LoadModel request;
    request.model = model;
    if (!config.empty()) request.config = config;
    engine_->forget(model);
    engine_->ask(request);
  }
  /// Unloads every version of a model: its requests in flight finish, new ones get
  /// UnavailableError naming it. Returns once its workers stopped.
  void unload_model(const std::string &model) {
    engine_->forget(model);
    engine_->ask(control::UnloadModel{model});
  }
  /// Triton's repository index: every model of the repository, each version's state.
  std::vector<IndexEntry> repository_index(bool ready = false) {
    control::RepositoryIndex request;
    request.ready = ready;
    return engine_->ask(request).models;
  }

  uint32_t client_id() const { return engine_->client_id; }
  uint32_t slots() const { return engine_->n_slots; }
  uint64_t arena_capacity() const { return engine_->alloc.capacity(); }
  uint64_t arena_used() const { return engine_->alloc.used(); }
  /// Throws ServerDeadError if the server is gone.
  void check_server() { engine_->check_server(); }

  /// Ends the lease. Results and Tensors still alive keep their mapping until freed.
  void close() {
    if (engine_) engine_->close();
  }

 private:
  static Options options_for(const std::string &name) {
    Options o;
    o.name = name;
    return o;
  }
  std::shared_ptr<detail::Engine> engine_;
};

}  // namespace shmserve
