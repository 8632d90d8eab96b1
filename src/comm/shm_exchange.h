// Shared-memory data path of the CPU communicator for ranks on one host.
//
// Over loopback TCP every byte of a collective is copied twice by the kernel (send and receive)
// on the same cores that compute, behind system calls and the transport's event loop. Here the
// ranks share one /dev/shm segment: per round each rank copies its chunk into its own slot,
// announces it (an atomic counter per rank), waits until every rank has, and reads the peers'
// slots. Slots alternate between two sets by round parity, so a rank can fill the next round's
// slot while slower peers still read this one (a rank reaches round r + 2 only after every rank
// announced round r + 1, i.e. finished reading round r).
//
// Every rank runs the same rounds in the same order (the slices of every rank are known to all),
// on the communicator's thread. A peer that exits is noticed within milliseconds (its pid is in
// the segment); one that stays silent is reported after the timeout, naming it.
#pragma once

#include <atomic>

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "comm/collective_args.h"
#include "mfsdp/comm/comm.h"

namespace mfsdp {

class ShmExchange {
 public:
  // Collective over the `size` ranks sharing `store`: rank 0 creates the segment, the others map
  // it. Returns null on every rank unless every rank mapped the same segment (other hosts or IPC
  // namespaces, no room in /dev/shm, or !enabled, CommOptions::shared_memory): then TCP carries
  // all.
  static std::unique_ptr<ShmExchange> connect(c10d::Store& store, int rank, int size,
                                              std::chrono::milliseconds timeout, bool enabled);
  ~ShmExchange();
  ShmExchange(const ShmExchange&) = delete;
  ShmExchange& operator=(const ShmExchange&) = delete;

  // Who is running what, for error messages: "<op> #<seq>".
  struct Call {
    const char* op;
    uint64_t seq;
    std::chrono::milliseconds timeout;
  };

  // Every rank's slice of `buffer` (flat, laid out by `s`) from its owner; this rank's own slice
  // must already be in place.
  void all_gather(const Call& call, const at::Tensor& buffer, const RankSlices& s);
  // result (counts[rank] elements, in the accumulation dtype) = the reduction over ranks q (in
  // rank order) of prescale x slice `rank` of rank q's `input` (flat, laid out by `s`).
  void reduce_scatter(const Call& call, const at::Tensor& result, const at::Tensor& input,
                      const RankSlices& s, ReduceOp op, double prescale);
  // all_to_all_single: slice r of `input` (flat, laid out by `send`) to rank r, slice q of
  // `output` (laid out by `recv`) from rank q; the own slices are left to the caller. The first
  // round carries every rank's sizes, so that all agree on the number of rounds, and a pair of
  // ranks whose sizes disagree fails on every rank (CommError naming both) instead of moving
  // wrong data.
  void all_to_all(const Call& call, const at::Tensor& output, const at::Tensor& input,
                  const RankSlices& send, const RankSlices& recv);
  // Bytes this rank has written into its slots for peers to read, so far.
  int64_t bytes_written() const { return written_.load(); }

 private:
  struct Header;
  ShmExchange(void* base, size_t bytes, int rank, int size, int64_t slot_bytes);
  char* slot(int parity, int rank) const;
  // Publishes this rank's slot of the next round and waits until every rank published it.
  void announce_and_wait(const Call& call);

  void* base_;
  size_t bytes_;
  int rank_, size_;
  int64_t slot_bytes_;
  uint64_t round_ = 0;
  bool check_pids_ = true;
  std::atomic<int64_t> written_{0};
};

}  // namespace mfsdp
