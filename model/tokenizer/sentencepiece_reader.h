// Reads the pieces of a SentencePiece tokenizer.model (its protobuf wire format, parsed here).
#ifndef CDCCA_MODEL_TOKENIZER_SENTENCEPIECE_READER_H_
#define CDCCA_MODEL_TOKENIZER_SENTENCEPIECE_READER_H_

#include <string>
#include <vector>

namespace cdcca::tokenizer {

struct SentencePiecePiece {
  std::string piece;
  float score = 0;
  bool unknown = false, control = false, byte = false, unused = false;
};

// Fills `pieces` (index = id) from the serialized model in `model_bytes`; on failure
// returns false with what is malformed in `error`.
bool ReadSentencePieceModel(const std::string& model_bytes, std::vector<SentencePiecePiece>* pieces,
                            std::string* error);

}  // namespace cdcca::tokenizer

#endif  // CDCCA_MODEL_TOKENIZER_SENTENCEPIECE_READER_H_
