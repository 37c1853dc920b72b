#include "smartcoll/store.h"

#include <poll.h>
#include <unistd.h>

#include <array>
#include <exception>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "smartcoll/types.h"
#include "store/protocol.h"
#include "store/server.h"
#include "transport/socket.h"

namespace smartcoll {

namespace {

std::string timeout_message(const std::string& key, std::chrono::milliseconds timeout) {
  return "rendezvous timed out after " + std::to_string(timeout.count() / 1000.0) + " s waiting for key '" + key +
         "': not every rank has started (check WORLD_SIZE and that all ranks use the same MASTER_ADDR/MASTER_PORT)";
}

}  // namespace

std::optional<std::string> Store::check(const std::string& key) {
  // Stores without a connection to lose: a get that gives up at once.
  try {
    return get(key, std::chrono::milliseconds(0));
  } catch (const CommError&) {
    return std::nullopt;
  }
}

void MemoryStore::set(const std::string& key, const std::string& value) {
  {
    std::lock_guard lock(mu_);
    values_[key] = value;
  }
  cv_.notify_all();
}

std::string MemoryStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return values_.count(key) > 0; }))
    throw StoreTimeout(timeout_message(key, timeout));
  return values_[key];
}

size_t MemoryStore::erase_prefix(const std::string& prefix) {
  std::lock_guard lock(mu_);
  size_t erased = 0;
  for (auto it = values_.lower_bound(prefix); it != values_.end() && it->first.starts_with(prefix); ++erased)
    it = values_.erase(it);
  return erased;
}

size_t MemoryStore::size() {
  std::lock_guard lock(mu_);
  return values_.size();
}

FileStore::FileStore(std::string dir) : dir_(std::move(dir)) { std::filesystem::create_directories(dir_); }

std::string FileStore::path_of(const std::string& key) const {
  std::string name;
  for (char c : key) name += std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' ? c : '_';
  return dir_ + "/" + name;
}

void FileStore::set(const std::string& key, const std::string& value) {
  std::string path = path_of(key);
  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary);
    out << value;
    if (!out) throw CommError("cannot write file store entry " + tmp);
  }
  std::filesystem::rename(tmp, path);  // readers see the whole value or nothing
}

std::string FileStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  auto deadline = net::Clock::now() + timeout;
  std::string path = path_of(key);
  for (;;) {
    std::ifstream in(path, std::ios::binary);
    if (in) {
      std::stringstream ss;
      ss << in.rdbuf();
      return ss.str();
    }
    if (net::Clock::now() > deadline)
      throw StoreTimeout(timeout_message(key, timeout) + " (file store " + dir_ + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

size_t FileStore::erase_prefix(const std::string& prefix) {
  // Names are keys with other characters than [A-Za-z0-9.-] as '_' (path_of): the prefix's name begins every
  // name of a key that begins with the prefix. A value still being written (its temporary file) is left alone.
  const std::string name = std::filesystem::path(path_of(prefix)).filename().string();
  size_t erased = 0;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string file = entry.path().filename().string();
    if (file.starts_with(name) && file.find(".tmp.") == std::string::npos && std::filesystem::remove(entry.path(), ec))
      ++erased;
  }
  return erased;
}

namespace {

// A connection the server has closed (after it idled) is replaced on the next request, briefly: if the server is
// gone, a rank reporting a failure must not wait a whole connect timeout to learn it.
constexpr auto kReconnectWindow = std::chrono::seconds(1);
constexpr auto kSetTimeout = std::chrono::seconds(60);

uint16_t checked_port(int port) {
  if (port < 0 || port > 65535)
    throw InvalidArgument("TCP store port " + std::to_string(port) + " is outside 0..65535");
  return static_cast<uint16_t>(port);
}

// True when the server has closed an idle connection or sent on it unasked: either way it is not usable.
bool unusable(int fd) {
  pollfd p{fd, POLLIN | POLLRDHUP, 0};
  return ::poll(&p, 1, 0) != 0;
}

}  // namespace

TcpStore::TcpStore(const std::string& host, int port, bool serve, std::chrono::milliseconds connect_timeout,
                   std::string secret, const StoreLimits& limits)
    : port_(checked_port(port)), ip_(net::resolve_ipv4(host)), secret_(std::move(secret)), limits_(limits) {
  if (serve) {
    // Listen on all addresses: MASTER_ADDR may name this host by an address other ranks reach it through.
    net::Fd listener;
    try {
      listener = net::listen_on("0.0.0.0", port_, 1024);
    } catch (const CommError& e) {
      throw CommError(std::string(e.what()) + " (rank 0 serves the rendezvous store on MASTER_PORT " +
                      std::to_string(port_) + ": another job or program may hold it; choose another port, e.g. "
                      "smartcoll run --master-port, or leave it unset for a free one)");
    }
    port_ = net::bound_port(listener.get());
    server_ = std::make_unique<store::Server>(std::move(listener), secret_, limits_);
  }
  fd_ = connect_and_greet(net::Clock::now() + connect_timeout);
}

std::shared_ptr<Store> open_store(const std::string& locator, std::chrono::milliseconds connect_timeout) {
  std::istringstream in(locator);
  std::string kind, where;
  in >> kind >> std::ws;
  if (kind == "file" && std::getline(in, where) && !where.empty()) return std::make_shared<FileStore>(where);
  int port = -1;
  if (kind == "tcp" && in >> where >> port) {
    std::string secret;
    std::getline(in >> std::ws, secret);
    return std::make_shared<TcpStore>(where, port, false, connect_timeout, secret);
  }
  throw InvalidArgument("cannot read a store locator of kind '" + kind +  // the rest may hold a secret
                        "': expected 'tcp IP PORT SECRET' or 'file DIR'");
}

TcpStore::~TcpStore() { close(); }

void TcpStore::close() {
  std::unique_ptr<store::Server> server;
  {
    std::lock_guard lock(mu_);
    closed_ = true;
    disconnect();
    server = std::move(server_);
  }
  server.reset();  // outside the lock: its linger must not hold up a concurrent call's error
}

std::string TcpStore::where() const { return ip_ + ":" + std::to_string(port_); }

void TcpStore::disconnect() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

StoreServerStats TcpStore::server_stats() const { return server_ ? server_->stats() : StoreServerStats{}; }

// Connects and completes the handshake (docs/wire-format.md): every failure names the store and what to check.
int TcpStore::connect_and_greet(net::Clock::time_point deadline) const {
  net::Fd fd = net::connect_to({ip_, port_}, deadline);
  const std::string store = "the store at " + where();
  uint8_t greeting = 0;
  try {
    net::recv_all(fd.get(), &greeting, 1, deadline, "the store's greeting");
  } catch (const CommError& e) {
    throw CommError(store + " did not greet this client: " + e.what() +
                    " (is it a smartcoll store? is it at its client limit?)");
  }
  if (greeting == store::kGreetingOpen) {
    if (!secret_.empty())
      throw CommError(store + " has no shared secret but this rank has one: SMARTCOLL_SECRET must be the same on "
                              "every rank, rank 0 included");
    return fd.release();
  }
  if (greeting != store::kGreetingSecret)
    throw CommError(store + " is not a smartcoll store (its greeting is byte " + std::to_string(greeting) + ")");
  if (secret_.empty())
    throw CommError(store + " refused this rank: it requires a shared secret and this rank has none (set "
                            "SMARTCOLL_SECRET, the same on every rank)");
  std::array<uint8_t, store::kNonceSize> nonce;
  uint8_t verdict = store::kRefused;
  try {
    net::recv_all(fd.get(), nonce.data(), nonce.size(), deadline, "the store's challenge");
    const Digest proof = store::handshake_proof(secret_, nonce);
    net::send_all(fd.get(), proof.data(), proof.size(), deadline, "the secret handshake");
    net::recv_all(fd.get(), &verdict, 1, deadline, "the store's verdict");
  } catch (const CommError& e) {
    // A server that rejects the proof may close before its verdict arrives: that is a refusal as well. One that
    // stays silent until the deadline is not.
    if (net::Clock::now() >= deadline)
      throw CommError(store + " did not finish the secret handshake in time: " + e.what() +
                      " (is it overloaded, or not a smartcoll store?)");
  }
  if (verdict != store::kAccepted)
    throw CommError(store + " refused this rank: wrong or missing shared secret (SMARTCOLL_SECRET must be the "
                            "same on every rank)");
  return fd.release();
}

int TcpStore::connection(net::Clock::time_point deadline) {
  if (closed_) throw CommError("the store at " + where() + " is closed: this process closed it (a communicator "
                               "that used it was closed); create a new communicator");
  if (fd_ >= 0 && !unusable(fd_)) return fd_;
  disconnect();
  fd_ = connect_and_greet(std::min(deadline, net::Clock::now() + kReconnectWindow));
  return fd_;
}

void TcpStore::set(const std::string& key, const std::string& value) {
  if (key.size() > limits_.max_key || value.size() > limits_.max_value)
    throw InvalidArgument("store entry '" + key.substr(0, 64) + "' is over the store's limits (key " +
                          std::to_string(key.size()) + " of at most " + std::to_string(limits_.max_key) +
                          " bytes, value " + std::to_string(value.size()) + " of at most " +
                          std::to_string(limits_.max_value) + ")");
  std::lock_guard lock(mu_);
  const auto deadline = net::Clock::now() + kSetTimeout;
  const std::string msg = store::encode_request({store::Op::set, key, value});
  try {
    net::send_all(connection(deadline), msg.data(), msg.size(), deadline, "store set");
  } catch (const CommError&) {
    disconnect();
    throw;
  }
}

std::string TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::lock_guard lock(mu_);
  return *ask(true, key, timeout);
}

std::optional<std::string> TcpStore::check(const std::string& key) {
  std::lock_guard lock(mu_);
  // Answered at once: the time limit only bounds a server that has stopped answering.
  return ask(false, key, std::chrono::seconds(5));
}

std::optional<std::string> TcpStore::peek(const std::string& key) {
  std::unique_lock lock(mu_, std::try_to_lock);
  if (!lock.owns_lock()) return std::nullopt;  // another thread's request is on the connection
  return ask(false, key, std::chrono::seconds(5));
}

size_t TcpStore::erase_prefix(const std::string& prefix) {
  if (prefix.size() > limits_.max_key)
    throw InvalidArgument("store key prefix '" + prefix.substr(0, 64) + "...' has " + std::to_string(prefix.size()) +
                          " bytes, over the limit of " + std::to_string(limits_.max_key));
  std::lock_guard lock(mu_);
  // Answered at once: the time limit only bounds a server that has stopped answering.
  const auto deadline = net::Clock::now() + std::chrono::seconds(5);
  const std::string msg = store::encode_request({store::Op::erase, prefix, {}});
  uint8_t count[4];
  try {
    const int fd = connection(deadline);
    net::send_all(fd, msg.data(), msg.size(), deadline, "store delete");
    net::recv_all(fd, count, 4, deadline, "the store's answer to a delete");
  } catch (const CommError& e) {
    disconnect();
    throw CommError("the store at " + where() + " did not delete the keys under '" + prefix + "': " + e.what() +
                    " (a server of smartcoll 0.1.0 cannot delete: it closes the connection at the request)");
  }
  return store::load_u32(count);
}

std::optional<std::string> TcpStore::ask(bool wait, const std::string& key, std::chrono::milliseconds timeout) {
  if (key.size() > limits_.max_key)
    throw InvalidArgument("store key '" + key.substr(0, 64) + "...' has " + std::to_string(key.size()) +
                          " bytes, over the limit of " + std::to_string(limits_.max_key));
  const auto deadline = net::Clock::now() + timeout;
  // After a failure the reply may still come; on this connection it would be read as the answer to the next get.
  auto lost = [&](const CommError& e) {
    disconnect();
    // (poll's millisecond rounding can end a wait a moment before the deadline)
    if (dynamic_cast<const net::TimedOut*>(&e) || net::Clock::now() >= deadline)
      return std::make_exception_ptr(StoreTimeout(timeout_message(key, timeout)));
    return std::make_exception_ptr(CommError(std::string(e.what()) + " (the rendezvous server on rank 0 is gone)"));
  };
  const int fd = connection(deadline);
  const std::string msg = store::encode_request({wait ? store::Op::get : store::Op::check, key, {}});
  const std::string what = "store value for '" + key + "'";
  uint8_t len[4];
  try {
    net::send_all(fd, msg.data(), msg.size(), deadline, "store get");
    net::recv_all(fd, len, 4, deadline, what);
  } catch (const CommError& e) {
    std::rethrow_exception(lost(e));
  }
  const uint32_t value_len = store::load_u32(len);
  if (!wait && value_len == store::kAbsent) return std::nullopt;
  if (value_len > limits_.max_value) {
    disconnect();
    throw CommError("the store at " + where() + " announced a value of " + std::to_string(value_len) +
                    " bytes for '" + key + "', over the limit of " + std::to_string(limits_.max_value) +
                    ": it is not a smartcoll store, or a broken one");
  }
  std::string value(value_len, '\0');
  try {
    net::recv_all(fd, value.data(), value_len, deadline, what);
  } catch (const CommError& e) {
    std::rethrow_exception(lost(e));
  }
  return value;
}

}  // namespace smartcoll
