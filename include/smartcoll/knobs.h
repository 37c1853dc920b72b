// The one table of settings. Each knob is declared here once; the environment variable SMARTCOLL_<NAME>,
// the Python keyword option <name>, `smartcoll info`, docs/knobs.md, the range check and the start-up check
// that ranks agree all come from this table.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>
#include <string_view>

namespace smartcoll {

struct Knob {
  std::string_view name;
  std::string_view default_value;
  std::string_view type;  // "int", "bytes" (an int, or one with a K, M or G suffix: 16M), "float", "str" or "choice:a|b|c"
  double lo, hi;          // accepted range of "int", "bytes" and "float" knobs
  bool must_match;        // ranks that disagree would misframe messages: checked at start-up
  std::string_view description;
};

inline constexpr double kNoLimit = 1e15;

inline constexpr Knob kKnobs[] = {
    {"algo", "auto", "choice:auto|ring|rhd|rd|cma|shm|hier|switch|switch_hier", 0, 0, true,
     "allreduce algorithm (smartcoll info lists them): ring (pipelined, segmented; bandwidth-optimal), rhd "
     "(recursive halving-doubling), rd (recursive doubling; fewest steps for tiny messages), cma (ranks on one "
     "host read each other's buffers once), shm (ranks on one host put small vectors through a shared segment), "
     "hier (several ranks per host: reduce-scatter per host, allreduce across hosts, allgather per host), switch "
     "(the aggregation switches of the switch option sum the vector), switch_hier (several ranks per host: "
     "reduce-scatter per host, each rank's share through the switches, allgather per host) or auto (chosen per "
     "call from the size, world size and host layout; the switch where one is set and the built-in cost model "
     "predicts it beats the ring, or the hierarchical ring)"},
    {"cma", "auto", "choice:auto|tcp|off", 0, 0, true,
     "same-host fast path: auto probes at start-up whether every rank shares this host and can read its peers' "
     "memory (process_vm_readv), and the ranks then signal each other through a shared-memory segment; tcp "
     "sends those control messages over TCP instead (as when the segment cannot be made); off never uses it"},
    {"rma_direct", "auto", "choice:auto|off", 0, 0, false,
     "one-sided calls between ranks of one host (where the same-host path is usable): auto reads the target's "
     "region, or writes into it, directly instead of asking the target's one-sided server: getv and putv when "
     "the pieces average 4 KiB or more (process_vm_readv / process_vm_writev), and for a region from allocate "
     "getv and putv of any pieces and accumulatev, through a mapping of it (a read checks that the region stayed "
     "registered, a write announces itself so that deregistering waits for it, and accumulates take the region's "
     "lock in shared memory, which the target's server takes too); calls under a codec always go to the server; "
     "off always asks the server"},
    {"shm_bytes", "1048576", "bytes", 0, 1 << 26, true,
     "same-host path: bytes per rank that a call may put through the shared control segment (algo=shm: one round "
     "of stores and loads, two for allreduce and reduce from 16 KiB, no system call while the ranks run); auto "
     "takes it for a call that fits, in any collective but alltoallv, while each rank copies at most 6 MiB through "
     "the segment (its part in, what it reads out) and all ranks together 24 MiB. The segment holds 2 x this per "
     "rank. 0: never"},
    {"rhd_max_bytes", "262144", "bytes", 0, kNoLimit, true,
     "auto uses latency-optimized algorithms (recursive doubling/halving, trees, Bruck) up to this many bytes"},
    {"model_profile", "", "str", 0, 0, false,
     "a cost-model profile (JSON from smartcoll model calibrate): auto then picks, per call, the algorithm the model "
     "predicts to be fastest on the measured machine (docs/cost-model.md); empty: the built-in size rules. Ranks "
     "must load equal profiles (their digests are compared at start-up), the paths may differ"},
    {"segment_size", "262144", "bytes", 64, 1 << 30, true,
     "bytes per pipeline segment on the wire (compressed bytes under a codec): the unit the ring sends, reduces "
     "and forwards while the next one is on the wire"},
    {"list_stage_bytes", "512", "bytes", 0, 1 << 20, false,
     "list calls: every run of two or more consecutive entries of fewer bytes than this each is copied into one "
     "staging piece before the call (and the results back after it), so that the wire, the reductions and the "
     "same-host reads see one piece instead of many tiny ones (a piece costs each of them a fixed amount of work "
     "that for tiny entries exceeds two copies). 0: never stage"},
    {"streams", "1", "int", 1, 64, true,
     "TCP connections per peer (lanes); pipeline segments are striped across them and each one is served by "
     "engine worker (stream mod engine_threads), so a large call's I/O, reductions and codec work spread over "
     "min(streams, engine_threads) cores: on fast links with a codec, set both to 4. Calls of one segment use the "
     "first alone; the others connect on first use. Several flows per peer can overflow shallow switch queues "
     "(losses, 200 ms retransmission stalls)"},
    {"engine_threads", "0", "int", 0, 64, false,
     "engine worker threads per rank; each owns its own connections and does their I/O, reductions and codec "
     "work. 0: chosen from the CPUs this process may use and LOCAL_WORLD_SIZE (at most 4). Results are bitwise "
     "identical whatever the number"},
    {"engine_cpus", "", "str", 0, 0, false,
     "comma-separated CPUs to pin the engine workers to, worker i on the i-th (cycled); empty: not pinned"},
    {"spin_us", "200", "int", 0, 1000000, false,
     "microseconds an engine that ran out of work keeps polling its sockets (yielding the core between polls, so "
     "ranks that share cores still run) before it sleeps; a caller waiting on a request drives the engine itself "
     "when it is idle"},
    {"spin", "auto", "choice:auto|on|off", 0, 0, false,
     "whether a waiting rank polls (for spin_us) before it sleeps: on; off (sleeps in epoll at once); auto polls "
     "only while this host has a CPU for every rank on it (start-up layout or LOCAL_WORLD_SIZE against the CPUs "
     "this process may use; with engine=nicd one more, for the daemon) and stops for 100 ms whenever two yields in "
     "a row give the core to another thread. With engine=nicd the waiting caller polls for the daemon's answer "
     "itself"},
    {"timeout", "60", "float", 0.001, 1e6, false,
     "seconds a collective may make no progress before it fails naming the peer it waits for"},
    {"connect_timeout", "120", "float", 0.001, 1e6, false,
     "seconds to wait for the rendezvous store and for a peer to connect"},
    {"ifname", "", "str", 0, 0, false, "network interface whose IPv4 address this rank listens on (e.g. eth0)"},
    {"addr", "", "str", 0, 0, false,
     "explicit IPv4 address to listen on; default: the local address that routes to MASTER_ADDR"},
    {"unix_sockets", "auto", "choice:auto|off", 0, 0, false,
     "data connections between ranks of one host: auto connects over a Unix-domain stream socket (named after the "
     "job and the rank's start-up claim in the abstract namespace of the network namespace) and falls back to TCP "
     "where the peer's socket cannot be reached (another network namespace: a container, an emulated host); no "
     "TCP/IP stack on the way, so 2-3x the bandwidth of TCP over loopback and a shorter round trip. off: TCP "
     "always"},
    {"sockbuf", "0", "bytes", 0, 1 << 30, false, "SO_SNDBUF/SO_RCVBUF bytes for data connections (0: kernel autotuning)"},
    {"codec", "identity", "str", 0, 0, false,
     "wire format for float32 sum/avg in allreduce, reduce_scatter and allgather: identity, fp16, bf16, bfp16, "
     "bfp:block=B,mant=M,exp=E, mxint8, mxfp8_e4m3, mxfp8_e5m2, mxfp6_e3m2, mxfp6_e2m3, mxfp4_e2m1"},
    {"codec_mode", "hop", "choice:hop|owner", 0, 0, false,
     "compressed allreduce and reduce_scatter: hop (every ring hop decodes, adds, re-encodes; error grows with "
     "ranks) or owner (each contribution is encoded once and summed in float32 by its chunk's owner; error "
     "independent of ranks)"},
    {"check", "1", "int", 0, 1, true,
     "1: the first message of each call between two ranks carries the call's collective, count, dtype, op and "
     "root, and a mismatch fails the call naming who called what; 0: skip (32 bytes less per message)"},
    {"posting", "one_thread", "choice:one_thread|ordered", 0, 0, false,
     "which threads post a communicator's calls: one_thread (one at a time: posting while another thread's call "
     "is still running raises, since two threads cannot post in the same order on every rank and same-shaped "
     "calls would mix data) or ordered (the application makes the order of posts from several threads the same "
     "on every rank; not checked)"},
    {"host", "", "str", 0, 0, false,
     "which host this rank is on, for the host layout that hierarchical algorithms follow (ranks with the same "
     "value share a host); empty: detected from the kernel (boot id, host name, network namespace)"},
    {"job_id", "", "str", 0, 0, false,
     "identifies the job: rendezvous keys and the peers' hello carry it, so ranks of another job that reach the "
     "same store or ports are refused, never joined. smartcoll run sets it; empty: TORCHELASTIC_RUN_ID, else "
     "SLURM_JOB_ID.SLURM_STEP_ID, else one drawn by rank 0 and shared through the store"},
    {"switch", "", "str", 0, 0, true,
     "aggregation switches (smartcoll switch) as host:port[,host:port...]: allreduce can then sum in the "
     "network (algo=switch; auto picks it where the built-in cost model predicts it beats the ring: 3 ranks or "
     "more, above rhd_max_bytes, no codec, neither the same-host path nor hier usable); reduce_scatter and "
     "allgather too with algo=switch; chunk c of a vector goes to switch c mod k. Empty: no switch"},
    {"switch_fallback", "ring", "choice:ring|fail", 0, 0, true,
     "when a switch stops answering, or a rank loses its path to it (or it cannot be joined at start-up): ring "
     "(every rank finishes the call, and later ones until the next probe (switch_retry), with a ring over TCP; "
     "logged once) or fail (the call fails on every rank naming the switch or the rank that lost it)"},
    {"switch_retry", "100", "int", 0, 1000000, true,
     "after a fallback to the ring, calls with algo=switch that go to the ring before every rank probes the "
     "switches again (joining afresh; they are used again only if every rank can); doubled after each failed "
     "probe or probe whose call falls back again, up to 64 times, until a call completes through the switch. "
     "Counted in calls, alike on every rank. 0: never probe"},
    {"switch_timeout", "2", "float", 0.05, 1e6, false,
     "seconds a switch may leave this rank without any answer, while it waits for results, before it counts as "
     "gone (a live switch answers every retransmission, even while it waits for slower ranks)"},
    {"switch_keepalive", "15", "float", 0, 1e6, false,
     "seconds without a switch call after which this rank sends its join to each switch again, so that a job "
     "that pauses (evaluation, a checkpoint) keeps its slots: a switch frees the slots of a job that sent "
     "nothing for its --job-timeout (60 s by default; keep it at least 2-3 times this). 0: never"},
    {"switch_slots", "128", "int", 1, 4096, true,
     "slots the job asks of each switch: chunks in flight per rank and switch (the window)"},
    {"switch_packet", "1408", "bytes", 64, 32768, true,
     "payload bytes per switch datagram, a multiple of 8: 1408 fits a 1500-byte MTU; larger values are sent as "
     "IP fragments (fine on loopback and jumbo-frame networks)"},
    {"switch_auth", "header", "choice:header|full", 0, 0, true,
     "what each switch datagram's MAC (SipHash-2-4 with the job's secret) covers: header (job, rank, chunk, "
     "count, ...) or full (header and payload)"},
    {"switch_offload", "on", "choice:on|off", 0, 0, false,
     "UDP segmentation offload for switch datagrams: on (equal datagrams to one switch port leave in one "
     "message with UDP_SEGMENT, and the kernel may join received ones, UDP_GRO; either falls back to one "
     "datagram at a time where the kernel refuses) or off (one datagram per message). The wire is the same"},
    {"engine", "inprocess", "choice:inprocess|nicd", 0, 0, true,
     "who runs the collectives: inprocess (this process's progress engine) or nicd (the host's offload daemon, "
     "smartcoll nicd, reads and writes this rank's buffers and runs the inter-host part; allreduce, reduce, "
     "reduce_scatter, broadcast, allgather, alltoall and barrier)"},
    {"nicd_socket", "", "str", 0, 0, false,
     "Unix socket of the offload daemon (engine=nicd); empty: $XDG_RUNTIME_DIR/smartcoll-nicd.sock, or "
     "/tmp/smartcoll-nicd-UID.sock without XDG_RUNTIME_DIR (the daemon's default too)"},
    {"log", "warn", "choice:error|warn|info|debug", 0, 0, false,
     "log level of messages on stderr (each line names the rank and the collective)"},
};

// Resolved settings: defaults, overridden by SMARTCOLL_* environment variables, overridden by explicit options.
class Options {
 public:
  // Throws InvalidArgument naming the knob for an unknown name, a value that does not parse or one outside the
  // knob's range. Values are kept canonical: a "bytes" knob's as its integer (16M -> 16777216), so that ranks that
  // spell one size two ways agree.
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

// SMARTCOLL_* environment variables that are no knob and no other variable smartcoll reads (the launcher's
// SMARTCOLL_SECRET, the emulated cluster's SMARTCOLL_CLUSTER*, ...): likely typos of a knob's variable, which would
// otherwise be ignored in silence. One line per variable, naming the closest knob.
std::vector<std::string> unknown_variables();

}  // namespace smartcoll
