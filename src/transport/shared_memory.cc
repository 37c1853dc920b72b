#include "transport/shared_memory.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

namespace smartcoll::cma {
namespace {
constexpr int kSeals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
}  // namespace

SharedMemory SharedMemory::create(const char* name, size_t bytes, std::string& error) {
  SharedMemory s;
  const int fd = static_cast<int>(syscall(SYS_memfd_create, name, MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (fd < 0) {
    error = std::string("memfd_create failed: ") + std::strerror(errno);
    return s;
  }
  // Sealed at its size: a peer's mapping can never reach past the end of the file (SIGBUS), and open() checks it.
  void* base = ftruncate(fd, static_cast<off_t>(bytes)) == 0 && fcntl(fd, F_ADD_SEALS, kSeals) == 0
                   ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
                   : MAP_FAILED;
  if (base == MAP_FAILED) {
    error = std::string("cannot size or map shared memory '") + name + "': " + std::strerror(errno);
    ::close(fd);
    return s;
  }
  s.base_ = base;
  s.bytes_ = bytes;
  s.fd_ = fd;
  return s;
}

SharedMemory SharedMemory::open(int pid, int fd, size_t bytes, const std::string& what, std::string& error) {
  SharedMemory s;
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int mine = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (mine < 0) {
    error = "cannot open " + what + " " + path + ": " + std::strerror(errno);
    return s;
  }
  struct stat st {};
  const int seals = fcntl(mine, F_GET_SEALS);  // -1 where it is no memfd
  void* base = fstat(mine, &st) == 0 && static_cast<size_t>(st.st_size) == bytes && seals >= 0 &&
                       (seals & kSeals) == kSeals
                   ? mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mine, 0)
                   : MAP_FAILED;
  ::close(mine);
  if (base == MAP_FAILED) {
    error = what + " " + path + " has the wrong size, is not sealed at it, or cannot be mapped";
    return s;
  }
  s.base_ = base;
  s.bytes_ = bytes;
  return s;
}

SharedMemory::SharedMemory(SharedMemory&& o) noexcept { *this = std::move(o); }

SharedMemory& SharedMemory::operator=(SharedMemory&& o) noexcept {
  if (this != &o) {
    this->~SharedMemory();
    base_ = std::exchange(o.base_, nullptr);
    bytes_ = std::exchange(o.bytes_, 0);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

SharedMemory::~SharedMemory() {
  close_fd();
  if (base_) munmap(base_, bytes_);
  base_ = nullptr;
}

void SharedMemory::close_fd() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

}  // namespace smartcoll::cma
