// Listing, removing and copying folders with POSIX calls instead of std::filesystem's
// directory iterators: every folder walk in mfsdp, its tests and benchmarks goes through these
// (a test greps the sources for the others).
//
// Why not std::filesystem: LibTorch's wheels export the copy of libstdc++'s std::filesystem they
// link statically (pytorch/pytorch#133437), and a program linked to LibTorch binds part of it to
// that copy and part to the system's libstdc++. On the first GPU machine (Ubuntu 24.04, GCC 13,
// LibTorch 2.11) every step of a directory iterator over a non-empty folder crashed, and with it
// every remove_all of one, while paths, status, create_directories, rename and copy_file worked
// (docs/building.md). Naming libstdc++ first on the link line did not change the binding there.
//
//   for (const std::string& name : mfsdp::list_directory(dir)) ...   // sorted names
//   mfsdp::remove_tree(dir);                                           // rm -rf; 0 if absent
//   mfsdp::copy_tree(from, to);                                        // cp -r
#pragma once

#include <cstdint>
#include <string>
#include <system_error>
#include <vector>

namespace mfsdp {

// The names of the entries of folder `dir`, without "." and "..", sorted. Throws
// std::runtime_error naming `dir` and the system's reason when it cannot be read.
std::vector<std::string> list_directory(const std::string& dir);

// Removes `path`: a file, a symbolic link (not what it points to), or a folder with everything
// under it. Returns how many entries were removed; 0 when `path` does not exist. Throws
// std::runtime_error naming the entry that could not be listed or removed.
std::uintmax_t remove_tree(const std::string& path);
// The same, reporting the first failure in `error` (cleared on success) instead of throwing.
std::uintmax_t remove_tree(const std::string& path, std::error_code& error) noexcept;

// Copies folder `from` into `to` (created, with any missing parents): its files, symbolic links
// (as links) and folders, recursively; existing files are overwritten. Throws
// std::runtime_error naming the entry that could not be copied.
void copy_tree(const std::string& from, const std::string& to);

}  // namespace mfsdp
