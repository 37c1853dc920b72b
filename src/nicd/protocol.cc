#include "nicd/protocol.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "smartcoll/comm.h"

namespace smartcoll::nicd {

namespace {

class Writer {
 public:
  explicit Writer(Type t) {
    u32(kMagic);
    u16(kVersion);
    u16(static_cast<uint16_t>(t));
  }
  void u8(uint8_t v) { raw(&v, 1); }
  void u16(uint16_t v) { raw(&v, 2); }
  void u32(uint32_t v) { raw(&v, 4); }
  void u64(uint64_t v) { raw(&v, 8); }
  void i32(int32_t v) { raw(&v, 4); }
  void f64(double v) { raw(&v, 8); }
  void str(const std::string& s) {  // longer texts (error messages) are cut to what a reader accepts
    const size_t n = std::min(s.size(), kMaxText);
    u32(static_cast<uint32_t>(n));
    out.append(s, 0, n);
  }
  std::string out;

 private:
  void raw(const void* p, size_t n) { out.append(static_cast<const char*>(p), n); }  // x86-64: little endian
};

class Reader {
 public:
  Reader(std::string_view msg, Type expect) : msg_(msg) {
    if (type_of(msg) != expect)
      throw ProtocolError{"expected message type " + std::to_string(static_cast<int>(expect)) + ", got " +
                          std::to_string(static_cast<int>(type_of(msg)))};
    at_ = 8;
  }
  uint8_t u8() { return get<uint8_t>(); }
  uint32_t u32() { return get<uint32_t>(); }
  uint64_t u64() { return get<uint64_t>(); }
  int32_t i32() { return get<int32_t>(); }
  double f64() { return get<double>(); }
  std::string str() {
    const uint32_t n = u32();
    if (n > kMaxText) throw ProtocolError{"a text field of " + std::to_string(n) + " bytes (at most " +
                                          std::to_string(kMaxText) + ")"};
    need(n);
    std::string s(msg_.substr(at_, n));
    at_ += n;
    return s;
  }
  void end() const {
    if (at_ != msg_.size())
      throw ProtocolError{std::to_string(msg_.size() - at_) + " bytes after the last field"};
  }

 private:
  template <class T>
  T get() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, msg_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return v;
  }
  void need(size_t n) const {
    if (msg_.size() - at_ < n) throw ProtocolError{"truncated message (" + std::to_string(msg_.size()) + " bytes)"};
  }
  std::string_view msg_;
  size_t at_ = 0;
};

}  // namespace

Type type_of(std::string_view msg) {
  if (msg.size() < 8) throw ProtocolError{"a message of " + std::to_string(msg.size()) + " bytes (header: 8)"};
  if (msg.size() > kMaxMessage) throw ProtocolError{"a message of " + std::to_string(msg.size()) + " bytes"};
  uint32_t magic;
  uint16_t version, type;
  std::memcpy(&magic, msg.data(), 4);
  std::memcpy(&version, msg.data() + 4, 2);
  std::memcpy(&type, msg.data() + 6, 2);
  if (magic != kMagic) throw ProtocolError{"not a nicd message (bad magic)"};
  if (version != kVersion)
    throw ProtocolError{"protocol version " + std::to_string(version) + ", this side speaks " +
                        std::to_string(kVersion) + " (a different smartcoll version?)"};
  if (type < 1 || type > 7) throw ProtocolError{"unknown message type " + std::to_string(type)};
  return static_cast<Type>(type);
}

std::string default_socket() {
  if (const char* dir = std::getenv("XDG_RUNTIME_DIR"); dir && *dir) return std::string(dir) + "/smartcoll-nicd.sock";
  return "/tmp/smartcoll-nicd-" + std::to_string(::getuid()) + ".sock";
}

std::string encode(const Hello& m) {
  Writer w(Type::hello);
  w.i32(m.rank);
  w.i32(m.size);
  w.f64(m.timeout);
  w.f64(m.connect_timeout);
  w.str(m.job_id);
  w.str(m.store);
  w.str(m.route_hint);
  w.str(m.settings);
  w.u32(static_cast<uint32_t>(m.hosts.size()));
  for (int32_t h : m.hosts) w.i32(h);
  return w.out;
}

Hello decode_hello(std::string_view msg) {
  Reader r(msg, Type::hello);
  Hello m;
  m.rank = r.i32();
  m.size = r.i32();
  m.timeout = r.f64();
  m.connect_timeout = r.f64();
  m.job_id = r.str();
  m.store = r.str();
  m.route_hint = r.str();
  m.settings = r.str();
  const uint32_t n = r.u32();
  if (m.size < 1 || m.size > kMaxWorld) throw ProtocolError{"world size " + std::to_string(m.size)};
  if (m.rank < 0 || m.rank >= m.size) throw ProtocolError{"rank " + std::to_string(m.rank) + " of " +
                                                          std::to_string(m.size)};
  if (n != static_cast<uint32_t>(m.size))
    throw ProtocolError{"a host layout of " + std::to_string(n) + " ranks for a world of " + std::to_string(m.size)};
  if (!(m.timeout > 0 && m.timeout < 1e7) || !(m.connect_timeout > 0 && m.connect_timeout < 1e7))
    throw ProtocolError{"a timeout outside (0, 1e7) s"};
  if (m.job_id.empty()) throw ProtocolError{"an empty job id"};
  m.hosts.resize(n);
  for (int32_t& h : m.hosts) {
    h = r.i32();
    if (h < 0 || h >= m.size) throw ProtocolError{"host number " + std::to_string(h)};
  }
  r.end();
  return m;
}

std::string encode(const Ready& m) {
  Writer w(Type::ready);
  w.str(m.error);
  return w.out;
}

Ready decode_ready(std::string_view msg) {
  Reader r(msg, Type::ready);
  Ready m{r.str()};
  r.end();
  return m;
}

std::string encode(const Post& m) {
  Writer w(Type::post);
  w.u64(m.seq);
  w.u8(m.coll);
  w.u8(m.dtype);
  w.u8(m.op);
  w.i32(m.root);
  w.u64(m.count);
  w.u64(m.in);
  w.u64(m.out);
  w.str(m.codec);
  w.u64(m.in_table);
  w.u64(m.out_table);
  w.u32(m.in_pieces);
  w.u32(m.out_pieces);
  w.u32(m.layout);
  w.u64(m.blocks);
  return w.out;
}

Post decode_post(std::string_view msg) {
  Reader r(msg, Type::post);
  Post m;
  m.seq = r.u64();
  m.coll = r.u8();
  m.dtype = r.u8();
  m.op = r.u8();
  m.root = r.i32();
  m.count = r.u64();
  m.in = r.u64();
  m.out = r.u64();
  m.codec = r.str();
  m.in_table = r.u64();
  m.out_table = r.u64();
  m.in_pieces = r.u32();
  m.out_pieces = r.u32();
  m.layout = r.u32();
  m.blocks = r.u64();
  r.end();
  if (m.in_pieces > kMaxListPieces || m.out_pieces > kMaxListPieces)
    throw ProtocolError{"a list of " + std::to_string(std::max(m.in_pieces, m.out_pieces)) + " pieces (at most " +
                        std::to_string(kMaxListPieces) + ")"};
  if (m.coll >= kCollectives) throw ProtocolError{"collective " + std::to_string(m.coll)};
  if (m.dtype >= std::size(kAllDataTypes)) throw ProtocolError{"dtype " + std::to_string(m.dtype)};
  if (m.op >= std::size(kAllReduceOps)) throw ProtocolError{"op " + std::to_string(m.op)};
  if (m.count > (uint64_t{1} << 40)) throw ProtocolError{"count " + std::to_string(m.count)};
  return m;
}

std::string encode(const Done& m) {
  Writer w(Type::done);
  w.u64(m.seq);
  w.str(m.error);
  return w.out;
}

Done decode_done(std::string_view msg) {
  Reader r(msg, Type::done);
  Done m;
  m.seq = r.u64();
  m.error = r.str();
  r.end();
  return m;
}

std::string encode(const Abort& m) {
  Writer w(Type::abort);
  w.str(m.reason);
  return w.out;
}

Abort decode_abort(std::string_view msg) {
  Reader r(msg, Type::abort);
  Abort m{r.str()};
  r.end();
  return m;
}

std::string encode(Type bodiless) { return Writer(bodiless).out; }

}  // namespace smartcoll::nicd
