#include "mfsdp/train/exit_signals.h"

#include <csignal>

namespace mfsdp {
namespace {

volatile std::sig_atomic_t g_received = 0;

void note_signal(int signal) {
  if (g_received == 0) g_received = signal;
}

}  // namespace

void install_exit_signal_handler() {
  struct sigaction action {};
  action.sa_handler = note_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;  // a read or poll interrupted by it goes on
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

int received_exit_signal() { return g_received; }

}  // namespace mfsdp
