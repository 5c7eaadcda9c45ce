"""The CUDA backend: our kernels (cuda/*.cu via PyCUDA), cuBLAS GEMMs and CUDA graphs over a bf16 paged KV cache."""
