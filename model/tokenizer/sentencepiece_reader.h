// Reads the pieces and the segmentation settings of a SentencePiece model (tokenizer.model,
// spiece.model: its protobuf wire format, parsed here).
#ifndef CDCCA_MODEL_TOKENIZER_SENTENCEPIECE_READER_H_
#define CDCCA_MODEL_TOKENIZER_SENTENCEPIECE_READER_H_

#include <cstdint>
#include <string>
#include <vector>

namespace cdcca::tokenizer {

struct SentencePiecePiece {
  std::string piece;
  float score = 0;
  bool unknown = false, control = false, byte = false, unused = false;
};

// The settings of a model that decide how text is split (TrainerSpec, NormalizerSpec).
struct SentencePieceSpec {
  int model_type = 1;  // 1 UNIGRAM, 2 BPE, 3 WORD, 4 CHAR
  bool byte_fallback = false;
  int64_t unk_id = 0;
  int64_t eos_id = 2;                // -1 = none
  std::string precompiled_charsmap;  // raw bytes; empty = no normalization
  bool add_dummy_prefix = true;
  bool remove_extra_whitespaces = true;
};

// Fills `pieces` (index = id) and, when `spec` is not null, *spec from the serialized model
// in `model_bytes`; on failure returns false with what is malformed in `error`.
bool ReadSentencePieceModel(const std::string& model_bytes, std::vector<SentencePiecePiece>* pieces,
                            std::string* error, SentencePieceSpec* spec = nullptr);

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_SENTENCEPIECE_READER_H_
