// Fuzz target for the cost model's profile (a file a user hands to every rank): parsed, or refused with an
// InvalidArgument; what parses writes canonical JSON that parses back to itself.
#include <string>

#include "coll/cost.h"
#include "targets.h"

namespace smartcoll::fuzz {

void model_profile(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  coll::Profile p;
  try {
    p = coll::Profile::parse(text, "fuzz.json");
  } catch (const InvalidArgument&) {
    return;
  }
  const std::string canonical = p.to_json();
  FUZZ_CHECK(coll::Profile::parse(canonical, "canonical").to_json() == canonical);
}

Seeds model_profile_seeds() {
  coll::Profile p = coll::Profile::builtin();
  p.switch_Bps = 1e9;
  return {coll::Profile::builtin().to_json(), p.to_json(),
          R"({"alpha_s": 1e-4, "link_Bps": 1.2e8, "reduce_Bps": 1e10, "mem_Bps": 2e10, "copy_Bps": 1e10,
              "flops": 8e10, "update_s_per_byte": 1e-10, "efficiency_algo": {"rhd": 0.8},
              "measured": {"host": "h\u00e9", "times": [1, 2.5, null, true]}})"};
}

}  // namespace smartcoll::fuzz
