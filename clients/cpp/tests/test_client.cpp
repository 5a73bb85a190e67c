// Tests of the C++ client against a live server (started by tests/test_cpp_client.py).
//
//   shmserve_cpp_tests suite     --socket PATH --vectors FILE   every check below
//   shmserve_cpp_tests vectors   --vectors FILE                 byte vectors only (no server),
//                                                               test_vectors.cpp
//   shmserve_cpp_tests roundtrip --socket PATH --dir DIR        requests from DIR/manifest.txt,
//                                                               outputs written to DIR
//   shmserve_cpp_tests shutdown  --socket PATH                  expects the server to stop
//                                                               while a request waits
//   shmserve_cpp_tests stream    --socket PATH                  decoupled models
//                                                               (tests/test_decoupled.py)
//   shmserve_cpp_tests device    --socket PATH --dir DIR        device tensors on a GPU
//                                                               (DIR/device.txt)
// No test framework: CHECK (check.hpp) prints what failed and where; the exit code
// counts failures.
#include <iostream>
#include <random>
#include <thread>

#include "check.hpp"

void test_vectors(const std::string &path);  // test_vectors.cpp

namespace {

using test::expect_error;
using test::read_file;
using test::run;

// ------------------------------------------------------------------ live server

/// Every fixed-size data type, with its name (from shmserve.h's list).
std::vector<std::pair<std::string, shmserve::DType>> fixed_size_dtypes() {
  std::vector<std::pair<std::string, shmserve::DType>> out;
  for (uint32_t c = 0; c < SHMS_TYPE_COUNT; c++)
    if (shms_dtype_size(c) > 0) out.emplace_back(shms_dtype_name(c), static_cast<shmserve::DType>(c));
  return out;
}

std::vector<int32_t> iota32(int n, int start) {
  std::vector<int32_t> v(n);
  for (int i = 0; i < n; i++) v[i] = start + i;
  return v;
}

/// simple: OUTPUT0 = a + b, OUTPUT1 = a - b.
bool check_simple(const shmserve::Result &r, const std::vector<int32_t> &a, const std::vector<int32_t> &b) {
  const auto &o0 = r["OUTPUT0"], &o1 = r["OUTPUT1"];
  if (o0.nbytes != a.size() * 4 || o1.nbytes != a.size() * 4) return false;
  for (size_t i = 0; i < a.size(); i++)
    if (o0.as<int32_t>()[i] != a[i] + b[i] || o1.as<int32_t>()[i] != a[i] - b[i]) return false;
  return true;
}

void suite(const shmserve::Options &opts) {
  using shmserve::DType;
  shmserve::Client client(opts);
  const uint64_t baseline = client.arena_used();

  run("metadata", [&] {
    auto models = client.models();
    bool identity = false, simple = false;
    for (const auto &m : models) identity |= m.name == "identity", simple |= m.name == "simple";
    CHECK(identity && simple, "models() lacks identity or simple");
    auto m = client.metadata("simple");
    CHECK(m.inputs.size() == 2 && m.inputs[0].dtype == DType::INT32 && m.max_batch_size == 8, "simple metadata");
    CHECK(client.config("simple").find("simple") != std::string::npos, "config text");
    expect_error<shmserve::ModelNotFoundError>("metadata of unknown model", [&] { client.metadata("nope"); },
                                               "nope", shmserve::Status::NOT_FOUND);
  });

  run("stats", [&] {
    auto a = iota32(16, 1);
    client.infer("simple", {{"INPUT0", {1, 16}, a}, {"INPUT1", {1, 16}, a}});
    auto rows = client.stats("simple");
    CHECK(rows.size() == 1 && rows[0].name == "simple" && rows[0].version == "1" &&
              rows[0].inference_stats.success.count >= 1 && rows[0].execution_count >= 1 &&
              rows[0].inference_stats.compute_infer.count >= 1 && !rows[0].batch_stats.empty() &&
              rows[0].shmserve.state == "READY" && !rows[0].shmserve.batch_requests.empty(),
          "stats of simple");
    CHECK(client.stats("simple", 1).size() == 1, "stats of simple version 1");
    expect_error<shmserve::ModelNotFoundError>("stats of unknown model", [&] { client.stats("nope"); },
                                               "nope", shmserve::Status::NOT_FOUND);
    CHECK(client.stats().size() == client.models().size(), "stats of every model");
  });

  run("simple", [&] {
    for (int rows : {1, 3, 8}) {
      auto a = iota32(16 * rows, -20), b = iota32(16 * rows, 1000);
      auto r = client.infer("simple", {{"INPUT0", {rows, 16}, a}, {"INPUT1", {rows, 16}, b}});
      CHECK(check_simple(r, a, b), "wrong answer for rows ", rows);
      CHECK(r["OUTPUT0"].shape == std::vector<int64_t>({rows, 16}) && r["OUTPUT0"].dtype == DType::INT32,
            "OUTPUT0 shape/dtype");
      auto one = client.infer("simple", {{"INPUT0", {rows, 16}, a}, {"INPUT1", {rows, 16}, b}}, {"OUTPUT1"});
      CHECK(one.size() == 1 && one.outputs()[0].name == "OUTPUT1", "output selection");
    }
  });

  run("identity 4 KiB", [&] {
    std::vector<float> x(1024);
    for (size_t i = 0; i < x.size(); i++) x[i] = 0.5f * i - 3;
    auto r = client.infer("identity", {{"INPUT0", {1, 1024}, x}});
    CHECK(r["OUTPUT0"].nbytes == 4096 && std::memcmp(r["OUTPUT0"].data, x.data(), 4096) == 0, "identity bytes");
    using T = shmserve::Timestamp;
    CHECK(r.timestamp_ns(T::CLIENT_WRITE) <= r.timestamp_ns(T::ENQUEUE) &&
              r.timestamp_ns(T::ENQUEUE) <= r.timestamp_ns(T::COMPLETE) &&
              r.timestamp_ns(T::COMPLETE) <= r.timestamp_ns(T::CLIENT_WAKE) &&
              r.timestamps_ns()[SHMS_T_CLIENT_WAKE] == r.timestamp_ns(T::CLIENT_WAKE),
          "timestamps out of order");
  });

  run("every dtype, bit exact", [&] {
    std::mt19937_64 rng(42);
    std::vector<std::string> names;
    for (const auto &m : client.models()) names.push_back(m.name);
    int tested = 0;
    for (const auto &[name, dt] : fixed_size_dtypes()) {
      std::string model = "id_" + name;
      if (std::find(names.begin(), names.end(), model) == names.end()) {
        CHECK(name == "BF16", "server lacks model ", model);
        continue;
      }
      for (int rows : {1, 3, 16}) {
        std::vector<int64_t> shape = {rows, 7};
        std::vector<unsigned char> x(rows * 7 * shmserve::dtype_size(dt));
        for (auto &c : x) c = static_cast<unsigned char>(rng());
        if (dt == DType::BOOL) for (auto &c : x) c &= 1;
        auto r = client.infer(model, {{"INPUT0", dt, shape, x.data(), x.size()}});
        const auto &o = r["OUTPUT0"];
        CHECK(o.dtype == dt && o.shape == shape && o.nbytes == x.size() &&
                  std::memcmp(o.data, x.data(), x.size()) == 0,
              model, " rows ", rows, ": output differs");
      }
      tested++;
    }
    CHECK(tested >= 12, "only ", tested, " dtypes tested");
    // BYTES: encoded by the caller, decoded from the view.
    std::vector<std::string> items = {"", std::string("\0\xff", 2), "h\xc3\xa9llo", std::string(1000, 'a'), "x", "yz"};
    std::string enc = shmserve::encode_bytes(items);
    auto r = client.infer("id_BYTES", {{"INPUT0", DType::BYTES, {2, 3}, enc.data(), enc.size()}});
    CHECK(r["OUTPUT0"].strings() == items && r["OUTPUT0"].bytes() == enc, "BYTES round trip");
  });

  run("zero-copy input and output lifetime", [&] {
    {
      shmserve::Tensor t = client.alloc(DType::FP32, {2, 300});
      for (int i = 0; i < 600; i++) t.data<float>()[i] = static_cast<float>(i);
      CHECK(client.arena_used() > baseline, "alloc() took no arena memory");
      uint64_t with_tensor = client.arena_used();
      shmserve::Result r = client.infer("identity", {{"INPUT0", t}});
      // Only the output buffer was allocated: the input was not copied.
      CHECK(client.arena_used() - with_tensor == shmserve::detail::align64(std::max<uint64_t>(2400, 4096)),
            "zero-copy request allocated ", client.arena_used() - with_tensor, " bytes");
      shmserve::Result copy = r;
      r.release();
      CHECK(std::memcmp(copy["OUTPUT0"].data, t.data(), 2400) == 0, "copy of a result lost its data");
    }
    CHECK(client.arena_used() == baseline, "arena not returned: ", client.arena_used(), " bytes held");
    // A result outlives its client: the mapping stays until the result is gone.
    shmserve::Result kept;
    {
      shmserve::Client other(opts);
      auto a = iota32(16, 5), b = iota32(16, 7);
      kept = other.infer("simple", {{"INPUT0", {1, 16}, a}, {"INPUT1", {1, 16}, b}});
    }
    CHECK(kept["OUTPUT0"].as<int32_t>()[15] == 20 + 22, "result after its client closed");
  });

  run("async: 100 in flight from one thread", [&] {
    std::vector<shmserve::Future> futures;
    std::vector<std::vector<int32_t>> as;
    for (int i = 0; i < 100; i++) {
      as.push_back(iota32(16, i * 100));
      futures.push_back(client.submit("simple", {{"INPUT0", {1, 16}, as.back()}, {"INPUT1", {1, 16}, as.back()}}));
    }
    int good = 0;
    for (int i = 99; i >= 0; i--) good += check_simple(futures[i].get(30), as[i], as[i]);
    CHECK(good == 100, good, " of 100 futures answered right");
    CHECK(client.arena_used() == baseline, "arena not returned after futures");
  });

  run("concurrency: 4 threads", [&] {
    std::atomic<int> wrong{0}, errors{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < 4; t++) {
      threads.emplace_back([&, t] {
        try {
          for (int i = 0; i < 150; i++) {
            int rows = 1 + (i + t) % 4;
            auto a = iota32(16 * rows, t * 100000 + i), b = iota32(16 * rows, -i);
            auto r = client.infer("simple", {{"INPUT0", {rows, 16}, a}, {"INPUT1", {rows, 16}, b}});
            if (!check_simple(r, a, b)) wrong++;
            std::vector<double> x(rows * (1 + i % 9), t + i * 0.5);
            auto r2 = client.infer("id_FP64", {{"INPUT0", {rows, 1 + i % 9}, x}});
            if (std::memcmp(r2["OUTPUT0"].data, x.data(), x.size() * 8) != 0) wrong++;
          }
        } catch (const std::exception &e) {
          std::fprintf(stderr, "thread %d: %s\n", t, e.what());
          errors++;
        }
      });
    }
    for (auto &th : threads) th.join();
    CHECK(wrong == 0 && errors == 0, wrong.load(), " wrong answers, ", errors.load(), " errors");
  });

  run("bad input gives typed errors", [&] {
    auto a = iota32(16, 0), short_ = iota32(15, 0);
    std::vector<float> f(16, 1.0f);
    using shmserve::Status;
    expect_error<shmserve::ModelNotFoundError>("unknown model", [&] { client.infer("nope", {{"INPUT0", {1, 16}, a}}); },
                                               "unknown model 'nope'", Status::NOT_FOUND);
    expect_error<shmserve::InvalidArgumentError>(
        "wrong shape", [&] { client.infer("simple", {{"INPUT0", {1, 15}, short_}, {"INPUT1", {1, 15}, short_}}); },
        "input 'INPUT0' dimension 1 is 15, expected 16", Status::INVALID_ARG);
    expect_error<shmserve::InvalidArgumentError>(
        "wrong dtype", [&] { client.infer("simple", {{"INPUT0", {1, 16}, f}, {"INPUT1", {1, 16}, a}}); },
        "data type FP32, expected INT32", Status::INVALID_ARG);
    expect_error<shmserve::InvalidArgumentError>(
        "missing input", [&] { client.infer("simple", {{"INPUT0", {1, 16}, a}}); }, "missing input 'INPUT1'",
        Status::INVALID_ARG);
    expect_error<shmserve::InvalidArgumentError>(
        "unknown input", [&] { client.infer("simple", {{"INPUTX", {1, 16}, a}}); }, "has no input 'INPUTX'",
        Status::INVALID_ARG);
    auto big = iota32(16 * 9, 0);
    expect_error<shmserve::InvalidArgumentError>(
        "batch too large", [&] { client.infer("simple", {{"INPUT0", {9, 16}, big}, {"INPUT1", {9, 16}, big}}); },
        "batch size 9 outside 1..8", Status::INVALID_ARG);
    std::vector<float> neg(4, -1.0f);
    expect_error<shmserve::InternalError>("model raises", [&] { client.infer("raiser", {{"INPUT0", {1, 4}, neg}}); },
                                          "boom", Status::INTERNAL);
    expect_error<shmserve::UnavailableError>("model failed to load",
                                             [&] { client.infer("broken", {{"INPUT0", {1, 4}, f}}); },
                                             "failed to load", Status::UNAVAILABLE);
    auto r = client.infer("simple", {{"INPUT0", {1, 16}, a}, {"INPUT1", {1, 16}, a}});  // still serving
    CHECK(check_simple(r, a, a), "no answer after errors");
    r.release();
    CHECK(client.arena_used() == baseline, "arena after errors: ", client.arena_used());
  });

  run("device tensors (CUDA IPC): refused by a model without device memory", [&] {
    using shmserve::Status;
    shmserve::DeviceTensor d;
    d.dtype = DType::FP32, d.shape = {1, 4}, d.device = 1, d.offset = 256;
    for (size_t i = 0; i < d.mem_handle.size(); i++) d.mem_handle[i] = static_cast<uint8_t>(i);
    d.event = shmserve::IpcHandle{};
    expect_error<shmserve::InvalidArgumentError>(
        "kind-1 input", [&] { client.infer("identity", {{"INPUT0", d}}); },
        "model 'identity': input 'INPUT0' is in memory kind 1 device 1; it takes kind 0 (arena, device 0); "
        "1 needs KIND_GPU pytorch",
        Status::INVALID_ARG);
    std::vector<float> x(4, 1.0f);
    shmserve::RequestOptions o;
    shmserve::DeviceBuffer out;
    out.capacity = 16, out.device = 2;
    o.device_outputs["OUTPUT0"] = out;
    expect_error<shmserve::InvalidArgumentError>(
        "kind-1 output", [&] { client.infer("identity", {{"INPUT0", {1, 4}, x}}, o); },
        "model 'identity': output 'OUTPUT0' is in memory kind 1 device 2; it takes kind 0 (arena, device 0); "
        "1 needs KIND_GPU pytorch",
        Status::INVALID_ARG);
    // Refused by the client, naming the tensor.
    o.device_outputs = {{"NOPE", out}};
    expect_error<shmserve::InvalidArgumentError>(
        "device buffer for no output", [&] { client.infer("identity", {{"INPUT0", {1, 4}, x}}, o); },
        "model 'identity' output 'NOPE' has a device buffer but is not an output of the model", Status::INVALID_ARG);
    o.device_outputs = {{"OUTPUT1", out}};
    auto a = iota32(16, 0);
    expect_error<shmserve::InvalidArgumentError>(
        "device buffer for an output not asked for",
        [&] { client.infer("simple", {{"INPUT0", {1, 16}, a}, {"INPUT1", {1, 16}, a}}, {"OUTPUT0"}, -1, 0, o); },
        "model 'simple' output 'OUTPUT1' has a device buffer but is not asked for", Status::INVALID_ARG);
    d.dtype = DType::BYTES;
    expect_error<shmserve::InvalidArgumentError>(
        "BYTES in device memory", [&] { client.infer("id_BYTES", {{"INPUT0", d}}); },
        "input 'INPUT0': a device tensor holds a fixed-size type, not BYTES", Status::INVALID_ARG);
    CHECK(client.arena_used() == baseline, "arena after refused device requests: ", client.arena_used());
  });

  run("device tensors (CUDA IPC): a record past the arena's end, and device results", [&] {
    using shmserve::Status;
    // The engine below the facade: a request the Client would never write.
    auto e = std::make_shared<shmserve::detail::Engine>();
    e->connect(opts);
    const uint64_t end = reinterpret_cast<const shms_arena_header *>(e->arena_at(0))->segment_bytes;
    auto call = std::make_shared<shmserve::detail::Call>();
    call->model = e->model("identity", 0);
    e->reserve(*call, {{0}}, 0);
    // 64-aligned, inside the arena, but its 160 bytes run past the end (check 11).
    call->in_refs = {shmserve::make_tensor_ref(0, DType::FP32, end - 64, 16, {1, 4}, shmserve::MemoryKind::CUDA_IPC, 0)};
    e->send(call);
    // identity takes no device memory: check 4a answers before check 11 looks at the record.
    expect_error<shmserve::InvalidArgumentError>(
        "record past the arena's end", [&] { e->wait(call, 30); },
        "model 'identity': input 'INPUT0' is in memory kind 1 device 0; it takes kind 0 (arena, device 0); "
        "1 needs KIND_GPU pytorch",
        Status::INVALID_ARG);
    // What a model that takes device memory answers for an output in the caller's
    // buffer: a result of kind 1 at the record, read without touching the arena.
    auto dev = std::make_shared<shmserve::detail::Call>();
    dev->model = call->model;
    e->reserve(*dev, {{0, true, 64, 3}}, 0);
    const shms_tensor_ref &want = dev->out_refs[0];
    CHECK(want.memory_kind == SHMS_MEMORY_CUDA_IPC && want.device_id == 3 && want.nbytes == 64 &&
              dev->out_block->nbytes == shmserve::detail::align64(sizeof(shms_cuda_ipc)),
          "a device output's ref and its record's place");
    shms_tensor_ref got = shmserve::make_tensor_ref(0, DType::FP32, want.offset, 48, {3, 4}, shmserve::MemoryKind::CUDA_IPC, 3);
    e->check_results(*dev, {got});
    auto r = shmserve::detail::Front::result(*e, *dev, {got});
    const auto &o = r["OUTPUT0"];
    CHECK(o.on_device() && o.data == nullptr && o.nbytes == 48 && o.device_id == 3 &&
              o.shape == std::vector<int64_t>({3, 4}),
          "a device output's result");
    expect_error<shmserve::InvalidArgumentError>("host view of a device output", [&] { o.as<float>(); },
                                                 "output 'OUTPUT0' was written into the caller's device buffer",
                                                 Status::INVALID_ARG);
    for (auto bad : {shmserve::make_tensor_ref(0, DType::FP32, want.offset, 80, {5, 4}, shmserve::MemoryKind::CUDA_IPC, 3),
                     shmserve::make_tensor_ref(0, DType::FP32, want.offset, 48, {3, 4}),
                     shmserve::make_tensor_ref(0, DType::FP32, want.offset, 48, {3, 4}, shmserve::MemoryKind::CUDA_IPC, 1)})
      expect_error<shmserve::ProtocolError>("a device result past its buffer, of another kind or device",
                                            [&] { e->check_results(*dev, {bad}); }, "outside the buffers",
                                            Status::INTERNAL);
    e->close();
  });

  run("request options: parameters reach the model", [&] {
    std::vector<float> x(1, 1.0f);
    shmserve::RequestOptions o;
    o.priority = 1;
    o.timeout_us = 5000000;
    o.parameters = {{"tag", std::string("cpp")}, {"n", int64_t(7)}, {"flag", true}, {"x", 1.5}};
    auto r = client.infer("params", {{"INPUT0", {1, 1}, x}}, o);
    auto seen = r["OUTPUT0"].strings();
    CHECK(seen.size() == 1 && seen[0] == R"({"flag": true, "n": 7, "tag": "cpp", "x": 1.5})",
          "parameters as the model saw them: ", seen.empty() ? std::string("none") : seen[0]);
    auto f = client.submit("params", {{"INPUT0", {2, 1}, std::vector<float>(2, 0.0f)}}, {}, 0, o);
    CHECK(f.get(30)["OUTPUT0"].strings().at(1) == seen.at(0), "parameters through submit()");
    CHECK(client.infer("params", {{"INPUT0", {1, 1}, x}})["OUTPUT0"].strings().at(0) == "{}",
          "a request without parameters");
    shmserve::RequestOptions bad;
    bad.parameters = {{"", true}};
    expect_error<shmserve::InvalidArgumentError>("empty parameter name",
                                                 [&] { client.infer("params", {{"INPUT0", {1, 1}, x}}, bad); },
                                                 "must not be empty", shmserve::Status::INVALID_ARG);
  });

  run("output larger than guessed (retried once)", [&] {
    std::vector<float> x(2000);
    for (size_t i = 0; i < x.size(); i++) x[i] = float(i);
    auto r = client.infer("grow", {{"INPUT0", {1, 2000}, x}});  // output is 3x the input
    const auto &o = r["OUTPUT0"];
    CHECK(o.shape == std::vector<int64_t>({1, 6000}) && o.nbytes == 24000 &&
              std::memcmp(o.as<float>() + 4000, x.data(), 8000) == 0,
          "grow output");
  });

  run("timeout, then the slot comes back", [&] {
    std::vector<float> x = {0.4f};
    expect_error<shmserve::TimeoutError>("timeout", [&] { client.infer("sleeper", {{"INPUT0", {1, 1}, x}}, {}, 0.05); },
                                         "no answer within", shmserve::Status::TIMEOUT);
    std::this_thread::sleep_for(std::chrono::milliseconds(600));
    auto a = iota32(16, 3);
    CHECK(check_simple(client.infer("simple", {{"INPUT0", {1, 16}, a}, {"INPUT1", {1, 16}, a}}), a, a),
          "after timeout");
    CHECK(client.arena_used() == baseline, "orphaned request not reclaimed: ", client.arena_used());
  });
}

// ------------------------------------------------------------------ other modes

/// DIR/manifest.txt, one request a line: id model n_inputs (name dtype ndim dims... file)...
/// Writes DIR/<id>.<output>.bin (raw bytes) and .meta ("DTYPE d0 d1 ...").
void roundtrip(const shmserve::Options &opts, const std::string &dir) {
  shmserve::Client client(opts);
  std::ifstream manifest(dir + "/manifest.txt");
  std::string line;
  int n = 0;
  while (std::getline(manifest, line)) {
    std::istringstream in(line);
    std::string id, model;
    int n_inputs;
    in >> id >> model >> n_inputs;
    std::vector<std::string> data(n_inputs);
    std::vector<shmserve::Input> inputs;
    for (int i = 0; i < n_inputs; i++) {
      std::string name, dtype, file;
      int ndim;
      in >> name >> dtype >> ndim;
      std::vector<int64_t> shape(ndim);
      for (auto &d : shape) in >> d;
      in >> file;
      data[i] = read_file(dir + "/" + file);
      inputs.emplace_back(name, shmserve::dtype_from_name(dtype), shape, data[i].data(), data[i].size());
    }
    auto r = client.infer(model, inputs);
    for (const auto &o : r.outputs()) {
      std::ofstream(dir + "/" + id + "." + o.name + ".bin", std::ios::binary).write(
          static_cast<const char *>(o.data), static_cast<std::streamsize>(o.nbytes));
      std::ofstream meta(dir + "/" + id + "." + o.name + ".meta");
      meta << shmserve::dtype_name(o.dtype);
      for (auto d : o.shape) meta << " " << d;
      meta << "\n";
    }
    n++;
  }
  CHECK(n > 0, "empty manifest");
  std::printf("roundtrip: %d requests\n", n);
}

/// A request waits on `sleeper` (5 s) when the test stops the server: get() must
/// fail with ServerDeadError soon, and later requests fail at once.
void shutdown(const shmserve::Options &opts) {
  shmserve::Client client(opts);
  std::vector<float> x = {5.0f};
  shmserve::Future f = client.submit("sleeper", {{"INPUT0", {1, 1}, x}});
  std::printf("READY\n");
  std::fflush(stdout);
  auto t0 = std::chrono::steady_clock::now();
  expect_error<shmserve::ServerDeadError>("pending request at shutdown", [&] { f.get(60); }, "",
                                          shmserve::Status::SERVER_DEAD);
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(s < 4.5, "server death noticed after ", s, " s");
  std::vector<float> y = {1.0f};
  expect_error<shmserve::ServerDeadError>("request after shutdown", [&] { client.infer("identity", {{"INPUT0", {1, 1}, y}}); },
                                          "", shmserve::Status::SERVER_DEAD);
  std::printf("shutdown noticed after %.2f s\n", s);
}

/// Sequence batching (tests/test_sequence.py starts the server): "acc" keeps a running
/// sum per sequence (numeric ids), "strseq" the same with string ids.
void sequence(const shmserve::Options &opts) {
  shmserve::Client client(opts);
  auto step = [&](const std::string &model, int64_t v, const shmserve::RequestOptions &o) {
    std::vector<int64_t> x = {v};
    auto r = client.infer(model, {{"INPUT0", {1, 1}, x}}, o);
    return r["OUTPUT0"].as<int64_t>()[0];
  };
  shmserve::RequestOptions a, b;
  a.sequence_id = 41;
  a.sequence_start = true;
  b.sequence_id_str = "cpp-sequence-é";
  b.sequence_start = true;
  CHECK(step("acc", 2, a) == 2, "numeric START");
  CHECK(step("strseq", 10, b) == 10, "string START");
  a.sequence_start = b.sequence_start = false;
  CHECK(step("acc", 3, a) == 5, "numeric step");
  CHECK(step("strseq", 20, b) == 30, "string step");
  a.sequence_end = b.sequence_end = true;
  CHECK(step("acc", 4, a) == 9, "numeric END");
  CHECK(step("strseq", 30, b) == 60, "string END");
  a.sequence_end = false;
  expect_error<shmserve::InvalidArgumentError>("after END, without START", [&] { step("acc", 1, a); },
                                               "must specify the START flag", shmserve::Status::INVALID_ARG);
  shmserve::RequestOptions both;
  both.sequence_id = 1;
  both.sequence_id_str = "x";
  expect_error<shmserve::InvalidArgumentError>("two ids", [&] { step("acc", 1, both); }, "not both",
                                               shmserve::Status::INVALID_ARG);
  // several sequences in flight at once, interleaved through submit()
  std::vector<shmserve::Future> fs;
  for (int k = 0; k < 3; k++)
    for (uint64_t id = 100; id < 104; id++) {
      shmserve::RequestOptions o;
      o.sequence_id = id;
      o.sequence_start = k == 0;
      o.sequence_end = k == 2;
      std::vector<int64_t> x = {int64_t(id) + k};
      fs.push_back(client.submit("acc", {{"INPUT0", {1, 1}, x}}, {}, 0, o));
    }
  for (int k = 0, i = 0; k < 3; k++)
    for (int64_t id = 100; id < 104; id++, i++) {
      auto r = fs[i].get(30);
      int64_t want = (k + 1) * id + k * (k + 1) / 2;
      CHECK(r["OUTPUT0"].as<int64_t>()[0] == want, "interleaved sequence ", id, " step ", k);
    }
}

/// Decoupled models (tests/test_decoupled.py starts the server): "stream" sends IN
/// responses OUT = 0, 1, ..., then the final flag alone; parameter mode "error_mid"
/// makes response 1 an error, "until_cancelled" streams until the caller cancels.
void stream(const shmserve::Options &opts) {
  shmserve::Client client(opts);
  auto in = [](int32_t n) { return std::vector<int32_t>{n}; };
  std::vector<int32_t> got;
  std::vector<bool> finals;
  auto collect = [&](const shmserve::StreamResponse &r) {
    CHECK(r.status == shmserve::Status::OK, "response ", r.index, ": ", r.error);
    got.push_back(r.result["OUT"].as<int32_t>()[0]);
    finals.push_back(r.final);
    return true;
  };
  auto n5 = in(5);
  size_t n = client.infer_stream("stream", {{"IN", {1}, n5}}, collect, {}, 30);
  CHECK(n == 5 && got == std::vector<int32_t>({0, 1, 2, 3, 4}), "five responses in order");
  CHECK(std::none_of(finals.begin(), finals.end(), [](bool f) { return f; }), "the final flag came alone");
  got.clear();
  auto n0 = in(0);
  CHECK(client.infer_stream("stream", {{"IN", {1}, n0}}, collect, {}, 30) == 0, "zero responses");
  shmserve::RequestOptions o;
  o.parameters = {{"mode", std::string("error_mid")}};
  std::vector<std::string> errors;
  auto n3 = in(3);
  client.infer_stream("stream", {{"IN", {1}, n3}}, [&](const shmserve::StreamResponse &r) {
    errors.push_back(r.status == shmserve::Status::OK ? "" : r.error);
    return true;
  }, {}, 30, 0, o);
  CHECK(errors.size() == 3 && errors[0].empty() && errors[1].find("response 1 failed") != std::string::npos &&
            errors[2].empty(), "an error response mid-stream, and the stream goes on");
  // cancellation: stop after three responses; the slot comes back with the final flag
  o.parameters = {{"mode", std::string("until_cancelled")}, {"marker", std::string("")}};
  size_t seen = client.infer_stream("stream", {{"IN", {1}, n0}}, [&](const shmserve::StreamResponse &r) {
    return r.index < 2;
  }, {}, 30, 0, o);
  CHECK(seen == 3, "cancelled after the third response, saw ", seen);
  got.clear();
  client.infer_stream("stream", {{"IN", {1}, n3}}, collect, {}, 30);
  CHECK(got == std::vector<int32_t>({0, 1, 2}), "the next stream after a cancellation");
  expect_error<shmserve::InvalidArgumentError>("infer() on a decoupled model", [&] {
    client.infer("stream", {{"IN", {1}, n3}});
  }, "model 'stream' is decoupled", shmserve::Status::INVALID_ARG);
}

/// Device tensors by CUDA IPC on a GPU (tests/test_cpp_client.py exports a torch
/// tensor and its output buffer into DIR/device.txt, the server serves `affine`,
/// x * 2 + 1 on KIND_GPU): the output into the caller's buffer, then into the arena
/// (DIR/arena.bin), then a buffer too small. Lines:
///   x   MEM_HANDLE OFFSET UUID ORDINAL EVENT_HANDLE|- ROWS COLS
///   out MEM_HANDLE OFFSET UUID ORDINAL CAPACITY
void device(const shmserve::Options &opts, const std::string &dir) {
  shmserve::Client client(opts);
  std::ifstream in(dir + "/device.txt");
  shmserve::DeviceTensor x;
  shmserve::DeviceBuffer out;
  auto bytes = [](const std::string &hex, auto &dst) {
    std::string raw = test::unhex(hex);
    CHECK(raw.size() == dst.size(), "a handle of ", raw.size(), " bytes");
    std::memcpy(dst.data(), raw.data(), std::min(raw.size(), dst.size()));
  };
  std::string key, mem, uuid, event;
  while (in >> key) {
    if (key == "x") {
      int64_t rows = 0, cols = 0;
      in >> mem >> x.offset >> uuid >> x.device >> event >> rows >> cols;
      bytes(mem, x.mem_handle), bytes(uuid, x.device_uuid);
      if (event != "-") bytes(event, x.event.emplace());
      x.dtype = shmserve::DType::FP32, x.shape = {rows, cols};
    } else if (key == "out") {
      in >> mem >> out.offset >> uuid >> out.device >> out.capacity;
      bytes(mem, out.mem_handle), bytes(uuid, out.device_uuid);
    }
  }
  CHECK(x.shape.size() == 2, "no input in ", dir, "/device.txt");
  if (x.shape.size() != 2) return;
  const uint64_t nbytes = static_cast<uint64_t>(x.shape[0] * x.shape[1]) * 4;
  shmserve::RequestOptions o;
  o.device_outputs["OUTPUT__0"] = out;
  auto r = client.infer("affine", {{"x", x}}, o);
  const auto &y = r["OUTPUT__0"];
  CHECK(y.on_device() && y.data == nullptr && y.nbytes == nbytes && y.shape == x.shape && y.device_id == out.device,
        "the output written into the caller's buffer: ", y.nbytes, " bytes");
  auto h = client.infer("affine", {{"x", x}});
  const auto &z = h["OUTPUT__0"];
  CHECK(!z.on_device() && z.nbytes == nbytes, "the output into the arena");
  std::ofstream(dir + "/arena.bin", std::ios::binary).write(z.as<char>(), static_cast<std::streamsize>(z.nbytes));
  o.device_outputs["OUTPUT__0"].capacity = 16;
  expect_error<shmserve::OutputTooSmallError>(
      "a device buffer too small", [&] { client.infer("affine", {{"x", x}}, o); },
      "output 'OUTPUT__0' needs " + std::to_string(nbytes) + " bytes, its device buffer holds 16",
      shmserve::Status::OUTPUT_TOO_SMALL);
}

}  // namespace

/// Model control against a server started with --model-control-mode explicit and
/// --load-model simple (identity in its repository, not loaded).
void model_control(const shmserve::Options &opts) {
  shmserve::Client a(opts), b(opts);
  auto state = [&](const std::string &name) {
    for (const auto &row : a.repository_index())
      if (row.name == name) return row.version + " " + row.state + " " + row.reason;
    return std::string("absent");
  };
  CHECK(state("simple") == "1 READY ", "index of simple: ", state("simple"));
  CHECK(state("identity") == "  ", "index of identity (never loaded): ", state("identity"));
  std::vector<float> x{1.5f, 2.5f};
  auto infer_identity = [&](shmserve::Client &c) {
    auto r = c.infer("identity", {shmserve::Input("INPUT0", {1, 2}, x)});
    return r["OUTPUT0"].as<float>()[1] == 2.5f;
  };
  a.load_model("identity");
  CHECK(state("identity") == "1 READY ", "identity after load: ", state("identity"));
  CHECK(infer_identity(a), "identity infers after load");
  // b reloads identity with a config override: a's handle goes stale; the error says
  // so, and a's next request resolves the name again.
  b.load_model("identity", R"({"name": "identity", "backend": "python", "max_batch_size": 4,
    "input": [{"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [-1]}],
    "output": [{"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [-1]}]})");
  CHECK(b.metadata("identity").max_batch_size == 4, "config override served");
  expect_error<shmserve::UnavailableError>("stale handle after a reload", [&] { infer_identity(a); },
                                           "was reloaded: resolve the model name again",
                                           shmserve::Status::UNAVAILABLE);
  CHECK(infer_identity(a), "identity infers after resolving again");
  b.unload_model("identity");
  CHECK(state("identity") == " UNAVAILABLE unloaded", "identity after unload: ", state("identity"));
  expect_error<shmserve::UnavailableError>("request after an unload", [&] { infer_identity(a); },
                                           "'identity' version 1 was unloaded",
                                           shmserve::Status::UNAVAILABLE);
  expect_error<shmserve::ModelNotFoundError>("load of a model not in the repository",
                                             [&] { a.load_model("nosuch"); }, "failed to load 'nosuch'",
                                             shmserve::Status::NOT_FOUND);
  auto ready = a.repository_index(true);
  CHECK(ready.size() == 1 && ready[0].name == "simple", "ready index: only simple");
}

int main(int argc, char **argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s suite|vectors|roundtrip|shutdown|sequence|stream|control|device [--socket P] [--vectors F] [--dir D]\n", argv[0]);
    return 2;
  }
  std::string mode = argv[1], vectors, dir;
  shmserve::Options opts;
  opts.arena_bytes = 8 << 20;
  for (int i = 2; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--socket") opts.socket_path = argv[i + 1];
    else if (k == "--name") opts.name = argv[i + 1];
    else if (k == "--vectors") vectors = argv[i + 1];
    else if (k == "--dir") dir = argv[i + 1];
  }
  if (const char *v = std::getenv("SHMSERVE_VECTORS"); vectors.empty() && v) vectors = v;
  if (mode == "vectors" || mode == "suite") run("protocol vectors", [&] { test_vectors(vectors); });
  if (mode == "suite") suite(opts);
  if (mode == "roundtrip") run("roundtrip", [&] { roundtrip(opts, dir); });
  if (mode == "shutdown") run("shutdown", [&] { shutdown(opts); });
  if (mode == "sequence") run("sequence", [&] { sequence(opts); });
  if (mode == "stream") run("stream", [&] { stream(opts); });
  if (mode == "control") run("model control", [&] { model_control(opts); });
  if (mode == "device") run("device tensors by CUDA IPC", [&] { device(opts, dir); });
  std::printf("%s: %d failure%s\n", mode.c_str(), test::failures, test::failures == 1 ? "" : "s");
  return test::failures ? 1 : 0;
}
