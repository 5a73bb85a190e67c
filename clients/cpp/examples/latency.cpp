// shmserve_latency: round trips of `identity` at concurrency 1 (default 4 KiB FP32),
// p50/p90/p99 over N timed requests after a warm-up; every answer checked.
//   shmserve_latency [--name SERVER] [--requests 20000] [--elements 1024] [--zero-copy]
#include <shmserve/client.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

int main(int argc, char **argv) {
  std::string server = "default";
  long requests = 20000, warmup = 1000, elements = 1024;
  bool zero_copy = false;
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--name" && i + 1 < argc) server = argv[++i];
    else if (a == "--requests" && i + 1 < argc) requests = std::atol(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc) warmup = std::atol(argv[++i]);
    else if (a == "--elements" && i + 1 < argc) elements = std::atol(argv[++i]);
    else if (a == "--zero-copy") zero_copy = true;
    else { std::fprintf(stderr, "unknown argument %s\n", a.c_str()); return 2; }
  }
  try {
    shmserve::Client client(server);
    std::vector<float> x(elements);
    for (long i = 0; i < elements; i++) x[i] = 0.25f * i;
    shmserve::Tensor t = client.alloc(shmserve::DType::FP32, {1, elements});
    std::memcpy(t.data(), x.data(), x.size() * 4);
    std::vector<double> us;
    us.reserve(requests);
    for (long i = 0; i < warmup + requests; i++) {
      auto t0 = std::chrono::steady_clock::now();
      shmserve::Result r = zero_copy ? client.infer("identity", {{"INPUT0", t}})
                                     : client.infer("identity", {{"INPUT0", {1, elements}, x}});
      const shmserve::Output &o = r["OUTPUT0"];
      auto t1 = std::chrono::steady_clock::now();
      if (o.nbytes != x.size() * 4 || std::memcmp(o.data, x.data(), o.nbytes) != 0) {
        std::fprintf(stderr, "wrong answer at request %ld\n", i);
        return 1;
      }
      if (i >= warmup) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::sort(us.begin(), us.end());
    auto pct = [&](double q) { return us[std::min(us.size() - 1, size_t(q / 100.0 * us.size()))]; };
    double mean = 0;
    for (double v : us) mean += v;
    mean /= us.size();
    std::printf("C++ client, identity %ld bytes, concurrency 1, %s, %zu requests: "
                "p50 %.1f us  p90 %.1f us  p99 %.1f us  mean %.1f us\n",
                elements * 4, zero_copy ? "zero-copy input" : "copied input", us.size(), pct(50),
                pct(90), pct(99), mean);
  } catch (const shmserve::Error &e) {
    std::fprintf(stderr, "shmserve_latency: %s: %s\n", shmserve::status_name(e.status()), e.what());
    return 1;
  }
  return 0;
}
