// Little-endian fixed-size fields in a byte string, as the project's own file and payload
// formats write them (the uplink codec, the trainer's state file, the replay buffer): values
// appended with Put, arrays and blobs with a u64 count first; ByteReader reads them back,
// each read checked against what is left, never past the end. Header-only, dependency-free.
#ifndef CDCCA_COMPRESS_BYTE_IO_H_
#define CDCCA_COMPRESS_BYTE_IO_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/strings/string_view.h"

namespace cdcca::compress {

// Appends `v`'s bytes (the host's order: every machine the project runs on is little-endian).
template <typename T>
void Put(std::string& out, T v) {
  static_assert(std::is_trivially_copyable_v<T>);
  out.append(reinterpret_cast<const char*>(&v), sizeof(v));
}

// u64 count, then the elements.
template <typename T>
void PutArray(std::string& out, const std::vector<T>& v) {
  Put<uint64_t>(out, v.size());
  out.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// u64 size, then the bytes.
inline void PutBytes(std::string& out, absl::string_view bytes) {
  Put<uint64_t>(out, bytes.size());
  out.append(bytes.data(), bytes.size());
}

class ByteReader {
 public:
  explicit ByteReader(absl::string_view data) : data_(data) {}

  template <typename T>
  bool Get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if (data_.size() - pos_ < sizeof(T)) return false;
    std::memcpy(v, data_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }
  // What PutArray wrote; false (and nothing allocated) when the count passes what is left.
  template <typename T>
  bool GetArray(std::vector<T>* v) {
    uint64_t n = 0;
    if (!Get(&n) || n > (data_.size() - pos_) / sizeof(T)) return false;
    v->resize(n);
    std::memcpy(v->data(), data_.data() + pos_, n * sizeof(T));
    pos_ += n * sizeof(T);
    return true;
  }
  // What PutBytes wrote.
  bool GetBytes(std::string* v) {
    uint64_t n = 0;
    absl::string_view bytes;
    if (!Get(&n) || !Skip(n, &bytes)) return false;
    v->assign(bytes.data(), bytes.size());
    return true;
  }
  // The next `n` bytes, as a view into the data.
  bool Skip(uint64_t n, absl::string_view* out) {
    if (data_.size() - pos_ < n) return false;
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == data_.size(); }

 private:
  absl::string_view data_;
  size_t pos_ = 0;
};

}  // namespace cdcca::compress

#endif  // CDCCA_COMPRESS_BYTE_IO_H_
