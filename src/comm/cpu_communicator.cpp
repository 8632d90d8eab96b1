#include "comm/cpu_communicator.h"

#include <ATen/ATen.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <atomic>
#include <cstdlib>
#include <map>
#include <sstream>

#include "comm/collective_args.h"
#include "comm/comm_thread.h"
#include "comm/shm_exchange.h"
#include "comm/tcp_mesh.h"

namespace mfsdp {
namespace {

// The numeric address of interface `name` (IPv4 preferred), for GLOO_SOCKET_IFNAME.
std::string interface_address(const std::string& name, const char* variable) {
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) != 0)
    throw CommError(std::string(variable) + "=" + name + ": cannot list the network interfaces");
  std::string v4, v6;
  for (ifaddrs* a = list; a != nullptr; a = a->ifa_next) {
    if (a->ifa_addr == nullptr || name != a->ifa_name) continue;
    const int family = a->ifa_addr->sa_family;
    if (family != AF_INET && family != AF_INET6) continue;
    char host[NI_MAXHOST];
    const socklen_t len = family == AF_INET ? sizeof(sockaddr_in) : sizeof(sockaddr_in6);
    if (getnameinfo(a->ifa_addr, len, host, sizeof host, nullptr, 0, NI_NUMERICHOST) != 0) continue;
    std::string& first = family == AF_INET ? v4 : v6;
    if (first.empty()) first = host;
  }
  freeifaddrs(list);
  if (!v4.empty()) return v4;
  if (!v6.empty()) return v6;
  throw CommError(std::string(variable) + "=" + name +
                  ": no network interface of that name with an IPv4 or IPv6 address");
}

// Where this rank listens for its peers: the interface `ifname` names (CommOptions::socket_ifname),
// else MFSDP_SOCKET_IFNAME's or GLOO_SOCKET_IFNAME's (torch's variable, so existing job scripts
// keep working), else loopback when all ranks are on this node (no name resolution needed), else
// this host's name.
std::string bind_host(const RendezvousInfo& info, const std::string& ifname) {
  if (!ifname.empty()) return interface_address(ifname, "socket_ifname");
  for (const char* variable : {"MFSDP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"}) {
    const char* named = std::getenv(variable);
    if (named != nullptr && *named != '\0') return interface_address(named, variable);
  }
  if (info.single_node()) return "127.0.0.1";
  char host[256] = {0};
  gethostname(host, sizeof(host) - 1);
  return host;
}

// One collective's traffic: a unique slot range and the names used in its errors.
class Transfer {
 public:
  Transfer(const char* op, uint64_t seq, int rank, const std::vector<int>& global_ranks,
           std::chrono::milliseconds timeout)
      : op_(op), seq_(seq), rank_(rank), global_ranks_(global_ranks), timeout_(timeout) {}

  // Steps (< 4096) and segments (< 4096) of one collective use distinct slots, so messages of
  // different steps or segments never match each other.
  uint64_t slot(int step, int64_t segment = 0) const {
    return (seq_ << 24) | (static_cast<uint64_t>(step) << 12) | static_cast<uint64_t>(segment);
  }

  ShmExchange::Call call() const { return {op_, seq_, timeout_}; }

  void wait_recv(TcpMesh& mesh, int peer) const {
    wait(peer, "receiving from", [&] { mesh.wait_recv(peer, timeout_); });
  }
  void wait_send(TcpMesh& mesh, int peer) const {
    wait(peer, "sending to", [&] { mesh.wait_send(peer, timeout_); });
  }

  [[noreturn]] void fail(int peer, const std::string& doing, const std::string& why) const {
    std::ostringstream s;
    s << op_ << " #" << seq_ << " failed on rank " << describe(rank_) << " while " << doing
      << " rank " << describe(peer) << " (timeout " << timeout_.count() << " ms): " << why;
    throw CommError(s.str());
  }

 private:
  template <class F>
  void wait(int peer, const char* doing, F&& f) const {
    try {
      f();
    } catch (const std::exception& e) {
      fail(peer, doing, e.what());
    }
  }

  std::string describe(int r) const {
    int g = global_ranks_[r];
    return g == r ? std::to_string(r) : std::to_string(r) + " (global " + std::to_string(g) + ")";
  }

  const char* op_;
  uint64_t seq_;
  int rank_;
  const std::vector<int>& global_ranks_;
  std::chrono::milliseconds timeout_;
};

char* bytes(const at::Tensor& t) { return static_cast<char*>(t.data_ptr()); }

// The one slot of every point-to-point message (send_recv). Collective slots are
// seq << 24 | step << 12 | segment, so the top bit would need 2^39 collectives: no collective
// slot is ever this one, and a p2p message never matches a collective's receive (nor the other
// way round). One slot for all p2p traffic keeps the k-th send to a peer matched with the k-th
// receive that peer posts from this rank: the mesh matches messages of one slot from one peer
// in order.
constexpr uint64_t kP2PSlot = uint64_t{1} << 63;

class CpuCommunicator : public Communicator {
 public:
  // `connect_timeout` bounds connecting to the peers (the world's: start-up, see
  // CommOptions::rendezvous_timeout; a sub-group's: `timeout`), `timeout` every collective.
  // `shared_memory`: bulk data through /dev/shm (when the ranks share this host); sub-groups
  // inherit it.
  CpuCommunicator(c10::intrusive_ptr<c10d::Store> store, std::string bind_host, int rank,
                  std::vector<int> global_ranks, std::chrono::milliseconds timeout,
                  std::chrono::milliseconds connect_timeout, bool shared_memory)
      : store_(std::move(store)),
        bind_host_(std::move(bind_host)),
        rank_(rank),
        global_ranks_(std::move(global_ranks)),
        timeout_(timeout),
        shared_memory_(shared_memory) {
    const int size = static_cast<int>(global_ranks_.size());
    if (size > 1) {
      try {
        mesh_ = TcpMesh::connect(*store_, rank_, size, bind_host_, connect_timeout);
      } catch (const std::exception& e) {
        throw CommError("rendezvous: rank " + std::to_string(global_ranks_[rank_]) +
                        " could not connect to its " + std::to_string(size - 1) +
                        " peers within " + std::to_string(connect_timeout.count()) + " ms: " +
                        e.what());
      }
      // Ranks on one host move the bulk data through shared memory (shm_exchange.h).
      shm_ = ShmExchange::connect(*store_, rank_, size, connect_timeout, shared_memory_);
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(global_ranks_.size()); }
  int64_t bytes_sent() const { return tcp_bytes_sent_.load() + (shm_ ? shm_->bytes_written() : 0); }
  std::string backend() const override { return "gloo"; }
  at::Device device() const override { return at::kCPU; }
  std::chrono::milliseconds default_timeout() const override { return timeout_; }

  WorkHandle all_gather_async(const at::Tensor& output, const at::Tensor& input,
                              const AllGatherOptions& options) override {
    return submit(all_gather_job(output, input, options));
  }
  WorkHandle reduce_scatter_async(const at::Tensor& output, const at::Tensor& input,
                                  const ReduceScatterOptions& options) override {
    return submit(reduce_scatter_job(output, input, options));
  }
  WorkHandle all_reduce_async(const at::Tensor& tensor, const AllReduceOptions& options) override {
    return submit(all_reduce_job(tensor, options));
  }
  WorkHandle broadcast_async(const at::Tensor& tensor, const BroadcastOptions& options) override {
    return submit(broadcast_job(tensor, options));
  }
  WorkHandle all_to_all_single_async(const at::Tensor& output, const at::Tensor& input,
                                     const AllToAllOptions& options) override {
    return submit(all_to_all_job(output, input, options));
  }
  WorkHandle barrier_async(const BarrierOptions& options) override {
    return submit(barrier_job(options));
  }
  WorkHandle send_recv_async(const std::vector<P2POp>& ops, const P2POptions& options) override {
    return submit(send_recv_job(ops, options));
  }

  // Synchronous forms run on the caller's thread when no async work is pending.
  void all_gather(const at::Tensor& output, const at::Tensor& input,
                  const AllGatherOptions& options) override {
    run(all_gather_job(output, input, options));
  }
  void reduce_scatter(const at::Tensor& output, const at::Tensor& input,
                      const ReduceScatterOptions& options) override {
    run(reduce_scatter_job(output, input, options));
  }
  void all_reduce(const at::Tensor& tensor, const AllReduceOptions& options) override {
    run(all_reduce_job(tensor, options));
  }
  void broadcast(const at::Tensor& tensor, const BroadcastOptions& options) override {
    run(broadcast_job(tensor, options));
  }
  void all_to_all_single(const at::Tensor& output, const at::Tensor& input,
                         const AllToAllOptions& options) override {
    run(all_to_all_job(output, input, options));
  }
  void barrier(const BarrierOptions& options) override { run(barrier_job(options)); }

  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks,
                                          const std::string& name) override {
    GroupPlan plan = plan_group(ranks, name, rank_, size(), global_ranks_, groups_created_);
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>(plan.store_prefix, store_);
    return std::make_shared<CpuCommunicator>(prefixed, bind_host_, plan.my_index,
                                             std::move(plan.global_ranks), timeout_, timeout_, shared_memory_);
  }

 private:
  // One collective, validated and ready to run on whichever thread executes it.
  struct Job {
    const char* op;
    std::chrono::milliseconds timeout;
    std::function<void(const Transfer&)> body;
    // Point-to-point: not issued by every rank, so it must not take a collective sequence
    // number (every rank derives the same slots and shared-memory rounds from those).
    bool point_to_point = false;
  };

  Job all_gather_job(const at::Tensor& output, const at::Tensor& input,
                              const AllGatherOptions& options) {
    RankSlices s = all_gather_layout(output, input, options, rank_, size(), c10::kCPU);
    return Job{"all_gather", options.timeout, [this, output, input, s](const Transfer& t) {
      at::Tensor own = output.view(-1).narrow(0, s.offsets[rank_], s.counts[rank_]);
      if (own.data_ptr() != input.data_ptr()) own.copy_(input.view(-1));
      all_gather_in_place(t, output.view(-1), s);
    }};
  }

  Job reduce_scatter_job(const at::Tensor& output, const at::Tensor& input,
                                  const ReduceScatterOptions& options) {
    RankSlices s = reduce_scatter_layout(output, input, options, rank_, size(), c10::kCPU);
    return Job{"reduce_scatter", options.timeout,
               [this, output, input, s, options](const Transfer& t) {
      at::ScalarType acc = accumulation_dtype(output.scalar_type());
      at::Tensor result = acc == output.scalar_type() ? output.view(-1)
                                                      : at::empty({s.counts[rank_]},
                                                                  output.options().dtype(acc));
      reduce_scatter_into(t, result, input.view(-1), s, options.op, options.prescale);
      if (options.op == ReduceOp::kAvg) result.div_(size());
      if (acc != output.scalar_type()) output.view(-1).copy_(result);
    }};
  }

  Job all_reduce_job(const at::Tensor& tensor, const AllReduceOptions& options) {
    check_tensor("all_reduce", "input", tensor, c10::kCPU);
    check_reduction("all_reduce", options.op, tensor.scalar_type(), 1.0);
    return Job{"all_reduce", options.timeout, [this, tensor, options](const Transfer& t) {
      // Reduce-scatter then all-gather. Full precision: in place. Low precision: the input's
      // own dtype on the wire both ways; this rank's slice is summed in the accumulation dtype
      // and rounded once before it is gathered.
      at::ScalarType acc = accumulation_dtype(tensor.scalar_type());
      at::Tensor work = tensor.view(-1);
      RankSlices s = even_slices(work.numel(), size());
      at::Tensor own = work.narrow(0, s.offsets[rank_], s.counts[rank_]);
      at::Tensor reduced = acc == tensor.scalar_type() ? own : at::empty({s.counts[rank_]}, work.options().dtype(acc));
      reduce_scatter_into(t, reduced, work, s, options.op, 1.0);
      if (options.op == ReduceOp::kAvg) reduced.div_(size());
      if (!reduced.is_same(own)) own.copy_(reduced);
      all_gather_in_place(t, work, s, /*first_step=*/size());
    }};
  }

  Job broadcast_job(const at::Tensor& tensor, const BroadcastOptions& options) {
    check_tensor("broadcast", "input", tensor, c10::kCPU);
    if (options.root < 0 || options.root >= size())
      throw std::invalid_argument("broadcast: root " + std::to_string(options.root) +
                                  " is outside [0, " + std::to_string(size()) + ")");
    return Job{"broadcast", options.timeout, [this, tensor, options](const Transfer& t) {
      size_t nbytes = tensor.nbytes();
      if (size() == 1 || nbytes == 0) return;
      if (rank_ == options.root) {
        for (int p = 0; p < size(); ++p)
          if (p != rank_) tcp_send(p, t.slot(0), bytes(tensor), nbytes);
        for (int p = 0; p < size(); ++p)
          if (p != rank_) t.wait_send(*mesh_, p);
      } else {
        mesh_->post_recv(options.root, t.slot(0), bytes(tensor), nbytes);
        t.wait_recv(*mesh_, options.root);
      }
    }};
  }

  Job all_to_all_job(const at::Tensor& output, const at::Tensor& input,
                     const AllToAllOptions& options) {
    AllToAllLayout l = all_to_all_layout(output, input, options, rank_, size(), c10::kCPU);
    return Job{"all_to_all_single", options.timeout, [this, output, input, l](const Transfer& t) {
      at::Tensor flat_out = output.view(-1), flat_in = input.view(-1);
      flat_out.narrow(0, l.recv.offsets[rank_], l.recv.counts[rank_])
          .copy_(flat_in.narrow(0, l.send.offsets[rank_], l.send.counts[rank_]));
      if (size() == 1) return;
      if (shm_) return shm_->all_to_all(t.call(), flat_out, flat_in, l.send, l.recv);
      tcp_all_to_all(t, flat_out, flat_in, l);
    }};
  }

  Job barrier_job(const BarrierOptions& options) {
    // Every rank contributes one element, so the ring cannot complete before all have arrived.
    at::Tensor token = at::ones({size()}, at::kInt);
    return Job{"barrier", options.timeout, [this, token](const Transfer& t) {
      RankSlices s = even_slices(size(), size());
      at::Tensor own = token.narrow(0, rank_, 1);
      ring_reduce_scatter(t, own, token, s, ReduceOp::kSum, 1.0);
      ring_all_gather(t, token, s, size());
    }};
  }

  // Posts every op (receives first, so that their payloads go straight from the socket into the
  // tensors), then waits for each in issue order. All p2p messages share kP2PSlot. Bulk data goes
  // over TCP, also on one host: the shared-memory exchange is a collective protocol (every rank
  // takes part in every round), which one pair of ranks cannot use.
  Job send_recv_job(const std::vector<P2POp>& ops, const P2POptions& options) {
    check_p2p_ops(ops, rank_, size(), c10::kCPU);
    return Job{"send_recv", options.timeout, [this, ops](const Transfer& t) {
      auto is_recv = [](const P2POp& op) { return op.kind == P2POp::Kind::kRecv; };
      for (const P2POp& op : ops)
        if (is_recv(op)) mesh_->post_recv(op.peer, kP2PSlot, bytes(op.tensor), op.tensor.nbytes());
      for (const P2POp& op : ops)
        if (!is_recv(op)) tcp_send(op.peer, kP2PSlot, bytes(op.tensor), op.tensor.nbytes());
      for (const P2POp& op : ops) {
        if (is_recv(op)) t.wait_recv(*mesh_, op.peer);
        else t.wait_send(*mesh_, op.peer);
      }
    }, /*point_to_point=*/true};
  }

  WorkHandle submit(Job job) { return thread_.submit(bind(std::move(job))); }
  void run(Job job) { thread_.run(bind(std::move(job))); }

  // Wraps a job with its sequence number, timeout and the broken-communicator rule. A p2p batch
  // is numbered by its own counter (its #k in errors counts this rank's batches).
  std::function<void()> bind(Job job) {
    const uint64_t seq = job.point_to_point ? next_p2p_seq_++ : next_seq_++;
    const auto limit = job.timeout.count() > 0 ? job.timeout : timeout_;
    // `self` outlives the job: the destructor drains the queue before any member goes away.
    CpuCommunicator* self = this;
    return [self, op = job.op, seq, limit, body = std::move(job.body)] {
      if (self->first_error_) {
        throw CommError(std::string(op) + " #" + std::to_string(seq) +
                        ": communicator is broken by an earlier failure: " + self->first_error_msg_);
      }
      Transfer t(op, seq, self->rank_, self->global_ranks_, limit);
      // Any failure midway leaves peers out of step, so it breaks the communicator.
      try {
        body(t);
      } catch (const CommError& e) {
        self->first_error_ = true;
        self->first_error_msg_ = e.what();
        throw;
      } catch (const std::exception& e) {
        self->first_error_ = true;
        self->first_error_msg_ = std::string(op) + " #" + std::to_string(seq) + " failed on rank " +
                                 std::to_string(self->rank_) + ": " + e.what();
        throw CommError(self->first_error_msg_);
      }
    };
  }

  // The bulk data path: shared memory when every rank is on this host, else the TCP ring.
  void all_gather_in_place(const Transfer& t, const at::Tensor& buffer, const RankSlices& s,
                           int first_step = 0) {
    if (shm_ && size() > 1 && buffer.nbytes() > 0) return shm_->all_gather(t.call(), buffer, s);
    ring_all_gather(t, buffer, s, first_step);
  }
  // `input` in its own dtype, `result` in the accumulation dtype. Shared memory and the direct
  // exchange move the input's own dtype (bf16 stays bf16 on the wire); the ring carries partial
  // sums, which must be in the accumulation dtype, so it serves full-precision inputs.
  void reduce_scatter_into(const Transfer& t, const at::Tensor& result, const at::Tensor& input,
                           const RankSlices& s, ReduceOp op, double prescale) {
    if (shm_ && size() > 1) return shm_->reduce_scatter(t.call(), result, input, s, op, prescale);
    if (input.scalar_type() != result.scalar_type() && size() > 1)
      return direct_reduce_scatter(t, result, input, s, op, prescale);
    ring_reduce_scatter(t, result, input, s, op, prescale);
  }

  // Low-precision inputs over TCP: every rank sends slice r of its input, in the input's own
  // dtype, straight to rank r, which sums the contributions in rank order in the accumulation
  // dtype and rounds once (exactly what the shared-memory path computes). Each rank sends
  // (n-1)/n of the input, as a ring does, at half the bytes of fp32 partial sums.
  void direct_reduce_scatter(const Transfer& t, const at::Tensor& result, const at::Tensor& input,
                             const RankSlices& s, ReduceOp op, double prescale) {
    const int n = size();
    const int64_t count = s.counts[rank_], item = input.element_size();
    at::Tensor incoming = scratch(1, input.scalar_type(), count * n);  // one row per source rank
    for (int q = 0; q < n; ++q)
      if (q != rank_ && count > 0)
        mesh_->post_recv(q, t.slot(0), bytes(incoming) + q * count * item, count * item);
    for (int r = 0; r < n; ++r)
      if (r != rank_ && s.counts[r] > 0)
        tcp_send(r, t.slot(0), bytes(input) + s.offsets[r] * item, s.counts[r] * item);
    for (int q = 0; q < n; ++q)
      if (q != rank_ && count > 0) t.wait_recv(*mesh_, q);
    for (int r = 0; r < n; ++r)
      if (r != rank_ && s.counts[r] > 0) t.wait_send(*mesh_, r);
    if (count == 0) return;
    auto from = [&](int q) {
      return q == rank_ ? input.narrow(0, s.offsets[rank_], count) : incoming.narrow(0, q * count, count);
    };
    reduce_in_rank_order(result, n, from, op, prescale);
  }

  // One message from every rank to every other, empty ones included: a message carries its
  // length, so splits that disagree with the peer's fail at once at the receiver, naming both
  // ranks (tcp_mesh.h), where a skipped empty message would leave its receiver waiting out the
  // timeout, or a message nobody expects unread. An empty message costs a 16-byte header.
  void tcp_all_to_all(const Transfer& t, const at::Tensor& output, const at::Tensor& input,
                      const AllToAllLayout& l) {
    const int n = size();
    const int64_t item = input.element_size();
    for (int q = 0; q < n; ++q)
      if (q != rank_)
        mesh_->post_recv(q, t.slot(0), bytes(output) + l.recv.offsets[q] * item, l.recv.counts[q] * item);
    // Rank r sends to r + 1 first, then r + 2, ...: no rank gets everyone's first message at once.
    for (int k = 1; k < n; ++k) {
      const int r = (rank_ + k) % n;
      tcp_send(r, t.slot(0), bytes(input) + l.send.offsets[r] * item, l.send.counts[r] * item);
    }
    for (int q = 0; q < n; ++q)
      if (q != rank_) t.wait_recv(*mesh_, q);
    for (int r = 0; r < n; ++r)
      if (r != rank_) t.wait_send(*mesh_, r);
  }

  // Every payload this rank puts on a TCP link goes through here (counted for bytes_sent()).
  void tcp_send(int peer, uint64_t slot, const void* src, size_t nbytes) {
    tcp_bytes_sent_ += static_cast<int64_t>(nbytes);
    mesh_->post_send(peer, slot, src, nbytes);
  }

  // Fills every rank's slice of `buffer` (laid out by `s`) from the ranks around the ring; this
  // rank's own slice must already be in place. Slots start at `first_step`.
  void ring_all_gather(const Transfer& t, const at::Tensor& buffer, const RankSlices& s,
                       int first_step = 0) {
    const int n = size();
    if (n == 1 || buffer.nbytes() == 0) return;
    const int64_t item = buffer.element_size();
    char* base = bytes(buffer);
    const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
    for (int step = 0; step < n - 1; ++step) {
      int send_idx = (rank_ - step + n) % n, recv_idx = (rank_ - step - 1 + 2 * n) % n;
      bool receiving = s.counts[recv_idx] > 0, sending = s.counts[send_idx] > 0;
      if (receiving) mesh_->post_recv(left, t.slot(first_step + step),
                                      base + s.offsets[recv_idx] * item, s.counts[recv_idx] * item);
      if (sending) tcp_send(right, t.slot(first_step + step),
                            base + s.offsets[send_idx] * item, s.counts[send_idx] * item);
      if (receiving) t.wait_recv(*mesh_, left);
      if (sending) t.wait_send(*mesh_, right);
    }
  }

  // Ring reduce-scatter of `input` (laid out by `s`): after n-1 steps `result` (counts[rank]
  // elements of the accumulation dtype; may alias this rank's slice of `input`) holds the
  // reduction of every rank's slice `rank`. Partial sums travel in the accumulation dtype.
  void ring_reduce_scatter(const Transfer& t, const at::Tensor& result, const at::Tensor& input,
                           const RankSlices& s, ReduceOp op, double prescale) {
    const int n = size();
    auto slice = [&](int i) { return input.narrow(0, s.offsets[i], s.counts[i]); };
    // dst = local (scaled) combined with incoming partial result.
    auto combine = [&](const at::Tensor& dst, const at::Tensor& local, const at::Tensor& incoming) {
      at::Tensor out = dst;
      if (op == ReduceOp::kMax) {
        at::maximum_out(out, prescale == 1.0 ? local : local * prescale, incoming);
      } else if (prescale == 1.0) {
        at::add_out(out, incoming, local);
      } else {
        at::add_out(out, incoming, local, prescale);  // incoming + prescale * local
      }
    };
    if (n == 1) {
      at::Tensor out = result;
      if (result.data_ptr() != slice(0).data_ptr()) out.copy_(slice(0));
      // In the accumulation dtype (LibTorch 2.x rejects mul_out into a wider dtype).
      if (prescale != 1.0) out.mul_(prescale);
      return;
    }
    const int64_t max_count = s.max_count();
    if (max_count == 0) return;
    const at::ScalarType acc = result.scalar_type();
    const int64_t item = c10::elementSize(acc);
    // Partial results alternate between two buffers: step k sends partial[k % 2] while its
    // segments are combined into partial[(k + 1) % 2] as they arrive.
    at::Tensor partial[2] = {scratch(0, acc, max_count), scratch(2, acc, max_count)};
    at::Tensor incoming = scratch(1, acc, max_count);
    const int64_t segment = segment_elements(max_count, item);
    const int right = (rank_ + 1) % n, left = (rank_ + n - 1) % n;
    for (int step = 0; step < n - 1; ++step) {
      const int send_idx = (rank_ - step - 1 + 2 * n) % n;
      const int recv_idx = (rank_ - step - 2 + 2 * n) % n;
      const int64_t send_count = s.counts[send_idx], recv_count = s.counts[recv_idx];
      // The first step sends this rank's own contribution (straight from the input when no
      // conversion is needed); later steps forward the previous step's partial result.
      const char* sender = bytes(partial[step % 2]);
      if (step == 0 && send_count > 0) {
        at::Tensor own = slice(send_idx);
        if (own.scalar_type() == acc && prescale == 1.0) {
          sender = bytes(own);
        } else {
          at::Tensor staged = partial[0].narrow(0, 0, send_count);
          at::mul_out(staged, own.to(acc), prescale);
        }
      }
      // Segments let the combine of one segment overlap the transfer of the next.
      const int64_t recv_segments = (recv_count + segment - 1) / segment;
      const int64_t send_segments = (send_count + segment - 1) / segment;
      for (int64_t k = 0; k < recv_segments; ++k) {
        int64_t len = std::min(segment, recv_count - k * segment);
        mesh_->post_recv(left, t.slot(step, k), bytes(incoming) + k * segment * item, len * item);
      }
      for (int64_t k = 0; k < send_segments; ++k) {
        int64_t len = std::min(segment, send_count - k * segment);
        tcp_send(right, t.slot(step, k), sender + k * segment * item, len * item);
      }
      const bool last = step == n - 2;  // then recv_idx == rank_
      at::Tensor dst = last ? result : partial[(step + 1) % 2].narrow(0, 0, recv_count);
      at::Tensor local = slice(recv_idx);
      for (int64_t k = 0; k < recv_segments; ++k) {
        t.wait_recv(*mesh_, left);  // segment k; k + 1 keeps arriving meanwhile
        int64_t off = k * segment, len = std::min(segment, recv_count - off);
        combine(dst.narrow(0, off, len), local.narrow(0, off, len), incoming.narrow(0, off, len));
      }
      for (int64_t k = 0; k < send_segments; ++k) t.wait_send(*mesh_, right);
    }
  }

  // Elements per pipelined segment: at least 1 MiB, at most 16 segments per step.
  static int64_t segment_elements(int64_t count, int64_t item) {
    const int64_t min_elements = std::max<int64_t>(1, (int64_t{1} << 20) / item);
    return std::max(min_elements, (count + 15) / 16);
  }

  // Reusable staging buffer `which` (0, 1 or 2) of at least `numel` elements of `dtype`. Fresh
  // large allocations are mmap'ed and page-faulted on every call, which costs more than the
  // transfer on small machines; these grow once and stay.
  at::Tensor scratch(int which, at::ScalarType dtype, int64_t numel) {
    at::Tensor& buf = scratch_[which];
    if (!buf.defined() || buf.scalar_type() != dtype || buf.numel() < numel)
      buf = at::empty({numel}, at::TensorOptions().dtype(dtype));
    return buf.narrow(0, 0, numel);
  }

  // Constant after construction.
  c10::intrusive_ptr<c10d::Store> store_;
  std::string bind_host_;  // where this rank listens; sub-groups listen there too
  int rank_;
  std::vector<int> global_ranks_;  // global rank of each rank of this communicator
  std::chrono::milliseconds timeout_;
  bool shared_memory_;
  std::unique_ptr<TcpMesh> mesh_;     // null when alone
  std::unique_ptr<ShmExchange> shm_;  // null: not all ranks on one host, or shared memory off

  // Touched only by the caller's thread.
  uint64_t next_seq_ = 1;      // collectives: the same on every rank
  uint64_t next_p2p_seq_ = 1;  // send_recv batches: this rank's own count
  std::map<std::string, int> groups_created_;

  // Touched only by the thread running a job (one at a time, see CommThread).
  std::atomic<int64_t> tcp_bytes_sent_{0};
  at::Tensor scratch_[3];
  bool first_error_ = false;
  std::string first_error_msg_;

  CommThread thread_;  // last: joined first, while everything it uses still exists
};

}  // namespace

int64_t cpu_bytes_sent(const Communicator& comm) {
  auto* cpu = dynamic_cast<const CpuCommunicator*>(&comm);
  return cpu ? cpu->bytes_sent() : -1;
}

std::shared_ptr<Communicator> make_cpu_communicator(const c10::intrusive_ptr<c10d::Store>& store,
                                                    const RendezvousInfo& info, const CommOptions& options) {
  std::vector<int> globals(info.world_size);
  for (int i = 0; i < info.world_size; ++i) globals[i] = i;
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("mfsdp/gloo/world", store);
  const char* env = std::getenv("MFSDP_SHM");
  const bool shared_memory = options.shared_memory.value_or(!(env != nullptr && std::string(env) == "0"));
  return std::make_shared<CpuCommunicator>(prefixed, bind_host(info, options.socket_ifname), info.rank,
                                           std::move(globals), options.timeout, options.rendezvous_timeout,
                                           shared_memory);
}

}  // namespace mfsdp
