// Fuzz target for what the offload daemon reads from a rank's socket (nicd/protocol.h): every message either
// decodes into fields within range, which encode back to the same bytes, or is refused with a ProtocolError.
#include <string>
#include <string_view>

#include "nicd/protocol.h"
#include "targets.h"

namespace smartcoll::fuzz {

namespace {

// Decodes `msg` as its type says; true and `again` = the re-encoding when it decodes.
bool decode_any(std::string_view msg, std::string& again) {
  try {
    switch (nicd::type_of(msg)) {
      case nicd::Type::hello: {
        const nicd::Hello h = nicd::decode_hello(msg);
        FUZZ_CHECK(h.rank >= 0 && h.rank < h.size && h.hosts.size() == static_cast<size_t>(h.size));
        again = nicd::encode(h);
        return true;
      }
      case nicd::Type::ready: again = nicd::encode(nicd::decode_ready(msg)); return true;
      case nicd::Type::post: again = nicd::encode(nicd::decode_post(msg)); return true;
      case nicd::Type::done: again = nicd::encode(nicd::decode_done(msg)); return true;
      case nicd::Type::abort: again = nicd::encode(nicd::decode_abort(msg)); return true;
      case nicd::Type::bye:
      case nicd::Type::heartbeat:
        again = std::string(msg.substr(0, 8));
        return true;
    }
  } catch (const nicd::ProtocolError&) {
  }
  return false;
}

}  // namespace

void nicd_message(const uint8_t* data, size_t size) {
  const std::string_view msg(reinterpret_cast<const char*>(data), size);
  std::string again;
  // Bodiless messages accept trailing bytes only by ignoring them; every other decoded message is exactly its
  // fields.
  if (decode_any(msg, again)) FUZZ_CHECK(again == msg || again == msg.substr(0, 8));
}

Seeds nicd_message_seeds() {
  nicd::Hello h;
  h.rank = 1;
  h.size = 3;
  h.timeout = 60;
  h.connect_timeout = 120;
  h.job_id = "job";
  h.store = "tcp 127.0.0.1 29500 secret";
  h.route_hint = "127.0.0.1";
  h.settings = "algo=auto streams=1";
  h.hosts = {0, 0, 1};
  return {nicd::encode(h), nicd::encode(nicd::Post{7, 0, 0, 0, -1, 1024, 0x7f0000001000, 0x7f0000002000, "identity"}),
          nicd::encode(nicd::Done{7, "rank 3 left the job"}), nicd::encode(nicd::Ready{}),
          nicd::encode(nicd::Abort{"interrupted"}), nicd::encode(nicd::Type::bye)};
}

}  // namespace smartcoll::fuzz
