#include "storage/env.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace cdcca::storage {
namespace {

class PosixWritableFile final : public WritableFile {
 public:
  PosixWritableFile(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~PosixWritableFile() override { ::close(fd_); }

  absl::Status Append(absl::string_view data) override {
    while (!data.empty()) {
      const ssize_t n = ::write(fd_, data.data(), data.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus("write", path_, errno);
      }
      data.remove_prefix(static_cast<size_t>(n));
      size_ += static_cast<uint64_t>(n);
    }
    return absl::OkStatus();
  }

  absl::Status Sync() override {
    if (::fdatasync(fd_) != 0) return ErrnoStatus("fdatasync", path_, errno);
    return absl::OkStatus();
  }

  uint64_t Size() const override { return size_; }

 private:
  const std::string path_;
  const int fd_;
  uint64_t size_;
};

class PosixRandomAccessFile final : public RandomAccessFile {
 public:
  PosixRandomAccessFile(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  ~PosixRandomAccessFile() override { ::close(fd_); }

  absl::Status Read(uint64_t offset, size_t n, char* out) const override {
    while (n > 0) {
      const ssize_t r = ::pread(fd_, out, n, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        return ErrnoStatus("pread", path_, errno);
      }
      if (r == 0) return absl::DataLossError(absl::StrCat(path_, ": unexpected end of file"));
      out += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> Size() const override {
    struct stat st {};
    if (::fstat(fd_, &st) != 0) return ErrnoStatus("fstat", path_, errno);
    // A pipe or device has no size to read up to: say so rather than read nothing.
    if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(path_ + " is not a regular file");
    return static_cast<uint64_t>(st.st_size);
  }

 private:
  const std::string path_;
  const int fd_;
};

absl::StatusOr<std::vector<std::string>> ListEntries(const std::string& dir, bool dirs) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return ErrnoStatus("opendir", dir, errno);
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    if (name == "." || name == "..") continue;
    unsigned char type = e->d_type;
    if (type == DT_UNKNOWN) {
      struct stat st {};
      if (::stat(absl::StrCat(dir, "/", name).c_str(), &st) != 0) continue;
      type = S_ISDIR(st.st_mode) ? DT_DIR : (S_ISREG(st.st_mode) ? DT_REG : DT_UNKNOWN);
    }
    if (type == (dirs ? DT_DIR : DT_REG)) names.push_back(name);
  }
  ::closedir(d);
  return names;
}

class PosixEnv final : public Env {
 public:
  absl::StatusOr<std::unique_ptr<WritableFile>> OpenForAppend(const std::string& path,
                                                              bool truncate) override {
    const int fd = ::open(
        path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0), 0644);
    if (fd < 0) return ErrnoStatus("open", path, errno);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int err = errno;
      ::close(fd);
      return ErrnoStatus("fstat", path, err);
    }
    return std::make_unique<PosixWritableFile>(path, fd, static_cast<uint64_t>(st.st_size));
  }

  absl::StatusOr<std::unique_ptr<RandomAccessFile>> OpenForRead(const std::string& path) override {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open", path, errno);
    return std::make_unique<PosixRandomAccessFile>(path, fd);
  }

  absl::Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) return ErrnoStatus("rename", from, errno);
    return absl::OkStatus();
  }

  absl::Status Remove(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) return ErrnoStatus("unlink", path, errno);
    return absl::OkStatus();
  }

  absl::Status Truncate(const std::string& path, uint64_t size) override {
    if (::truncate(path.c_str(), static_cast<off_t>(size)) != 0) {
      return ErrnoStatus("truncate", path, errno);
    }
    return absl::OkStatus();
  }

  absl::Status SyncDir(const std::string& dir) override {
    const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ErrnoStatus("open dir", dir, errno);
    const int rc = ::fsync(fd);
    const int err = errno;
    ::close(fd);
    if (rc != 0) return ErrnoStatus("fsync dir", dir, err);
    return absl::OkStatus();
  }

  absl::Status CreateDirs(const std::string& dir) override {
    if (dir.empty()) return absl::InvalidArgumentError("CreateDirs: empty path");
    struct stat st {};
    if (::stat(dir.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) return absl::OkStatus();
      return absl::FailedPreconditionError(absl::StrCat(dir, " exists and is not a directory"));
    }
    const std::string parent = DirName(dir);
    if (parent != dir) {
      if (absl::Status s = CreateDirs(parent); !s.ok()) return s;
    }
    if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
      return ErrnoStatus("mkdir", dir, errno);
    }
    // The new entry lives in the parent: make it durable there.
    return SyncDir(parent);
  }

  absl::StatusOr<std::vector<std::string>> ListFiles(const std::string& dir) override {
    return ListEntries(dir, /*dirs=*/false);
  }
  absl::StatusOr<std::vector<std::string>> ListDirs(const std::string& dir) override {
    return ListEntries(dir, /*dirs=*/true);
  }
};

}  // namespace

Env* Env::Default() {
  static Env* const env = new PosixEnv();
  return env;
}

absl::Status ErrnoStatus(absl::string_view op, const std::string& path, int err) {
  std::string message = absl::StrCat(op, " ", path, ": ", std::strerror(err));
  if (err == ENOENT) return absl::NotFoundError(message);
  if (err == ENOSPC || err == EDQUOT) return absl::ResourceExhaustedError(message);
  if (err == EACCES || err == EPERM) return absl::PermissionDeniedError(message);
  return absl::InternalError(message);
}

std::string DirName(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

absl::StatusOr<std::string> ReadFile(Env& env, const std::string& path) {
  absl::StatusOr<std::unique_ptr<RandomAccessFile>> file = env.OpenForRead(path);
  if (!file.ok()) return file.status();
  absl::StatusOr<uint64_t> size = (*file)->Size();
  if (!size.ok()) return size.status();
  std::string out(*size, '\0');
  if (absl::Status s = (*file)->Read(0, out.size(), out.data()); !s.ok()) return s;
  return out;
}

absl::Status WriteFileAtomically(Env& env, const std::string& path, absl::string_view contents) {
  const std::string tmp = path + ".tmp";
  absl::Status s;
  {
    absl::StatusOr<std::unique_ptr<WritableFile>> file = env.OpenForAppend(tmp, /*truncate=*/true);
    if (!file.ok()) return file.status();
    s = (*file)->Append(contents);
    if (s.ok()) s = (*file)->Sync();
  }
  if (s.ok()) s = env.Rename(tmp, path);
  if (!s.ok()) {
    (void)env.Remove(tmp);
    return s;
  }
  return env.SyncDir(DirName(path));
}

absl::Status RemoveDurably(Env& env, const std::string& path) {
  absl::Status s = env.Remove(path);
  if (absl::IsNotFound(s)) return absl::OkStatus();
  if (!s.ok()) return s;
  return env.SyncDir(DirName(path));
}

}  // namespace cdcca::storage
