// The one table of settings. Each knob is declared here once; the environment variable SMARTCOLL_<NAME>,
// the Python keyword option <name>, `smartcoll info` and docs/knobs.md all come from this table.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>

namespace smartcoll {

struct Knob {
  std::string_view name;
  std::string_view default_value;
  std::string_view type;  // "int", "float", "str" or "choice:a|b|c"
  std::string_view description;
};

inline constexpr Knob kKnobs[] = {
    {"algo", "auto", "choice:auto|ring|rhd|cma",
     "allreduce algorithm: ring (pipelined, segmented; bandwidth-optimal), rhd (recursive halving-doubling; "
     "fewer steps for small messages), cma (ranks on one host read each other's buffers once with "
     "process_vm_readv) or auto (rhd up to rhd_max_bytes; above, cma where usable, else ring)"},
    {"cma", "auto", "choice:auto|off",
     "same-host fast path: auto probes at start-up whether every rank shares this host and can read its peers' "
     "memory (process_vm_readv); off never uses it. Must be the same on every rank"},
    {"rhd_max_bytes", "262144", "int", "auto picks rhd for allreduce messages up to this many bytes"},
    {"segment_size", "262144", "int",
     "bytes per pipeline segment: the unit the ring sends, reduces and forwards while the next one is on the wire"},
    {"streams", "1", "int", "TCP connections per peer; ring segments are striped across them"},
    {"timeout", "60", "float",
     "seconds a collective may make no progress before it fails naming the peer it waits for"},
    {"connect_timeout", "120", "float", "seconds to wait for the rendezvous store and for peers to connect"},
    {"ifname", "", "str", "network interface whose IPv4 address this rank listens on (e.g. eth0, veth-h1)"},
    {"addr", "", "str",
     "explicit IPv4 address to listen on; default: the local address that routes to MASTER_ADDR"},
    {"engine_cpu", "-1", "int", "pin the progress-engine thread to this CPU (-1: not pinned)"},
    {"sockbuf", "0", "int", "SO_SNDBUF/SO_RCVBUF bytes for data connections (0: kernel autotuning)"},
    {"codec", "identity", "str",
     "wire format for float32 sum/avg in allreduce, reduce_scatter and allgather: identity, fp16, bf16, bfp16, "
     "bfp:block=B,mant=M,exp=E, mxint8, mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, mxfp6_e2m3, mxfp4_e2m1"},
    {"codec_mode", "hop", "choice:hop|owner",
     "compressed allreduce and reduce_scatter: hop (every ring hop decodes, adds, re-encodes; error grows with "
     "ranks) or owner (each contribution is encoded once and summed in float32 by its chunk's owner; error "
     "independent of ranks)"},
    {"check", "1", "int",
     "1: ranks exchange each call's collective, count, dtype, op and root first and fail on a mismatch; "
     "0: skip (saves one small exchange per call)"},
};

// Resolved settings: defaults, overridden by SMARTCOLL_* environment variables, overridden by explicit options.
class Options {
 public:
  // Throws InvalidArgument naming the knob for an unknown name or a value that does not parse.
  static Options resolve(const std::map<std::string, std::string>& explicit_options = {});

  const std::string& str(std::string_view name) const;
  int64_t integer(std::string_view name) const;
  double real(std::string_view name) const;
  const std::map<std::string, std::string>& values() const { return values_; }

 private:
  std::map<std::string, std::string> values_;
};

const Knob& find_knob(std::string_view name);  // throws InvalidArgument listing the valid names
std::string knob_env_name(std::string_view name);

}  // namespace smartcoll
