// Folder walks with opendir/readdir, lstat, unlink and rmdir (include/mfsdp/base/directory_tree.h
// says why not std::filesystem's iterators). Paths are plain strings joined with '/'.
#include "mfsdp/base/directory_tree.h"

#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <stdexcept>

namespace mfsdp {
namespace {

std::string join(const std::string& dir, const std::string& name) {
  return !dir.empty() && dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::runtime_error failure(const std::string& what, const std::string& path, int error) {
  return std::runtime_error(what + " " + path + ": " + std::strerror(error));
}

// list_directory without throwing: the errno of the failure, or 0.
int read_names(const std::string& dir, std::vector<std::string>& names) {
  DIR* handle = ::opendir(dir.c_str());
  if (handle == nullptr) return errno;
  errno = 0;
  while (const dirent* entry = ::readdir(handle)) {
    const std::string name = entry->d_name;
    if (name != "." && name != "..") names.push_back(name);
    errno = 0;
  }
  const int error = errno;
  ::closedir(handle);
  std::sort(names.begin(), names.end());
  return error;
}

// Removes `path` and what is under it, adding to `removed`; stops at the first failure, whose
// errno it returns with the entry in `where`.
int remove_entry(const std::string& path, std::uintmax_t& removed, std::string& where) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0) {
    where = path;
    return errno;
  }
  if (S_ISDIR(st.st_mode)) {
    std::vector<std::string> names;
    if (const int error = read_names(path, names)) {
      where = path;
      return error;
    }
    for (const std::string& name : names)
      if (const int error = remove_entry(join(path, name), removed, where)) return error;
    if (::rmdir(path.c_str()) != 0) {
      where = path;
      return errno;
    }
  } else if (::unlink(path.c_str()) != 0) {
    where = path;
    return errno;
  }
  ++removed;
  return 0;
}

// remove_entry of `path`, where a `path` that does not exist is nothing to do (0).
int remove_path(const std::string& path, std::uintmax_t& removed, std::string& where) {
  struct stat st{};
  if (::lstat(path.c_str(), &st) != 0 && errno == ENOENT) return 0;
  return remove_entry(path, removed, where);
}

}  // namespace

std::vector<std::string> list_directory(const std::string& dir) {
  std::vector<std::string> names;
  if (const int error = read_names(dir, names)) throw failure("cannot list the folder", dir, error);
  return names;
}

std::uintmax_t remove_tree(const std::string& path, std::error_code& error) noexcept {
  error.clear();
  std::uintmax_t removed = 0;
  std::string where;
  try {
    if (const int e = remove_path(path, removed, where)) error.assign(e, std::generic_category());
  } catch (const std::bad_alloc&) {
    error = std::make_error_code(std::errc::not_enough_memory);
  }
  return removed;
}

std::uintmax_t remove_tree(const std::string& path) {
  std::uintmax_t removed = 0;
  std::string where;
  if (const int error = remove_path(path, removed, where)) throw failure("cannot remove", where, error);
  return removed;
}

void copy_tree(const std::string& from, const std::string& to) {
  namespace fs = std::filesystem;
  std::error_code error;
  fs::create_directories(to, error);
  if (error) throw failure("cannot create the folder", to, error.value());
  for (const std::string& name : list_directory(from)) {
    const std::string source = join(from, name), target = join(to, name);
    struct stat st{};
    if (::lstat(source.c_str(), &st) != 0) throw failure("cannot read", source, errno);
    if (S_ISDIR(st.st_mode)) {
      copy_tree(source, target);
    } else if (S_ISLNK(st.st_mode)) {
      const fs::path link = fs::read_symlink(source, error);
      if (!error) {
        fs::remove(target, error);  // a link over an existing entry: replaced, like the files
        fs::create_symlink(link, target, error);
      }
      if (error) throw failure("cannot copy the link", source, error.value());
    } else {
      fs::copy_file(source, target, fs::copy_options::overwrite_existing, error);
      if (error) throw failure("cannot copy " + source + " to", target, error.value());
    }
  }
}

}  // namespace mfsdp
