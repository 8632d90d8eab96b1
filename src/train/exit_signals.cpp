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
  // SA_RESTART: reads and writes it interrupts go on (poll returns EINTR, which every caller
  // retries); SA_RESETHAND: a second signal acts as it would without the handler (a second
  // Ctrl-C ends the rank).
  action.sa_flags = SA_RESTART | SA_RESETHAND;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

int received_exit_signal() { return g_received; }

}  // namespace mfsdp
