#include "distill/model/tokenizer/tokenizer.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace cdcca::tokenizer {
namespace {

TEST(TokenizerJson, MalformedJsonIsAnError) {
  EXPECT_FALSE(Tokenizer::FromJson("{").ok());
}

}  // namespace
}  // namespace cdcca::tokenizer
