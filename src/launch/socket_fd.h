// An owned file descriptor and errno's text: what the socket code of src/comm/ and the launcher
// (src/launch/) share. Torch-free.
#pragma once

#include <unistd.h>

#include <cstring>
#include <string>
#include <utility>

namespace mfsdp {

inline std::string errno_text(int err) {
  char buf[256];
  return strerror_r(err, buf, sizeof buf);  // GNU strerror_r: returns the message
}

// Closes its descriptor when it goes away (also the launcher's pipes, src/launch/).
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_ = -1;
};

}  // namespace mfsdp
