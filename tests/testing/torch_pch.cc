// Compiled once so that <torch/torch.h> is precompiled for every target that reuses it.
