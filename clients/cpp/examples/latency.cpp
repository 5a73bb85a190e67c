// shmserve_latency: round trips of a model with one FP32 input INPUT0 [1, elements]
// (default `identity`, 4 KiB), p50/p90/p99 over N timed requests after a warm-up, and
// this process's CPU per timed request; identity's answers are checked.
//   shmserve_latency [--name SERVER] [--requests 20000] [--elements 1024] [--zero-copy]
//                    [--spin-us N]   (the client's spin before it sleeps; default 100)
//                    [--model NAME] [--concurrency K]
// --concurrency K keeps K requests in flight from this one thread (submit(), then the
// oldest future's get(), then submit again), as the Python client_cost.py "submit K":
// answers of one batch share a wake-up, so its CPU per request is the client's work.
#include <shmserve/client.hpp>

#include <sys/resource.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <utility>

// CPU seconds (user + system) this process used so far.
static double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + 1e-6 * (u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

int main(int argc, char **argv) {
  shmserve::Options options;
  long requests = 20000, warmup = 1000, elements = 1024, concurrency = 1;
  bool zero_copy = false;
  std::string model = "identity";
  for (int i = 1; i < argc; i++) {
    std::string a = argv[i];
    if (a == "--name" && i + 1 < argc) options.name = argv[++i];
    else if (a == "--spin-us" && i + 1 < argc) options.spin_us = std::atol(argv[++i]);
    else if (a == "--requests" && i + 1 < argc) requests = std::atol(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc) warmup = std::atol(argv[++i]);
    else if (a == "--elements" && i + 1 < argc) elements = std::atol(argv[++i]);
    else if (a == "--zero-copy") zero_copy = true;
    else if (a == "--model" && i + 1 < argc) model = argv[++i];
    else if (a == "--concurrency" && i + 1 < argc) concurrency = std::atol(argv[++i]);
    else { std::fprintf(stderr, "unknown argument %s\n", a.c_str()); return 2; }
  }
  if (requests < 1 || warmup < 0 || elements < 1 || concurrency < 1) {
    std::fprintf(stderr, "--requests, --elements and --concurrency must be at least 1, "
                 "--warmup at least 0\n");
    return 2;
  }
  try {
    shmserve::Client client(options);
    std::vector<float> x(elements);
    for (long i = 0; i < elements; i++) x[i] = 0.25f * i;
    shmserve::Tensor t = client.alloc(shmserve::DType::FP32, {1, elements});
    std::memcpy(t.data(), x.data(), x.size() * 4);
    std::vector<double> us;
    us.reserve(requests);
    const bool check = model == "identity";
    auto send = [&]() {
      return zero_copy ? client.submit(model, {{"INPUT0", t}})
                       : client.submit(model, {{"INPUT0", {1, elements}, x}});
    };
    auto checked = [&](shmserve::Result &r, long i) {
      const shmserve::Output &o = r["OUTPUT0"];
      if (check && (o.nbytes != x.size() * 4 || std::memcmp(o.data, x.data(), o.nbytes) != 0)) {
        std::fprintf(stderr, "wrong answer at request %ld\n", i);
        std::exit(1);
      }
    };
    // In flight, oldest first, with the time each was sent.
    std::deque<std::pair<shmserve::Future, std::chrono::steady_clock::time_point>> flight;
    long sent = 0;
    double cpu0 = 0;
    for (long i = 0; i < warmup + requests; i++) {
      if (i == warmup) cpu0 = cpu_seconds();  // the timed requests' CPU, not start-up's
      while (sent < warmup + requests && (long)flight.size() < concurrency) {
        auto t0 = std::chrono::steady_clock::now();
        flight.emplace_back(send(), t0);
        sent++;
      }
      shmserve::Result r = flight.front().first.get();
      auto t1 = std::chrono::steady_clock::now();
      checked(r, i);
      if (i >= warmup)
        us.push_back(std::chrono::duration<double, std::micro>(t1 - flight.front().second).count());
      flight.pop_front();
    }
    double cpu_us = 1e6 * (cpu_seconds() - cpu0) / requests;
    std::sort(us.begin(), us.end());
    auto pct = [&](double q) { return us[std::min(us.size() - 1, size_t(q / 100.0 * us.size()))]; };
    double mean = 0;
    for (double v : us) mean += v;
    mean /= us.size();
    std::printf("C++ client, %s %ld bytes, concurrency %ld, %s, spin %lld us, %zu requests: "
                "p50 %.1f us  p90 %.1f us  p99 %.1f us  mean %.1f us  cpu %.2f us/request\n",
                model.c_str(), elements * 4, concurrency, zero_copy ? "zero-copy input" : "copied input",
                (long long)options.spin_us, us.size(), pct(50), pct(90), pct(99), mean, cpu_us);
  } catch (const shmserve::Error &e) {
    std::fprintf(stderr, "shmserve_latency: %s: %s\n", shmserve::status_name(e.status()), e.what());
    return 1;
  }
  return 0;
}
