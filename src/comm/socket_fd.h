// An owned file descriptor and errno's text: what the socket code of src/comm/ shares.
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

// Closes its descriptor when it goes away.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) {
      reset();
      fd_ = std::exchange(o.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

}  // namespace mfsdp
