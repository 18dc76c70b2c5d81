"""Expert GEMM kernels: weight formats, a PyTorch reference, and device backends."""
