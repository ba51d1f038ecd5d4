#include "distill/model/tokenizer/sentencepiece_reader.h"

#include <sentencepiece_processor.h>

namespace cdcca::tokenizer {

bool ReadSentencePieceModel(const std::string& model_bytes, std::vector<SentencePiecePiece>* pieces,
                            std::string* error) {
  sentencepiece::SentencePieceProcessor sp;
  const auto status = sp.LoadFromSerializedProto(model_bytes);
  if (!status.ok()) {
    *error = status.ToString();
    return false;
  }
  const int n = sp.GetPieceSize();
  pieces->clear();
  pieces->reserve(n);
  for (int i = 0; i < n; ++i) {
    SentencePiecePiece p;
    p.piece = sp.IdToPiece(i);
    p.score = sp.GetScore(i);
    p.unknown = sp.IsUnknown(i);
    p.control = sp.IsControl(i);
    p.byte = sp.IsByte(i);
    p.unused = sp.IsUnused(i);
    pieces->push_back(std::move(p));
  }
  return true;
}

}  // namespace cdcca::tokenizer
