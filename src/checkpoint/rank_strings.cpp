// Every rank's string (rank_strings.h): the lengths first, then the bytes, uneven all_gather.
#include "checkpoint/rank_strings.h"

#include <ATen/ATen.h>

#include <cstring>

namespace mfsdp::checkpoint {

std::vector<std::string> all_gather_strings(Communicator& comm, const std::string& text) {
  const at::Device device = comm.device();
  const auto longs = at::TensorOptions().dtype(at::kLong).device(device);
  at::Tensor lengths = at::empty({comm.size()}, longs);
  comm.all_gather(lengths, at::full({1}, static_cast<int64_t>(text.size()), longs));
  const at::Tensor lengths_cpu = lengths.cpu();
  std::vector<int64_t> counts(lengths_cpu.data_ptr<int64_t>(), lengths_cpu.data_ptr<int64_t>() + comm.size());
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  at::Tensor mine = at::empty({static_cast<int64_t>(text.size())}, at::kByte);
  if (!text.empty()) std::memcpy(mine.data_ptr(), text.data(), text.size());
  at::Tensor all = at::empty({total}, at::TensorOptions().dtype(at::kByte).device(device));
  comm.all_gather(all, mine.to(device), {counts});
  const at::Tensor all_cpu = all.cpu();
  std::vector<std::string> out;
  const char* p = reinterpret_cast<const char*>(all_cpu.data_ptr());
  for (int64_t c : counts) {
    out.emplace_back(p, static_cast<size_t>(c));
    p += c;
  }
  return out;
}

}  // namespace mfsdp::checkpoint
