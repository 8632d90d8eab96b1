// This machine's host name (gethostname), for log lines and file names; "localhost" when the
// system cannot say.
#pragma once

#include <unistd.h>

#include <string>

namespace mfsdp {

inline std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "localhost";
  return name;
}

}  // namespace mfsdp
