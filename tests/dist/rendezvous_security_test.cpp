// The rendezvous store against hostile and mistaken clients, each against a real job: two rank
// processes (this binary, started again in rank mode) that connect, all-reduce, and, when told
// to, hold until the test lets them finish. The test process plays the stranger: oversized
// requests (rank 0's memory is measured), a partial request left hanging, a missing or wrong
// job token, a second job on the same port; plus start-up slower than the collective timeout,
// and a master address that does not resolve. (src/comm/store_server.h, docs/comm.md.)
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include "comm/store.h"
#include "comm/store_protocol.h"
#include "harness/expect_error.h"
#include "harness/temp_dir.h"
#include "mfsdp/launch/rank_processes.h"
#include "mfsdp/comm/comm.h"
#include "mfsdp/comm/rendezvous.h"

namespace {

namespace launch = mfsdp::launch;
namespace wire = mfsdp::store_wire;
using Clock = std::chrono::steady_clock;
using mfsdp::testing::expect_contains;
using mfsdp::testing::TempDir;
using std::chrono::milliseconds;

// Set in the rank processes this test starts.
constexpr const char* kRankRole = "MFSDP_RDZV_TEST_RANK";
constexpr const char* kDir = "MFSDP_RDZV_TEST_DIR";
constexpr const char* kWaitForGo = "MFSDP_RDZV_TEST_WAIT_FOR_GO";   // wait for <dir>/go first
constexpr const char* kSleepMs = "MFSDP_RDZV_TEST_SLEEP_MS";        // sleep this long first
constexpr const char* kHold = "MFSDP_RDZV_TEST_HOLD";               // wait for <dir>/finish
constexpr const char* kCommTimeoutMs = "MFSDP_RDZV_TEST_COMM_TIMEOUT_MS";
constexpr const char* kStartupTimeoutMs = "MFSDP_RDZV_TEST_STARTUP_TIMEOUT_MS";

// "Does not hang" bounds, never performance assertions.
constexpr milliseconds kBound{60000};

bool in_rank() { return std::getenv(kRankRole) != nullptr; }

std::string env_or(const char* name, const std::string& fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : fallback;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

bool wait_for_file(const std::string& path, milliseconds bound) {
  const auto until = Clock::now() + bound;
  while (!std::filesystem::exists(path)) {
    if (Clock::now() >= until) return false;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return true;
}

void write_file(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp";
  std::ofstream(tmp) << text;
  std::filesystem::rename(tmp, path);
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// ---- the rank program ---------------------------------------------------------------------------

// Connects, checks an all-reduce, tells the test rank 0's pid, holds when asked, checks a
// second all-reduce (the job still works after whatever the test did meanwhile), exits.
// A failure is one line on stderr and exit code 3.
void rank_program() {
  try {
    at::set_num_threads(1);  // ranks x threads <= 2
    const std::string dir = env_or(kDir, "");
    if (env_or(kWaitForGo, "") == "1" && !wait_for_file(dir + "/go", kBound))
      throw std::runtime_error("no go from the test");
    std::this_thread::sleep_for(milliseconds(std::stoll(env_or(kSleepMs, "0"))));
    mfsdp::CommOptions options;
    options.timeout = milliseconds(std::stoll(env_or(kCommTimeoutMs, "60000")));
    options.rendezvous_timeout = milliseconds(std::stoll(env_or(kStartupTimeoutMs, "120000")));
    auto comm = mfsdp::init_communicator(options);
    at::Tensor t = at::ones({4});
    comm->all_reduce(t);
    if (!at::equal(t, at::full({4}, static_cast<float>(comm->size()))))
      throw std::runtime_error("wrong all-reduce result");
    if (comm->rank() == 0) write_file(dir + "/ready", std::to_string(getpid()));
    if (env_or(kHold, "") == "1") {
      if (!wait_for_file(dir + "/finish", milliseconds(180000)))
        throw std::runtime_error("no finish from the test");
      t = at::ones({4});
      comm->all_reduce(t);
      if (!at::equal(t, at::full({4}, static_cast<float>(comm->size()))))
        throw std::runtime_error("wrong all-reduce result after the test's clients");
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank error: %s\n", e.what());
    std::fflush(stderr);
    _exit(3);
  }
}

// ---- jobs ---------------------------------------------------------------------------------------

std::string self_executable() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

std::string current_test() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return std::string(info->test_suite_name()) + "." + info->name();
}

// The rank processes `ranks` of a job of `world` ranks on 127.0.0.1:`port` (this test, in
// rank mode), with `env` on top of each.
std::vector<launch::RankProcessSpec> job_specs(int world, int port, const std::string& token,
                                               const std::string& dir,
                                               const std::map<int, std::map<std::string, std::string>>& env,
                                               std::vector<int> ranks = {}) {
  if (ranks.empty())
    for (int r = 0; r < world; ++r) ranks.push_back(r);
  std::vector<launch::RankProcessSpec> specs;
  for (int r : ranks) {
    launch::RankProcessSpec spec;
    spec.rank = r;
    spec.argv = {self_executable(), "--gtest_filter=" + current_test(), "--gtest_color=no"};
    spec.env = launch::rank_environment(0, 1, world, r, "127.0.0.1", port);
    spec.env["MFSDP_JOB_TOKEN"] = token;
    spec.env[kRankRole] = "1";
    spec.env[kDir] = dir;
    spec.env["OMP_NUM_THREADS"] = "1";
    if (auto it = env.find(r); it != env.end())
      for (const auto& [k, v] : it->second) spec.env[k] = v;
    specs.push_back(std::move(spec));
  }
  return specs;
}

// A job supervised on a thread of its own while the test does its part.
class Job {
 public:
  explicit Job(std::vector<launch::RankProcessSpec> specs) {
    thread_ = std::thread([this, specs = std::move(specs)] {
      launch::SuperviseOptions options;
      options.deadline = milliseconds(240000);
      options.kill_grace = milliseconds(2000);
      options.on_line = [this](int rank, launch::OutputStream, const std::string& line) {
        std::lock_guard<std::mutex> lock(mutex_);
        output_ += "[rank" + std::to_string(rank) + "] " + line + "\n";
      };
      launch::SuperviseResult r = launch::run_rank_processes(specs, options);
      std::lock_guard<std::mutex> lock(mutex_);
      result_ = std::move(r);
    });
  }
  ~Job() {
    if (thread_.joinable()) thread_.join();
  }
  const launch::SuperviseResult& finish() {
    if (thread_.joinable()) thread_.join();
    return result_;
  }
  std::string output() {
    std::lock_guard<std::mutex> lock(mutex_);
    return output_;
  }

 private:
  std::mutex mutex_;
  std::string output_;
  launch::SuperviseResult result_;
  std::thread thread_;
};

// Runs a job to its end (bounded) and returns its result and output.
std::pair<launch::SuperviseResult, std::string> run_job(std::vector<launch::RankProcessSpec> specs) {
  Job job(std::move(specs));
  launch::SuperviseResult result = job.finish();
  return {result, job.output()};
}

std::string describe(const launch::SuperviseResult& result, const std::string& output) {
  std::string s = result.summary() + "\n";
  for (const auto& e : result.exits) s += "  " + e.describe() + "\n";
  return s + output;
}

// A field of /proc/<pid>/status in KiB: "VmRSS" (resident now), "VmHWM" (the peak, which also
// sees memory that was taken and given back while a client was connected).
int64_t status_kib(pid_t pid, const std::string& field) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1));
  return -1;
}

// ---- a stranger's connection --------------------------------------------------------------------

class RawClient {
 public:
  // Connects to 127.0.0.1:port (bounded: the store may still be starting).
  explicit RawClient(int port) {
    const auto until = Clock::now() + kBound;
    for (;;) {
      fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      a.sin_port = htons(static_cast<uint16_t>(port));
      if (::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) return;
      ::close(fd_);
      fd_ = -1;
      if (Clock::now() >= until) throw std::runtime_error("nothing listens on port " + std::to_string(port));
      std::this_thread::sleep_for(milliseconds(20));
    }
  }
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  // Sends what the socket takes; false once the server has closed the connection.
  bool send(const std::string& bytes) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
      if (n <= 0) return false;
      done += static_cast<size_t>(n);
    }
    return true;
  }
  // Sends what the server takes until all is sent or it took nothing for `stall`; the bytes
  // sent (a server that stops reading leaves the rest in the sockets' buffers).
  size_t send_until_stalled(const std::string& bytes, milliseconds stall) {
    size_t done = 0;
    while (done < bytes.size()) {
      const ssize_t n = ::send(fd_, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (n > 0) {
        done += static_cast<size_t>(n);
        continue;
      }
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) break;
      pollfd p{fd_, POLLOUT, 0};
      if (::poll(&p, 1, static_cast<int>(stall.count())) <= 0) break;
    }
    return done;
  }
  // Reads until the server closes the connection; false if it has not within `bound`.
  bool closed_by_server(milliseconds bound = kBound) {
    const auto until = Clock::now() + bound;
    char buf[4096];
    for (;;) {
      pollfd p{fd_, POLLIN, 0};
      const auto left = std::chrono::duration_cast<milliseconds>(until - Clock::now()).count();
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) return false;
      const ssize_t n = ::recv(fd_, buf, sizeof buf, 0);
      if (n <= 0) return true;
      received_.append(buf, static_cast<size_t>(n));
    }
  }
  // One answer frame's body (bounded wait).
  std::string answer() {
    std::string body;
    uint32_t n = 0;
    if (!read_exact(reinterpret_cast<char*>(&n), 4) || n > (1u << 20)) return "";
    body.resize(n);
    return read_exact(body.data(), n) ? body : "";
  }
  std::string greeting(const std::string& token, int64_t rank, int64_t world) {
    send(wire::Writer().u64(wire::kMagic).str(token).i64(rank).i64(world).frame());
    return answer();
  }

 private:
  bool read_exact(char* dst, size_t n) {
    size_t done = 0;
    while (done < n) {
      pollfd p{fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(kBound.count())) <= 0) return false;
      const ssize_t got = ::recv(fd_, dst + done, n - done, 0);
      if (got <= 0) return false;
      done += static_cast<size_t>(got);
    }
    return true;
  }
  int fd_ = -1;
  std::string received_;
};

// Status and message of a greeting's answer.
std::pair<int, std::string> greeting_answer(const std::string& body) {
  wire::Reader r(body);
  if (r.u64() != wire::kMagic) return {-1, "no magic"};
  const int status = r.u8();
  return {status, r.str(wire::kMaxGreetingBytes, "message")};
}

mfsdp::RendezvousInfo client_info(int port, const std::string& token, int rank = 1, int world = 2) {
  mfsdp::RendezvousInfo info;
  info.rank = rank;
  info.world_size = world;
  info.local_world_size = world;
  info.master_addr = "127.0.0.1";
  info.master_port = port;
  info.job_token = token;
  info.source = "explicit";
  return info;
}

}  // namespace

// Requests that claim or send far more than a greeting, from strangers and from a client with
// the token: rank 0 reads none of it into memory (its RSS, and its peak RSS, grow by less than
// 4 MiB; c10d's TCPStore allocated the claimed 1 GiB), and the job goes on.
TEST(RendezvousSecurity, OversizedRequestsDoNotGrowRankZero) {
  if (in_rank()) return rank_program();
  TempDir dir("mfsdp-rdzv");
  const int port = launch::pick_free_port();
  const std::string token = launch::launcher_job_token();
  Job job(job_specs(2, port, token, dir.path().string(), {{0, {{kHold, "1"}}}, {1, {{kHold, "1"}}}}));
  ASSERT_TRUE(wait_for_file(dir.file("ready"), kBound)) << job.output();
  const pid_t rank0 = std::stoi(read_file(dir.file("ready")));
  const int64_t before = status_kib(rank0, "VmRSS"), peak_before = status_kib(rank0, "VmHWM");

  {  // c10d TCPStore's shape: a query byte and an 8-byte key length of 1 GiB
    RawClient c(port);
    std::string request(1, '\0');
    const uint64_t gib = uint64_t{1} << 30;
    request.append(reinterpret_cast<const char*>(&gib), 8);
    c.send(request);
    EXPECT_TRUE(c.closed_by_server()) << "a 9-byte request claiming 1 GiB was not dropped";
  }
  {  // this store's framing, a first frame that claims 1 GiB
    RawClient c(port);
    c.send(wire::Writer().u64(wire::kMagic).frame().replace(0, 4, std::string("\0\0\0\x40", 4)));
    EXPECT_TRUE(c.closed_by_server());
  }
  {  // 64 MiB of garbage streamed at the store: it closes the connection, it does not buffer it
    RawClient c(port);
    const std::string chunk(1 << 20, 'x');
    int sent_mib = 0;
    while (sent_mib < 64 && c.send(chunk)) ++sent_mib;
    EXPECT_TRUE(c.closed_by_server());
    EXPECT_LT(sent_mib, 64) << "the store took 64 MiB of garbage without closing the connection";
  }
  {  // a client with the token claiming a 1 GiB request: refused with a message, then closed
    RawClient c(port);
    ASSERT_EQ(greeting_answer(c.greeting(token, 1, 2)).first, wire::kOk);
    c.send(std::string("\0\0\0\x40", 4) + std::string(64, 'k'));
    const std::string answer = c.answer();
    ASSERT_FALSE(answer.empty());
    wire::Reader r(answer);
    EXPECT_EQ(r.u8(), wire::kBadRequest);
    expect_contains(r.str(1 << 20, "message"), {"over the limit"});
    EXPECT_TRUE(c.closed_by_server());
  }
  {  // a value over the cap through the client API fails before anything is sent
    auto store = mfsdp::connect_store_client(client_info(port, token), kBound);
    EXPECT_THROW(store->set("big", std::vector<uint8_t>(wire::kMaxValueBytes + 1)), std::invalid_argument);
    store->set("small", std::vector<uint8_t>(16, 1));  // and the connection still serves
    EXPECT_EQ(store->get("small").size(), 16u);
  }
  const int64_t after = status_kib(rank0, "VmRSS"), peak_after = status_kib(rank0, "VmHWM");
  std::cout << "rank 0 RSS: " << before << " KiB before the oversized clients, " << after
            << " KiB after (+" << (after - before) << " KiB); peak RSS " << peak_before
            << " KiB before, " << peak_after << " KiB after (+" << (peak_after - peak_before)
            << " KiB)" << std::endl;
  RecordProperty("rank0_rss_growth_kib", std::to_string(after - before));
  EXPECT_GT(before, 0);
  EXPECT_LT(after - before, 4 << 10) << "rank 0 grew by " << (after - before) << " KiB";
  EXPECT_LT(peak_after - peak_before, 4 << 10)
      << "rank 0's peak grew by " << (peak_after - peak_before) << " KiB";

  write_file(dir.file("finish"), "");
  const auto& result = job.finish();
  EXPECT_TRUE(result.ok()) << describe(result, job.output());
  expect_contains(job.output(), {"not an mfsdp", "closed"});  // rank 0 says what it dropped
}

// Many connections with the token, each sending most of a request of the largest size and
// then nothing: rank 0 buffers at most kMaxBufferedBytes of them all together (it used to buffer
// up to 32 MiB for each, for as many as connected: 8 took 197 MB, kept after they closed); a
// rank's requests, small and large, are still served meanwhile (the silent ones are closed once
// they hold the buffers up, kStalledRequestTimeout); and the memory is given back when they go.
TEST(RendezvousSecurity, PartialRequestsOfManyConnectionsShareOneBound) {
  if (in_rank()) return rank_program();
  TempDir dir("mfsdp-rdzv");
  const int port = launch::pick_free_port();
  const std::string token = launch::launcher_job_token();
  Job job(job_specs(2, port, token, dir.path().string(), {{0, {{kHold, "1"}}}, {1, {{kHold, "1"}}}}));
  ASSERT_TRUE(wait_for_file(dir.file("ready"), kBound)) << job.output();
  const pid_t rank0 = std::stoi(read_file(dir.file("ready")));
  const int64_t before = status_kib(rank0, "VmRSS"), peak_before = status_kib(rank0, "VmHWM");
  const int64_t bound_kib = static_cast<int64_t>(wire::kMaxBufferedBytes >> 10);
  constexpr int64_t kSlackKib = 8 << 10;  // allocator and stack noise, not buffers

  // 10 x 24 MiB: 240 MiB if each connection were buffered on its own, 3.75 times the bound.
  constexpr int kClients = 10;
  const std::string partial = std::string(reinterpret_cast<const char*>(&wire::kMaxRequestBytes), 4) +
                              std::string(size_t{24} << 20, 'v');
  std::vector<std::unique_ptr<RawClient>> clients;
  size_t pushed = 0;
  for (int i = 0; i < kClients; ++i) {
    clients.push_back(std::make_unique<RawClient>(port));
    ASSERT_EQ(greeting_answer(clients.back()->greeting(token, 1, 2)).first, wire::kOk);
    pushed += clients.back()->send_until_stalled(partial, milliseconds(300));
  }
  std::this_thread::sleep_for(milliseconds(500));  // what rank 0 reads of it, it has read now
  const int64_t held = status_kib(rank0, "VmRSS");

  // A rank's requests while the silent connections hold the buffers: served.
  auto store = mfsdp::connect_store_client(client_info(port, token), kBound);
  const auto t0 = Clock::now();
  store->set("during", std::vector<uint8_t>(100, 1));
  EXPECT_EQ(store->get("during").size(), 100u);
  const double small_s = seconds_since(t0);
  const std::vector<uint8_t> large(8 << 20, 2);
  store->set("large", large);
  EXPECT_EQ(store->get("large"), large);
  store->deleteKey("large");
  const double large_s = seconds_since(t0) - small_s;
  const int64_t peak = status_kib(rank0, "VmHWM");

  clients.clear();  // the hostile connections close
  int64_t after = 0;
  for (const auto until = Clock::now() + milliseconds(10000); Clock::now() < until;) {
    std::this_thread::sleep_for(milliseconds(200));
    after = status_kib(rank0, "VmRSS");
    if (after - before < kSlackKib) break;
  }
  store->set("after", std::vector<uint8_t>(16, 3));  // the same connection still serves
  EXPECT_EQ(store->get("after").size(), 16u);
  {  // and a request of the largest size (over what the other connections share) is served
    const std::vector<uint8_t> x(wire::kMaxValueBytes, 4), y(wire::kMaxValueBytes, 5);
    store->set("cas", x);
    EXPECT_EQ(store->compareSet("cas", x, y), y);
    store->deleteKey("cas");
  }

  std::cout << kClients << " connections pushed " << (pushed >> 20) << " MiB of partial requests; "
            << "rank 0 RSS " << before << " KiB before, " << held << " KiB while they were held (+"
            << (held - before) << " KiB; bound " << bound_kib << " KiB), peak +"
            << (peak - peak_before) << " KiB, " << after << " KiB after they closed (+"
            << (after - before) << " KiB); a rank's small request took " << small_s
            << " s, its 8 MiB set and get " << large_s << " s meanwhile" << std::endl;
  EXPECT_GT(before, 0);
  EXPECT_LT(held - before, bound_kib + kSlackKib) << "rank 0 buffered more than the bound";
  EXPECT_LT(peak - peak_before, bound_kib + kSlackKib + (8 << 10) * 3)  // the 8 MiB value: request, store, answer
      << "rank 0's peak RSS grew past the bound";
  EXPECT_LT(after - before, kSlackKib) << "rank 0 kept the memory after the connections closed";

  write_file(dir.file("finish"), "");
  const auto& result = job.finish();
  EXPECT_TRUE(result.ok()) << describe(result, job.output());
  expect_contains(job.output(), {"bytes of an unfinished request and sent nothing for", "were full; closed"});
}

// A stranger that sends part of a greeting and a client with the token that sends part of a
// request, both then silent and kept open until the job has ended: rank 1 still joins, and the
// job starts and exits (with c10d's TCPStore the server read the partial request blocking, and
// start-up and exit waited for as long as the sender held it).
TEST(RendezvousSecurity, PartialRequestThenSilenceDelaysNothing) {
  if (in_rank()) return rank_program();
  TempDir dir("mfsdp-rdzv");
  const int port = launch::pick_free_port();
  const std::string token = launch::launcher_job_token();
  const auto start = Clock::now();
  Job job(job_specs(2, port, token, dir.path().string(), {{1, {{kWaitForGo, "1"}}}}));
  RawClient stranger(port);  // rank 0 listens now; rank 1 waits for "go"
  stranger.send(std::string("\x40\0", 2));
  RawClient member(port);
  ASSERT_EQ(greeting_answer(member.greeting(token, 1, 2)).first, wire::kOk);
  member.send(wire::Writer().u8(wire::kSet).str("key").str(std::string(1000, 'v')).frame().substr(0, 20));
  write_file(dir.file("go"), "");
  const auto& result = job.finish();  // both connections are still open and silent
  EXPECT_TRUE(result.ok()) << describe(result, job.output());
  EXPECT_FALSE(result.timed_out);
  std::cout << "the job started and ended in " << seconds_since(start)
            << " s with both partial requests held open" << std::endl;
}

// A client without the token, or with another job's, or with the wrong world size is refused
// with a message naming the port and never served; with the token the same request is served.
TEST(RendezvousSecurity, ClientsWithoutTheJobTokenAreRefused) {
  if (in_rank()) return rank_program();
  TempDir dir("mfsdp-rdzv");
  const int port = launch::pick_free_port();
  const std::string token = launch::launcher_job_token();
  Job job(job_specs(2, port, token, dir.path().string(), {{0, {{kHold, "1"}}}, {1, {{kHold, "1"}}}}));
  ASSERT_TRUE(wait_for_file(dir.file("ready"), kBound)) << job.output();

  for (const std::string& wrong : {std::string(), std::string("another-job"), token + "x"}) {
    const auto t0 = Clock::now();
    const std::string error = mfsdp::testing::error_of(
        [&] { mfsdp::connect_store_client(client_info(port, wrong), kBound); });
    expect_contains(error, {"rank 1 was refused by the store at 127.0.0.1:" + std::to_string(port),
                            "job token differs", "port " + std::to_string(port)});
    std::cout << "token '" << wrong.substr(0, 12) << "': refused in " << seconds_since(t0) << " s"
              << std::endl;
  }
  expect_contains(mfsdp::testing::error_of([&] {
                    mfsdp::connect_store_client(client_info(port, token, 1, 3), kBound);
                  }),
                  {"refused", "a job of 2 ranks"});
  {  // on the wire: the refusal, then the connection closes; a request after it is not served
    RawClient c(port);
    auto [status, message] = greeting_answer(c.greeting("another-job", 0, 2));
    EXPECT_EQ(status, wire::kRefused) << message;
    c.send(wire::Writer().u8(wire::kNumKeys).frame());
    EXPECT_TRUE(c.closed_by_server());
  }
  // The same look-up with the token is served: the refusals were about the token.
  auto store = mfsdp::connect_store_client(client_info(port, token), kBound);
  EXPECT_TRUE(store->check({"mfsdp/gloo/world/tcp_mesh/0"}));

  write_file(dir.file("finish"), "");
  const auto& result = job.finish();
  EXPECT_TRUE(result.ok()) << describe(result, job.output());
  expect_contains(job.output(), {"refused a client from 127.0.0.1", "wrong job token"});
}

// A second job on the port of a running one: its rank 0 fails at once naming the port in use,
// its rank 1 is refused by the first job's store naming the port, and the first job goes on.
TEST(RendezvousSecurity, SecondJobOnTheSamePortFailsFast) {
  if (in_rank()) return rank_program();
  TempDir dir("mfsdp-rdzv"), dir2("mfsdp-rdzv");
  const int port = launch::pick_free_port();
  Job first(job_specs(2, port, "first-job", dir.path().string(),
                      {{0, {{kHold, "1"}}}, {1, {{kHold, "1"}}}}));
  ASSERT_TRUE(wait_for_file(dir.file("ready"), kBound)) << first.output();

  // Each rank of the second job on its own, so that neither is stopped by the other's failure.
  for (int rank : {0, 1}) {
    const auto t0 = Clock::now();
    auto [result, output] = run_job(job_specs(2, port, "second-job", dir2.path().string(), {}, {rank}));
    const double took = seconds_since(t0);
    EXPECT_FALSE(result.ok()) << output;
    EXPECT_FALSE(result.timed_out) << output;
    if (rank == 0) {
      expect_contains(output, {"rank error: rendezvous: rank 0 cannot serve the store on 127.0.0.1:" +
                                   std::to_string(port),
                               "port " + std::to_string(port) + " is in use"});
    } else {
      expect_contains(output, {"rank error: rendezvous: rank 1 was refused by the store at 127.0.0.1:" +
                                   std::to_string(port),
                               "another job"});
    }
    std::cout << "second job's rank " << rank << " failed " << took
              << " s after it was started (process start-up included)" << std::endl;
  }
  EXPECT_FALSE(std::filesystem::exists(dir2.file("ready")));

  write_file(dir.file("finish"), "");
  const auto& result = first.finish();
  EXPECT_TRUE(result.ok()) << describe(result, first.output());
}

// Start-up has its own timeout: a rank that starts 3 s late joins a job whose collectives time
// out after 1 s (the rendezvous used to share the collective timeout).
TEST(RendezvousSecurity, StartUpMayTakeLongerThanTheCollectiveTimeout) {
  if (in_rank()) return rank_program();
  TempDir dir("mfsdp-rdzv");
  const int port = launch::pick_free_port();
  std::map<std::string, std::string> fast = {{kCommTimeoutMs, "1000"}};
  std::map<std::string, std::string> late = {{kCommTimeoutMs, "1000"}, {kSleepMs, "3000"}};
  auto [result, output] = run_job(job_specs(2, port, launch::launcher_job_token(),
                                            dir.path().string(), {{0, fast}, {1, late}}));
  EXPECT_TRUE(result.ok()) << describe(result, output);
}

// A master address that does not resolve fails after a bounded time with one line: at once on
// one node; on several nodes after min(rendezvous timeout, 30 s) of quiet retries (here 2 s).
TEST(RendezvousSecurity, UnresolvableMasterAddressFailsWithOneLine) {
  if (in_rank()) return rank_program();
  TempDir dir("mfsdp-rdzv");
  const std::string host = "no-such-host.invalid";
  for (const bool several_nodes : {false, true}) {
    std::map<std::string, std::string> env = {{"MASTER_ADDR", host}, {kStartupTimeoutMs, "2000"}};
    if (several_nodes) {
      env["LOCAL_WORLD_SIZE"] = "1";
      env["LOCAL_RANK"] = "0";
    }
    for (int rank : {0, 1}) {
      const auto t0 = Clock::now();
      auto [result, output] = run_job(job_specs(2, launch::pick_free_port(), "t", dir.path().string(),
                                                {{rank, env}}, {rank}));
      const double took = seconds_since(t0);
      EXPECT_FALSE(result.ok()) << output;
      EXPECT_FALSE(result.timed_out) << output;
      int lines = 0;
      std::istringstream in(output);
      for (std::string line; std::getline(in, line);) lines += line.find(host) != std::string::npos;
      EXPECT_EQ(lines, 1) << output;
      expect_contains(output, {"the master address '" + host + "' (MASTER_ADDR) does not resolve"});
      std::cout << (several_nodes ? "several nodes" : "one node") << ", rank " << rank
                << ": failed " << took << " s after it was started" << std::endl;
    }
  }
}

// mfsdp-run (through rank_environment) gives every rank of a single-node job the same random
// token, and none on several nodes, where each node's launcher would make a different one.
TEST(RendezvousSecurity, LauncherGivesEachSingleNodeJobAToken) {
  // A token the user exported is passed on as it is; this checks the one mfsdp-run makes.
  const char* exported_value = std::getenv("MFSDP_JOB_TOKEN");
  const bool exported = exported_value != nullptr;
  const std::string saved = exported ? exported_value : "";
  ::unsetenv("MFSDP_JOB_TOKEN");
  auto a = launch::rank_environment(0, 1, 2, 0, "127.0.0.1", 29500);
  auto b = launch::rank_environment(0, 1, 2, 1, "127.0.0.1", 29500);
  EXPECT_EQ(a["MFSDP_JOB_TOKEN"].size(), 32u);
  EXPECT_EQ(a["MFSDP_JOB_TOKEN"], b["MFSDP_JOB_TOKEN"]);
  EXPECT_EQ(launch::rank_environment(0, 2, 2, 0, "node0", 29500).count("MFSDP_JOB_TOKEN"), 0u);
  if (exported) ::setenv("MFSDP_JOB_TOKEN", saved.c_str(), 1);
}
