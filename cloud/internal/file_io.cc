#include "cloud/internal/file_io.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace cdcca::cloud::internal {

absl::Status ErrnoStatus(absl::string_view op, const std::string& path, int err) {
  std::string msg = absl::StrCat(op, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(msg);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(msg);
  if (err == ENOSPC) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

namespace {

absl::Status WriteAll(int fd, absl::string_view data, const std::string& path) {
  while (!data.empty()) {
    ssize_t n = ::write(fd, data.data(), data.size());
    if (n < 0) {
      if (errno == EINTR) continue;
      return ErrnoStatus("write", path, errno);
    }
    data.remove_prefix(static_cast<size_t>(n));
  }
  return absl::OkStatus();
}

std::string DirName(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::Status SyncDir(const std::string& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("open dir", dir, errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus("fsync dir", dir, err);
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path, absl::string_view contents) {
  const std::string tmp = absl::StrCat(path, ".tmp.", ::getpid());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("open", tmp, errno);
  absl::Status s = WriteAll(fd, contents, tmp);
  if (s.ok() && ::fdatasync(fd) != 0) s = ErrnoStatus("fdatasync", tmp, errno);
  ::close(fd);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0) s = ErrnoStatus("rename", tmp, errno);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  return SyncDir(DirName(path));
}

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus("open", path, errno);
  std::string out;
  char buf[1 << 16];
  while (true) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      return ErrnoStatus("read", path, err);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

absl::Status MakeDirs(const std::string& dir) {
  if (dir.empty()) return absl::InvalidArgumentError("MakeDirs: empty path");
  std::string partial;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    partial = dir.substr(0, pos);
    if (partial.empty()) continue;
    if (::mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus("mkdir", partial, errno);
    }
  }
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(dir, " exists and is not a directory"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> ListDir(const std::string& dir) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoStatus("opendir", dir, errno);
  std::vector<std::string> names;
  while (struct dirent* e = ::readdir(d)) {
    if (e->d_type == DT_REG || e->d_type == DT_UNKNOWN) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(std::move(name));
    }
  }
  ::closedir(d);
  return names;
}

}  // namespace cdcca::cloud::internal
