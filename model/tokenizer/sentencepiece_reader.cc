#include "model/tokenizer/sentencepiece_reader.h"

#include <cstdint>
#include <cstring>

// tokenizer.model is a serialized sentencepiece.ModelProto (sentencepiece_model.proto):
//   ModelProto     { repeated SentencePiece pieces = 1; trainer_spec = 2; normalizer_spec = 3; ...
//   } SentencePiece  { string piece = 1; float score = 2; Type type = 3 [default NORMAL]; } Type {
//   NORMAL = 1; UNKNOWN = 2; CONTROL = 3; USER_DEFINED = 4; UNUSED = 5; BYTE = 6; }
// Only the pieces matter here, so they are read straight off the protobuf wire format.
// libsentencepiece is not used: its shared library carries its own copy of protobuf's
// runtime, and a process that also loads libprotobuf (LibTorch, gRPC) crashes at start-up
// when both register their descriptors.

namespace cdcca::tokenizer {
namespace {

class WireReader {
 public:
  WireReader(const char* data, size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ >= end_; }

  bool Varint(uint64_t* v) {
    *v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ >= end_) return false;
      const uint8_t b = static_cast<uint8_t>(*p_++);
      *v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return true;
    }
    return false;
  }
  bool Bytes(const char** data, size_t* size) {
    uint64_t n = 0;
    if (!Varint(&n) || n > static_cast<uint64_t>(end_ - p_)) return false;
    *data = p_;
    *size = static_cast<size_t>(n);
    p_ += n;
    return true;
  }
  bool Fixed32(uint32_t* v) {
    if (end_ - p_ < 4) return false;
    const auto* b = reinterpret_cast<const uint8_t*>(p_);
    *v = static_cast<uint32_t>(b[0]) | static_cast<uint32_t>(b[1]) << 8 |
         static_cast<uint32_t>(b[2]) << 16 | static_cast<uint32_t>(b[3]) << 24;
    p_ += 4;
    return true;
  }
  // Skips a field of `wire_type`; false on a malformed or unsupported (group) field.
  bool Skip(uint32_t wire_type) {
    uint64_t v = 0;
    uint32_t f = 0;
    const char* d = nullptr;
    size_t n = 0;
    switch (wire_type) {
      case 0:
        return Varint(&v);
      case 1:
        if (end_ - p_ < 8) return false;
        p_ += 8;
        return true;
      case 2:
        return Bytes(&d, &n);
      case 5:
        return Fixed32(&f);
      default:
        return false;
    }
  }

 private:
  const char* p_;
  const char* end_;
};

bool ReadPiece(const char* data, size_t size, SentencePiecePiece* piece) {
  WireReader r(data, size);
  uint64_t type = 1;  // NORMAL
  while (!r.done()) {
    uint64_t key = 0;
    if (!r.Varint(&key)) return false;
    const uint64_t field = key >> 3;
    const uint32_t wire = key & 7;
    if (field == 1 && wire == 2) {
      const char* s = nullptr;
      size_t n = 0;
      if (!r.Bytes(&s, &n)) return false;
      piece->piece.assign(s, n);
    } else if (field == 2 && wire == 5) {
      uint32_t bits = 0;
      if (!r.Fixed32(&bits)) return false;
      std::memcpy(&piece->score, &bits, sizeof(bits));
    } else if (field == 3 && wire == 0) {
      if (!r.Varint(&type)) return false;
    } else if (!r.Skip(wire)) {
      return false;
    }
  }
  piece->unknown = type == 2;
  piece->control = type == 3;
  piece->unused = type == 5;
  piece->byte = type == 6;
  return type >= 1 && type <= 6;
}

// TrainerSpec: model_type = 3, byte_fallback = 35, unk_id = 40, eos_id = 42.
bool ReadTrainerSpec(const char* data, size_t size, SentencePieceSpec* spec) {
  WireReader r(data, size);
  while (!r.done()) {
    uint64_t key = 0, v = 0;
    if (!r.Varint(&key)) return false;
    const uint64_t field = key >> 3;
    const uint32_t wire = key & 7;
    if (wire == 0 && (field == 3 || field == 35 || field == 40 || field == 42)) {
      if (!r.Varint(&v)) return false;
      if (field == 3) spec->model_type = static_cast<int>(v);
      if (field == 35) spec->byte_fallback = v != 0;
      // int32 fields: -1 arrives sign-extended to 64 bits.
      if (field == 40) spec->unk_id = static_cast<int32_t>(static_cast<uint32_t>(v));
      if (field == 42) spec->eos_id = static_cast<int32_t>(static_cast<uint32_t>(v));
    } else if (!r.Skip(wire)) {
      return false;
    }
  }
  return true;
}

// NormalizerSpec: precompiled_charsmap = 2, add_dummy_prefix = 3, remove_extra_whitespaces = 4.
bool ReadNormalizerSpec(const char* data, size_t size, SentencePieceSpec* spec) {
  WireReader r(data, size);
  while (!r.done()) {
    uint64_t key = 0, v = 0;
    if (!r.Varint(&key)) return false;
    const uint64_t field = key >> 3;
    const uint32_t wire = key & 7;
    if (field == 2 && wire == 2) {
      const char* s = nullptr;
      size_t n = 0;
      if (!r.Bytes(&s, &n)) return false;
      spec->precompiled_charsmap.assign(s, n);
    } else if ((field == 3 || field == 4) && wire == 0) {
      if (!r.Varint(&v)) return false;
      (field == 3 ? spec->add_dummy_prefix : spec->remove_extra_whitespaces) = v != 0;
    } else if (!r.Skip(wire)) {
      return false;
    }
  }
  return true;
}

}  // namespace

bool ReadSentencePieceModel(const std::string& model_bytes, std::vector<SentencePiecePiece>* pieces,
                            std::string* error, SentencePieceSpec* spec) {
  pieces->clear();
  WireReader r(model_bytes.data(), model_bytes.size());
  while (!r.done()) {
    uint64_t key = 0;
    if (!r.Varint(&key)) {
      *error = "malformed protobuf (truncated field key)";
      return false;
    }
    const uint32_t wire = key & 7;
    if ((key >> 3) == 1 && wire == 2) {
      const char* s = nullptr;
      size_t n = 0;
      SentencePiecePiece piece;
      if (!r.Bytes(&s, &n) || !ReadPiece(s, n, &piece)) {
        *error = "malformed piece " + std::to_string(pieces->size());
        return false;
      }
      pieces->push_back(std::move(piece));
    } else if (spec != nullptr && ((key >> 3) == 2 || (key >> 3) == 3) && wire == 2) {
      const char* s = nullptr;
      size_t n = 0;
      const bool trainer = (key >> 3) == 2;
      if (!r.Bytes(&s, &n) ||
          !(trainer ? ReadTrainerSpec(s, n, spec) : ReadNormalizerSpec(s, n, spec))) {
        *error = trainer ? "malformed trainer_spec" : "malformed normalizer_spec";
        return false;
      }
    } else if (!r.Skip(wire)) {
      *error = "malformed protobuf (bad field)";
      return false;
    }
  }
  if (pieces->empty()) {
    *error = "no pieces (not a SentencePiece model)";
    return false;
  }
  return true;
}

}  // namespace cdcca::tokenizer
