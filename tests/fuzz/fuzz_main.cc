// A small fuzz driver (no libFuzzer here): runs each target on its seeds, then on random inputs and on seeds
// mutated by bit flips, byte changes, length fields set to extremes, truncations, deletions, duplications and
// splices, for a given time. The input sequence depends only on --seed, so a run can be repeated with --runs.
// When a target aborts (a FUZZ_CHECK or a sanitizer), the input is saved to fuzz-crash-<target>.bin; --input
// runs a saved file again.
//
//     smartcoll_fuzz [--seconds S] [--target NAME] [--seed N] [--runs N] [--input FILE] [--list]
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <string_view>

#include "targets.h"

namespace smartcoll::fuzz {

namespace {

struct Target {
  const char* name;
  void (*run)(const uint8_t*, size_t);
  Seeds (*seeds)();
};

// ---- Registry of targets: one row per target (declared in targets.h, defined in a tests/fuzz/*.cc file). ----
constexpr Target kTargets[] = {
    {"store_request", store_request, store_request_seeds},
    {"sha256_pieces", sha256_pieces, sha256_pieces_seeds},
    {"peer_hello", peer_hello, peer_hello_seeds},
    {"call_descriptor", call_descriptor, call_descriptor_seeds},
    {"start_up_verdict", start_up_verdict, start_up_verdict_seeds},
    {"switch_packet", switch_packet, switch_packet_seeds},
    {"model_profile", model_profile, model_profile_seeds},
    {"nicd_message", nicd_message, nicd_message_seeds},
    {"onesided_message", onesided_message, onesided_message_seeds},
};
// ---- End of registry. ----

constexpr size_t kMaxInput = 64 * 1024;

// The input being run, for the abort handler (which may only make async-signal-safe calls).
std::string g_input;
char g_crash_path[256];

void save_input_on_abort(int sig) {
  const int fd = ::open(g_crash_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd >= 0) {
    [[maybe_unused]] auto n = ::write(fd, g_input.data(), g_input.size());
    ::close(fd);
  }
  static constexpr char kMsg[] = "\nfuzz: the failing input is saved in ";
  [[maybe_unused]] auto n1 = ::write(STDERR_FILENO, kMsg, sizeof kMsg - 1);
  [[maybe_unused]] auto n2 = ::write(STDERR_FILENO, g_crash_path, std::strlen(g_crash_path));
  [[maybe_unused]] auto n3 = ::write(STDERR_FILENO, "\n", 1);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

void run_one(const Target& t, std::string input) {
  g_input = std::move(input);
  t.run(reinterpret_cast<const uint8_t*>(g_input.data()), g_input.size());
}

class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::string random_input() {
    std::string s(below(257), '\0');
    for (char& c : s) c = static_cast<char>(rng_());
    return s;
  }

  // One to four stacked mutations of a seed.
  std::string mutate(const Seeds& seeds) {
    std::string s = pick(seeds);
    for (size_t n = 1 + below(4); n > 0; --n) mutate_once(s, seeds);
    if (s.size() > kMaxInput) s.resize(kMaxInput);
    return s;
  }

 private:
  size_t below(size_t n) { return n == 0 ? 0 : static_cast<size_t>(rng_() % n); }
  const std::string& pick(const Seeds& seeds) { return seeds[below(seeds.size())]; }

  // Values around the edges of length fields: zero, small, the store's limits (and the fuzz targets' own small
  // ones) plus or minus one, the signed and unsigned extremes, and the length of what follows.
  uint32_t extreme_length(size_t rest) {
    static constexpr uint32_t kEdges[] = {0,          1,         2,          63,         64,        65,
                                          1023,       1024,      1025,       4095,       4096,      4097,
                                          0xffffff,   0x1000000, 0x1000001,  0x7fffffff, 0x80000000, 0xffffffff};
    if (below(4) == 0) return static_cast<uint32_t>(rest + below(3)) - 1;  // rest - 1, rest or rest + 1
    return kEdges[below(std::size(kEdges))];
  }

  void mutate_once(std::string& s, const Seeds& seeds) {
    switch (below(9)) {
      case 0:  // flip one bit
        if (!s.empty()) s[below(s.size())] ^= static_cast<char>(1u << below(8));
        break;
      case 1: {  // set one byte to an interesting or random value
        static constexpr uint8_t kBytes[] = {0, 1, 2, 3, 0x7f, 0x80, 0xfe, 0xff};
        if (!s.empty()) s[below(s.size())] = static_cast<char>(below(2) ? kBytes[below(8)] : rng_());
        break;
      }
      case 2: {  // overwrite four bytes with an extreme little-endian length
        if (s.size() < 4) break;
        const size_t at = below(s.size() - 3);
        const uint32_t v = extreme_length(s.size() - at - 4);
        for (int i = 0; i < 4; ++i) s[at + i] = static_cast<char>(v >> (8 * i));
        break;
      }
      case 3:  // truncate
        s.resize(below(s.size() + 1));
        break;
      case 4: {  // delete a range
        const size_t at = below(s.size() + 1);
        s.erase(at, below(s.size() - at + 1));
        break;
      }
      case 5: {  // duplicate a range in place
        const size_t at = below(s.size() + 1);
        s.insert(at, s.substr(at, below(s.size() - at + 1)));
        break;
      }
      case 6: {  // splice: a prefix of this, a suffix of another seed
        const std::string& other = pick(seeds);
        s = s.substr(0, below(s.size() + 1)) + other.substr(below(other.size() + 1));
        break;
      }
      case 7: {  // insert random bytes
        std::string junk(1 + below(8), '\0');
        for (char& c : junk) c = static_cast<char>(rng_());
        s.insert(below(s.size() + 1), junk);
        break;
      }
      default:  // append another seed (several requests in one stream)
        s += pick(seeds);
        break;
    }
  }

  std::mt19937_64 rng_;
};

// Runs one target for `seconds` or `runs` inputs, whichever ends first; returns the inputs run.
uint64_t fuzz(const Target& t, double seconds, uint64_t runs, uint64_t seed) {
  std::snprintf(g_crash_path, sizeof g_crash_path, "fuzz-crash-%s.bin", t.name);
  const Seeds seeds = t.seeds();
  for (const std::string& s : seeds) run_one(t, s);
  Mutator m(seed);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  uint64_t n = seeds.size();
  for (; n < runs; ++n) {
    if (n % 64 == 0 && std::chrono::steady_clock::now() >= deadline) break;
    run_one(t, n % 16 == 0 ? m.random_input() : m.mutate(seeds));
  }
  return n;
}

int usage() {
  std::fprintf(stderr, "usage: smartcoll_fuzz [--seconds S] [--target NAME] [--seed N] [--runs N] [--input FILE] "
                       "[--list]\ntargets:");
  for (const Target& t : kTargets) std::fprintf(stderr, " %s", t.name);
  std::fprintf(stderr, "\n");
  return 2;
}

}  // namespace

[[noreturn]] void check_failed(const char* expr, const char* file, int line) {
  std::fprintf(stderr, "fuzz check failed: %s (%s:%d)\n", expr, file, line);
  std::abort();
}

}  // namespace smartcoll::fuzz

int main(int argc, char** argv) {
  using namespace smartcoll::fuzz;
  double seconds = 10;
  uint64_t runs = UINT64_MAX;
  uint64_t seed = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  std::string only, input_file;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--list") {
      for (const Target& t : kTargets) std::printf("%s\n", t.name);
      return 0;
    }
    if (i + 1 >= argc) return usage();
    const char* value = argv[++i];
    if (arg == "--seconds") seconds = std::atof(value);
    else if (arg == "--runs") runs = std::strtoull(value, nullptr, 10);
    else if (arg == "--seed") seed = std::strtoull(value, nullptr, 10);
    else if (arg == "--target") only = value;
    else if (arg == "--input") input_file = value;
    else return usage();
  }
  std::vector<const Target*> chosen;
  for (const Target& t : kTargets)
    if (only.empty() || only == t.name) chosen.push_back(&t);
  if (chosen.empty()) return usage();
  for (int sig : {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL}) std::signal(sig, save_input_on_abort);

  if (!input_file.empty()) {
    std::ifstream in(input_file, std::ios::binary);
    if (!in) return usage();
    const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    for (const Target* t : chosen) {
      std::snprintf(g_crash_path, sizeof g_crash_path, "fuzz-crash-%s.bin", t->name);
      run_one(*t, bytes);
      std::printf("%s: %s passes\n", t->name, input_file.c_str());
    }
    return 0;
  }
  std::printf("fuzz: --seed %llu\n", static_cast<unsigned long long>(seed));
  std::fflush(stdout);
  for (const Target* t : chosen) {
    const uint64_t n = fuzz(*t, seconds / chosen.size(), runs, seed);
    std::printf("%s: %llu inputs passed\n", t->name, static_cast<unsigned long long>(n));
    std::fflush(stdout);
  }
  return 0;
}
