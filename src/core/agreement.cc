#include "core/agreement.h"

#include <charconv>
#include <cstdio>
#include <map>
#include <sstream>

namespace smartcoll {

namespace {

constexpr std::string_view kMarker = "ranks disagree on call #";

std::string hex(const Descriptor& d) {
  static const char digits[] = "0123456789abcdef";
  std::string s;
  const auto* p = reinterpret_cast<const unsigned char*>(&d);
  for (size_t i = 0; i < sizeof d; ++i) {
    s += digits[p[i] >> 4];
    s += digits[p[i] & 15];
  }
  return s;
}

bool unhex(const std::string& s, Descriptor& d) {
  if (s.size() != 2 * sizeof d) return false;
  auto* p = reinterpret_cast<unsigned char*>(&d);
  for (size_t i = 0; i < sizeof d; ++i) {
    auto v = [&](char c) { return c <= '9' ? c - '0' : c - 'a' + 10; };
    p[i] = static_cast<unsigned char>(v(s[2 * i]) * 16 + v(s[2 * i + 1]));
  }
  return true;
}

constexpr std::string_view kHow =
    " every rank must make the same calls in the same order with the same arguments and settings (count, dtype, "
    "op, root, algo, codec, codec_mode)";

}  // namespace

StartUpVerdict parse_verdict(const std::string& verdict, int size) {
  if (!verdict.starts_with("ok ")) throw CommError(verdict);
  const std::string corrupted = ": a corrupted store, or another smartcoll version";
  StartUpVerdict out;
  std::istringstream words(verdict.substr(3));
  std::vector<std::string> fields;
  for (std::string w; words >> w;) fields.push_back(w);
  if (fields.size() != 2 * static_cast<size_t>(size)) {
    // Two fields a rank: a whole number of ranks other than this world's is a world size rank 0 disagrees on.
    if (fields.size() % 2 == 0)
      throw CommError("rank 0 started a world of " + std::to_string(fields.size() / 2) + " ranks, this rank one of " +
                      std::to_string(size) + ": set the same WORLD_SIZE (or world_size) on every rank");
    throw CommError("rank 0's start-up verdict has " + std::to_string(fields.size()) + " fields, not " +
                    std::to_string(2 * size) + corrupted);
  }
  for (int p = 0; p < size; ++p) {
    const std::string& h = fields[static_cast<size_t>(size + p)];
    int index = -1;
    const auto [end, ec] = std::from_chars(h.data(), h.data() + h.size(), index);
    if (ec != std::errc() || end != h.data() + h.size() || index < 0 || index >= size)
      throw CommError("rank 0's start-up verdict names host '" + h + "' for rank " + std::to_string(p) + corrupted);
    out.hosts.push_back(index);
  }
  fields.resize(static_cast<size_t>(size));
  out.claims = std::move(fields);
  return out;
}

Descriptor make_descriptor(Collective coll, DataType dt, ReduceOp op, Algorithm algo, int root, size_t count,
                           const Codec& codec, bool codec_owner, uint64_t call) {
  const bool compressed = codec.kind() != CodecKind::identity;
  return {kDescriptorMagic,
          static_cast<uint16_t>(call),
          static_cast<uint8_t>(coll),
          static_cast<uint8_t>(dt),
          static_cast<uint8_t>(op),
          static_cast<uint8_t>(algo),
          static_cast<uint8_t>(codec.kind()),
          static_cast<uint8_t>(compressed ? codec.mant_bits() : 0),
          static_cast<uint8_t>(compressed ? codec.exp_bits() : 0),
          // codec_mode changes allreduce and reduce_scatter, not allgather
          static_cast<uint8_t>(compressed && coll != Collective::allgather && codec_owner),
          static_cast<uint32_t>(compressed ? codec.block() : 0),
          root,
          count};
}

void set_list_layout(Descriptor& d, uint32_t digest) {
  if (d.coll == static_cast<uint8_t>(Collective::broadcast))
    d.codec_block = digest;
  else
    d.root = digest;
}

uint32_t list_layout(const Descriptor& d) {
  const auto coll = static_cast<Collective>(d.coll);
  if (coll == Collective::broadcast) return static_cast<CodecKind>(d.codec) == CodecKind::identity ? d.codec_block : 0;
  const bool unrooted = coll == Collective::allreduce || coll == Collective::reduce_scatter ||
                        coll == Collective::allgather;
  return unrooted && d.root > 0 ? static_cast<uint32_t>(d.root) : 0;
}

std::string describe(const Descriptor& d) {
  // Every code is range-checked before it names anything: the bytes came from the network.
  if (d.magic != kDescriptorMagic || d.coll >= kCollectives || d.dtype > static_cast<uint8_t>(DataType::i64) ||
      d.op > static_cast<uint8_t>(ReduceOp::avg) || d.algo > static_cast<uint8_t>(kLastAlgorithm))
    return "a corrupted or foreign message";
  auto coll = static_cast<Collective>(d.coll);
  std::string s = std::string(collective_name(coll)) + "(count=" + std::to_string(d.count) + ", " +
                  std::string(dtype_name(static_cast<DataType>(d.dtype)));
  if (coll == Collective::allreduce || coll == Collective::reduce_scatter || coll == Collective::reduce)
    s += ", op=" + std::string(op_name(static_cast<ReduceOp>(d.op)));
  if (coll != Collective::barrier) s += ", algo=" + std::string(algorithm_name(static_cast<Algorithm>(d.algo)));
  if (const auto kind = static_cast<CodecKind>(d.codec); kind != CodecKind::identity) {
    std::string name = "kind " + std::to_string(d.codec);
    for (const std::string& preset : Codec::names())
      if (Codec::parse(preset).kind() == kind) name = preset;
    if (kind == CodecKind::bfp)
      name = "bfp:block=" + std::to_string(d.codec_block) + ",mant=" + std::to_string(d.codec_mant) +
             ",exp=" + std::to_string(d.codec_exp);
    s += ", codec=" + name;
    if (coll == Collective::allreduce || coll == Collective::reduce_scatter)
      s += std::string(", codec_mode=") + (d.codec_owner ? "owner" : "hop");
  }
  if (coll == Collective::broadcast || coll == Collective::reduce) s += ", root=" + std::to_string(d.root);
  if (const uint32_t layout = list_layout(d)) {
    char digest[16];
    std::snprintf(digest, sizeof digest, "%08x", layout);
    s += std::string(", a list of counts digest ") + digest;
  }
  return s + ")";
}

std::string disagreement_text(uint64_t seq, int rank, const Descriptor& mine, int peer, const Descriptor& theirs) {
  const uint64_t call = call_of(theirs, seq);
  std::string as;
  if (call > seq)
    as = " as its call #" + std::to_string(call) + " (it is ahead: it made call #" + std::to_string(seq) +
         " with no message to this rank, as a call of no elements does)";
  else if (call < seq)
    as = " in its call #" + std::to_string(call) + " (this rank's call #" + std::to_string(call) +
         " took no message from it: the ranks disagreed on that call, on its count (one of no elements sends "
         "nothing) or its root, for one)";
  return std::string(kMarker) + std::to_string(seq) + ": rank(s) " + std::to_string(rank) + " called " +
         describe(mine) + "; rank(s) " + std::to_string(peer) + " called " + describe(theirs) + as + ";" +
         std::string(kHow);
}

uint64_t call_of(const Descriptor& d, uint64_t seq) {
  const auto ahead = static_cast<int16_t>(static_cast<uint16_t>(d.call - static_cast<uint16_t>(seq)));
  return ahead < 0 && seq < static_cast<uint64_t>(-ahead) ? seq : seq + static_cast<uint64_t>(int64_t{ahead});
}

Disagreement::Disagreement(const Task& task, int from, const Descriptor& got)
    : CommError(disagreement_text(task.seq, task.rank, task.desc, from, got)), seq(task.seq), peer(from), theirs(got) {}

void publish_call(Store& store, uint64_t seq, int rank, const Descriptor* d) {
  try {
    store.set("call/" + std::to_string(seq) + "/" + std::to_string(rank), d ? hex(*d) : "unknown");
  } catch (const std::exception&) {  // the store is gone: each rank reports what it knows
  }
}

bool disagreement_call(const std::string& error, uint64_t& seq) {
  const size_t at = error.find(kMarker);
  if (at == std::string::npos) return false;
  seq = std::strtoull(error.c_str() + at + kMarker.size(), nullptr, 10);
  return true;
}

std::string disagreement_report(Store& store, int size, uint64_t seq, std::chrono::milliseconds wait) {
  const std::string prefix = "call/" + std::to_string(seq) + "/";
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::map<std::string, std::string> groups;  // call -> ranks that made it
  for (int p = 0; p < size; ++p) {
    std::string what = "no report (it did not fail, or failed elsewhere)";
    try {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline -
                                                                               std::chrono::steady_clock::now());
      Descriptor d{};
      if (unhex(store.get(prefix + std::to_string(p), std::max(left, std::chrono::milliseconds(1))), d))
        what = describe(d);
    } catch (const std::exception&) {
    }
    groups[what] += (groups[what].empty() ? "" : ",") + std::to_string(p);
  }
  size_t known = groups.size();
  for (const auto& [what, ranks] : groups) known -= what.starts_with("no report");
  if (known < 2) return "";  // the store is gone or too slow: the pairwise report is all there is
  std::string msg = "ranks disagree on the collective call (#" + std::to_string(seq) + "):";
  for (const auto& [what, ranks] : groups) msg += " rank(s) " + ranks + " called " + what + ";";
  return msg + std::string(kHow);
}

}  // namespace smartcoll
