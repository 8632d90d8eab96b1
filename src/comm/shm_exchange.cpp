#include "comm/shm_exchange.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <immintrin.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>

namespace mfsdp {
namespace {

constexpr uint64_t kMagic = 0x6d66736470736d31;  // "mfsdpsm1"
constexpr size_t kPage = 4096;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

// Per-rank slots of 4 MiB, fewer bytes for many ranks: at most 32 MiB of /dev/shm in all.
int64_t slot_bytes_for(int size) {
  const int64_t cap = (int64_t{16} << 20) / size;
  return std::max<int64_t>(64 << 10, std::min<int64_t>(4 << 20, cap / kPage * kPage));
}

std::string text(const std::vector<uint8_t>& v) { return std::string(v.begin(), v.end()); }
std::vector<uint8_t> bytes_of(const std::string& s) { return std::vector<uint8_t>(s.begin(), s.end()); }

bool process_gone(pid_t pid) {
  if (kill(pid, 0) != 0) return errno == ESRCH;
  // An exited child its parent has not reaped yet still answers kill(): look at its state.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const auto paren = line.rfind(')');
  return paren != std::string::npos && paren + 2 < line.size() && line[paren + 2] == 'Z';
}

// "TAG-" from MFSDP_SHM_TAG when it is 1..64 letters and digits, else "" (a name stays valid).
std::string shm_tag() {
  const char* env = std::getenv("MFSDP_SHM_TAG");
  if (env == nullptr) return "";
  const std::string tag = env;
  if (tag.empty() || tag.size() > 64) return "";
  for (char c : tag)
    if (!std::isalnum(static_cast<unsigned char>(c))) return "";
  return tag + "-";
}

}  // namespace

struct ShmExchange::Header {
  struct alignas(64) RankState {
    std::atomic<uint64_t> announced;  // last round whose slot this rank filled
    uint64_t seq[2];                  // the collective its last round of each parity belonged to
    int32_t pid;
  };
  uint64_t magic;
  uint64_t nonce;
  int32_t size;
  int64_t slot_bytes;
  RankState ranks[1];  // [size]

  static size_t bytes(int size) {
    return round_up(offsetof(Header, ranks) + sizeof(RankState) * static_cast<size_t>(size), kPage);
  }
};
static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared counters need lock-free atomics");

std::unique_ptr<ShmExchange> ShmExchange::connect(c10d::Store& store, int rank, int size,
                                                  std::chrono::milliseconds timeout, bool enabled) {
  const bool wanted = size > 1 && enabled;
  const int64_t slot_bytes = slot_bytes_for(size);
  const size_t header = Header::bytes(size);
  const size_t total = header + 2 * static_cast<size_t>(size) * static_cast<size_t>(slot_bytes);

  // Rank 0 creates the segment and publishes its name ("" when it could not), with a nonce
  // that proves a peer mapped the very segment rank 0 made (not a namesake elsewhere).
  std::string name;
  uint64_t nonce = 0;
  void* base = MAP_FAILED;
  if (rank == 0) {
    if (wanted) {
      nonce = std::random_device{}() * 0x9e3779b97f4a7c15ULL ^ static_cast<uint64_t>(getpid());
      std::ostringstream s;
      // "/mfsdp-[TAG-]PID-NONCE": TAG (MFSDP_SHM_TAG, set by mfsdp-run per job) lets the launcher
      // unlink every segment of its job after its ranks exited, whenever they died
      // (include/mfsdp/launch/rank_processes.h, remove_shm_segments).
      s << "/mfsdp-" << shm_tag() << getpid() << "-" << std::hex << nonce;
      name = s.str();
      int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
      // posix_fallocate reserves the pages now: a tmpfs short of room fails here instead of
      // raising SIGBUS on a later write.
      if (fd >= 0 && posix_fallocate(fd, 0, static_cast<off_t>(total)) == 0)
        base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (fd >= 0) close(fd);
      if (base == MAP_FAILED) {
        shm_unlink(name.c_str());
        name.clear();
      } else {
        auto* h = static_cast<Header*>(base);
        h->magic = kMagic;
        h->nonce = nonce;
        h->size = size;
        h->slot_bytes = slot_bytes;
        for (int r = 0; r < size; ++r) {
          new (&h->ranks[r].announced) std::atomic<uint64_t>(0);
          h->ranks[r].seq[0] = h->ranks[r].seq[1] = 0;
          h->ranks[r].pid = 0;
        }
      }
    }
    store.set("shm/name", bytes_of(name + " " + std::to_string(nonce)));
  } else {
    std::istringstream published(text(store.get("shm/name")));
    published >> name >> nonce;
    if (wanted && !name.empty()) {
      int fd = shm_open(name.c_str(), O_RDWR, 0);
      struct stat st {};
      if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) == total)
        base = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
      if (fd >= 0) close(fd);
      if (base != MAP_FAILED) {
        auto* h = static_cast<Header*>(base);
        if (h->magic != kMagic || h->nonce != nonce || h->size != size || h->slot_bytes != slot_bytes) {
          munmap(base, total);
          base = MAP_FAILED;
        }
      }
    }
  }
  const bool mapped = base != MAP_FAILED;
  if (mapped) static_cast<Header*>(base)->ranks[rank].pid = static_cast<int32_t>(getpid());

  // Everyone uses the segment only if everyone mapped it.
  store.set("shm/ok/" + std::to_string(rank), bytes_of(mapped ? "1" : "0"));
  bool all = true;
  for (int r = 0; r < size; ++r) all &= text(store.get("shm/ok/" + std::to_string(r))) == "1";
  if (rank == 0 && !name.empty()) shm_unlink(name.c_str());  // mapped ones keep it; no leak
  (void)timeout;
  if (!all) {
    if (mapped) munmap(base, total);
    return nullptr;
  }
  std::unique_ptr<ShmExchange> ex(new ShmExchange(base, total, rank, size, slot_bytes));
  // Liveness checks need the peers' pids to mean something here (same pid namespace).
  auto* h = static_cast<Header*>(base);
  for (int r = 0; r < size; ++r)
    if (r != rank && (h->ranks[r].pid <= 0 || (kill(h->ranks[r].pid, 0) != 0 && errno != EPERM)))
      ex->check_pids_ = false;
  return ex;
}

ShmExchange::ShmExchange(void* base, size_t bytes, int rank, int size, int64_t slot_bytes)
    : base_(base), bytes_(bytes), rank_(rank), size_(size), slot_bytes_(slot_bytes) {}

ShmExchange::~ShmExchange() { munmap(base_, bytes_); }

char* ShmExchange::slot(int parity, int rank) const {
  return static_cast<char*>(base_) + Header::bytes(size_) +
         (static_cast<size_t>(parity) * size_ + rank) * static_cast<size_t>(slot_bytes_);
}

void ShmExchange::announce_and_wait(const Call& call) {
  auto* h = static_cast<Header*>(base_);
  const int parity = static_cast<int>(round_ % 2);
  h->ranks[rank_].seq[parity] = call.seq;
  h->ranks[rank_].announced.store(round_, std::memory_order_release);
  const auto start = std::chrono::steady_clock::now();
  auto next_pid_check = start + std::chrono::milliseconds(20);
  auto fail = [&](int r, const std::string& why) {
    std::ostringstream s;
    s << call.op << " #" << call.seq << " failed on rank " << rank_ << " while waiting for rank " << r
      << " at the shared-memory exchange (timeout " << call.timeout.count() << " ms): " << why;
    throw CommError(s.str());
  };
  for (int r = 0; r < size_; ++r) {
    int spins = 0;
    while (h->ranks[r].announced.load(std::memory_order_acquire) < round_) {
      // Spin briefly (a peer is usually microseconds away), then sleep: the cores are shared
      // with the compute threads.
      if (++spins < 256) {
        _mm_pause();
        continue;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(20));
      const auto now = std::chrono::steady_clock::now();
      std::string why;
      if (now - start > call.timeout) {
        why = "no data within the timeout";
      } else if (check_pids_ && now > next_pid_check) {
        next_pid_check = now + std::chrono::milliseconds(20);
        if (process_gone(h->ranks[r].pid))
          why = "the peer's process (pid " + std::to_string(h->ranks[r].pid) + ") exited";
      }
      if (!why.empty()) fail(r, why);
    }
    // The peer cannot refill this parity before this rank announces the next round.
    if (h->ranks[r].seq[parity] != call.seq)
      fail(r, "it is in collective #" + std::to_string(h->ranks[r].seq[parity]) +
                  ": the ranks disagree on the sizes or the order of their collectives");
  }
}

void ShmExchange::all_gather(const Call& call, const at::Tensor& buffer, const RankSlices& s) {
  const int64_t item = buffer.element_size();
  const int64_t per_round = slot_bytes_ / item;
  const int64_t rounds = (s.max_count() + per_round - 1) / per_round;
  char* data = static_cast<char*>(buffer.data_ptr());
  auto chunk = [&](int r, int64_t lo) { return std::clamp<int64_t>(s.counts[r] - lo, 0, per_round); };
  for (int64_t j = 0; j < rounds; ++j) {
    const int64_t lo = j * per_round;
    const int parity = static_cast<int>(++round_ % 2);
    std::memcpy(slot(parity, rank_), data + (s.offsets[rank_] + lo) * item, chunk(rank_, lo) * item);
    written_ += chunk(rank_, lo) * item;
    announce_and_wait(call);
    for (int r = 0; r < size_; ++r)
      if (r != rank_) std::memcpy(data + (s.offsets[r] + lo) * item, slot(parity, r), chunk(r, lo) * item);
  }
}

void ShmExchange::reduce_scatter(const Call& call, const at::Tensor& result, const at::Tensor& input,
                                 const RankSlices& s, ReduceOp op, double prescale) {
  const int64_t item = input.element_size();
  // Each round carries `per_dest` elements of every destination's slice.
  const int64_t per_dest = slot_bytes_ / (size_ * item);
  const int64_t rounds = (s.max_count() + per_dest - 1) / per_dest;
  const char* in = static_cast<const char*>(input.data_ptr());
  auto chunk = [&](int r, int64_t lo) { return std::clamp<int64_t>(s.counts[r] - lo, 0, per_dest); };
  for (int64_t j = 0; j < rounds; ++j) {
    const int64_t lo = j * per_dest;
    const int parity = static_cast<int>(++round_ % 2);
    char* mine = slot(parity, rank_);
    for (int r = 0; r < size_; ++r) {
      std::memcpy(mine + r * per_dest * item, in + (s.offsets[r] + lo) * item, chunk(r, lo) * item);
      if (r != rank_) written_ += chunk(r, lo) * item;
    }
    announce_and_wait(call);
    const int64_t n = chunk(rank_, lo);
    if (n == 0) continue;
    auto from = [&](int q) {
      return at::from_blob(slot(parity, q) + rank_ * per_dest * item, {n}, input.options());
    };
    // Rank order on every rank; each term scaled as the ring scales its local contribution.
    reduce_in_rank_order(result.narrow(0, lo, n), size_, from, op, prescale);
  }
}

void ShmExchange::all_to_all(const Call& call, const at::Tensor& output, const at::Tensor& input,
                             const RankSlices& send, const RankSlices& recv) {
  const int64_t item = input.element_size();
  // A slot: this rank's bytes for and from every rank (2 x size int64, read in the first round),
  // then one part per destination, filled with the next `part` bytes of its slice each round.
  const int64_t header = static_cast<int64_t>(round_up(2 * size_ * sizeof(int64_t), 64));
  const int64_t part = (slot_bytes_ - header) / size_ / 64 * 64;
  if (part <= 0) throw std::logic_error("all_to_all: too many ranks for the shared-memory slots");
  const char* in = static_cast<const char*>(input.data_ptr());
  char* out = static_cast<char*>(output.data_ptr());
  auto chunk = [&](int64_t elements, int64_t lo) {
    return std::clamp<int64_t>(elements * item - lo, 0, part);
  };
  int64_t rounds = 1;  // until the first round told every rank's sizes
  for (int64_t j = 0; j < rounds; ++j) {
    const int64_t lo = j * part;
    const int parity = static_cast<int>(++round_ % 2);
    char* mine = slot(parity, rank_);
    if (j == 0) {
      auto* sizes = reinterpret_cast<int64_t*>(mine);
      for (int r = 0; r < size_; ++r) {
        sizes[r] = send.counts[r] * item;
        sizes[size_ + r] = recv.counts[r] * item;
      }
    }
    for (int r = 0; r < size_; ++r) {
      if (r == rank_) continue;
      const int64_t n = chunk(send.counts[r], lo);
      std::memcpy(mine + header + r * part, in + send.offsets[r] * item + lo, n);
      written_ += n;
    }
    announce_and_wait(call);
    if (j == 0) {
      // Every rank reads the same sizes, so all agree on the rounds and all fail together.
      int64_t most = 0;
      for (int q = 0; q < size_; ++q) {
        const auto* from = reinterpret_cast<const int64_t*>(slot(parity, q));
        for (int r = 0; r < size_; ++r) {
          if (r == q) continue;
          const int64_t expected = reinterpret_cast<const int64_t*>(slot(parity, r))[size_ + q];
          if (from[r] != expected) {
            std::ostringstream s;
            s << call.op << " #" << call.seq << " failed on rank " << rank_ << ": rank " << q << " sends "
              << from[r] << " bytes to rank " << r << ", which expects " << expected
              << " bytes from it (rank " << q << "'s input_split_sizes[" << r << "] and rank " << r
              << "'s output_split_sizes[" << q << "] disagree, or their dtypes or row shapes do)";
            throw CommError(s.str());
          }
          most = std::max(most, from[r]);
        }
      }
      rounds = std::max<int64_t>(1, (most + part - 1) / part);
    }
    for (int q = 0; q < size_; ++q)
      if (q != rank_)
        std::memcpy(out + recv.offsets[q] * item + lo, slot(parity, q) + header + rank_ * part,
                    chunk(recv.counts[q], lo));
  }
}

}  // namespace mfsdp
