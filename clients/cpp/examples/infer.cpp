// shmserve_infer: one request to `simple` (or `identity`) from C++, outputs printed.
//   shmserve_infer [model] [--name SERVER]
#include <shmserve/client.hpp>

#include <chrono>
#include <cstdio>
#include <numeric>

int main(int argc, char **argv) {
  std::string model = "simple", server = "default";
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--name" && i + 1 < argc) server = argv[++i];
    else model = a;
  }
  try {
    shmserve::Client client(server);
    auto t0 = std::chrono::steady_clock::now();
    shmserve::Result r;
    if (model == "simple") {
      std::vector<int32_t> a(16), b(16, 1);
      std::iota(a.begin(), a.end(), 0);
      r = client.infer("simple", {{"INPUT0", {1, 16}, a}, {"INPUT1", {1, 16}, b}});
    } else {
      shmserve::Tensor x = client.alloc(shmserve::DType::FP32, {1, 8});  // zero-copy input
      for (int i = 0; i < 8; i++) x.data<float>()[i] = 0.5f * i;
      r = client.infer(model, {{"INPUT0", x}});
    }
    double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    for (const auto &o : r.outputs()) {
      std::printf("%s %s [", o.name.c_str(), shmserve::dtype_name(o.dtype));
      for (size_t d = 0; d < o.shape.size(); d++) std::printf("%s%lld", d ? ", " : "", (long long)o.shape[d]);
      std::printf("]:");
      uint64_t n = shmserve::element_count(o.shape);
      for (uint64_t i = 0; i < n && i < 16; i++) {
        if (o.dtype == shmserve::DType::INT32) std::printf(" %d", o.as<int32_t>()[i]);
        else if (o.dtype == shmserve::DType::FP32) std::printf(" %g", o.as<float>()[i]);
      }
      std::printf("\n");
    }
    std::printf("round trip %.1f us (first request, includes connection warm-up)\n", us);
  } catch (const shmserve::Error &e) {
    std::fprintf(stderr, "shmserve_infer: %s error: %s\n", shmserve::status_name(e.status()), e.what());
    return 1;
  }
  return 0;
}
