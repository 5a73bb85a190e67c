// The C++ client against tests/vectors/protocol_vectors.json (scripts/make_vectors.py
// writes it from the Python side's code): descriptors, ring cells, BYTES tensors, and
// every control frame in the file, whatever its name: each must decode (strictly: no
// key left over) into one of the C++ typed messages and encode back to the same bytes.
#include <memory>

#include "check.hpp"

namespace {

using namespace shmserve;
using test::hex;

/// The message type M decodes the frame strictly and encodes it back byte for byte.
template <class M> bool round_trips(const msgpack::object &body, const std::string &bytes) {
  try {
    return control::encode(control::decode<M>(body, true)) == bytes;
  } catch (const Error &) {
    return false;
  }
}

/// The typed message that a frame vector is, or "" if none.
std::string typed_message_of(const std::string &bytes) {
  auto oh = control::parse_frame(bytes);
  const msgpack::object &body = oh.get();
#define SHMSERVE_TRY_(M) if (round_trips<control::M>(body, bytes)) return #M;
  // requests
  SHMSERVE_TRY_(Hello) SHMSERVE_TRY_(ListModels) SHMSERVE_TRY_(GetMetadata) SHMSERVE_TRY_(GetConfig)
  SHMSERVE_TRY_(GetStats)
  // replies
  SHMSERVE_TRY_(HelloReply) SHMSERVE_TRY_(ModelList) SHMSERVE_TRY_(ModelMetadata) SHMSERVE_TRY_(ModelConfig)
  SHMSERVE_TRY_(StatsReply) SHMSERVE_TRY_(ErrorReply)
#undef SHMSERVE_TRY_
  return "";
}

void check_frames(const test::Json &vectors) {
  int frames = 0;
  for (const auto &[name, v] : vectors.members) {
    const test::Json *params = v.get("params");
    if (!params || !params->get("message")) continue;  // not a control frame
    frames++;
    std::string type;
    try {
      type = typed_message_of(test::unhex(v.str("hex")));
    } catch (const std::exception &e) {
      CHECK(false, "frame vector '", name, "' does not parse: ", e.what());
      continue;
    }
    CHECK(!type.empty(), "frame vector '", name,
          "': no C++ typed message (wire.hpp) decodes it and encodes it back to the same bytes");
    std::printf("     frame vector %s: %s\n", name.c_str(), type.empty() ? "UNCHECKED" : type.c_str());
  }
  CHECK(frames >= 4, "only ", frames, " frame vectors found");
}

void check_error_types() {
  auto reply = [](int32_t code, std::string msg, std::optional<std::string> type) {
    control::ErrorReply e;
    e.code = code, e.error = std::move(msg), e.type = std::move(type);
    std::string bytes = control::encode(e);
    auto oh = control::parse_frame(bytes);
    (void)control::decode_reply<control::ListModels>(oh.get(), true);
  };
  using test::expect_error;
  expect_error<ConfigError>("type ConfigError", [&] { reply(SHMS_ERR_INVALID_ARG, "m.pbtxt: bad", "ConfigError"); },
                            "m.pbtxt", Status::INVALID_ARG);
  expect_error<ShmSpaceError>("type ShmSpaceError", [&] { reply(SHMS_ERR_UNAVAILABLE, "no space", "ShmSpaceError"); },
                              "no space", Status::UNAVAILABLE);
  expect_error<BusyError>("type BusyError", [&] { reply(SHMS_ERR_UNAVAILABLE, "no client id", "BusyError"); },
                          "no client id", Status::UNAVAILABLE);
  expect_error<ModelNotFoundError>("type of no C++ class", [&] { reply(SHMS_ERR_NOT_FOUND, "nope", "ShmServeError"); },
                                   "nope", Status::NOT_FOUND);
  expect_error<TimeoutError>("type ServerTimeoutError", [&] { reply(SHMS_ERR_TIMEOUT, "late", "ServerTimeoutError"); },
                             "late", Status::TIMEOUT);
  expect_error<ServerDeadError>("no type", [&] { reply(SHMS_ERR_SERVER_DEAD, "gone", std::nullopt); }, "gone",
                                Status::SERVER_DEAD);
  expect_error<ProtocolError>("reply without ok", [&] {
    msgpack::sbuffer buf;
    msgpack::packer<msgpack::sbuffer>(buf).pack_map(0);
    (void)control::decode_reply<control::ListModels>(control::parse_body(buf.data(), buf.size()).get());
  }, "'ok' is missing", Status::INTERNAL);
  // ServerDeadError and TimeoutError are errors of their own, not UnavailableErrors.
  CHECK((!std::is_base_of_v<UnavailableError, ServerDeadError> && !std::is_base_of_v<UnavailableError, TimeoutError>),
        "ServerDeadError/TimeoutError derive from UnavailableError");
  CHECK(std::string(status_name(Status::SERVER_DEAD)) == "SERVER_DEAD" &&
            static_cast<int>(Status::TIMEOUT) == SHMS_ERR_TIMEOUT && std::string(name_of(SlotState::DONE)) == "DONE" &&
            std::string(name_of(static_cast<Status>(99))) == "UNKNOWN",
        "enums generated from shmserve.h");
}

template <class Bytes> Bytes bytes_of(const std::string &hex_text) {
  std::string raw = test::unhex(hex_text);
  Bytes out{};
  CHECK(raw.size() == out.size(), "a handle of ", raw.size(), " bytes");
  std::memcpy(out.data(), raw.data(), std::min(raw.size(), out.size()));
  return out;
}

/// CUDA IPC (docs/protocol.md 4.7, 7a): the records and the request with device
/// tensors, as the front writes them (make_cuda_ipc_record, make_tensor_ref of kind
/// CUDA_IPC), from the vectors' params; and the server's bounds for a record.
void check_device_memory(const test::Json &vectors) {
  for (const char *name : {"cuda_ipc_record", "cuda_ipc_record_output"}) {
    const test::Json *v = vectors.get(name);
    CHECK(v, "vector ", name, " missing");
    if (!v) continue;
    const test::Json &p = *v->get("params");
    std::optional<IpcHandle> event;
    if (p.get("event_handle")->kind == test::Json::String) event = bytes_of<IpcHandle>(p.str("event_handle"));
    shms_cuda_ipc r = make_cuda_ipc_record(bytes_of<IpcHandle>(p.str("mem_handle")), std::stoull(p.str("offset")),
                                           bytes_of<DeviceUuid>(p.str("device_uuid")), event ? &*event : nullptr);
    CHECK(hex(&r, sizeof r) == v->str("hex"), name, " differs: ", hex(&r, sizeof r));
  }
  const test::Json *v = vectors.get("request_device");
  CHECK(v, "vector request_device missing");
  if (!v) return;
  // The front's layout: the input's record at the block's start, the output's after it.
  const uint64_t block = 0x28000, record = detail::align64(sizeof(shms_cuda_ipc));
  std::vector<shms_tensor_ref> in = {make_tensor_ref(0, DType::FP32, block, 4096, {1, 1024}, MemoryKind::CUDA_IPC, 1)};
  std::vector<shms_tensor_ref> out = {make_tensor_ref(0, DType::INVALID, block + record, 8192, {}, MemoryKind::CUDA_IPC, 1)};
  auto slot = std::make_unique<shms_slot>();
  std::memset(static_cast<void *>(slot.get()), 0, sizeof *slot);
  encode_request(*shms_slot_begin(slot.get()), 7, in, out);
  shms_slot_submit(slot.get(), 1);
  CHECK(hex(&slot->request, sizeof slot->request) == v->str("hex"), "request_device differs");

  // Checks 4a and 11 (shms_validate_request, the batcher's): a record must lie in the
  // data region, 160 bytes whatever the tensor's size; a model that does not take
  // device memory refuses kind 1 before looking at the record.
  auto entry = std::make_unique<shms_model_entry>();  // large: its statistics
  shms_model_entry &m = *entry;
  std::memset(static_cast<void *>(&m), 0, sizeof m);
  std::snprintf(m.name, sizeof m.name, "gpu_identity");
  m.max_batch_size = 8, m.n_inputs = 1, m.n_outputs = 1, m.device_memory = 1;
  std::snprintf(m.inputs[0].name, sizeof m.inputs[0].name, "INPUT0");
  std::snprintf(m.outputs[0].name, sizeof m.outputs[0].name, "OUTPUT0");
  m.inputs[0].dtype = m.outputs[0].dtype = SHMS_TYPE_FP32;
  m.inputs[0].ndim = m.outputs[0].ndim = 1;
  m.inputs[0].dims[0] = m.outputs[0].dims[0] = -1;
  const uint64_t begin = 0x28000, end = 0x30000;
  auto validate = [&](uint64_t in_at, std::string *error) {
    shms_request r;
    std::memset(static_cast<void *>(&r), 0, sizeof r);
    encode_request(r, 0, {make_tensor_ref(0, DType::FP32, in_at, 4096, {1, 1024}, MemoryKind::CUDA_IPC, 1)},
                   {make_tensor_ref(0, DType::INVALID, begin, 8192, {}, MemoryKind::CUDA_IPC, 1)});
    uint32_t rows = 0;
    char err[SHMS_ERROR_BYTES] = {0};
    int rc = shms_validate_request(&r, &m, begin, end, &rows, err, sizeof err);
    *error = err;
    return rc;
  };
  std::string error;
  CHECK(validate(end - record, &error) == SHMS_OK, "a record in the arena's last 192 bytes: ", error);
  CHECK(validate(end - 128, &error) == SHMS_ERR_BAD_DESCRIPTOR &&
            error == "model 'gpu_identity': input 'INPUT0' CUDA IPC record [196480, +160) is outside the caller's arena",
        "a record running past the arena's end: ", error);
  m.device_memory = 0;
  CHECK(validate(end - 128, &error) == SHMS_ERR_INVALID_ARG &&
            error == "model 'gpu_identity': input 'INPUT0' is in memory kind 1 device 1; "
                     "it takes kind 0 (arena, device 0); 1 needs KIND_GPU pytorch",
        "kind 1 to a model without device memory: ", error);
}

}  // namespace

void test_vectors(const std::string &path) {
  const test::Json doc = test::JsonReader(test::read_file(path)).read();
  const test::Json *vectors = doc.get("vectors");
  CHECK(vectors && vectors->kind == test::Json::Object, "no vectors in ", path);
  if (!vectors) return;
  auto want = [&](const char *name) { return vectors->get(name) ? vectors->get(name)->str("hex") : "<missing>"; };

  std::vector<shms_tensor_ref> in = {make_tensor_ref(0, DType::INT32, 0x28000, 64, {1, 16}),
                                     make_tensor_ref(1, DType::INT32, 0x28040, 64, {1, 16})};
  std::vector<shms_tensor_ref> out = {make_tensor_ref(0, DType::INVALID, 0x28080, 64, {}),
                                      make_tensor_ref(1, DType::INVALID, 0x280c0, 64, {})};
  CHECK(hex(&in[0], sizeof in[0]) == want("tensor_ref"), "tensor_ref differs");
  // A request as a client writes it: shms_slot_begin, the descriptors, shms_slot_submit.
  auto slot = std::make_unique<shms_slot>();
  std::memset(static_cast<void *>(slot.get()), 0, sizeof *slot);
  encode_request(*shms_slot_begin(slot.get()), 2, in, out);
  shms_slot_submit(slot.get(), 1);
  CHECK(hex(&slot->request, sizeof slot->request) == want("request_simple"), "request_simple differs");

  // Request options (protocol 3): the parameters as encode_parameters packs them, and
  // the request with every option set, as the engine's publish() writes it.
  std::string params = encode_parameters({{"flag", true}, {"n", int64_t(7)}, {"tag", std::string("cpp")}, {"x", 1.5}});
  CHECK(hex(params) == want("parameters_msgpack"), "parameters differ: ", hex(params));
  std::memset(static_cast<void *>(slot.get()), 0, sizeof *slot);
  shms_request &r = *shms_slot_begin(slot.get());
  encode_request(r, 2, in, out);
  r.flags = SHMS_REQUEST_SEQUENCE_START | SHMS_REQUEST_SEQUENCE_END;
  r.priority = 2;
  r.timeout_us = 1500;
  r.parameters_offset = 0x28100;
  r.parameters_bytes = static_cast<uint32_t>(params.size());
  r.sequence_id = 42;
  shms_slot_submit(slot.get(), 1);
  CHECK(hex(&slot->request, sizeof slot->request) == want("request_options"), "request_options differs");
  // A string correlation id, as Front::submit and publish() write it.
  std::memset(static_cast<void *>(slot.get()), 0, sizeof *slot);
  shms_request &rs = *shms_slot_begin(slot.get());
  encode_request(rs, 2, in, out);
  rs.flags = SHMS_REQUEST_SEQUENCE_START;
  rs.sequence_id_offset = 0x28100;
  rs.sequence_id_bytes = 5;  // "seq-7"
  shms_slot_submit(slot.get(), 1);
  CHECK(hex(&slot->request, sizeof slot->request) == want("request_string_id"), "request_string_id differs");

  check_device_memory(*vectors);

  uint64_t claim = shms_claim_word(3, 4097);
  CHECK(hex(&claim, 8) == want("claim_word"), "claim word ", hex(&claim, 8));

  // The v5 layout the vectors' offsets assume (docs/protocol.md section 12): with 32
  // slots, the ring at 192..1215, slots at 0x4C0, data at 0x28000 as in v4.
  const shms_arena_geometry g32 = shms_arena_layout(32, 0x100000);
  CHECK(g32.ring_offset == 192 && g32.ring_capacity == 32 && g32.slots_offset == 0x4C0 && g32.data_offset == 0x28000,
        "arena geometry of 32 slots: ring ", g32.ring_offset, " x", g32.ring_capacity, ", slots ", g32.slots_offset,
        ", data ", g32.data_offset);
  CHECK(sizeof(shms_control) == 64 && sizeof(shms_bell) == 64 && sizeof(shms_arena_header) == 192 &&
            offsetof(shms_arena_header, enqueue_pos) == 128 && offsetof(shms_control, batcher_sleeping) == 40 &&
            shms_control_bytes() == 4096 && SHMS_BELL_BYTES == 4096,
        "v5 segment layout");

  // A submission ring of 8 cells in an arena of 8 slots (shms_arena_init), enqueue_pos
  // 4097, one real push (shms_ring_push).
  const shms_arena_geometry g = shms_arena_layout(8, 0);
  std::vector<uint64_t> buf(g.segment_bytes / 8);
  shms_arena_init(buf.data(), &g, 8, 3, 1);
  shms_ring ring{};
  const bool attached = shms_ring_attach(&ring, buf.data(), g.segment_bytes) == 0;
  CHECK(attached, "attach failed");
  if (attached) {
    CHECK(ring.capacity == 8 && reinterpret_cast<char *>(ring.cells) == reinterpret_cast<char *>(buf.data()) + 192 &&
              reinterpret_cast<char *>(ring.enqueue_pos) == reinterpret_cast<char *>(buf.data()) + 128,
          "ring of an arena: ", ring.capacity, " cells at ",
          reinterpret_cast<char *>(ring.cells) - reinterpret_cast<char *>(buf.data()));
    ring.enqueue_pos->store(4097);
    ring.cells[1].seq.store(4097);
    CHECK(shms_ring_push(&ring, 3, 5, 7) == SHMS_RING_OK, "push failed");
    uint64_t enq = ring.enqueue_pos->load();
    CHECK(hex(&ring.cells[1], 32) + hex(&enq, 8) == want("ring_cell_after_push"),
          "ring cell differs: ", hex(&ring.cells[1], 32) + hex(&enq, 8));
  }

  CHECK(hex(encode_bytes({"ab", ""})) == want("bytes_tensor"), "BYTES encoding differs");
  auto items = decode_bytes("\x02\0\0\0ab\0\0\0\0", 10, 2);
  CHECK(items.size() == 2 && items[0] == "ab" && items[1].empty(), "BYTES decoding");

  // Control frames: what this client sends, byte for byte; what it reads, field by field.
  control::Hello hello;
  hello.pid = 4242, hello.arena_bytes = 1048576;
  CHECK(hex(control::encode(hello)) == want("hello_frame"), "hello frame differs: ", hex(control::encode(hello)));
  CHECK(hex(control::encode(control::GetMetadata{"simple", control::version_or_latest(0)})) == want("metadata_frame"),
        "metadata frame differs");
  auto err = control::parse_frame(test::unhex(want("error_reply_frame")));
  test::expect_error<InvalidArgumentError>("error reply", [&] { control::decode_reply<control::Hello>(err.get()); },
                                           "protocol version 1 not supported", Status::INVALID_ARG);
  auto meta = control::parse_frame(test::unhex(want("metadata_reply_frame")));
  ModelInfo m = control::decode_reply<control::GetMetadata>(meta.get(), true);
  CHECK(m.id == 2 && m.name == "simple" && m.version == 1 && m.max_batch_size == 8 && m.platform == "python" &&
            m.inputs.size() == 2 && m.outputs.size() == 2 && m.inputs[1].name == "INPUT1" &&
            m.inputs[1].dtype == DType::INT32 && m.inputs[1].shape == std::vector<int64_t>({-1, 16}) && m.ready(),
        "metadata reply decoded wrong");
  check_frames(*vectors);
  check_error_types();
}
