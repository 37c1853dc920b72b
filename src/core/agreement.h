// Argument agreement: what each call is (its Descriptor, core/task.h), and how a disagreement is reported.
//
// The first message of a call between two ranks carries the sender's descriptor; the receiver compares it with
// its own before using any byte of the message. The rank that finds a difference fails with the marker
// "ranks disagree on call #N"; every rank that fails because of it then publishes its own descriptor of call N
// in the rendezvous store and reads the others', so that each one reports which ranks called what.
#pragma once

#include <string>
#include <vector>

#include "core/task.h"
#include "smartcoll/codec.h"
#include "smartcoll/comm.h"
#include "smartcoll/store.h"

namespace smartcoll {

// Rank 0's start-up verdict, "ok <claim of each rank> <host number of each rank>", as every rank reads it.
struct StartUpVerdict {
  std::vector<std::string> claims;
  std::vector<int> hosts;  // numbered from 0 in order of first appearance
};
// Throws CommError with the verdict's text when it is not "ok ...", or naming what is malformed (the bytes came
// from the store).
StartUpVerdict parse_verdict(const std::string& verdict, int size);

inline constexpr uint16_t kDescriptorMagic = 0x3444;  // "D4"

Descriptor make_descriptor(Collective coll, DataType dt, ReduceOp op, Algorithm algo, int root, size_t count,
                           const Codec& codec, bool codec_owner, uint64_t call = 0);
// List calls (docs/vectored.md) carry a digest of their counts (never 0) where the call has room: in root, which
// the unrooted collectives leave at -1, and for broadcast (which takes no codec) in codec_block.
void set_list_layout(Descriptor& d, uint32_t digest);
uint32_t list_layout(const Descriptor& d);  // 0: not a list call
// The number of the call a peer's descriptor belongs to, read against this rank's call `seq`: it carries the low
// 16 bits, so the nearest number with those bits.
uint64_t call_of(const Descriptor& d, uint64_t seq);
// "allreduce(count=10, float32, op=sum, algo=ring)"; a descriptor with a bad magic or codes is named as such.
std::string describe(const Descriptor& d);
// "ranks disagree on call #seq: rank(s) R called ...; rank(s) P called ...; <what to check>": the text of a
// disagreement found by `rank` in call `seq` (the communicator's number, from 0), which explain_disagreement
// turns into the report naming every rank's call.
std::string disagreement_text(uint64_t seq, int rank, const Descriptor& mine, int peer, const Descriptor& theirs);
// What the rank that received `theirs` from `peer` in call `seq` throws. Its handler publishes both descriptors
// (publish_call) before the communicator fails, so every rank's report names at least the two calls that differ.
struct Disagreement : CommError {
  Disagreement(const Task& task, int peer, const Descriptor& theirs);
  uint64_t seq;
  int peer;
  Descriptor theirs;
};
// Publishes rank `rank`'s descriptor of call `seq` (null: unknown) under "call/<seq>/<rank>".
void publish_call(Store& store, uint64_t seq, int rank, const Descriptor* d);
// If `error` carries the marker of a disagreement on call N: publishes `mine(N)` (this rank's descriptor of
// that call, when it still knows it) under "call/N/<rank>", reads every rank's for up to `wait`, and returns
// the report naming which ranks called what. Otherwise returns `error` unchanged.
template <class Mine>
std::string explain_disagreement(const std::string& error, Store& store, int rank, int size, Mine&& mine,
                                 std::chrono::milliseconds wait);

// Implementation detail of explain_disagreement ("" when fewer than two different calls could be read).
std::string disagreement_report(Store& store, int size, uint64_t seq, std::chrono::milliseconds wait);
bool disagreement_call(const std::string& error, uint64_t& seq);

template <class Mine>
std::string explain_disagreement(const std::string& error, Store& store, int rank, int size, Mine&& mine,
                                 std::chrono::milliseconds wait) {
  uint64_t seq = 0;
  if (!disagreement_call(error, seq)) return error;
  Descriptor d{};
  publish_call(store, seq, rank, mine(seq, d) ? &d : nullptr);
  std::string report = disagreement_report(store, size, seq, wait);
  return report.empty() ? error : report;
}

}  // namespace smartcoll
