#include "coll/schedule.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <string>

#include "coll/segmented.h"
#include "core/agreement.h"
#include "core/engine.h"
#include "smartcoll/reduce.h"

namespace smartcoll::coll {

int mod(int a, int n) { return ((a % n) + n) % n; }

Builder::Builder(Task& task, const Context& context, std::shared_ptr<const ReduceSpec> reduce_spec)
    : cx(context), spec(*reduce_spec), task_(task),
      said_(static_cast<size_t>(context.size) * context.streams * 2, 0) {
  task.state = std::move(reduce_spec);
}

Lane& Builder::lane(int stream) {
  if (lane_of_stream_.empty()) lane_of_stream_.assign(static_cast<size_t>(cx.streams), -1);
  int& i = lane_of_stream_[static_cast<size_t>(stream)];
  if (i < 0) {
    i = static_cast<int>(task_.lanes.size());
    Lane l;
    l.stream = stream;
    l.after = &after_receive;
    l.ctx = &spec;
    task_.lanes.push_back(std::move(l));
  }
  return task_.lanes[static_cast<size_t>(i)];
}

int32_t Builder::add(int stream, Op op, std::initializer_list<int32_t> deps) {
  Lane& l = lane(stream);
  size_t k = 0;
  for (int32_t d : deps)
    if (d >= 0) op.deps[k++] = d;  // at most two: join() gathers more
  if (op.kind == Op::Kind::send || op.kind == Op::Kind::recv) {
    uint8_t& said = said_[(static_cast<size_t>(op.peer) * cx.streams + stream) * 2 + (op.kind == Op::Kind::send)];
    op.header = task_.check && !said;
    said = 1;
  }
  l.ops.push_back(op);
  return static_cast<int32_t>(l.ops.size() - 1);
}

int32_t Builder::send(int stream, int peer, const char* buf, size_t len, std::initializer_list<int32_t> deps) {
  Op op;
  op.kind = Op::Kind::send;
  op.peer = peer;
  op.buf = const_cast<char*>(buf);  // sends only read it
  op.len = len;
  return add(stream, op, deps);
}

int32_t Builder::recv(int stream, int peer, char* buf, size_t len, std::initializer_list<int32_t> deps, Finish finish,
                      char* dst, const char* local, size_t elems, bool divide, uint8_t* enc) {
  Op op;
  op.kind = Op::Kind::recv;
  op.peer = peer;
  op.buf = buf;
  op.len = len;
  op.finish = finish;
  op.dst = dst;
  op.local = local;
  op.elems = elems;
  op.divide = divide;
  op.enc = enc;
  return add(stream, op, deps);
}

int32_t Builder::compute(int stream, std::function<void()> fn, std::initializer_list<int32_t> deps) {
  Op op;
  op.kind = Op::Kind::compute;
  op.compute = static_cast<uint32_t>(task_.computes.size());
  task_.computes.push_back(std::move(fn));
  return add(stream, op, deps);
}

int32_t Builder::copy(int stream, char* dst, const char* src, size_t bytes, std::initializer_list<int32_t> deps) {
  Op op;
  op.kind = Op::Kind::copy;
  op.dst = dst;
  op.local = src;
  op.len = bytes;
  return add(stream, op, deps);
}

int32_t Builder::join(int stream, const std::vector<int32_t>& ops) {
  int32_t last = -1;
  for (int32_t op : ops) last = compute(stream, [] {}, {last, op});
  return last;
}

Collective Builder::collective() const { return static_cast<Collective>(task_.desc.coll); }

uint32_t Builder::compared_layout() const { return task_.check ? list_layout(task_.desc) : 0; }

void Builder::exclusive(std::function<void()> body, std::function<bool()> lanes_instead, Algorithm lanes_algo) {
  task_.exclusive = [body = std::move(body)](std::chrono::steady_clock::time_point) {
    body();
    return true;
  };
  task_.lanes_instead = std::move(lanes_instead);
  task_.lanes_algo = lanes_algo;
}

void Builder::exclusive_until(std::function<bool(std::chrono::steady_clock::time_point until)> body) {
  task_.exclusive = std::move(body);
}

char* Builder::scratch(size_t bytes) {
  task_.scratch.emplace_back(cx.pool, bytes);
  return task_.scratch.back().data();
}

namespace {

// The final sum every rank gets (kCodecReduceShare): dst = decode(enc = encode(local + decode(wire)), divided for
// avg before the encode). Run in chunks of whole blocks that stay in L1 between the four steps, so dst is written
// to memory once instead of three times; the steps and their bits are those of the whole segment at once.
void reduce_share(const ReduceSpec& spec, const uint8_t* wire, const float* local, float* dst, uint8_t* enc,
                  size_t elems, bool divide) {
  const Codec& codec = spec.codec;
  const size_t block = codec.block_elems(), chunk = std::max(block, 4096 / block * block);
  for (size_t i = 0; i < elems; i += chunk) {
    const size_t n = std::min(chunk, elems - i), at = codec.encoded_size(i);
    codec.decode_add(wire + at, n, local + i, dst + i);
    if (divide) scale_divide(DataType::f32, dst + i, n, spec.divisor);
    codec.encode(dst + i, n, enc + at, dst + i);
  }
}

// A receive's finish step on real addresses.
void finish_receive(const ReduceSpec& spec, const Op& op, const char* data) {
  const auto* wire = reinterpret_cast<const uint8_t*>(data);
  auto* dst = reinterpret_cast<float*>(op.dst);
  auto* local = reinterpret_cast<const float*>(op.local);
  const Codec& codec = spec.codec;
  if (op.finish == kCodecReduceShare) return reduce_share(spec, wire, local, dst, op.enc, op.elems, op.divide);
  switch (op.finish) {
    case kReduce: reduce(spec.dtype, spec.op, op.dst, op.local, data, op.elems); break;
    case kReduceFromLeft: reduce(spec.dtype, spec.op, op.dst, data, op.local, op.elems); break;
    case kCodecReduceEncode: codec.decode_add_encode(wire, op.elems, local, op.enc, nullptr); break;
    case kCodecReduce: codec.decode_add(wire, op.elems, local, dst); break;
    case kCodecDecode: codec.decode(wire, op.elems, dst); break;
    case kCheckCount: {
      uint64_t sent;
      std::memcpy(&sent, data, sizeof sent);
      if (sent != op.elems)
        throw CommError("alltoallv: rank " + std::to_string(op.peer) + " sends " + std::to_string(sent) +
                        " elements to this rank, whose recvcounts[" + std::to_string(op.peer) + "] is " +
                        std::to_string(op.elems) + "; rank i's sendcounts[j] must equal rank j's recvcounts[i]");
      break;
    }
    default: break;
  }
  if (op.divide) scale_divide(spec.dtype, op.dst, op.elems, spec.divisor);
}

}  // namespace

void after_receive(const void* ctx, const Op& op, const char* data) {
  const auto& spec = *static_cast<const ReduceSpec*>(ctx);
  const Views* views = spec.views.get();
  if (!views) return finish_receive(spec, op, data);
  // A list call (coll/segmented.h): the operand and the result may lie in its views.
  const size_t esize = dtype_size(spec.dtype), bytes = op.elems * esize;
  if (!spec.wire()) {  // raw elements: reduced piece by piece, straight into the list's buffers
    for_each_run(views, op.dst, op.local, bytes, [&](char* dst, const char* local, size_t off, size_t n) {
      Op part = op;
      part.dst = dst;
      part.local = local;
      part.elems = n / esize;
      finish_receive(spec, part, data + off);
    });
    return;
  }
  // A codec works on whole blocks, which may straddle two buffers: a staging of one segment each.
  thread_local std::vector<char> local_stage, dst_stage;
  Op staged = op;
  staged.local = gather_range(views, op.local, bytes, local_stage);
  staged.dst = write_range(views, op.dst, bytes, dst_stage);
  finish_receive(spec, staged, data);
  if (op.divide || op.finish == kCodecReduce || op.finish == kCodecReduceShare || op.finish == kCodecDecode)
    scatter_range(views, op.dst, staged.dst, bytes);
}

namespace {

Chunks make_chunks(const std::vector<size_t>& lens, size_t esize, const Codec* codec) {
  Chunks c;
  size_t pos = 0, wire = 0;
  for (size_t len : lens) {
    const size_t wlen = codec ? codec->encoded_size(len) : len * esize;
    c.off.push_back(pos);
    c.len.push_back(len);
    c.wire_off.push_back(wire);
    c.wire_len.push_back(wlen);
    pos += len;
    wire += wlen;
  }
  return c;
}

}  // namespace

Chunks split_vector(size_t count, int n, size_t esize, const Codec* codec) {
  const size_t unit = codec ? codec->block_elems() : 1, units = (count + unit - 1) / unit;
  std::vector<size_t> lens;
  size_t pos = 0;
  for (int i = 0; i < n; ++i) {
    const size_t elems = std::min(count - pos, (units / n + (static_cast<size_t>(i) < units % n ? 1 : 0)) * unit);
    lens.push_back(elems);
    pos += elems;
  }
  return make_chunks(lens, esize, codec);
}

Chunks equal_blocks(size_t per_rank, int n, size_t esize, const Codec* codec) {
  return make_chunks(std::vector<size_t>(static_cast<size_t>(n), per_rank), esize, codec);
}

// segment_bytes counts bytes on the wire: a compressed segment holds ratio x more elements, so that what each
// message costs (a system call, an op of the engine, a wake-up of the peer) is spread over as many wire bytes as
// without a codec. (bfp16 at 256 KiB per segment on the wire: ~1 MiB of float32 per segment.)
size_t segment_elems(size_t segment_bytes, size_t esize, const Codec* codec) {
  if (!codec) return std::max<size_t>(1, segment_bytes / esize);
  const size_t unit = codec->block_elems();
  return std::max<size_t>(1, segment_bytes / codec->encoded_size(unit)) * unit;
}

std::vector<char*> chunk_pointers(char* base, const Chunks& ch, size_t esize) {
  std::vector<char*> p;
  for (size_t off : ch.off) p.push_back(base + off * esize);
  return p;
}

std::pair<int, int> host_layout_shape(const std::vector<int>& hosts) {
  std::map<int, int> count;
  for (int h : hosts) ++count[h];
  const int per_host = count.empty() ? 0 : count.begin()->second;
  for (const auto& [h, k] : count)
    if (k != per_host) return {static_cast<int>(count.size()), 0};
  return {static_cast<int>(count.size()), per_host};
}

bool hosts_interleaved(const std::vector<int>& hosts) {
  std::set<int> left;  // hosts whose run of ranks has ended
  for (size_t r = 1; r < hosts.size(); ++r) {
    if (hosts[r] == hosts[r - 1]) continue;
    left.insert(hosts[r - 1]);
    if (left.count(hosts[r])) return true;
  }
  return false;
}

std::vector<std::vector<int>> ranks_by_host(const std::vector<int>& hosts) {
  std::map<int, std::vector<int>> by_host;  // host -> its ranks, ascending
  for (int r = 0; r < static_cast<int>(hosts.size()); ++r) by_host[hosts[static_cast<size_t>(r)]].push_back(r);
  std::vector<std::vector<int>> out;
  for (auto& [h, ranks] : by_host) out.push_back(std::move(ranks));
  return out;
}

namespace {
Layout layout_of(const std::vector<std::vector<int>>& by_host, int rank) {
  Layout l;
  for (const std::vector<int>& ranks : by_host) {
    const auto at = std::find(ranks.begin(), ranks.end(), rank);
    if (at == ranks.end()) continue;
    l.local.members = ranks;
    l.local.pos = static_cast<int>(at - ranks.begin());
  }
  for (const std::vector<int>& ranks : by_host) {
    if (ranks == l.local.members) l.cross.pos = static_cast<int>(l.cross.members.size());
    l.cross.members.push_back(ranks[static_cast<size_t>(l.local.pos)]);
  }
  return l;
}
}  // namespace

HostGrid host_grid(const std::vector<int>& hosts, int rank) {
  std::vector<std::vector<int>> by_host = ranks_by_host(hosts);
  HostGrid g{layout_of(by_host, rank), std::move(by_host), 0, 0, 0, 0};
  g.k = static_cast<int>(g.at.local.members.size()), g.hosts = static_cast<int>(g.at.cross.members.size());
  g.i = g.at.local.pos, g.h = g.at.cross.pos;
  return g;
}

HostGrid::Chains HostGrid::chains(int root) const {
  Chains c{0, 0, false, 0, 0};
  for (int g = 0; g < hosts; ++g)
    for (int j = 0; j < k; ++j)
      if (rank_at(g, j) == root) c.g0 = g, c.i0 = j;
  c.across = i == c.i0;
  c.cpos = mod(h - c.g0, hosts), c.lpos = mod(i - c.i0, k);
  return c;
}

std::vector<int32_t> RingOps::received(int c, int first, int n) const {
  const int k = mod(first - 1 - c, n);  // the step whose receive is chunk first - k - 1
  if (static_cast<size_t>(k) >= step_recvs.size()) return {};
  const size_t end = static_cast<size_t>(k) + 1 < step_recvs.size() ? step_recvs[static_cast<size_t>(k) + 1] : recvs.size();
  return {recvs.begin() + static_cast<std::ptrdiff_t>(step_recvs[static_cast<size_t>(k)]),
          recvs.begin() + static_cast<std::ptrdiff_t>(end)};
}

RingOps ring(Builder& b, int steps, int first, const std::function<Step(int)>& kind_of, const Chunks& ch,
             const RingBuffers& buf, int streams, int32_t ready, const Group& group,
             const std::vector<int32_t>& step_ready) {
  const bool world = group.members.empty();
  const int n = world ? b.cx.size : static_cast<int>(group.members.size());
  const int r = world ? b.cx.rank : group.pos;
  auto rank_of = [&](int member) { return world ? member : group.members[static_cast<size_t>(member)]; };
  const int next = rank_of(mod(r + 1, n)), prev = rank_of(mod(r - 1, n));
  RingOps ops;
  const size_t esize = dtype_size(b.spec.dtype);
  const Codec* codec = b.spec.wire();
  const size_t seg = segment_elems(b.cx.segment_bytes, esize, codec);
  if (streams == 0) streams = b.cx.streams;
  if (ready >= 0 || !step_ready.empty()) streams = 1;  // they are ops of lane 0
  auto wire_of = [&](size_t elems) { return codec ? codec->encoded_size(elems) : elems * esize; };
  // The receive of segment j at the previous step, per segment index (what the send of segment j forwards).
  std::vector<int32_t> prev_recv, this_recv;
  size_t staging_bytes = 0;
  for (size_t w : ch.wire_len) staging_bytes = std::max(staging_bytes, std::min(w, wire_of(seg)));
  std::vector<char*> staging(static_cast<size_t>(streams), nullptr);
  for (int k = 0; k < steps; ++k) {
    const int sc = mod(first - k, n), rc = mod(first - k - 1, n);
    const Step kind = kind_of(k);
    const char* src;
    if (codec)
      src = reinterpret_cast<const char*>(buf.enc) + ch.wire_off[sc];
    else
      src = k == 0 ? (kind == Step::gather ? buf.acc[sc] : buf.in + ch.off[sc] * esize) : buf.acc[sc];
    size_t j = 0;
    for_each_segment(ch.len[sc], seg, [&](size_t off, size_t len) {
      const int s = static_cast<int>(j % static_cast<size_t>(streams));
      int32_t dep = k == 0 ? ready : prev_recv[j];
      if (k == 0 && codec && !buf.pre_encoded) {
        const char* values = (kind == Step::gather ? buf.acc[sc] : buf.in + ch.off[sc] * esize) + off * esize;
        uint8_t* to = buf.enc + ch.wire_off[sc] + wire_of(off);
        const Views* views = b.spec.views.get();  // the task keeps them
        dep = b.compute(s, [codec, values, len, to, views, esize] {
          thread_local std::vector<char> stage;
          codec->encode(reinterpret_cast<const float*>(gather_range(views, values, len * esize, stage)), len, to);
        }, {dep});
      }
      ops.sends.push_back(b.send(s, next, src + wire_of(off), wire_of(len), {dep}));
      ++j;
    });
    this_recv.clear();
    j = 0;
    for_each_segment(ch.len[rc], seg, [&](size_t off, size_t len) {
      const int s = static_cast<int>(j % static_cast<size_t>(streams));
      char* dst = buf.acc[rc] + off * esize;
      const char* local = kind == Step::gather ? nullptr : buf.in + (ch.off[rc] + off) * esize;
      uint8_t* enc = codec ? buf.enc + ch.wire_off[rc] + wire_of(off) : nullptr;
      Finish finish = kNone;
      char* land;
      if (kind == Step::gather) {
        land = codec ? reinterpret_cast<char*>(enc) : dst;
        finish = codec ? kCodecDecode : kNone;
      } else {
        if (!staging[static_cast<size_t>(s)]) staging[static_cast<size_t>(s)] = b.scratch(staging_bytes);
        land = staging[static_cast<size_t>(s)];
        finish = !codec ? kReduce : kind == Step::reduce ? kCodecReduceEncode
                                  : buf.share_final      ? kCodecReduceShare
                                                         : kCodecReduce;
      }
      const bool divide = kind == Step::last_reduce && b.spec.op == ReduceOp::avg;
      const int32_t step_dep = static_cast<size_t>(k) < step_ready.size() ? step_ready[static_cast<size_t>(k)] : -1;
      this_recv.push_back(b.recv(s, prev, land, wire_of(len), {ready, step_dep}, finish, dst, local, len, divide, enc));
      ++j;
    });
    ops.step_recvs.push_back(ops.recvs.size());
    ops.recvs.insert(ops.recvs.end(), this_recv.begin(), this_recv.end());
    prev_recv.swap(this_recv);
  }
  return ops;
}

}  // namespace smartcoll::coll
