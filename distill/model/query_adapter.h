// Q-Former-like query adapter: L learnable queries; each layer does self-attention among
// the queries, cross-attention to the visual tokens (honouring a key mask for absent tokens)
// and an MLP; the result is projected into the LM width as its visual prefix.
//
// Parameter names: "vis_proj.*", "vis_norm.*", "vis_pos" [N, qa_dim], "queries" [L, qa_dim],
// "layers.<i>.{sa_norm,
// sa_q,sa_k,sa_v,sa_o,ca_norm,ca_q,ca_k,ca_v,ca_o,mlp_norm,mlp_fc1,mlp_fc2}.*", "out_norm.*",
// "out_proj.*". Linear layers are AdaptedLinear with bias; LoRA sits on the q and v
// projections of both attentions.
#ifndef CDCCA_DISTILL_MODEL_QUERY_ADAPTER_H_
#define CDCCA_DISTILL_MODEL_QUERY_ADAPTER_H_

#include <torch/torch.h>

#include <vector>

#include "distill/model/config.h"
#include "distill/model/layers.h"

namespace cdcca::model {

struct QueryAdapterOutput {
  torch::Tensor queries;  // Q: [B, L, qa_dim], after the final LayerNorm (alignment hook)
  torch::Tensor prefix;   // [B, L, d_model], the LM's visual prefix
  // [B, N]: cross-attention weight each visual token receives, averaged over layers and
  // heads and summed over queries / L (so a row sums to 1 over present tokens, 0 if none).
  torch::Tensor attention_mass;
};

class QueryAdapterLayerImpl : public torch::nn::Module {
 public:
  explicit QueryAdapterLayerImpl(const TowerConfig& c);
  // x [B, L, qa]; vis [B, N, qa]; allowed [B, 1, 1, N] bool or undefined. Writes the
  // cross-attention weights [B, H, L, N] (before dropout) into *cross_probs.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& vis,
                        const torch::Tensor& allowed, double dropout_p, torch::Tensor* cross_probs);
  // Only the cross-attention weights [Bv, H, L, N] of forward() (which come before any of
  // its dropout), without the value path and the MLP. x [Bx, L, qa] may have fewer rows than
  // vis [Bv, N, qa] when Bv is a multiple of Bx: row i of vis then pairs with row i % Bx of
  // x, as after x.repeat({Bv / Bx, 1, 1}).
  torch::Tensor CrossAttentionProbs(const torch::Tensor& x, const torch::Tensor& vis,
                                    const torch::Tensor& allowed);

 private:
  torch::Tensor SelfAttend(const torch::Tensor& x);   // x + self-attention(x)
  torch::Tensor Heads(const torch::Tensor& x) const;  // [B, T, qa] -> [B, H, T, D]
  torch::Tensor Merge(const torch::Tensor& x) const;  // inverse
  int64_t heads_;
  torch::nn::LayerNorm sa_norm_{nullptr}, ca_norm_{nullptr}, mlp_norm_{nullptr};
  AdaptedLinear sa_q_{nullptr}, sa_k_{nullptr}, sa_v_{nullptr}, sa_o_{nullptr};
  AdaptedLinear ca_q_{nullptr}, ca_k_{nullptr}, ca_v_{nullptr}, ca_o_{nullptr};
  AdaptedLinear mlp_fc1_{nullptr}, mlp_fc2_{nullptr};
};
TORCH_MODULE(QueryAdapterLayer);

class QueryAdapterImpl : public torch::nn::Module {
 public:
  explicit QueryAdapterImpl(const TowerConfig& c);

  // tokens [B, N, d_vis]; mask [B, N] bool (true = present) or undefined (all present). A
  // masked token has no effect on any output. dropout_p applies to the projected visual
  // tokens, the cross-attention weights and the MLP output (0 = deterministic).
  QueryAdapterOutput forward(const torch::Tensor& tokens, const torch::Tensor& mask,
                             double dropout_p);

  // attention_mass [passes, B, N] of `passes` dropout passes of forward(), as one batched
  // computation: the same distribution as forward(tokens.repeat({passes, 1, 1}), ...,
  // dropout_p).attention_mass, without the work that cannot reach the mass (the token
  // projection runs once before the passes diverge; the last layer stops at its
  // cross-attention weights; no output projection).
  torch::Tensor AttentionMassPasses(const torch::Tensor& tokens, const torch::Tensor& mask,
                                    int passes, double dropout_p);

 private:
  torch::Tensor Project(const torch::Tensor& tokens);  // [B, N, d_vis] -> [B, N, qa]
  torch::Tensor Allowed(const torch::Tensor& mask, int64_t b, int64_t n) const;
  AdaptedLinear vis_proj_{nullptr};
  torch::nn::LayerNorm vis_norm_{nullptr};
  // Cross-attention is blind to key order, so each grid position gets its own embedding;
  // without it "where" questions sit at chance.
  torch::Tensor vis_pos_;
  torch::Tensor queries_;
  torch::nn::ModuleList layers_;
  torch::nn::LayerNorm out_norm_{nullptr};
  AdaptedLinear out_proj_{nullptr};
};
TORCH_MODULE(QueryAdapter);

}  // namespace cdcca::model

#endif  // CDCCA_DISTILL_MODEL_QUERY_ADAPTER_H_
