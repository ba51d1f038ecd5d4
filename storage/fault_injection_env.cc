#include "storage/fault_injection_env.h"

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace cdcca::storage {
namespace {

// "a//b/" -> "a/b"; "/" stays.
std::string Normalize(const std::string& path) {
  std::string out;
  for (char c : path) {
    if (c == '/' && !out.empty() && out.back() == '/') continue;
    out.push_back(c);
  }
  if (out.size() > 1 && out.back() == '/') out.pop_back();
  return out;
}

const char* OpName(int op) {
  static const char* const kNames[] = {"open",      "open",   "write",  "fdatasync",
                                       "pread",     "rename", "unlink", "truncate",
                                       "fsync dir", "mkdir",  "opendir"};
  return kNames[op];
}

}  // namespace

const char* FaultName(Fault fault) {
  switch (fault) {
    case Fault::kEio:
      return "eio";
    case Fault::kEnospc:
      return "enospc";
    case Fault::kShortWrite:
      return "short_write";
    case Fault::kPowerLoss:
      return "power_loss";
    case Fault::kCrash:
      return "crash";
  }
  return "?";
}

// What a file object of the env holds.
struct FaultInjectionEnv::OpenFile {
  FaultInjectionEnv* env;
  std::shared_ptr<Node> node;
  std::string path;
  uint64_t generation;  // of the "process" that opened it

  uint64_t Size() const {
    absl::MutexLock lock(&env->mu_);
    return node->data.size();
  }
};

class FaultWritableFile final : public WritableFile {
 public:
  explicit FaultWritableFile(FaultInjectionEnv::OpenFile file) : f_(std::move(file)) {}

  absl::Status Append(absl::string_view data) override {
    absl::MutexLock lock(&f_.env->mu_);
    bool short_write = false;
    absl::Status s =
        f_.env->Enter(FaultInjectionEnv::Op::kAppend, f_.path, f_.generation, &short_write);
    if (short_write) f_.node->data.append(data.data(), data.size() / 2);
    if (s.ok()) f_.node->data.append(data.data(), data.size());
    return s;
  }

  absl::Status Sync() override {
    absl::MutexLock lock(&f_.env->mu_);
    absl::Status s = f_.env->Enter(FaultInjectionEnv::Op::kSync, f_.path, f_.generation, nullptr);
    if (s.ok()) {
      f_.node->synced = f_.node->data;
    } else if (!absl::IsAborted(s) && !absl::IsFailedPrecondition(s)) {
      f_.node->data = f_.node->synced;  // the failed writeback lost the dirty pages
    }
    return s;
  }

  uint64_t Size() const override { return f_.Size(); }

 private:
  const FaultInjectionEnv::OpenFile f_;
};

class FaultRandomAccessFile final : public RandomAccessFile {
 public:
  explicit FaultRandomAccessFile(FaultInjectionEnv::OpenFile file) : f_(std::move(file)) {}

  absl::Status Read(uint64_t offset, size_t n, char* out) const override {
    absl::MutexLock lock(&f_.env->mu_);
    if (absl::Status s =
            f_.env->Enter(FaultInjectionEnv::Op::kRead, f_.path, f_.generation, nullptr);
        !s.ok()) {
      return s;
    }
    const std::string& data = f_.node->data;
    if (offset > data.size() || data.size() - offset < n) {
      return absl::DataLossError(absl::StrCat(f_.path, ": unexpected end of file"));
    }
    std::memcpy(out, data.data() + offset, n);
    return absl::OkStatus();
  }

  absl::StatusOr<uint64_t> Size() const override { return f_.Size(); }

 private:
  const FaultInjectionEnv::OpenFile f_;
};

FaultInjectionEnv::FaultInjectionEnv() { dirs_ = {"/", "."}; }
FaultInjectionEnv::~FaultInjectionEnv() = default;

void FaultInjectionEnv::Arm(Fault fault, uint64_t n) {
  absl::MutexLock lock(&mu_);
  armed_ = n > 0;
  fault_ = fault;
  countdown_ = n;
  hit_ = false;
}

void FaultInjectionEnv::Disarm() {
  absl::MutexLock lock(&mu_);
  armed_ = false;
}

bool FaultInjectionEnv::fault_hit() const {
  absl::MutexLock lock(&mu_);
  return hit_;
}

void FaultInjectionEnv::CutPower() {
  absl::MutexLock lock(&mu_);
  dead_ = true;
  power_lost_ = true;
}

void FaultInjectionEnv::Restart() {
  absl::MutexLock lock(&mu_);
  if (power_lost_) {
    files_ = durable_;
    for (auto& [path, node] : files_) node->data = node->synced;
  }
  armed_ = false;
  dead_ = false;
  power_lost_ = false;
  ++generation_;
}

absl::Status FaultInjectionEnv::Enter(Op op, const std::string& path, uint64_t generation,
                                      bool* short_write) {
  if (dead_) {
    return absl::AbortedError(absl::StrCat(OpName(static_cast<int>(op)), " ", path, ": injected ",
                                           power_lost_ ? "power loss" : "crash",
                                           " (the process is dead)"));
  }
  if (generation != generation_) {
    return absl::FailedPreconditionError(
        absl::StrCat(path, ": a file object opened before the restart"));
  }
  if (!armed_) return absl::OkStatus();
  const bool mutates = op != Op::kOpenRead && op != Op::kRead && op != Op::kList;
  bool counts = false;
  switch (fault_) {
    case Fault::kEio:
      counts = true;
      break;
    case Fault::kEnospc:
      counts = op == Op::kOpenAppend || op == Op::kAppend || op == Op::kSync || op == Op::kRename ||
               op == Op::kSyncDir || op == Op::kCreateDirs;
      break;
    case Fault::kShortWrite:
      counts = op == Op::kAppend;
      break;
    case Fault::kPowerLoss:
    case Fault::kCrash:
      counts = mutates;
      break;
  }
  if (!counts || --countdown_ > 0) return absl::OkStatus();
  armed_ = false;
  hit_ = true;
  const std::string what = absl::StrCat(OpName(static_cast<int>(op)), " (injected)");
  switch (fault_) {
    case Fault::kEio:
      return ErrnoStatus(what, path, EIO);
    case Fault::kShortWrite:
      if (short_write != nullptr) *short_write = true;
      return ErrnoStatus(what, path, ENOSPC);
    case Fault::kEnospc:
      return ErrnoStatus(what, path, ENOSPC);
    case Fault::kPowerLoss:
    case Fault::kCrash:
      dead_ = true;
      power_lost_ = fault_ == Fault::kPowerLoss;
      return absl::AbortedError(absl::StrCat(OpName(static_cast<int>(op)), " ", path, ": injected ",
                                             FaultName(fault_), " (the process is dead)"));
  }
  return absl::OkStatus();
}

bool FaultInjectionEnv::DirExists(const std::string& dir) const { return dirs_.count(dir) > 0; }

absl::StatusOr<std::unique_ptr<WritableFile>> FaultInjectionEnv::OpenForAppend(
    const std::string& path_in, bool truncate) {
  const std::string path = Normalize(path_in);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kOpenAppend, path, generation_, nullptr); !s.ok()) return s;
  if (!DirExists(DirName(path))) return ErrnoStatus("open", path, ENOENT);
  if (DirExists(path)) return ErrnoStatus("open", path, EISDIR);
  std::shared_ptr<Node>& node = files_[path];
  if (node == nullptr) node = std::make_shared<Node>();
  if (truncate) node->data.clear();
  return std::unique_ptr<WritableFile>(
      std::make_unique<FaultWritableFile>(OpenFile{this, node, path, generation_}));
}

absl::StatusOr<std::unique_ptr<RandomAccessFile>> FaultInjectionEnv::OpenForRead(
    const std::string& path_in) {
  const std::string path = Normalize(path_in);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kOpenRead, path, generation_, nullptr); !s.ok()) return s;
  auto it = files_.find(path);
  if (it == files_.end()) return ErrnoStatus("open", path, ENOENT);
  return std::unique_ptr<RandomAccessFile>(
      std::make_unique<FaultRandomAccessFile>(OpenFile{this, it->second, path, generation_}));
}

absl::Status FaultInjectionEnv::Rename(const std::string& from_in, const std::string& to_in) {
  const std::string from = Normalize(from_in), to = Normalize(to_in);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kRename, from, generation_, nullptr); !s.ok()) return s;
  auto it = files_.find(from);
  if (it == files_.end()) return ErrnoStatus("rename", from, ENOENT);
  if (!DirExists(DirName(to))) return ErrnoStatus("rename", to, ENOENT);
  std::shared_ptr<Node> node = it->second;
  files_.erase(it);
  files_[to] = std::move(node);
  return absl::OkStatus();
}

absl::Status FaultInjectionEnv::Remove(const std::string& path_in) {
  const std::string path = Normalize(path_in);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kRemove, path, generation_, nullptr); !s.ok()) return s;
  if (files_.erase(path) == 0) return ErrnoStatus("unlink", path, ENOENT);
  return absl::OkStatus();
}

absl::Status FaultInjectionEnv::Truncate(const std::string& path_in, uint64_t size) {
  const std::string path = Normalize(path_in);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kTruncate, path, generation_, nullptr); !s.ok()) return s;
  auto it = files_.find(path);
  if (it == files_.end()) return ErrnoStatus("truncate", path, ENOENT);
  it->second->data.resize(size);
  return absl::OkStatus();
}

absl::Status FaultInjectionEnv::SyncDir(const std::string& dir_in) {
  const std::string dir = Normalize(dir_in);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kSyncDir, dir, generation_, nullptr); !s.ok()) return s;
  if (!DirExists(dir)) return ErrnoStatus("open dir", dir, ENOENT);
  for (auto it = durable_.begin(); it != durable_.end();) {
    it = DirName(it->first) == dir ? durable_.erase(it) : std::next(it);
  }
  for (const auto& [path, node] : files_) {
    if (DirName(path) == dir) durable_[path] = node;
  }
  return absl::OkStatus();
}

absl::Status FaultInjectionEnv::CreateDirs(const std::string& dir_in) {
  const std::string dir = Normalize(dir_in);
  if (dir.empty()) return absl::InvalidArgumentError("CreateDirs: empty path");
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kCreateDirs, dir, generation_, nullptr); !s.ok()) return s;
  for (std::string d = dir; !DirExists(d); d = DirName(d)) {
    if (files_.count(d) > 0) {
      return absl::FailedPreconditionError(absl::StrCat(d, " exists and is not a directory"));
    }
    dirs_.insert(d);
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> FaultInjectionEnv::ListFiles(const std::string& dir_in) {
  const std::string dir = Normalize(dir_in);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kList, dir, generation_, nullptr); !s.ok()) return s;
  if (!DirExists(dir)) return ErrnoStatus("opendir", dir, ENOENT);
  std::vector<std::string> names;
  for (const auto& [path, node] : files_) {
    if (DirName(path) == dir) names.push_back(path.substr(path.find_last_of('/') + 1));
  }
  return names;
}

absl::StatusOr<std::vector<std::string>> FaultInjectionEnv::ListDirs(const std::string& dir_in) {
  const std::string dir = Normalize(dir_in);
  absl::MutexLock lock(&mu_);
  if (absl::Status s = Enter(Op::kList, dir, generation_, nullptr); !s.ok()) return s;
  if (!DirExists(dir)) return ErrnoStatus("opendir", dir, ENOENT);
  std::vector<std::string> names;
  for (const std::string& d : dirs_) {
    if (d != dir && d != "/" && d != "." && DirName(d) == dir) {
      names.push_back(d.substr(d.find_last_of('/') + 1));
    }
  }
  return names;
}

}  // namespace cdcca::storage
