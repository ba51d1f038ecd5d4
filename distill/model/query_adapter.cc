#include "distill/model/query_adapter.h"

#include <algorithm>
#include <cmath>

namespace cdcca::model {
namespace {

AdaptedLinear Linear(const TowerConfig& c, int64_t in, int64_t out, bool lora) {
  AdaptedLinearOptions o;
  o.in_features = in;
  o.out_features = out;
  o.bias = true;
  o.lora_rank = lora ? c.lora_rank : 0;
  o.lora_alpha = c.lora_alpha;
  o.precision = c.precision;
  o.int4_group = c.int4_group;
  return AdaptedLinear(o);
}

// 2-D sinusoidal encoding of a square grid (row in the first half of the channels, column
// in the second), unit amplitude: as strong as the LayerNorm-ed tokens it is added to, so
// the queries can tell cells apart from the first step ("where" questions need it).
torch::Tensor GridPositionEncoding(int64_t tokens, int64_t dim) {
  const auto side = static_cast<int64_t>(std::lround(std::sqrt(static_cast<double>(tokens))));
  torch::Tensor idx = torch::arange(tokens, torch::kDouble);
  torch::Tensor row = (idx / side).floor();
  torch::Tensor col = idx - row * side;
  const int64_t quarter = std::max<int64_t>(1, dim / 4);
  torch::Tensor freq =
      torch::pow(side * 2.0, -torch::arange(quarter, torch::kDouble) / quarter) * M_PI;
  torch::Tensor out = torch::zeros({tokens, dim}, torch::kDouble);
  torch::Tensor parts =
      torch::cat({torch::sin(torch::outer(row, freq)), torch::cos(torch::outer(row, freq)),
                  torch::sin(torch::outer(col, freq)), torch::cos(torch::outer(col, freq))},
                 1);
  const int64_t used = std::min(dim, parts.size(1));
  out.narrow(1, 0, used).copy_(parts.narrow(1, 0, used));
  return out.to(torch::kFloat);
}

torch::nn::LayerNorm Norm(int64_t d) {
  return torch::nn::LayerNorm(torch::nn::LayerNormOptions({d}));
}

}  // namespace

QueryAdapterLayerImpl::QueryAdapterLayerImpl(const TowerConfig& c) : heads_(c.qa_heads) {
  const int64_t d = c.qa_dim;
  sa_norm_ = register_module("sa_norm", Norm(d));
  sa_q_ = register_module("sa_q", Linear(c, d, d, true));
  sa_k_ = register_module("sa_k", Linear(c, d, d, false));
  sa_v_ = register_module("sa_v", Linear(c, d, d, true));
  sa_o_ = register_module("sa_o", Linear(c, d, d, false));
  ca_norm_ = register_module("ca_norm", Norm(d));
  ca_q_ = register_module("ca_q", Linear(c, d, d, true));
  ca_k_ = register_module("ca_k", Linear(c, d, d, false));
  ca_v_ = register_module("ca_v", Linear(c, d, d, true));
  ca_o_ = register_module("ca_o", Linear(c, d, d, false));
  mlp_norm_ = register_module("mlp_norm", Norm(d));
  mlp_fc1_ = register_module("mlp_fc1", Linear(c, d, c.qa_mlp_hidden, false));
  mlp_fc2_ = register_module("mlp_fc2", Linear(c, c.qa_mlp_hidden, d, false));
}

torch::Tensor QueryAdapterLayerImpl::Heads(const torch::Tensor& x) const {
  return x.view({x.size(0), x.size(1), heads_, x.size(2) / heads_}).transpose(1, 2);
}

torch::Tensor QueryAdapterLayerImpl::Merge(const torch::Tensor& x) const {
  return x.transpose(1, 2).reshape({x.size(0), x.size(2), x.size(1) * x.size(3)});
}

torch::Tensor QueryAdapterLayerImpl::SelfAttend(const torch::Tensor& x) {
  torch::Tensor h = sa_norm_->forward(x);
  torch::Tensor sa = MaskedAttention(Heads(sa_q_->forward(h)), Heads(sa_k_->forward(h)),
                                     Heads(sa_v_->forward(h)), torch::Tensor(), 0.0, nullptr);
  return x + sa_o_->forward(Merge(sa));
}

torch::Tensor QueryAdapterLayerImpl::forward(const torch::Tensor& x, const torch::Tensor& vis,
                                             const torch::Tensor& allowed, double dropout_p,
                                             torch::Tensor* cross_probs) {
  torch::Tensor y = SelfAttend(x);
  torch::Tensor h = ca_norm_->forward(y);
  torch::Tensor ca = MaskedAttention(Heads(ca_q_->forward(h)), Heads(ca_k_->forward(vis)),
                                     Heads(ca_v_->forward(vis)), allowed, dropout_p, cross_probs);
  y = y + ca_o_->forward(Merge(ca));
  h = mlp_fc2_->forward(torch::gelu(mlp_fc1_->forward(mlp_norm_->forward(y))));
  if (dropout_p > 0.0) h = torch::dropout(h, dropout_p, /*train=*/true);
  return y + h;
}

torch::Tensor QueryAdapterLayerImpl::CrossAttentionProbs(const torch::Tensor& x,
                                                         const torch::Tensor& vis,
                                                         const torch::Tensor& allowed) {
  TORCH_CHECK(vis.size(0) % x.size(0) == 0, "CrossAttentionProbs: ", vis.size(0),
              " visual rows are not a multiple of ", x.size(0), " query rows");
  torch::Tensor q = Heads(ca_q_->forward(ca_norm_->forward(SelfAttend(x))));
  if (q.size(0) != vis.size(0)) q = q.repeat({vis.size(0) / q.size(0), 1, 1, 1});
  return AttentionProbs(q, Heads(ca_k_->forward(vis)), allowed);
}

QueryAdapterImpl::QueryAdapterImpl(const TowerConfig& c) {
  vis_proj_ = register_module("vis_proj", Linear(c, c.d_vis, c.qa_dim, false));
  vis_norm_ = register_module("vis_norm", Norm(c.qa_dim));
  vis_pos_ = register_parameter("vis_pos", GridPositionEncoding(c.num_visual_tokens, c.qa_dim));
  queries_ = register_parameter("queries", torch::randn({c.num_queries, c.qa_dim}) * 0.02);
  layers_ = register_module("layers", torch::nn::ModuleList());
  for (int i = 0; i < c.qa_layers; ++i) layers_->push_back(QueryAdapterLayer(c));
  out_norm_ = register_module("out_norm", Norm(c.qa_dim));
  out_proj_ = register_module("out_proj", Linear(c, c.qa_dim, c.d_model, false));
}

torch::Tensor QueryAdapterImpl::Project(const torch::Tensor& tokens) {
  TORCH_CHECK(tokens.dim() == 3, "QueryAdapter expects tokens [B, N, d_vis]");
  TORCH_CHECK(tokens.size(1) == vis_pos_.size(0), "QueryAdapter expects ", vis_pos_.size(0),
              " visual tokens");
  return vis_norm_->forward(vis_proj_->forward(tokens)) + vis_pos_;
}

torch::Tensor QueryAdapterImpl::Allowed(const torch::Tensor& mask, int64_t b, int64_t n) const {
  if (!mask.defined()) return torch::Tensor();
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == b && mask.size(1) == n,
              "QueryAdapter mask must be [B, N]");
  return mask.to(torch::kBool).view({b, 1, 1, n});
}

QueryAdapterOutput QueryAdapterImpl::forward(const torch::Tensor& tokens, const torch::Tensor& mask,
                                             double dropout_p) {
  torch::Tensor vis = Project(tokens);
  const int64_t b = tokens.size(0);
  const int64_t n = tokens.size(1);
  if (dropout_p > 0.0) vis = torch::dropout(vis, dropout_p, /*train=*/true);
  torch::Tensor allowed = Allowed(mask, b, n);
  torch::Tensor x = queries_.unsqueeze(0).expand({b, queries_.size(0), queries_.size(1)});
  torch::Tensor mass = torch::zeros({b, n}, tokens.options());
  for (const auto& layer : *layers_) {
    torch::Tensor probs;
    x = layer->as<QueryAdapterLayer>()->forward(x, vis, allowed, dropout_p, &probs);
    mass = mass + probs.mean(1).mean(1);  // over heads, then over queries
  }
  QueryAdapterOutput out;
  out.queries = out_norm_->forward(x);
  out.prefix = out_proj_->forward(out.queries);
  out.attention_mass = mass / static_cast<double>(layers_->size());
  return out;
}

torch::Tensor QueryAdapterImpl::AttentionMassPasses(const torch::Tensor& tokens,
                                                    const torch::Tensor& mask, int passes,
                                                    double dropout_p) {
  TORCH_CHECK(passes > 0, "AttentionMassPasses needs at least one pass");
  torch::Tensor vis = Project(tokens);  // once: the passes differ only from here on
  const int64_t b = tokens.size(0);
  const int64_t n = tokens.size(1);
  const int64_t rows = b * passes;
  vis = vis.repeat({passes, 1, 1});  // row m * b + i = pass m of sample i
  if (dropout_p > 0.0) vis = torch::dropout(vis, dropout_p, /*train=*/true);
  torch::Tensor allowed =
      mask.defined() ? Allowed(mask, b, n).repeat({passes, 1, 1, 1}) : torch::Tensor();
  // The queries are the same in every pass until a layer's dropout reaches them; the last
  // layer's weights are read before its dropout, so a one-layer adapter never repeats them.
  torch::Tensor x = queries_.unsqueeze(0).expand({b, queries_.size(0), queries_.size(1)});
  torch::Tensor mass = torch::zeros({rows, n}, tokens.options());
  const size_t last = layers_->size() - 1;
  for (size_t i = 0; i < layers_->size(); ++i) {
    QueryAdapterLayerImpl* layer = (*layers_)[i]->as<QueryAdapterLayer>();
    torch::Tensor probs;
    if (i == last) {
      probs = layer->CrossAttentionProbs(x, vis, allowed);
    } else {
      if (x.size(0) != rows) x = x.repeat({passes, 1, 1});
      x = layer->forward(x, vis, allowed, dropout_p, &probs);
    }
    mass = mass + probs.mean(1).mean(1);
  }
  return (mass / static_cast<double>(layers_->size())).view({passes, b, n});
}

}  // namespace cdcca::model
