// Megatron's --exit-signal-handler: SIGTERM (a scheduler's preemption notice, or mfsdp-run
// passing one on) or SIGINT no longer kills the rank; the handler only notes it, and the training
// loop, at the end of the iteration, agrees over every rank that one was received, saves and
// exits 0 (TrainingRun::after_iteration).
#pragma once

namespace mfsdp {

// Installs the handler for SIGTERM and SIGINT in this process (idempotent): the first of them is
// noted; after it both act as they would without the handler.
void install_exit_signal_handler();

// The first signal the handler received (SIGTERM or SIGINT), 0 while none has come.
int received_exit_signal();

}  // namespace mfsdp
