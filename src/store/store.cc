#include "smartcoll/store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <vector>

#include "smartcoll/types.h"
#include "transport/socket.h"

namespace smartcoll {

namespace {

std::string timeout_message(const std::string& key, std::chrono::milliseconds timeout) {
  return "rendezvous timed out after " + std::to_string(timeout.count() / 1000.0) + " s waiting for key '" + key +
         "': not every rank has started (check WORLD_SIZE and that all ranks use the same MASTER_ADDR/MASTER_PORT)";
}

}  // namespace

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
    throw CommError(timeout_message(key, timeout));
  return values_[key];
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
    if (net::Clock::now() > deadline) throw CommError(timeout_message(key, timeout) + " (file store " + dir_ + ")");
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

// Wire format, both directions little-endian: request = op(u8: 1 set, 2 get) klen(u32) key [vlen(u32) value];
// a get is answered with vlen(u32) value once the key exists.
class TcpStore::Server {
 public:
  explicit Server(net::Fd listener) : listener_(std::move(listener)) {
    if (::pipe2(wake_, O_CLOEXEC) != 0) throw CommError("pipe failed");
    thread_ = std::thread([this] { run(); });
  }
  // Serves on for up to kLinger while other ranks are still connected: a rank that fails reads the others'
  // reports from the store after rank 0 may already be closing.
  ~Server() {
    stop_ = true;
    char c = 0;
    [[maybe_unused]] auto n = ::write(wake_[1], &c, 1);
    thread_.join();
    ::close(wake_[0]);
    ::close(wake_[1]);
  }

 private:
  struct Client {
    net::Fd fd;
    std::string in;
  };

  void run() {
    std::vector<Client> clients;
    std::map<std::string, std::string> values;
    std::multimap<std::string, int> waiting;  // key -> client fd waiting for it
    std::optional<net::Clock::time_point> closing;
    for (;;) {
      if (stop_) {
        if (!closing) closing = net::Clock::now() + kLinger;
        if (clients.empty() || net::Clock::now() > *closing) break;
      }
      std::vector<pollfd> fds{{listener_.get(), POLLIN, 0}, {wake_[0], POLLIN, 0}};
      for (auto& c : clients) fds.push_back({c.fd.get(), POLLIN, 0});
      if (::poll(fds.data(), fds.size(), stop_ ? 50 : 1000) <= 0) continue;
      if (fds[1].revents & POLLIN) {
        char drain[16];
        [[maybe_unused]] auto n = ::read(wake_[0], drain, sizeof drain);
      }
      if (fds[0].revents & POLLIN) {
        int fd = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
        if (fd >= 0) clients.push_back({net::Fd(fd), {}});
      }
      for (size_t i = 2; i < fds.size(); ++i) {
        if (!(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
        Client& c = clients[i - 2];
        char buf[4096];
        ssize_t n = ::recv(c.fd.get(), buf, sizeof buf, MSG_DONTWAIT);
        if (n <= 0) {
          // Forget its pending gets: a later client may be given the same fd number.
          std::erase_if(waiting, [&](const auto& w) { return w.second == c.fd.get(); });
          c.fd.reset();
          continue;
        }
        c.in.append(buf, static_cast<size_t>(n));
        parse(c, values, waiting);
      }
      std::erase_if(clients, [](const Client& c) { return !c.fd; });
    }
  }

  static bool take_u32(const std::string& in, size_t& pos, uint32_t& v) {
    if (in.size() < pos + 4) return false;
    std::memcpy(&v, in.data() + pos, 4);
    pos += 4;
    return true;
  }

  static void reply(int fd, const std::string& value) {
    uint32_t len = static_cast<uint32_t>(value.size());
    std::string msg(reinterpret_cast<char*>(&len), 4);
    msg += value;
    try {
      net::send_all(fd, msg.data(), msg.size(), net::Clock::now() + std::chrono::seconds(10), "store reply");
    } catch (const CommError&) {
      // The client went away; it will report its own error.
    }
  }

  void parse(Client& c, std::map<std::string, std::string>& values, std::multimap<std::string, int>& waiting) {
    for (;;) {
      size_t pos = 1;
      uint32_t klen = 0, vlen = 0;
      if (c.in.empty() || !take_u32(c.in, pos, klen) || c.in.size() < pos + klen) return;
      std::string key = c.in.substr(pos, klen);
      pos += klen;
      const char op = c.in[0];
      if (op == 1) {
        if (!take_u32(c.in, pos, vlen) || c.in.size() < pos + vlen) return;
        std::string value = c.in.substr(pos, vlen);
        pos += vlen;
        values[key] = value;
        auto [lo, hi] = waiting.equal_range(key);
        for (auto it = lo; it != hi; ++it) reply(it->second, value);
        waiting.erase(lo, hi);
      } else if (op == 2) {
        if (auto it = values.find(key); it != values.end())
          reply(c.fd.get(), it->second);
        else
          waiting.emplace(key, c.fd.get());
      } else {
        c.fd.reset();  // not a smartcoll store client
        return;
      }
      c.in.erase(0, pos);
    }
  }

  static constexpr auto kLinger = std::chrono::seconds(3);
  net::Fd listener_;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

TcpStore::TcpStore(const std::string& host, uint16_t port, bool serve, std::chrono::milliseconds connect_timeout) {
  std::string ip = net::resolve_ipv4(host);
  if (serve) {
    // Listen on all addresses: MASTER_ADDR may name this host by an address other ranks reach it through.
    net::Fd listener = net::listen_on("0.0.0.0", port, 1024);
    port = net::bound_port(listener.get());
    server_ = std::make_unique<Server>(std::move(listener));
  }
  port_ = port;
  fd_ = net::connect_to({ip, port}, net::Clock::now() + connect_timeout).release();
}

TcpStore::~TcpStore() {
  if (fd_ >= 0) ::close(fd_);
  server_.reset();
}

void TcpStore::set(const std::string& key, const std::string& value) {
  std::lock_guard lock(mu_);
  std::string msg(1, '\1');
  uint32_t klen = static_cast<uint32_t>(key.size()), vlen = static_cast<uint32_t>(value.size());
  msg.append(reinterpret_cast<char*>(&klen), 4).append(key).append(reinterpret_cast<char*>(&vlen), 4).append(value);
  net::send_all(fd_, msg.data(), msg.size(), net::Clock::now() + std::chrono::seconds(60), "store set");
}

std::string TcpStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  std::lock_guard lock(mu_);
  std::string msg(1, '\2');
  uint32_t klen = static_cast<uint32_t>(key.size());
  msg.append(reinterpret_cast<char*>(&klen), 4).append(key);
  auto deadline = net::Clock::now() + timeout;
  net::send_all(fd_, msg.data(), msg.size(), deadline, "store get");
  uint32_t vlen = 0;
  try {
    net::recv_all(fd_, &vlen, 4, deadline, "store value for '" + key + "'");
  } catch (const CommError& e) {
    if (net::Clock::now() >= deadline) throw CommError(timeout_message(key, timeout));
    throw CommError(std::string(e.what()) + " (the rendezvous server on rank 0 is gone)");
  }
  std::string value(vlen, '\0');
  net::recv_all(fd_, value.data(), vlen, deadline, "store value for '" + key + "'");
  return value;
}

}  // namespace smartcoll
