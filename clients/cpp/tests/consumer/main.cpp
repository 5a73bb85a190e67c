#include <shmserve/client.hpp>

#include <cstdio>

int main() {
  std::printf("shmserve protocol %u, FP32 is %u bytes\n", SHMS_PROTOCOL_VERSION,
              shmserve::dtype_size(shmserve::DType::FP32));
  return 0;
}
