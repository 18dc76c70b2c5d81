"""Expert backends, one per file, behind kernels.backends.base.ExpertBackend; chosen by kernels.oracle."""
