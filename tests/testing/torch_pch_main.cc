// Compiled once, as an executable, so that <torch/torch.h> is precompiled with the flags of
// executables (-fPIE) for every test and benchmark that reuses it.
int main() { return 0; }
